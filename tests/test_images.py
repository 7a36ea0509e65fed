"""Image classification: the loaders of every format, on-device augmentation, BatchNorm over the
global batch, the ResNets' FLOPs, exact eval accuracy and one-line errors for bad images."""

import dataclasses
import importlib.util
import json
import pickle
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from PIL import Image

import hopperjax
from hopperjax.config import ConfigError, RematConfig
from hopperjax.data import EpochBatches, image_shards, images
from hopperjax.data.errors import DataError
from hopperjax.data.grain_io import ProcessShard
from hopperjax.models import resnet
from hopperjax.trainer import build_components
from hopperjax.trainer.step import preprocess_key

RNG = np.random.default_rng(0)
PIXELS = RNG.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
LABELS = np.array([3, 0, 9, 3, 1, 0], np.int32)


def _write_cifar(tmp_path):
    """The same six images in the binary and the python release (train: 5 batch files)."""
    planes = PIXELS.transpose(0, 3, 1, 2).reshape(6, -1)
    binary, python = tmp_path / "bin", tmp_path / "py"
    binary.mkdir()
    python.mkdir()
    splits = {name: slice(i, i + 1) for i, name in enumerate(images.CIFAR_TRAIN_FILES)}
    splits[images.CIFAR_TEST_FILE] = slice(5, 6)
    for name, rows in splits.items():
        records = np.concatenate([LABELS[rows, None].astype(np.uint8), planes[rows]], axis=1)
        records.tofile(binary / f"{name}.bin")
        batch = {b"data": planes[rows], b"labels": LABELS[rows].tolist(), b"batch_label": b"x"}
        (python / name).write_bytes(pickle.dumps(batch, protocol=2))
    return binary, python


def _write_folders(root, pixels=PIXELS, labels=LABELS, suffix=".png"):
    for split, rows in (("train", range(5)), ("test", range(5, 6))):
        for i in rows:
            folder = root / split / images.CIFAR_CLASSES[labels[i]]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels[i]).save(folder / f"{i:04d}{suffix}")


def test_every_source_reads_the_same_images_and_labels(tmp_path):
    binary, python = _write_cifar(tmp_path)
    for root, is_binary in ((binary, True), (python, False)):
        train = images.read_cifar(root, "train", binary=is_binary)
        test = images.read_cifar(root, "test", binary=is_binary)
        np.testing.assert_array_equal(train.images, PIXELS[:5])
        np.testing.assert_array_equal(train.labels, LABELS[:5])
        np.testing.assert_array_equal(test.images, PIXELS[5:])
        assert train.classes[3] == "cat"
    # Folders (lossless PNG): class ids are the sorted names of the classes present.
    _write_folders(tmp_path / "folders")
    train = images.read_folder(tmp_path / "folders", "train", 32)
    assert train.classes == ("airplane", "automobile", "cat", "truck")
    order = np.argsort([images.CIFAR_CLASSES[c] for c in LABELS[:5]], kind="stable")
    np.testing.assert_array_equal(train.images, PIXELS[:5][order])
    assert [train.classes[c] for c in train.labels] == [
        images.CIFAR_CLASSES[c] for c in LABELS[:5][order]
    ]
    # Grayscale and palette images become RGB.
    gray = tmp_path / "gray.png"
    Image.fromarray(PIXELS[0, :, :, 0]).save(gray)
    np.testing.assert_array_equal(images.decode(gray, 32), np.repeat(PIXELS[0, :, :, :1], 3, 2))


def test_bad_images_are_one_line_errors_naming_the_file_or_are_skipped(tmp_path):
    root = tmp_path / "folders"
    _write_folders(root, suffix=".jpg")
    broken = root / "train" / "cat" / "broken.jpg"
    broken.write_bytes(b"not a jpeg")
    with pytest.raises(DataError, match=r"broken\.jpg: not a readable image"):
        images.read_folder(root, "train", 32)
    skipped = images.read_folder(root, "train", 32, skip_bad=True)
    assert len(skipped) == 5 and skipped.skipped == 1
    broken.unlink()
    Image.fromarray(PIXELS[0, :30]).save(root / "train" / "cat" / "small.png")
    with pytest.raises(DataError, match=r"small\.png: 32x30 pixels, expected 32x32"):
        images.read_folder(root, "train", 32)
    # Through the trainer: one line naming the file, under data.path.
    config = hopperjax.load_config(
        REPO / "configs" / "cifar10_resnet.yaml",
        [f"data.path={root}", f"run_dir={tmp_path / 'run'}", "train.batch_size=8"],
    )
    with pytest.raises(ConfigError, match=r"small\.png: 32x30 pixels") as info:
        hopperjax.train(config, console=False)
    assert "\n" not in str(info.value)

    cut = tmp_path / "cut.bin"
    cut.write_bytes(bytes(images.CIFAR_RECORD + 5))
    with pytest.raises(DataError, match=r"cut\.bin: 3078 bytes, not a whole number"):
        images.read_cifar_binary_file(cut)
    evil = tmp_path / "evil"
    evil.write_bytes(pickle.dumps(print))
    with pytest.raises(DataError, match=r"refused to unpickle global 'builtins\.print'"):
        images.read_cifar_python_file(evil)


def _image_config(tmp_path, *overrides):
    cls = hopperjax.workloads.get("image")
    return hopperjax.load_config(
        None, ["workload=image", *cls.smoke_overrides, f"run_dir={tmp_path / 'run'}", *overrides]
    )


def test_augmentation_crops_flips_and_cuts_per_image_and_eval_only_normalizes(tmp_path):
    config = _image_config(tmp_path, "data.cutout=8")
    workload = hopperjax.workloads.get("image")(config)
    batch = {"images": jnp.asarray(PIXELS), "labels": jnp.asarray(LABELS)}
    mean, std = (np.asarray(v, np.float32) for v in config.data.channel_stats())
    normalized = (PIXELS / np.float32(255) - mean) / std

    held = workload.preprocess(batch, jax.random.key(0), train=False)["images"]
    np.testing.assert_allclose(held, normalized, rtol=1e-6, atol=1e-6)

    key = jax.random.key(7)
    jitted = jax.jit(lambda b, k: workload.preprocess(b, k, train=True)["images"])(batch, key)
    again = np.asarray(workload.preprocess(batch, key, train=True)["images"])
    np.testing.assert_allclose(jitted, again, atol=1e-6)  # the same key, the same augmentation
    other = np.asarray(workload.preprocess(batch, jax.random.key(8), train=True)["images"])
    assert not np.allclose(other, again)  # another step's key, other augmentations

    # Each image is a 32x32 window of its reflect-padded self (or its mirror), with one square
    # of at most 8x8 set to 0 (the mean).
    pad = config.data.crop_padding
    placements = []
    for i in range(len(PIXELS)):
        padded = np.pad(normalized[i], ((pad, pad), (pad, pad), (0, 0)), mode="reflect")
        cut = np.all(again[i] == 0.0, axis=-1)
        assert 0 < cut.sum() <= 64
        found = [
            (top, left, mirrored)
            for top in range(2 * pad + 1)
            for left in range(2 * pad + 1)
            for mirrored, window in enumerate(
                (
                    padded[top : top + 32, left : left + 32],
                    padded[top : top + 32, left : left + 32][:, ::-1],
                )
            )
            if np.allclose(window[~cut], again[i][~cut], atol=1e-5)
        ]
        assert found, i
        placements.append(found[0])
    # The crops and flips did happen: offsets other than the centre, and mirrored images.
    assert any((top, left) != (pad, pad) for top, left, _ in placements), placements
    assert any(mirrored for _, _, mirrored in placements), placements


def test_resnet_flops_match_the_published_counts():
    """Multiply-adds per 224x224 image: ResNet-18 1.82 G, ResNet-34 3.67 G, ResNet-50 (v1.5)
    4.09 G (torchvision's model cards count 1.81, 3.66, 4.09 GMACs)."""
    for arch, gmacs in (("resnet18", 1.82), ("resnet34", 3.67), ("resnet50", 4.09)):
        config = resnet.ResNetConfig(arch=arch, stem="imagenet", num_classes=1000)
        forward, _ = resnet.forward_flops(config, 224)
        assert forward / 2e9 == pytest.approx(gmacs, rel=0.01), arch


@pytest.mark.parametrize(
    ("arch", "count"),
    [("resnet18", 11_689_512), ("resnet34", 21_797_672), ("resnet50", 25_557_032)],
)
def test_resnets_have_torchvisions_parameter_counts(arch, count):
    """The ImageNet ResNets' parameters (BatchNorm scales and biases included, running
    statistics not) number what torchvision's do: the same layers, v1.5 for ResNet-50."""
    config = resnet.ResNetConfig(arch=arch, stem="imagenet", num_classes=1000)
    model = resnet.ResNet(config, hopperjax.get_policy("fp32"), RematConfig())
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)))
    assert sum(x.size for x in jax.tree.leaves(shapes["params"])) == count


def test_eval_scores_every_held_out_image_once(tmp_path):
    """77 held-out images in eval batches of 16: the last batch is padded with masked rows, so
    the scores are over exactly 77 images (a dropped remainder would score 64)."""
    config = _image_config(tmp_path, "data.synthetic_images=308")
    parts = build_components(config)
    batches = list(parts.datasets.eval)
    labels = np.concatenate([b["labels"] for b in batches])
    assert len(labels) == 80 and (labels >= 0).sum() == 77 and (labels[77:] == -1).all()
    logits = RNG.normal(size=(80, 10)).astype(np.float32)
    outputs = parts.workload.eval_outputs(jnp.asarray(logits), {"labels": jnp.asarray(labels)})
    scores = parts.workload.summarize([jax.device_get(outputs)])
    real = labels >= 0
    expected = (logits[real].argmax(-1) == labels[real]).mean()
    assert float(outputs["images"]) == 77
    assert scores["eval_accuracy"] == pytest.approx(expected)
    shifted = logits[real] - logits[real].max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    loss = -log_probs[np.arange(77), labels[real]].mean()
    assert scores["eval_loss"] == pytest.approx(loss, rel=1e-5)  # padding rows add no loss


def test_training_batches_cover_each_epoch_once_split_across_processes_and_resume():
    """Batches are gathered whole: each epoch is a fresh permutation (its remainder left out),
    two processes' rows are the halves of one process's batch, and batch i depends on i alone
    (what an exact resume needs)."""
    n = 70
    data = images.ImageSet(
        np.arange(n, dtype=np.uint8)[:, None, None, None] * np.ones((1, 2, 2, 3), np.uint8),
        np.arange(n, dtype=np.int32),
        classes=("a",),
    )
    one = EpochBatches(data, global_batch=16, rows=16, seed=3)
    halves = [EpochBatches(data, 16, rows=8, offset=8 * i, seed=3) for i in range(2)]
    epochs = [np.concatenate([one[4 * e + k]["labels"] for k in range(4)]) for e in range(3)]
    for labels in epochs:
        assert len(set(labels.tolist())) == 64  # 4 batches of 16 distinct images, 6 left out
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled each epoch
    for i in (0, 5, 11):
        batch = one[i]
        np.testing.assert_array_equal(batch["images"][:, 0, 0, 0], batch["labels"])
        joined = np.concatenate([h[i]["labels"] for h in halves])
        np.testing.assert_array_equal(joined, batch["labels"])
    fresh = EpochBatches(data, global_batch=16, rows=16, seed=3)
    np.testing.assert_array_equal(fresh[9]["labels"], one[9]["labels"])
    ordered = EpochBatches(data, 16, rows=16, shuffle=False, epochs=1)
    assert len(ordered) == 4
    np.testing.assert_array_equal(ordered[1]["labels"], np.arange(16, 32))


def test_imagenet_recipe_trains_on_photos_of_any_shape_decoded_in_the_pipeline(tmp_path):
    """configs/imagenet_resnet50.yaml (random-resized crop, lazy decoding, host resize), shrunk
    in width and image size and with ResNet-18's basic blocks (ResNet-50's 16 bottlenecks take a
    minute to compile here; their structure is checked by parameter count below), trains and
    evaluates on tiny generated folders of photos of several shapes."""
    root = tmp_path / "imagenet"
    shapes = [(40, 30), (64, 48), (36, 52), (48, 48)]
    for split, count in (("train", 16), ("val", 5)):
        for i in range(count):
            folder = root / split / f"n0{i % 3}"
            folder.mkdir(parents=True, exist_ok=True)
            width, height = shapes[i % len(shapes)]
            pixels = RNG.integers(0, 256, (height, width, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.JPEG")
    config = hopperjax.load_config(
        REPO / "configs" / "imagenet_resnet50.yaml",
        [f"data.path={root}", f"run_dir={tmp_path / 'run'}", "data.workers=0",
         "model.arch=resnet18", "model.width=4", "data.image_size=40", "data.crop_size=32",
         "precision=fp32", "train.batch_size=8", "train.eval_batch_size=8", "train.steps=2",
         "train.eval_every=2", "optim.warmup_steps=1"],
    )  # fmt: skip
    parts = build_components(config)
    assert len(parts.datasets.meta.classes) == 3
    batches = iter(parts.datasets.train)
    first = next(batches)
    assert first["images"].shape == (8, 40, 40, 3) and first["images"].dtype == np.uint8
    workload = parts.workload
    crops = workload.preprocess(
        {k: jnp.asarray(v) for k, v in first.items()}, jax.random.key(0), train=True
    )["images"]
    assert crops.shape == (8, 32, 32, 3) and np.isfinite(np.asarray(crops)).all()
    centre = workload.preprocess({"images": jnp.asarray(first["images"])}, None, train=False)
    mean, std = (np.asarray(v, np.float32) for v in config.data.channel_stats())
    expected = (first["images"][:, 4:36, 4:36] / np.float32(255) - mean) / std
    np.testing.assert_allclose(centre["images"], expected, rtol=1e-5, atol=1e-5)
    # Two training steps (the eval step's compile is left to the contract test's smoke model).
    state = parts.init_state()
    start = jax.device_get(state.params)
    for batch in (first, next(batches)):
        placed = {k: jax.device_put(v, parts.batch_sharding[k]) for k, v in batch.items()}
        state, metrics = parts.train_step(state, placed)
        assert np.isfinite(float(metrics["loss"]))
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, start)
    assert max(jax.tree.leaves(moved)) > 0


@pytest.mark.parametrize(
    ("overrides", "key", "message"),
    [
        (["data.crop_size=24"], "data.crop_size", "= it with data.augment=crop"),
        (["data.augment=resized_crop", "data.crop_size=40"], "data.crop_size", "<= data.image"),
        (["data.preload=false"], "data.preload", "needs data.source=folder"),
        (["data.resize=true"], "data.resize", "needs data.source=folder"),
        (["data.mean=0.5,0.5"], "data.mean", "three comma-separated numbers"),
        (["data.std=0.2,0,0.2"], "data.std", "three comma-separated positive numbers"),
        (["data.crop_padding=32"], "data.crop_padding", "padding < data.image_size"),
        (["model.bn_momentum=1"], "model.bn_momentum", "0 <= momentum < 1"),
        (["model.bn_bias_lr_scale=64"], "model.bn_bias_lr_scale", "needs optim.name=sgd"),
        (["data.tta_translate=32"], "data.tta_translate", "0 <= shift < data.image_size"),
    ],
)
def test_bad_image_keys_are_named(overrides, key, message, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        _image_config(tmp_path, *overrides)
    assert info.value.key == key


def test_skipping_bad_images_needs_them_decoded_up_front(tmp_path):
    _write_folders(tmp_path / "f")
    with pytest.raises(ConfigError, match=r"skip needs data\.preload=true") as info:
        _image_config(
            tmp_path, "data.source=folder", f"data.path={tmp_path / 'f'}",
            "data.preload=false", "data.bad_records=skip",
        )  # fmt: skip
    assert info.value.key == "data.bad_records"


def test_an_image_decoded_when_read_names_its_file(tmp_path):
    """With data.preload=false a bad image surfaces when the pipeline reaches it, as a DataError
    naming the file (the CLI prints it as one line, exit 2)."""
    root = tmp_path / "f"
    _write_folders(root, suffix=".jpg")
    (root / "train" / "cat" / "0000.jpg").write_bytes(b"truncated")
    config = _image_config(
        tmp_path, "data.source=folder", f"data.path={root}", "data.preload=false",
        "train.batch_size=5", "data.shuffle=false",
    )  # fmt: skip
    datasets = hopperjax.workloads.get("image")(config).build_datasets(ProcessShard())
    with pytest.raises(DataError, match=r"0000\.jpg: not a readable image"):
        next(iter(datasets.train))


def test_one_step_batchnorm_on_eight_devices_remat_and_every_parameter_learning(tmp_path):
    """One training step of the smoke ResNet-9, three checks (one compile of each model):

    - BatchNorm statistics with the batch split over 8 devices equal those of the same model on
      one device over the whole batch (fp32, 1e-4; per-device means would differ by ~0.1), and
      are fp32 under bf16 compute. Under the jitted SPMD step this holds by construction; the
      test guards against a per-device formulation (shard_map, pmap) changing it.
    - remat.policy=full (every block recomputed, its train flag static) gives the same step.
    - every parameter moves (a residual branch whose last BatchNorm started at zero behind a
      ReLU would get no gradient).
    """
    bf16 = build_components(_image_config(tmp_path / "bf16", "precision=bf16")).abstract_state
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(bf16.model_state))
    batch = {"images": RNG.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8),
             "labels": np.tile(LABELS[:4], 4)}  # fmt: skip
    results = []
    for policy in ("none", "full"):
        config = _image_config(tmp_path / policy, f"remat.policy={policy}", "optim.clip_norm=null")
        parts = build_components(config)
        state = parts.init_state()
        variables = {"params": jax.device_get(state.params), **jax.device_get(state.model_state)}
        key = preprocess_key(state.rng, state.step)  # the step's own augmentation
        placed = {k: jax.device_put(v, parts.batch_sharding[k]) for k, v in batch.items()}
        assert len(placed["images"].sharding.device_set) == 8
        state, metrics = parts.train_step(state, placed)
        results.append((float(metrics["loss"]), jax.device_get(state.params)))
        if policy == "none":
            eight = jax.device_get(state.model_state["batch_stats"])
            model = parts.workload.build_model(hopperjax.get_policy("fp32"), config.remat)

            def one_device(v, images, model=model, workload=parts.workload, key=key):
                images = workload.preprocess({"images": images}, key, train=True)["images"]
                return model.apply(v, images, deterministic=False, mutable=["batch_stats"])[1]

            device = jax.devices()[0]
            one = jax.jit(one_device)(
                jax.device_put(variables, device), jax.device_put(batch["images"], device)
            )
            leaves = jax.tree.leaves(one["batch_stats"])
            assert len(leaves) == 16 and max(float(np.abs(v).max()) for v in leaves) > 1e-2
            for a, b in zip(jax.tree.leaves(eight), leaves, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
            start = variables["params"]
    (loss, params), (loss_full, params_full) = results
    assert loss_full == pytest.approx(loss, rel=1e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_full), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), params, start)
    frozen = [
        jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_leaves_with_path(moved) if v == 0
    ]
    assert not frozen, frozen


def _folder_of(tmp_path, count=40):
    """``count`` random train images and 12 test images in a folder tree, labels 0-3."""
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (count + 12, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 4, count + 12).astype(np.int32)
    root = tmp_path / "folders"
    for i in range(count + 12):
        split = "train" if i < count else "test"
        folder = root / split / images.CIFAR_CLASSES[labels[i]]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels[i]).save(folder / f"{i:04d}.png")
    return root


def test_converted_shards_feed_the_same_batches_as_the_folder(tmp_path, capsys):
    """tools/convert_images.py decodes once; training from the shards sees exactly the batches
    (train and eval) that decoding the folder gives, and its bench reads them back."""
    spec = importlib.util.spec_from_file_location(
        "convert_images", REPO / "tools/convert_images.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    convert = tool.main
    root = _folder_of(tmp_path)
    out = tmp_path / "shards"
    rc = convert(["--source", "folder", "--path", str(root), "--out", str(out), "--shards", "3",
                  "--bench", "--bench-workers", "0", "--bench-batches", "2",
                  "--batch-size", "8"])  # fmt: skip
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert "train 40, test 12 images of 4 classes 32x32x3, 0 skipped" in lines[0]
    rates = [json.loads(x) for x in lines[1:]]
    assert {r["source"] for r in rates} == {"shards", "files", "memory"}
    assert all(r["images_per_s"] > 0 for r in rates)
    assert len(list(out.glob("train-*-of-00003.array_record"))) == 3

    common = ["data.source=synthetic", "data.path=null", "train.batch_size=8",
              "train.eval_batch_size=8"]  # fmt: skip
    folder = build_components(
        _image_config(tmp_path, *common, "data.source=folder", f"data.path={root}")
    )
    for preload in ("true", "false"):  # shards read into memory, or a batch at a time
        shards = build_components(
            _image_config(tmp_path, *common, "data.source=shards", f"data.path={out}",
                          f"data.preload={preload}")
        )  # fmt: skip
        assert folder.datasets.meta == shards.datasets.meta
        train_a, train_b = iter(folder.datasets.train), iter(shards.datasets.train)
        for _ in range(7):  # past an epoch of 5 batches: the reshuffle matches too
            a, b = next(train_a), next(train_b)
            np.testing.assert_array_equal(a["images"], b["images"])
            np.testing.assert_array_equal(a["labels"], b["labels"])
        eval_a, eval_b = list(folder.datasets.eval), list(shards.datasets.eval)
        assert len(eval_a) == len(eval_b) == 2  # 12 images in batches of 8: 4 padded rows
        for a, b in zip(eval_a, eval_b, strict=True):
            np.testing.assert_array_equal(a["images"], b["images"])
            np.testing.assert_array_equal(a["labels"], b["labels"])


@pytest.mark.parametrize(
    ("setup", "overrides", "key", "message"),
    [
        ("empty", [], "data.path", r"no dataset\.json; not an image shard directory"),
        ("shards", ["data.image_size=28", "data.crop_padding=2"], "data.image_size",
         r"hold \(32, 32, 3\) images, expected \(28, 28, 3\)"),
        ("shards", ["data.eval_split=valid"], "data.path", r"no split 'valid'"),
        ("missing", [], "data.path", r"test-00000-of-00001\.array_record: missing"),
        ("truncated", [], "data.path", r"shards: cannot open its 'test' shards"),
    ],
)  # fmt: skip
def test_bad_shard_directories_are_one_line_errors(tmp_path, setup, overrides, key, message):
    out = tmp_path / "shards"
    out.mkdir()
    if setup != "empty":
        data = images.ImageSet(PIXELS, np.array([0, 1, 0, 1, 0, 1], np.int32), ("a", "b"))
        image_shards.write_image_shards({"train": data, "test": data.take(np.arange(2))}, out,
                                        num_shards=1)  # fmt: skip
    if setup == "missing":
        (out / "test-00000-of-00001.array_record").unlink()
    if setup == "truncated":
        (out / "test-00000-of-00001.array_record").write_bytes(b"\0" * 100)
    config = _image_config(tmp_path, "data.source=shards", f"data.path={out}", *overrides)
    with pytest.raises(ConfigError, match=message) as info:
        build_components(config)
    assert info.value.key == key and "\n" not in str(info.value)


def test_shard_reads_of_padding_alone_and_batches_too_large_for_the_data(tmp_path):
    """A process's share of the last eval batch can be padding only (no record read); a batch
    larger than the data, or rows outside it, is refused up front."""
    data = images.ImageSet(PIXELS, LABELS, images.CIFAR_CLASSES)
    image_shards.write_image_shards({"train": data}, tmp_path, num_shards=2)
    records = image_shards.read_image_shards(tmp_path, "train").padded(8)
    tail = records.batch(np.array([6, 7]))
    assert (tail["labels"] == -1).all() and not tail["images"].any()
    np.testing.assert_array_equal(records.batch(np.arange(6))["images"], PIXELS)
    with pytest.raises(ValueError, match="a batch of 16 needs at least that many examples"):
        EpochBatches(data, global_batch=16, rows=16)
    with pytest.raises(ValueError, match=r"rows \[4, 8\) are not inside a batch of 6"):
        EpochBatches(data, global_batch=6, rows=4, offset=4)


def test_torch_init_starts_kernels_at_pytorchs_scale():
    """model.init=torch: PyTorch's Conv2d/Linear default, variance 1 / (3 fan-in); he: variance
    2 / fan-out for convolutions."""
    model_config = resnet.ResNetConfig(arch="resnet9", width=16)
    stds = {}
    for init in ("he", "torch"):
        config = dataclasses.replace(model_config, init=init)
        model = resnet.ResNet(config, hopperjax.get_policy("fp32"), RematConfig())
        params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
        kernel = nn.unbox(params["stage1"]["conv"]["kernel"])  # 3x3, 32 -> 64 channels
        stds[init] = float(jnp.std(kernel))
    assert stds["he"] == pytest.approx((2 / (9 * 64)) ** 0.5, rel=0.05)
    assert stds["torch"] == pytest.approx((1 / (3 * 9 * 32)) ** 0.5, rel=0.05)
