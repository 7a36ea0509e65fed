"""The airbench network (``model.arch=airbench``): whitening filters from data, identity-started
convolutions, its optimizer groups, multi-crop test-time augmentation, its warmup. The contract
test (``test_workload_contract.py``, case ``image-airbench``) trains, resumes and restores it."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_script

import hopperjax
from hopperjax.config import RematConfig
from hopperjax.models import resnet
from hopperjax.optim import build_schedule
from hopperjax.trainer import build_components

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


# The PyTorch reference's golden-file script (numpy only at import): its inputs, weights and
# smooth images serve the tests here too.
GOLDEN = load_script("airbench_torch_golden")


def _smooth_images(count, side=8, seed=0):
    return GOLDEN.smooth_images(count, side, seed)


def test_whitening_filters_whiten_the_training_patches():
    """The first 12 filters map the normalized images' 2x2 patches to unit, uncorrelated
    outputs (eigenvalues floored by eps: 1 - eps / (value + eps)); the other 12 are their
    negatives; the kernel is laid out as the convolution reads patches."""
    images = _smooth_images(64)
    filters = np.asarray(resnet.whitening_filters(images, MEAN, STD, eps=1e-6)).reshape(2, 2, 3, 24)
    np.testing.assert_array_equal(filters[..., 12:], -filters[..., :12])
    x = (images / 255.0 - np.asarray(MEAN)) / np.asarray(STD)
    out = jax.lax.conv_general_dilated(
        jnp.asarray(x, jnp.float32), jnp.asarray(filters[..., :12], jnp.float32), (1, 1), "VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"), precision="highest",
    )  # fmt: skip
    flat = np.asarray(out, np.float64).reshape(-1, 12)
    moment = flat.T @ flat / len(flat)
    np.testing.assert_allclose(moment, np.eye(12), atol=2e-3)
    # Largest eigenvalue first: the first filter is the smallest (it divides by the most).
    norms = np.linalg.norm(filters[..., :12].reshape(12, 12), axis=0)
    assert norms[0] == norms.min()


def _model(**settings):
    config = resnet.ResNetConfig(arch="airbench", width=8, init="dirac", **settings)
    return resnet.ResNet(config, hopperjax.get_policy("fp32"), RematConfig())


def test_dirac_init_passes_each_convolutions_input_on_and_without_data_whitening_is_identity():
    params = jax.jit(_model().init)(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
    kernel = np.asarray(nn.unbox(params["group1"]["conv0"]["kernel"]))  # 3x3, 8 -> 32 channels
    eye = np.zeros((3, 3, 8, 8))
    eye[1, 1] = np.eye(8)
    np.testing.assert_array_equal(kernel[..., :8], eye)
    assert np.std(kernel[..., 8:]) == pytest.approx((1 / (3 * 9 * 8)) ** 0.5, rel=0.1)
    whiten = np.asarray(nn.unbox(params["whiten"]["kernel"]))
    np.testing.assert_array_equal(whiten, np.asarray(resnet.identity_patches()))
    assert "scale" not in params["group0"]["bn0"] and "bias" not in params["head"]


def _image_config(tmp_path, *overrides):
    cls = hopperjax.workloads.get("image")
    return hopperjax.load_config(
        None,
        ["workload=image", *cls.smoke_overrides, f"run_dir={tmp_path / 'run'}",
         "model.arch=airbench", "model.whiten_images=100", "optim.name=sgd",
         "optim.momentum=0.85", "optim.nesterov=true", "optim.weight_decay=1e-3",
         "optim.clip_norm=null", *overrides],
    )  # fmt: skip


def test_the_data_sets_the_whitening_and_the_groups_train_it_not_and_biases_64x(tmp_path):
    """The run's whitening kernel is the filters of its training images (all of them: more
    asked for than there are); the optimizer leaves it alone, and moves BatchNorm biases 64x as
    far as the other group would for the same gradient, with the same weight decay per step."""
    config = _image_config(tmp_path, "model.bn_bias_lr_scale=64", "model.whiten_images=100000")
    parts = build_components(config)
    state = parts.init_state()
    whiten = np.asarray(state.params["whiten"]["kernel"])
    workload = parts.workload
    train, _ = workload._read()
    images = train.batch(np.arange(len(train)))["images"]
    expected = resnet.whitening_filters(images, *config.data.channel_stats(), eps=5e-4)
    np.testing.assert_allclose(whiten.ravel(), np.asarray(expected), rtol=1e-5, atol=1e-6)
    assert not np.array_equal(whiten, np.asarray(resnet.identity_patches()))
    params = jax.device_get(state.params)
    params["group0"]["bn0"]["bias"] = np.full_like(params["group0"]["bn0"]["bias"], 0.5)
    grads = jax.tree.map(np.ones_like, params)
    updates, _ = parts.tx.update(grads, parts.tx.init(params), params)
    assert not np.asarray(updates["whiten"]["kernel"]).any()
    config = workload.config
    lr = float(build_schedule(config.optim, total_steps=config.train.steps,
                              global_batch_size=config.train.batch_size)(0))  # fmt: skip
    nesterov = 1 + 0.85  # the first step of Nesterov momentum from zero: (1 + m) x the input
    np.testing.assert_allclose(
        updates["group0"]["bn0"]["bias"], -64 * lr * nesterov * (1 + 1e-3 / 64 * 0.5), rtol=1e-5
    )
    np.testing.assert_allclose(updates["group0"]["bn1"]["bias"], -64 * lr * nesterov, rtol=1e-5)
    np.testing.assert_allclose(updates["whiten"]["bias"], -lr * nesterov, rtol=1e-5)
    kernel = params["head"]["kernel"]
    np.testing.assert_allclose(
        updates["head"]["kernel"], -lr * nesterov * (1 + 1e-3 * kernel), rtol=1e-5
    )


def test_multi_crop_eval_averages_the_centre_the_two_shifts_and_their_mirrors(tmp_path):
    config = _image_config(tmp_path, "data.tta_flip=true", "data.tta_translate=1")
    workload = hopperjax.workloads.from_config(config)
    model = _model()
    variables = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 32, 32, 3)))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 32, 32, 3)), jnp.float32)
    got = workload.predict(model, variables, {"images": x})

    def logits(v):
        return model.apply(variables, v, deterministic=True)

    padded = np.pad(np.asarray(x), ((0, 0), (1, 1), (1, 1), (0, 0)), mode="reflect")
    views = [np.asarray(x), padded[:, :32, :32], padded[:, 2:, 2:]]
    each = [(logits(v) + logits(v[:, :, ::-1])) / 2 for v in views]
    np.testing.assert_allclose(got, each[0] / 2 + (each[1] + each[2]) / 4, rtol=1e-5, atol=1e-6)
    assert not np.allclose(each[0], each[1], atol=1e-4)  # the shifts change the logits


def test_warmup_starts_at_its_init_ratio_and_reaches_the_peak():
    optim = hopperjax.load_config(None, ["optim.warmup_steps=9", "optim.warmup_init_ratio=0.2",
                                         "optim.base_lr=2.0", "optim.schedule=linear",
                                         "optim.min_lr_ratio=0"]).optim  # fmt: skip
    schedule = build_schedule(optim, total_steps=50, global_batch_size=1)
    assert float(schedule(0)) == pytest.approx(2.0 * (0.2 + 0.8 / 10))
    assert float(schedule(9)) == pytest.approx(2.0)
    assert float(schedule(50)) == pytest.approx(0.0, abs=1e-6)
    plain = build_schedule(dataclasses.replace(optim, warmup_init_ratio=0.0), total_steps=50,
                           global_batch_size=1)  # fmt: skip
    assert float(plain(0)) == pytest.approx(2.0 / 10)


def test_airbench_parameter_and_flop_counts():
    """Width 64: 1,971,640 parameters (2x2x3x24 + 24 whitening, the six 3x3 convolutions'
    kernels, their BatchNorms' biases, a bias-free classifier) and 118.15 M multiply-adds
    forward per 32x32 image."""
    config = resnet.ResNetConfig(arch="airbench", width=64)
    model = resnet.ResNet(config, hopperjax.get_policy("fp32"), RematConfig())
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
    assert sum(np.prod(v.shape) for v in jax.tree.leaves(shapes)) == 1_971_640
    forward, first = resnet.forward_flops(config, 32)
    assert first == 2 * 31 * 31 * 4 * 3 * 24
    macs = (31 * 31 * 4 * 3 * 24  # whitening, 32 -> 31 (valid 2x2)
            + 31 * 31 * 9 * 24 * 64 + 15 * 15 * 9 * 64 * 64  # group 0, pooled to 15x15
            + 15 * 15 * 9 * 64 * 256 + 7 * 7 * 9 * 256 * 256  # group 1, to 7x7
            + 7 * 7 * 9 * 256 * 256 + 3 * 3 * 9 * 256 * 256  # group 2, to 3x3
            + 256 * 10)  # fmt: skip
    assert forward == 2 * macs == 236_294_720


def test_the_network_computes_the_pytorch_references_function():
    """Given the same weights (width 16), the airbench network's logits in training and eval
    mode, its label-smoothed loss and every parameter's gradient (norm and a random projection)
    are those of our PyTorch implementation of airbench94's network, recorded in float64 by
    ``experiments/airbench_torch_golden.py`` (tests/golden/airbench_torch.json): the same
    convolutions, pooling, whitening bias, BatchNorm (batch statistics in training, running ones
    at eval), GELU, max pool and 1/9 scale, so a gap in accuracy between the two is not the
    network's."""
    import json

    from hopperjax.workloads.base import cross_entropy

    golden_script = GOLDEN
    golden = json.loads(golden_script.GOLDEN.read_text())
    width, seed = golden["width"], golden["seed"]
    flat, stats = golden_script.weights(width, seed)
    images, labels = golden_script.inputs(seed)
    model = resnet.ResNet(
        resnet.ResNetConfig(arch="airbench", width=width, init="dirac", bn_eps=1e-12,
                            bn_momentum=golden["bn_momentum"], logit_scale=1 / 9),
        hopperjax.get_policy("fp32"), RematConfig(),
    )  # fmt: skip

    def nest(tree):
        out = {}
        for path, value in tree.items():
            *parents, leaf = path.split("/")
            node = out
            for name in parents:
                node = node.setdefault(name, {})
            node[leaf] = jnp.asarray(value)
        return out

    params, batch_stats = nest(flat), nest(stats)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    assert jax.tree.structure(nn.unbox(shapes["params"])) == jax.tree.structure(params)

    def loss_fn(params):
        logits, updated = model.apply({"params": params, "batch_stats": batch_stats}, images,
                                      deterministic=False, mutable=["batch_stats"])  # fmt: skip
        return cross_entropy(logits, jnp.asarray(labels), 0.2).mean(), (logits, updated)

    value_and_grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (loss, (train_logits, updated)), grads = value_and_grad(params)
    eval_logits = jax.jit(model.apply)({"params": params, "batch_stats": batch_stats}, images)
    np.testing.assert_allclose(train_logits, golden["train_logits"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(eval_logits, golden["eval_logits"], rtol=1e-4, atol=1e-5)
    assert float(loss) == pytest.approx(golden["loss"], rel=1e-5)
    grads = {"/".join(k.key for k in path): np.asarray(g, np.float64)
             for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]}  # fmt: skip
    probes = golden_script.probes(width, seed)
    assert set(grads) == set(golden["grads"])
    for path, want in golden["grads"].items():
        assert np.linalg.norm(grads[path]) == pytest.approx(want["norm"], rel=1e-4), path
        assert (grads[path] * probes[path]).sum() == pytest.approx(
            want["probe"], rel=1e-3, abs=1e-4 * want["norm"]
        ), path
    # Running statistics: the same momentum convention (Flax's decay 0.6 is PyTorch's 0.4).
    # PyTorch keeps the unbiased batch variance (n / (n - 1) of the one it normalizes with),
    # Flax the biased one: converted here, n the values a channel has (4 images x side^2).
    sides = {"group0": 15, "group1": 7, "group2": 3}  # 31 after the whitening, pooled
    decay = golden["bn_momentum"]
    for path, want in golden["running_stats"].items():
        group, layer, leaf = path.split("/")
        got = np.asarray(updated["batch_stats"][group][layer][leaf], np.float64)
        if leaf == "var":
            n = len(images) * sides[group] ** 2
            batch_var = (got - decay * stats[path]) / (1 - decay)
            got = decay * stats[path] + (1 - decay) * batch_var * n / (n - 1)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=path)
    # The whitening filters from the same images and statistics, up to each eigenvector's sign
    # (LAPACK's choice; the negatives are in the kernel too).
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # the reference's
    filters = np.asarray(
        resnet.whitening_filters(golden_script.smooth_images(seed=seed + 3), mean, std, 5e-4)
    ).reshape(4 * 3, 2 * 4 * 3)
    want = np.asarray(golden["whitening_filters"]).reshape(4 * 3, 2 * 4 * 3)
    signs = np.sign((filters * want).sum(axis=0))
    np.testing.assert_allclose(filters * signs, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
