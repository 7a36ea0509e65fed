"""Memory: remat policies, host offload, gradient accumulation and the compile-only batch finder."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, TINY

import hopperjax
from hopperjax.config import ConfigError
from hopperjax.inspect import inspect_config
from hopperjax.memory import budget, offload
from hopperjax.observe import hlo
from hopperjax.trainer import measure
from hopperjax.workloads.base import cross_entropy

POLICIES = {
    "full": ["remat.policy=full"],
    "dots": ["remat.policy=dots"],
    "dots_no_batch": ["remat.policy=dots_no_batch"],
    "save_names": ["remat.policy=save_names", "remat.names=qkv,mlp_hidden"],
    "offload": [
        "remat.policy=offload",
        "remat.names=attention",
        "remat.offload_names=qkv,mlp_in,mlp_hidden",
    ],
}


def _batch(rows: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, 256, (rows, length + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _grads(configs: dict[str, hopperjax.Config], batch: dict[str, np.ndarray]):
    """Gradients of every config's model at the same params and batch, from one compile."""
    models = {
        name: hopperjax.build_model(c, hopperjax.get_policy("fp32")) for name, c in configs.items()
    }
    init = jax.jit(next(iter(models.values())).init)
    params = init(jax.random.PRNGKey(0), batch["inputs"])["params"]
    rngs = {"dropout": jax.random.PRNGKey(1)}

    def grad(model):
        def loss(p):
            logits = model.apply({"params": p}, batch["inputs"], deterministic=False, rngs=rngs)
            return cross_entropy(logits, batch["targets"]).mean()

        return jax.grad(loss)

    return jax.jit(lambda p: {name: grad(m)(p) for name, m in models.items()})(params)


def _max_difference(a, b) -> float:
    return max(
        float(jnp.abs(x - y).max())
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# ---------------------------------------------------------------------------------------------
# Remat


def test_every_remat_policy_gives_the_no_remat_gradients(tiny_config):
    configs = {"none": tiny_config(), **{n: tiny_config(*o) for n, o in POLICIES.items()}}
    grads = _grads(configs, _batch(4, 32))
    reference = grads.pop("none")
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(reference))
    assert scale > 1e-3  # the comparison below is not of zeros
    for name, policy_grads in grads.items():
        worst = _max_difference(policy_grads, reference)
        assert worst <= 1e-6, (name, worst)


def test_recompute_draws_the_same_dropout_masks(tiny_config):
    grads = _grads(
        {
            "off": tiny_config(),
            "on": tiny_config("model.dropout=0.2"),
            "recomputed": tiny_config("model.dropout=0.2", "remat.policy=full"),
        },
        _batch(4, 32),
    )
    assert _max_difference(grads["on"], grads["off"]) > 1e-3  # dropout is on
    assert _max_difference(grads["recomputed"], grads["on"]) <= 1e-6


def test_the_block_tags_every_name_the_policies_accept(tiny_config):
    config = tiny_config()
    model = hopperjax.build_model(config, hopperjax.get_policy("fp32"))
    accepted = hopperjax.workloads.get(config.workload).remat_names  # what remat.names accepts
    assert accepted
    tokens = jnp.zeros((2, 8), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens)
    jaxpr = str(jax.make_jaxpr(lambda p: model.apply(p, tokens))(params))
    for name in accepted:
        assert f"name={name}" in jaxpr, name


def test_remat_trades_memory_for_recompute_on_six_layers(tiny_config):
    """Temp bytes fall none -> dots -> full; GEMM FLOPs stay (dots saves every GEMM) then rise."""
    rows = {}
    for policy in ("none", "dots", "full"):
        config = tiny_config("model.n_layers=6", "train.batch_size=64", f"remat.policy={policy}")
        parts = hopperjax.build_components(config)
        compiled = parts.lower_train_step().compile()
        gemms, _ = hlo.analyze(compiled.as_text(), num_devices=parts.mesh.size)
        rows[policy] = (
            budget.compiled_memory(compiled)["temp_bytes"],
            sum(g.flops for g in gemms),
        )
    temp = {p: r[0] for p, r in rows.items()}
    flops = {p: r[1] for p, r in rows.items()}
    assert temp["none"] > temp["dots"] > temp["full"], temp
    assert flops["none"] == flops["dots"] < flops["full"], flops
    # full recomputes the whole forward pass of every block: at most one more forward's GEMMs.
    assert flops["full"] < 4 / 3 * flops["none"] * 1.05, flops


# ---------------------------------------------------------------------------------------------
# Gradient accumulation


def _first_steps(configs, batch: dict[str, np.ndarray]):
    """(initial params, [(state, metrics) after one step of each config]) from one initial state."""
    parts = [hopperjax.build_components(c) for c in configs]
    initial = parts[0].init_state()
    start = jax.tree.map(np.asarray, initial.params)
    results = []
    for p in parts:
        state = jax.tree.map(lambda x: x.copy(), initial)  # the step donates its input
        placed = {k: jax.device_put(v, p.batch_sharding[k]) for k, v in batch.items()}
        results.append(p.train_step(state, placed))
    return start, results


def test_four_microbatches_make_the_full_batch_update(tiny_config):
    _, [(full, full_metrics), (split, split_metrics)] = _first_steps(
        [
            tiny_config("train.batch_size=32"),
            tiny_config("train.batch_size=32", "train.microbatches=4"),
        ],
        _batch(32, 32, seed=1),
    )
    assert float(split_metrics["loss"]) == pytest.approx(float(full_metrics["loss"]), abs=1e-6)
    assert float(split_metrics["grad_norm"]) == pytest.approx(
        float(full_metrics["grad_norm"]), rel=1e-5
    )
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(split.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_fp8_microbatches_combine_amax_by_max(tiny_config):
    """Two microbatches record the full batch's amax histories (a sum would double them).

    Plain SGD at lr 1 makes the update the gradient itself. Its tolerance is FP8's, not 1e-5:
    the CPU matmul sums a 16-row and a 32-row batch in different orders, and a last-bit
    difference can round an activation to the neighbouring e4m3 value.
    """
    base = ("train.batch_size=32", "precision=fp8", "optim.name=sgd", "optim.base_lr=1",
            "optim.clip_norm=null", "optim.momentum=0")  # fmt: skip
    start, [(full, _), (split, _)] = _first_steps(
        [tiny_config(*base), tiny_config(*base, "train.microbatches=2")], _batch(32, 32, seed=1)
    )
    amax = [np.asarray(x) for x in jax.tree.leaves(full.fp8)]
    assert max(float(x.max()) for x in amax) > 0
    for a, b in zip(amax, jax.tree.leaves(split.fp8), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5)
    for p0, a, b in zip(
        jax.tree.leaves(start), jax.tree.leaves(full.params), jax.tree.leaves(split.params),
        strict=True,
    ):  # fmt: skip
        grad_full, grad_split = p0 - np.asarray(a), p0 - np.asarray(b)
        relative = np.linalg.norm(grad_full - grad_split) / np.linalg.norm(grad_full)
        assert relative < 1e-2, relative


def test_microbatches_must_split_the_batch_evenly(tiny_config):
    with pytest.raises(ConfigError, match=r"train\.microbatches: must divide train\.batch_size=16"):
        tiny_config("train.microbatches=3")
    # 16 rows / 4 microbatches = 4 rows, not divisible by the 8 data-parallel devices.
    with pytest.raises(ConfigError, match="microbatch of 4 rows is not divisible"):
        hopperjax.build_components(tiny_config("train.microbatches=4"))


# ---------------------------------------------------------------------------------------------
# Offload


def test_offload_trains_with_the_same_losses_and_resumes(tiny_config, tmp_path):
    common = ("train.stop_after=6", "train.eval_every=6", "train.checkpoint_every=3")
    plain = hopperjax.train(tiny_config(*common), console=False)
    moved = tiny_config(
        *common,
        *POLICIES["offload"],
        "offload.optimizer_state=true",
        "offload.params=true",
        f"run_dir={tmp_path / 'offload'}",
    )
    hopperjax.train(moved.replace(**{"train.stop_after": 3}), console=False)
    resumed = hopperjax.train(moved, console=False)  # restores host-resident state at step 3
    losses = [r["loss"] for r in plain.history if "loss" in r]
    moved_losses = [r["loss"] for r in resumed.history if "loss" in r]
    np.testing.assert_allclose(moved_losses, losses[-len(moved_losses) :], rtol=1e-6)
    assert len(moved_losses) == 3
    opt_leaf = jax.tree.leaves(resumed.state.opt_state)[0]
    assert opt_leaf.sharding.memory_kind == offload.HOST_MEMORY
    assert jax.tree.leaves(resumed.state.params)[0].sharding.memory_kind == offload.HOST_MEMORY


def test_inspect_reports_what_offload_moves_to_the_host(tiny_config):
    config = tiny_config(*POLICIES["offload"], "offload.optimizer_state=true")
    report = inspect_config(config)
    state = report["offload"]["state_bytes_per_device"]
    params = sum(
        x.size * 4
        for x in jax.tree.leaves(hopperjax.build_components(config).abstract_state.params)
    )
    # AdamW's two moments (fp32, replicated over the data-parallel mesh) and its step counts.
    assert 2 * params < state[offload.HOST_MEMORY] <= 2 * params + 16
    # Per step: qkv, mlp_in and mlp_hidden of each of the 2 layers, batch 16 x 32 tokens.
    tokens, d = 16 * 32, config.model.d_model
    moved = report["offload"]["activations_to_host_per_step"]
    assert moved["count"] == 3 * 2
    assert moved["bytes"] == 2 * tokens * 4 * (3 * d + 4 * d + 4 * d)
    # XLA:CPU keeps host and device buffers in the one RAM and drops the activation copies while
    # compiling, so its memory analysis has no host bytes to show; a GPU's does (gpu_check.sh).
    assert report["memory"]["host_temp_bytes"] == 0
    assert inspect_config(tiny_config())["offload"]["activations_to_host_per_step"] == {
        "count": 0,
        "bytes": 0,
    }


class _Memory:
    def __init__(self, kind):
        self.kind = kind


class _DeviceWithoutHostMemory:
    platform = "tpu"

    def addressable_memories(self):
        return [_Memory("device")]


def test_offload_without_host_memory_is_a_one_line_config_error(tiny_config):
    config = tiny_config("offload.optimizer_state=true")
    with pytest.raises(ConfigError) as info:
        offload.check_host_memory([_DeviceWithoutHostMemory()], config.offload, config.remat)
    message = str(info.value)
    assert message.startswith("offload.optimizer_state: the tpu backend has no 'pinned_host'")
    assert "\n" not in message
    config = tiny_config(*POLICIES["offload"])
    with pytest.raises(ConfigError, match=r"^remat\.policy: "):
        offload.check_host_memory([_DeviceWithoutHostMemory()], config.offload, config.remat)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["remat.policy=save_names"], "remat.names: remat.policy 'save_names' needs"),
        (["remat.policy=offload"], "remat.offload_names: remat.policy 'offload' needs"),
        (
            ["remat.policy=save_names", "remat.names=qkv,mlp"],
            "remat.names: unknown activation 'mlp'",
        ),
        (["remat.policy=dots", "remat.names=qkv"], "remat.names: not used by remat.policy 'dots'"),
        (
            ["remat.policy=offload", "remat.names=qkv", "remat.offload_names=qkv"],
            "remat.offload_names: qkv also in remat.names",
        ),
        (["remat.policy=some"], "remat.policy: expected one of none, full"),
    ],
)
def test_bad_remat_settings_name_the_key(tiny_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(*overrides)


# ---------------------------------------------------------------------------------------------
# Batch finder


def test_search_finds_the_exact_largest_fit_in_few_probes():
    """Against a known memory curve (affine plus a bump the line cannot predict)."""

    def peak(batch: int) -> int:
        return 1000 + 37 * batch + (500 if batch > 700 else 0)

    config = hopperjax.load_config(REPO / "configs" / "quickstart.yaml", ["mesh.data=8"])
    seen = []

    def probe(c, batch):
        seen.append(batch)
        return peak(batch), 0.0, 0.0

    for budget_bytes in (1000 + 37 * 8, 20_000, 27_000, 40_000, 10**7):
        seen.clear()
        search = budget.find_largest_batch(
            config, budget_bytes=budget_bytes, probe=probe, devices=jax.devices(),
            max_batch_size=10**5,
        )  # fmt: skip
        best = max(b for b in range(8, 10**5 + 1, 8) if peak(b) <= budget_bytes)
        assert search.batch_size == best, budget_bytes
        assert search.proven_max == (best < 10**5)
        assert len(seen) <= 12, (budget_bytes, seen)
    assert budget.find_largest_batch(config, budget_bytes=100, probe=probe).batch_size is None


def test_search_stops_below_a_batch_the_data_refuses():
    """A probe the run refuses (fewer examples than the batch) caps the search instead of
    ending it: the result is the largest fitting batch the data can serve, marked as such."""
    config = hopperjax.load_config(REPO / "configs" / "quickstart.yaml", ["mesh.data=8"])
    examples = 300

    def probe(c, batch):
        if batch > examples:
            raise budget.BatchRefused(f"train.batch_size: larger than the {examples} rows")
        return 1000 + batch, 1.0, 1.0

    search = budget.find_largest_batch(
        config, budget_bytes=10**6, probe=probe, devices=jax.devices()
    )
    assert search.batch_size == 296 and not search.proven_max
    assert "300 rows" in search.refused
    assert "| 296 (data) |" in budget.search_table([search])
    # Refused at the smallest batch: nothing to search, a one-line config error.
    with pytest.raises(hopperjax.ConfigError, match=r"train\.batch_size: larger than the 300"):
        budget.find_largest_batch(
            config, budget_bytes=10**6, probe=lambda c, b: probe(c, b + 400),
            devices=jax.devices(),
        )  # fmt: skip


def test_find_batch_cli_result_fits_and_the_next_power_of_two_does_not(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "tools"))
    import find_batch

    overrides = [o for o in TINY if not o.startswith("train.batch_size")]
    out = tmp_path / "search.json"
    budget_gb = 0.004
    rc = find_batch.main(
        ["--config", str(REPO / "configs" / "quickstart.yaml"), *overrides,
         "--budget-gb", str(budget_gb), "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| none | 1 |" in printed and "pick: remat.policy=none" in printed
    (search,) = json.loads(out.read_text())["searches"]
    batch = search["batch_size"]
    assert batch and batch % 8 == 0 and search["proven_max"]
    config = hopperjax.load_config(REPO / "configs" / "quickstart.yaml", overrides)
    limit = int(budget_gb * budget.GIB)
    (fit,) = [p for p in search["probes"] if p["batch_size"] == batch]
    assert fit["fits"] and fit["peak_bytes"] <= limit
    next_pow2 = 1 << batch.bit_length()
    assert measure.probe_batch(config, next_pow2)[0] > limit
    assert f"{search['learning_rate']:.3g}" in printed


def test_batch_probe_is_not_refused_by_a_small_eval_split():
    """The probe never evaluates: a train batch larger than the eval split (1 % of the embedded
    corpus: 15 windows of 513 bytes when written, fewer than the 64 asked for while the corpus
    stays under ~3 MB) still compiles and measures; it was refused on an H200 at 1B, sequence
    2,048."""
    overrides = [o for o in TINY if not o.startswith("train.batch_size")]
    overrides += ["model.max_len=512", "data.seq_len=512", "data.eval_fraction=0.01"]
    config = hopperjax.load_config(REPO / "configs" / "quickstart.yaml", overrides)
    assert measure.at_batch(config, 64).train.eval_batch_size == jax.device_count()
    peak, gemm_flops, model_flops = measure.probe_batch(config, 64)
    assert peak > 0 and gemm_flops > 0 and model_flops > 0


# ---------------------------------------------------------------------------------------------
# Host heap (XLA:CPU's per-step temporary buffer stays resident)


class _FakeLibc:
    def __init__(self, accept: bool = True):
        self.calls: list[tuple[int, int]] = []
        self.accept = accept

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1 if self.accept else 0


@pytest.fixture
def fake_libc(monkeypatch):
    from hopperjax.memory import host_heap

    libc = _FakeLibc()
    monkeypatch.setattr(host_heap, "_glibc", lambda: libc)
    monkeypatch.setattr(host_heap, "_applied", 0)
    return libc


def test_host_heap_pad_covers_the_temp_buffer_and_a_margin():
    from hopperjax.memory.host_heap import pad_for

    mib = 1 << 20
    assert pad_for(48 * mib) == 48 * mib + 16 * mib
    assert pad_for(48 * mib + 1) == 64 * mib + 16 * mib
    assert pad_for(1) == 16 * mib + 16 * mib


def test_host_heap_auto_sizes_from_the_compiled_step_on_cpu(tiny_config, fake_libc):
    from hopperjax.memory import host_heap
    from hopperjax.trainer import build_components

    compiled = build_components(tiny_config()).lower_train_step().compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp > 0
    setting = host_heap.keep_step_memory(None, backend="cpu", compiled_steps=[compiled])
    pad = host_heap.pad_for(temp)
    assert setting.pad_bytes == pad
    # Both glibc knobs: the threshold keeps the buffer in the heap, the pad keeps the heap.
    assert fake_libc.calls == [(host_heap.M_MMAP_THRESHOLD, pad), (host_heap.M_TOP_PAD, pad)]
    assert "keeps" in setting.describe() and "auto" in setting.describe()

    # Only ever raised: a smaller request leaves the larger setting in place.
    again = host_heap.keep_step_memory(1, backend="cpu")
    assert again.pad_bytes == pad and len(fake_libc.calls) == 2
    bigger = host_heap.keep_step_memory(pad // (1 << 20) + 64, backend="cpu")
    assert bigger.pad_bytes == pad + (64 << 20) and len(fake_libc.calls) == 4


@pytest.mark.parametrize(
    ("pad_mib", "backend", "reason"),
    [(0, "cpu", "host_heap_pad_mib=0"), (None, "gpu", "gpu backend")],
)
def test_host_heap_leaves_the_allocator_alone_when_asked_or_off_cpu(
    fake_libc, pad_mib, backend, reason
):
    from hopperjax.memory import host_heap

    setting = host_heap.keep_step_memory(pad_mib, backend=backend, compiled_steps=[])
    assert setting.pad_bytes == 0 and reason in setting.describe()
    assert fake_libc.calls == []


def test_host_heap_reports_a_refusal_and_a_foreign_libc(monkeypatch):
    from hopperjax.memory import host_heap

    monkeypatch.setattr(host_heap, "_applied", 0)
    monkeypatch.setattr(host_heap, "_glibc", lambda: _FakeLibc(accept=False))
    refused = host_heap.keep_step_memory(64, backend="cpu")
    assert refused.pad_bytes == 0 and "refused" in refused.describe()
    monkeypatch.setattr(host_heap, "_glibc", lambda: None)
    foreign = host_heap.keep_step_memory(64, backend="cpu")
    assert foreign.pad_bytes == 0 and "not glibc" in foreign.describe()


def test_host_heap_finds_glibc_where_python_runs_on_it():
    import platform

    from hopperjax.memory import host_heap

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not a glibc platform")
    assert host_heap._glibc() is not None


@pytest.mark.parametrize("value", [-1, 2048])
def test_host_heap_pad_out_of_range_names_the_key(tiny_config, value):
    with pytest.raises(ConfigError, match=r"train\.host_heap_pad_mib"):
        tiny_config(f"train.host_heap_pad_mib={value}")
