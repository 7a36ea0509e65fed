"""The T5-style encoder-decoder on packed rows: an example packed beside another gets exactly the
logits it gets alone (masks and per-example positions keep examples apart), the decoder is causal,
and the analytic FLOPs count what XLA compiles."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hopperjax
from hopperjax import workloads
from hopperjax.config import RematConfig
from hopperjax.data import parallel_text as pt
from hopperjax.data.grain_io import ProcessShard
from hopperjax.models import decoding, t5

CONFIG = t5.T5Config(vocab_size=40, d_model=32, n_heads=2, encoder_layers=2, decoder_layers=2,
                     mlp_dim=64, dropout=0.0)  # fmt: skip
# The original Transformer's shape (fairseq's, the literature's baselines), the five keys turned.
VANILLA = {"norm": "layer", "norm_position": "post", "mlp": "relu", "positions": "sinusoidal",
           "use_bias": True}  # fmt: skip
SHAPES = pytest.mark.parametrize("shape", [{}, VANILLA], ids=["t5", "vanilla"])
LEN = 16


def _batch(packed: pt.Packed) -> tuple:
    a = packed.arrays
    names = ("source", "source_segments", "source_positions", "target_inputs",
             "target_segments", "target_positions")  # fmt: skip
    return tuple(jnp.asarray(a[n]) for n in names)


@SHAPES
def test_packed_examples_match_themselves_alone_and_the_decoder_is_causal(shape):
    rng = np.random.default_rng(0)
    sources = [np.append(rng.integers(3, 40, n), pt.EOS_ID).astype(np.int32) for n in (5, 6)]
    targets = [np.append(rng.integers(3, 40, n), pt.EOS_ID).astype(np.int32) for n in (4, 7)]
    together = pt.pack(sources, targets, [0, 1], source_len=LEN, target_len=LEN)
    assert together.rows == 1
    alone = [pt.pack(sources, targets, [i], source_len=LEN, target_len=LEN) for i in (0, 1)]
    joined = {k: np.concatenate([alone[0].arrays[k], alone[1].arrays[k]]) for k in alone[0].arrays}
    model = t5.T5(dataclasses.replace(CONFIG, **shape), hopperjax.get_policy("fp32"), RematConfig())
    both = _batch(pt.Packed({k: np.repeat(v, 2, 0) for k, v in together.arrays.items()}, 2, 0))
    params = jax.jit(model.init)(jax.random.key(0), *both)
    apply = jax.jit(model.apply)
    packed_logits = np.asarray(apply(params, *both))[0]
    alone_logits = np.asarray(apply(params, *_batch(pt.Packed(joined, 2, 0))))
    segments = together.arrays["target_segments"][0]
    for i in (0, 1):
        mine = segments == i + 1
        n = int(mine.sum())
        np.testing.assert_allclose(packed_logits[mine], alone_logits[i, :n], rtol=2e-5, atol=2e-5)
    # Causal: changing the second example's last decoder input changes no earlier position.
    changed = [np.array(x) for x in both]
    last = int(np.flatnonzero(segments == 2)[-1])
    changed[3][0, last] = (changed[3][0, last] + 1) % 40
    out = np.asarray(apply(params, *[jnp.asarray(x) for x in changed]))[0]
    np.testing.assert_allclose(out[:last], packed_logits[:last], rtol=1e-6, atol=1e-6)
    assert not np.allclose(out[last], packed_logits[last])


@SHAPES
def test_forward_flops_count_the_compiled_gemms(shape):
    # Unrolled layer scans: XLA's cost analysis counts a loop body once, not per iteration.
    config = dataclasses.replace(CONFIG, scan_unroll=2, **shape)
    model = t5.T5(config, hopperjax.get_policy("fp32"), RematConfig())
    rows = 4
    ids = jnp.ones((rows, LEN), jnp.int32)
    args = (ids, ids, ids, ids, ids, ids)
    params = jax.eval_shape(model.init, jax.random.key(0), *args)
    compiled = jax.jit(model.apply).lower(params, *args).compile()
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    analytic = t5.forward_flops(config, rows=rows, source_len=LEN, target_len=LEN)
    # XLA adds the elementwise work (norms, softmax, GELU, RoPE): a few percent at this size.
    assert analytic <= xla["flops"] <= 1.25 * analytic


def _layer_norm(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def test_the_vanilla_encoder_is_the_original_transformers_maths():
    """The encoder in the original Transformer's shape against a NumPy transcription of it:
    embeddings times sqrt(d_model) plus the sinusoids, then per block LayerNorm(x + attention(x))
    and LayerNorm(x + W2 relu(W1 x + b1) + b2), every projection biased, no final norm."""
    config = dataclasses.replace(CONFIG, **VANILLA)
    model = t5.T5(config, hopperjax.get_policy("fp32"), RematConfig())
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(3, 40, (2, LEN)), jnp.int32)
    ones, positions = jnp.ones((2, LEN), jnp.int32), jnp.broadcast_to(jnp.arange(LEN), (2, LEN))
    args = (tokens, ones, positions, tokens, ones, positions)
    variables = model.init(jax.random.key(0), *args)
    # Biases and norms start at zero and one: move them, so a dropped term shows.
    variables = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape), nn.unbox(variables))
    got = np.asarray(model.apply(variables, tokens, ones, positions, method="encode"))

    params = jax.tree.map(np.asarray, variables["params"])
    d, eps = config.d_model, config.norm_eps
    x = params["token_embed"]["embedding"][np.asarray(tokens)] * np.sqrt(d)
    x = x + np.asarray(t5.sinusoids(positions, d))
    for layer in range(config.encoder_layers):
        block = jax.tree.map(lambda w, i=layer: w[i], params["encoder"]["blocks"])
        att = block["attention"]
        qkv = np.einsum("btd,dchk->btchk", x, att["qkv"]["kernel"]) + att["qkv"]["bias"]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(config.head_dim)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        heads = np.einsum("bhts,bshk->bthk", probs, v)
        out = np.einsum("bthk,hkd->btd", heads, att["attn_out"]["kernel"]) + att["attn_out"]["bias"]
        x = _layer_norm(x + out, block["attn_norm"], eps)
        mlp = block["mlp"]
        hidden = np.maximum(x @ mlp["mlp_in"]["kernel"] + mlp["mlp_in"]["bias"], 0.0)
        x = _layer_norm(x + hidden @ mlp["mlp_out"]["kernel"] + mlp["mlp_out"]["bias"],
                        block["mlp_norm"], eps)  # fmt: skip
    np.testing.assert_allclose(got, x, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("d_model", [32, 128])
def test_tied_head_logits_start_at_unit_scale_whatever_d_model(d_model):
    # The tied head's logits start at std ~1 (rows of the embedding at norm ~1 against the final
    # norm's output): with an extra d_model ** -0.5 they started at ~0.1 at d_model 128 and
    # the model learned slowly (docs/translation.md).
    config = dataclasses.replace(CONFIG, d_model=d_model, vocab_size=512)
    assert config.tie_embeddings
    model = t5.T5(config, hopperjax.get_policy("fp32"), RematConfig())
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, 512, (4, LEN)), jnp.int32)
    ones = jnp.ones((4, LEN), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(LEN), (4, LEN))
    args = (ids, ones, positions, ids, ones, positions)
    params = model.init(jax.random.key(0), *args)
    assert "lm_head" not in params["params"]["decoder"]
    logits = np.asarray(model.apply(params, *args))
    assert 0.7 < logits.std() < 1.4


def test_config_errors_name_the_key():
    with pytest.raises(hopperjax.ConfigError, match=r"model\.n_heads"):
        t5.T5Config(d_model=32, n_heads=3).validate()
    with pytest.raises(hopperjax.ConfigError, match=r"model\.dropout"):
        t5.T5Config(dropout=1.0).validate()
    # Odd head sizes: refused for RoPE only.
    with pytest.raises(hopperjax.ConfigError, match=r"model\.n_heads.*even head sizes"):
        t5.T5Config(d_model=30, n_heads=2).validate()
    t5.T5Config(d_model=30, n_heads=2, positions="sinusoidal").validate()
    smoke = ["workload=translation", *workloads.get("translation").smoke_overrides]
    with pytest.raises(hopperjax.ConfigError, match=r"model\.norm_position.*pre, post"):
        hopperjax.load_config(None, [*smoke, "model.norm_position=sandwich"])


def test_the_vanilla_keys_build_the_original_transformer():
    """Post-norm LayerNorm (with biases, no final norms), a two-matrix ReLU MLP and biased
    projections hold the parameters they should; the fixed sinusoids are fairseq's table (the
    forward maths: the NumPy transcription below; each example's own positions: the packed
    test above)."""
    config = dataclasses.replace(CONFIG, **VANILLA)
    model = t5.T5(config, hopperjax.get_policy("fp32"), RematConfig())
    ids = jnp.ones((2, LEN), jnp.int32)
    args = (ids, ids, jnp.broadcast_to(jnp.arange(LEN), (2, LEN)), ids, ids, ids)
    params = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), *args))["params"]
    for stack in ("encoder", "decoder"):
        assert "final_norm" not in params[stack]
        block = params[stack]["blocks"]
        assert set(block["attn_norm"]) == {"scale", "bias"}
        assert block["mlp"]["mlp_in"]["kernel"].shape == (2, 32, 64)  # [layers, d, mlp]
        assert block["mlp"]["mlp_in"]["bias"].shape == (2, 64)
        assert block["attention"]["qkv"]["bias"].shape == (2, 3, 2, 16)
    assert set(params["decoder"]["blocks"]) == {"attention", "attn_norm", "cross", "cross_norm",
                                                "mlp", "mlp_norm"}  # fmt: skip
    table = np.asarray(t5.sinusoids(jnp.arange(50), 32))
    assert table.shape == (50, 32)
    np.testing.assert_allclose(table[0], [0.0] * 16 + [1.0] * 16, atol=1e-7)
    np.testing.assert_allclose(table[:, 0], np.sin(np.arange(50)), atol=1e-5)  # frequency 1
    np.testing.assert_allclose(table[:, 15], np.sin(np.arange(50) * 1e-4), atol=1e-6)  # 1/10^4
    np.testing.assert_allclose((table**2).sum(-1), 16.0, rtol=1e-5)


def _markov_logits(table: np.ndarray):
    """A decoder whose next-token distribution depends on the previous token alone."""
    log_table = jnp.log(jnp.asarray(table))

    def logits_fn(inputs):
        return log_table[inputs]  # inputs are the previous tokens (padding first)

    return logits_fn


def test_beam_search_finds_the_likelier_sentence_greedy_misses():
    # Tokens: 0 pad, 1 eos, 2 A, 3 B. Greedy takes A (0.6) then eos (0.35): 0.21; the beam
    # finds B (0.4) then eos (0.99): 0.396.
    table = np.full((4, 4), 1e-6)
    table[0] = [1e-6, 1e-6, 0.6, 0.4]
    table[2] = [1e-6, 0.35, 0.33, 0.32]
    table[3] = [1e-6, 0.99, 0.005, 0.005]
    table[1] = [1.0, 1e-6, 1e-6, 1e-6]
    stepper = decoding.uncached(_markov_logits(table))
    greedy = np.asarray(decoding.greedy(stepper, 2, 4))
    assert greedy[0, :2].tolist() == [2, 1] and (greedy[:, 2:] == 0).all()
    beam = np.asarray(decoding.beam_search(stepper, 2, 4, beams=2, length_penalty=0.0))
    assert beam[0, :2].tolist() == [3, 1] and (beam[:, 2:] == 0).all()
    np.testing.assert_array_equal(
        np.asarray(decoding.beam_search(stepper, 2, 4, beams=1, length_penalty=0.0)), greedy
    )


@SHAPES
def test_cached_decoding_equals_uncached_and_one_beam_equals_greedy(tmp_path, shape):
    """On a (randomly initialized) model: the key-value cache gives the tokens the full-prefix
    decoder gives, greedy and beam search; one beam is greedy; translate decodes text."""
    config = hopperjax.load_config(
        None,
        ["workload=translation", *workloads.get("translation").smoke_overrides,
         f"run_dir={tmp_path}", *[f"model.{k}={v}" for k, v in shape.items()]],
    )  # fmt: skip
    workload = workloads.get("translation")(config)
    datasets = workload.build_datasets(ProcessShard())
    tokenizer = pt.Tokenizer(datasets.meta.tokenizer, name="smoke")
    model = workload.build_model(hopperjax.get_policy("fp32"), RematConfig())
    batch = next(iter(datasets.train))
    variables = jax.jit(model.init)(
        jax.random.key(0), *[jnp.asarray(x) for x in workload.model_inputs(batch)]
    )
    sentences = ["a red dog runs .", "the child sees a big car ."]
    greedy = workload.translate(model, variables, tokenizer, sentences, batch=2, beams=1)
    ids = np.zeros((2, config.data.source_len), np.int32)
    for row, encoded in enumerate(tokenizer.encode(sentences)):
        ids[row, : len(encoded)] = encoded
    for beams in (1, 3):
        fast = workload.translator(model, batch=2, beams=beams)(variables, ids)
        slow = workload.translator(model, batch=2, beams=beams, cache=False)(variables, ids)
        np.testing.assert_array_equal(np.asarray(fast), np.asarray(slow))
        assert (np.asarray(fast)[:, :3] != pt.PAD_ID).all()  # it decoded something
        if beams == 1:
            assert [tokenizer.decode(x) for x in np.asarray(fast)] == greedy


def test_translate_cli_prints_one_line_per_sentence_and_errors_are_one_line(tmp_path, capsys):
    from hopperjax import translate

    overrides = ["workload=translation", *workloads.get("translation").smoke_overrides,
                 f"run_dir={tmp_path / 'run'}", "train.steps=10", "train.eval_every=10",
                 "train.checkpoint_every=5", "train.log_every=5", "train.generate_every=10",
                 "data.generate_pairs=8", "data.beams=2", "train.keep_checkpoints=2"]  # fmt: skip
    result = hopperjax.train(hopperjax.load_config(None, overrides), console=False)
    [record] = [r for r in result.history if "eval_loss" in r]
    assert record["step"] == 10
    assert 0.0 <= record["eval_bleu"] <= 100.0 and 0.0 <= record["eval_chrf"] <= 100.0
    assert (tmp_path / "run" / "spm.model").is_file()
    argv = ["--run-dir", str(tmp_path / "run"), "a red dog .", "--beams", "2", "the man runs ."]
    assert translate.main(argv) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert translate.main(["--run-dir", str(tmp_path / "nowhere"), "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hopperjax.translate: --run-dir:") and err.count("\n") == 1
    assert translate.main([*argv, "--average", "2"]) == 0  # the mean of steps 5 and 10
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert translate.main([*argv, "--average", "3"]) == 2  # two checkpoints kept
    err = capsys.readouterr().err
    assert err.startswith("hopperjax.translate: --average: 3 checkpoints asked for")
    assert err.count("\n") == 1
    assert translate.main([*argv, "--average", "0"]) == 2
    assert capsys.readouterr().err.startswith("hopperjax.translate: --average: expected a positive")


def test_generation_metrics_score_the_held_out_references_on_their_cadence(tmp_path, monkeypatch):
    """BLEU and chrF join the eval records every ``train.generate_every`` steps and at the end,
    scored against the first ``data.generate_pairs`` held-out references: a translator that
    returns exactly those references scores 100."""
    from hopperjax.workloads.translation import Translation

    overrides = ["workload=translation", *workloads.get("translation").smoke_overrides,
                 f"run_dir={tmp_path}", "train.steps=6", "train.eval_every=2",
                 "train.generate_every=4", "train.checkpoint_every=6", "train.log_every=2",
                 "data.generate_pairs=30"]  # fmt: skip
    config = hopperjax.load_config(None, overrides)
    held = pt.synthetic_pairs(config.data.synthetic_pairs // 4, config.seed + 1)
    reference = dict(zip(held.sources, held.targets, strict=True))
    asked = []

    def perfect(self, model, variables, tokenizer, sentences, **kwargs):
        asked.append(list(sentences))
        return [reference[s] for s in sentences]

    monkeypatch.setattr(Translation, "translate", perfect)
    result = hopperjax.train(config, console=False)
    evals = {r["step"]: r for r in result.history if "eval_loss" in r}
    assert sorted(evals) == [2, 4, 6]
    assert "eval_bleu" not in evals[2]
    assert evals[4]["eval_bleu"] == evals[6]["eval_bleu"] == pytest.approx(100.0)
    assert evals[6]["eval_chrf"] == pytest.approx(100.0)
    assert asked == [held.sources[:30]] * 2


def test_generate_every_is_checked_against_eval_every_and_the_workload():
    smoke = ["workload=translation", *workloads.get("translation").smoke_overrides]
    with pytest.raises(hopperjax.ConfigError, match=r"train\.generate_every.*multiple"):
        hopperjax.load_config(None, [*smoke, "train.eval_every=4", "train.generate_every=6"])
    with pytest.raises(hopperjax.ConfigError, match=r"train\.generate_every.*no generation"):
        hopperjax.load_config(None, ["train.generate_every=100"])  # language modeling
    with pytest.raises(hopperjax.ConfigError, match=r"data\.beams"):
        hopperjax.load_config(None, [*smoke, "data.beams=0"])
    with pytest.raises(hopperjax.ConfigError, match=r"data\.subword_alpha.*>= 0, got -0\.1"):
        hopperjax.load_config(None, [*smoke, "data.subword_alpha=-0.1"])
    with pytest.raises(hopperjax.ConfigError, match=r"data\.subword_alpha.*unigram.*'bpe'"):
        hopperjax.load_config(None, [*smoke, "data.tokenizer=bpe", "data.subword_alpha=0.1"])
    for nbest in (-1, 1, 513):
        with pytest.raises(hopperjax.ConfigError, match=rf"data\.subword_nbest.*2-512.*{nbest}"):
            hopperjax.load_config(
                None, [*smoke, "data.subword_alpha=0.1", f"data.subword_nbest={nbest}"]
            )


def test_subword_regularization_packs_the_training_rows_anew_each_epoch(tmp_path):
    """``data.subword_alpha``: the workload's training rows are segmented and packed anew every
    epoch, and a fresh build reads the same epochs (the data-level properties are in
    test_parallel_text.py; nothing else differs for the trainer, so no run here: CI's budget)."""
    overrides = ["workload=translation", *workloads.get("translation").smoke_overrides,
                 f"run_dir={tmp_path}", "train.steps=12", "train.eval_every=12",
                 "train.checkpoint_every=12", "train.log_every=4", "data.subword_alpha=0.1",
                 "data.subword_nbest=8", "data.synthetic_pairs=100"]  # fmt: skip
    config = hopperjax.load_config(None, overrides)
    workload = workloads.get("translation")(config)
    datasets = workload.build_datasets(ProcessShard())
    per_epoch = datasets.meta.train_rows // 16
    assert per_epoch >= 1

    def rows(train, epoch):  # an epoch's source rows, in any order
        batches = [train[epoch * per_epoch + i]["source"] for i in range(per_epoch)]
        return sorted(map(tuple, np.concatenate(batches).tolist()))

    assert rows(datasets.train, 0) != rows(datasets.train, 1)  # packed anew, not reshuffled
    # A fresh build (a resumed run) reads the same epochs.
    again = workloads.get("translation")(config).build_datasets(ProcessShard()).train
    assert rows(again, 1) == rows(datasets.train, 1)


def test_t5_base_config_is_t5_base_sized_and_shards_every_matrix_over_fsdp_and_tensor(tmp_path):
    """configs/t5_base.yaml: ~220M parameters (T5-base's size), and on a fsdp=4 x tensor=2 mesh
    of the 8 test devices every weight matrix is split over both axes (shapes only: nothing is
    allocated or compiled; the README's inspect command compiles it)."""
    from conftest import REPO

    from hopperjax.optim import build_optimizer
    from hopperjax.parallel import build_mesh, merge_rules
    from hopperjax.trainer.components import example_inputs
    from hopperjax.trainer.state import initializer, shardings_of

    overrides = [f"data.path={tmp_path}", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]
    config = hopperjax.load_config(REPO / "configs" / "t5_base.yaml", overrides)
    workload = workloads.get("translation")(config)
    model = workload.build_model(hopperjax.get_policy(config.precision), config.remat)
    tx, _ = build_optimizer(config.optim, total_steps=10, global_batch_size=8)
    fields = workload.batch_fields(8, None)
    example = example_inputs(
        workload, {k: jax.ShapeDtypeStruct(f.shape, f.dtype) for k, f in fields.items()}
    )
    mesh = build_mesh(config.mesh)
    init = initializer(model, tx, seed=0, example_inputs=example)
    abstract, shardings = shardings_of(init, mesh, merge_rules(workload.axis_rules()))
    params = jax.tree_util.tree_flatten_with_path(abstract.params)[0]
    count = sum(int(np.prod(leaf.shape)) for _, leaf in params)
    assert 215e6 < count < 230e6, count
    specs = jax.tree_util.tree_flatten_with_path(shardings.params)[0]
    checked = 0
    for (path, leaf), (_, sharding) in zip(params, specs, strict=True):
        if leaf.ndim >= 2 and np.prod(leaf.shape) >= 768 * 768:
            axes = {a for entry in sharding.spec if entry for a in np.atleast_1d(entry)}
            assert {"fsdp", "tensor"} <= axes, (jax.tree_util.keystr(path), sharding.spec)
            checked += 1
    assert checked >= 9, checked  # embedding, head, and each block kind's matrices
