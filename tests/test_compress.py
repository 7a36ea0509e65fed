"""Gradient compression over the data axis: fewer bytes on the wire, the same training."""

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, TINY
from jax.sharding import NamedSharding, PartitionSpec
from testenv import xla_flags

import hopperjax
from hopperjax import inspect as inspect_lib
from hopperjax.config import ConfigError
from hopperjax.parallel import build_mesh, overlap
from hopperjax.parallel.compress import Compression, data_group_rules
from hopperjax.trainer import build_components

MODEL = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=8",
    "model.max_len=32",
    "data.seq_len=32",
    "train.batch_size=16",
    "train.steps=8",
    "train.log_every=1",
    "train.eval_every=100",
    "train.eval_batches=1",
    "train.checkpoint_every=100",
    "optim.warmup_steps=2",
]


QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


def config(tmp_path, *overrides):
    return hopperjax.load_config(
        REPO / "configs" / "quickstart.yaml", [*MODEL, f"run_dir={tmp_path}", *overrides]
    )


def losses(result):
    return np.array([r["loss"] for r in result.history if "loss" in r])


def _compression(scheme, *, ways=8, shapes=((37, 5), (300,), (2, 3, 4)), **kw):
    mesh = build_mesh(hopperjax.config.MeshConfig(data=ways), jax.devices()[:ways])
    return Compression(
        scheme=scheme,
        error_feedback=kw.get("error_feedback", True),
        rounding=kw.get("rounding", "nearest"),
        block_size=kw.get("block_size", 32),
        mesh=mesh,
        param_specs=tuple(PartitionSpec() for _ in shapes),
        param_shapes=tuple(shapes),
    )


def _group_grads(comp, rng):
    """One random gradient per data group: [ways, *shape] per leaf, sharded over data."""
    leaves = []
    for shape in comp.param_shapes:
        x = rng.normal(size=(comp.ways, *shape)).astype(np.float32) * rng.uniform(0.01, 10)
        spec = PartitionSpec("data", *([None] * len(shape)))
        leaves.append(jax.device_put(x, NamedSharding(comp.mesh, spec)))
    return leaves


def _state(comp):
    init = comp.init_state()
    if init is None:
        return None
    rows = NamedSharding(comp.mesh, PartitionSpec(("data", "fsdp", "tensor"), None))
    return {k: jax.device_put(np.asarray(v.value), rows) for k, v in init.items()}


@pytest.mark.parametrize(
    ("scheme", "rounding", "tolerance"),
    [("bf16", "nearest", 2**-8), ("bf16", "stochastic", 2**-7), ("int8", "nearest", 1 / 127),
     ("int8", "stochastic", 2 / 127)],
)  # fmt: skip
def test_reduce_is_the_mean_within_the_encoding_error(scheme, rounding, tolerance):
    comp = _compression(scheme, rounding=rounding, error_feedback=False)
    rng = np.random.default_rng(0)
    grads = _group_grads(comp, rng)
    out, state = jax.jit(comp.reduce)(grads, None, jax.random.key(1))
    assert state is None
    for g, o in zip(grads, out, strict=True):
        mean = np.asarray(g).mean(axis=0)
        assert o.shape == mean.shape and o.dtype == mean.dtype
        # Two encodings (each peer's chunk, then the mean): each off by at most a step of the
        # grid, relative to the block's (or the value's, for bf16) magnitude.
        bound = 2 * tolerance * np.abs(np.asarray(g)).max()
        err = np.abs(np.asarray(o) - mean).max()
        assert 0 < err <= bound, (err, bound)


@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_error_feedback_loses_nothing_over_steps(scheme):
    """Summed over steps, the outputs equal the summed true means, less what the residuals
    still hold: sum(out) = sum(mean g) - mean_d(sent_d) - reduced (chunk by chunk)."""
    comp = _compression(scheme, rounding="stochastic")
    rng = np.random.default_rng(0)
    reduce = jax.jit(comp.reduce)
    state = _state(comp)
    total_out = [0.0] * len(comp.param_shapes)
    total_mean = [0.0] * len(comp.param_shapes)
    for step in range(5):
        grads = _group_grads(comp, rng)
        out, state = reduce(grads, state, jax.random.key(step))
        for i, (g, o) in enumerate(zip(grads, out, strict=True)):
            total_out[i] = total_out[i] + np.asarray(o, np.float64)
            total_mean[i] = total_mean[i] + np.asarray(g, np.float64).mean(axis=0)
    sent = np.asarray(state["sent"], np.float64)  # [devices, padded]: rows = data peers here
    reduced = np.asarray(state["reduced"], np.float64).reshape(-1)  # chunk c on peer c
    held = sent.mean(axis=0) + reduced
    # Each parameter sits in its own slot of the flat vector (whole blocks).
    offsets = np.cumsum([0, *comp.slots()])
    flat_out = np.concatenate([t.reshape(-1) for t in total_out])
    flat_mean = np.concatenate([t.reshape(-1) for t in total_mean])
    flat_held = np.concatenate(
        [held[o : o + t.size] for o, t in zip(offsets, total_out, strict=False)]
    )
    np.testing.assert_allclose(flat_out, flat_mean - flat_held, atol=1e-4 * np.abs(flat_mean).max())
    assert np.abs(flat_held).max() > 0  # the residuals did hold something back


@pytest.mark.parametrize("feedback", [True, False])
def test_without_error_feedback_small_gradients_drift(feedback):
    """A gradient 500x smaller than its block's largest rounds to zero every step without error
    feedback (its parameter never moves: the drift); with it, the residual builds up until it
    crosses a grid step, so over steps the sum comes through."""
    comp = _compression("int8", shapes=((32,),), error_feedback=feedback)
    grad = np.full((comp.ways, 32), 0.002, np.float32)
    grad[:, 0] = 1.0
    grads = [jax.device_put(grad, NamedSharding(comp.mesh, PartitionSpec("data", None)))]
    reduce, state, total = jax.jit(comp.reduce), _state(comp), 0.0
    for step in range(50):
        (out,), state = reduce(grads, state, jax.random.key(step))
        total = total + np.asarray(out)
    assert total[0] == pytest.approx(50.0, rel=1e-3)
    if feedback:
        np.testing.assert_allclose(total[1:], 0.1, atol=2 / 127)  # within two grid steps
    else:
        np.testing.assert_array_equal(total[1:], 0.0)


def test_padding_and_sizes():
    comp = _compression("int8", block_size=32)
    assert comp.local_size == 37 * 5 + 300 + 24
    assert comp.padded_size % (8 * 32) == 0 and comp.padded_size >= comp.local_size
    assert comp.slots() == [192, 320, 32]  # whole blocks of 32 per parameter
    sent, fp32 = _compression("int8", shapes=((1000, 64), (300,))).wire_bytes()
    assert 0.24 < sent / fp32 < 0.30
    assert _compression("bf16").padded_size % 8 == 0


def test_data_group_rules_drop_the_data_axis():
    rules = (("batch", ("data", "fsdp")), ("x", "data"), ("y", ("data",)), ("z", "tensor"))
    assert data_group_rules(rules) == (
        ("batch", "fsdp"),
        ("x", None),
        ("y", None),
        ("z", "tensor"),
    )


def _collectives(cfg):
    report = inspect_lib.inspect_config(cfg)
    return report, {(c["kind"], c["dtype"]) for c in report["collectives"]}


@pytest.mark.parametrize(("scheme", "dtype", "ratio"), [("int8", "s8", 0.26), ("bf16", "u16", 0.5)])
def test_compressed_step_moves_fewer_bytes(scheme, dtype, ratio, tmp_path):
    plain, kinds = _collectives(config(tmp_path, "mesh.data=8"))
    assert ("all-reduce", "f32") in kinds and not any(k == "all-to-all" for k, _ in kinds)
    packed, kinds = _collectives(
        config(tmp_path, "mesh.data=8", f"comm.gradient_compression={scheme}")
    )
    assert {("all-to-all", dtype), ("all-gather", dtype)} <= kinds
    # Only scalars (loss, norms) are still reduced in fp32.
    assert all(c["bytes"] <= 64 for c in packed["collectives"] if c["kind"] == "all-reduce")
    key = "collective_wire_bytes_per_step_per_device"
    assert packed[key] <= ratio * plain[key]


def assert_replicas_agree(tree):
    """Every device holding the same slice of an array holds the same values (a replicated
    parameter's copies have not drifted apart)."""
    for leaf in jax.tree.leaves(tree):
        seen = {}
        for shard in leaf.addressable_shards:
            index = tuple((s.start, s.stop) for s in shard.index)
            if index in seen:
                np.testing.assert_array_equal(np.asarray(shard.data), seen[index])
            else:
                seen[index] = np.asarray(shard.data)


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory):
    return losses(hopperjax.train(config(tmp_path_factory.mktemp("plain")), console=False))


@pytest.mark.parametrize(
    "overrides",
    [
        ["mesh.data=8", "comm.gradient_compression=int8"],
        ["mesh.data=8", "comm.gradient_compression=int8", "comm.rounding=stochastic"],
        ["mesh.data=8", "comm.gradient_compression=bf16", "comm.error_feedback=false"],
        ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "comm.gradient_compression=int8"],
        ["mesh.data=8", "comm.gradient_compression=int8", "train.microbatches=2"],
    ],
    ids=["int8", "int8-stochastic", "bf16-no-feedback", "dp2-fsdp2-tp2", "microbatches"],
)
def test_compressed_training_follows_the_plain_run(overrides, plain_losses, tmp_path):
    result = hopperjax.train(config(tmp_path, *overrides), console=False)
    assert_replicas_agree(result.state.params)
    got = losses(result)
    # 8 steps from the same start: the first loss is the same forward pass, the rest follow
    # the uncompressed run closely.
    np.testing.assert_allclose(got[0], plain_losses[0], rtol=1e-5)
    np.testing.assert_allclose(got, plain_losses, rtol=2e-2)
    assert not np.array_equal(got, plain_losses)  # the compression did act
    history = [r for r in result.history if "loss" in r]
    if "comm.error_feedback=false" not in overrides:
        assert all(r["comm_residual_norm"] > 0 for r in history[1:])
    else:
        assert "comm_residual_norm" not in history[-1]


def test_compression_off_is_todays_step(tmp_path):
    """The keys that only matter with compression change nothing without it: same losses, bit
    for bit, and no residuals in the state."""
    base = losses(hopperjax.train(config(tmp_path / "a", "mesh.data=8"), console=False))
    other = config(
        tmp_path / "b", "mesh.data=8", "comm.error_feedback=false", "comm.rounding=stochastic"
    )
    assert np.array_equal(base, losses(hopperjax.train(other, console=False)))
    assert build_components(other).init_state().comm is None


def test_residuals_resume_exactly(tmp_path):
    """Steps 4-7 again from the run's own step-4 checkpoint (its step-8 one taken away): the
    restored residuals, sent and reduced, carry the int8 encoding on exactly."""
    keys = ["mesh.data=8", "comm.gradient_compression=int8", "comm.rounding=stochastic"]
    run = config(tmp_path / "run", *keys, "train.checkpoint_every=4", "train.keep_checkpoints=2")
    straight = hopperjax.train(run, console=False)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "8")
    resumed = hopperjax.train(run, console=False)
    assert resumed.start_step == 4 and len(losses(resumed)) == 4
    np.testing.assert_array_equal(losses(resumed), losses(straight)[-4:])
    a, b = straight.state.comm, resumed.state.comm
    for name in ("sent", "reduced"):
        assert np.abs(np.asarray(a[name])).max() > 0
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))


def test_a_new_mesh_or_switching_compression_restarts_the_residuals(tmp_path):
    """The residuals follow the mesh: on another mesh (or with compression switched on or off) a
    resume restores everything else and starts them at zero, rather than refusing the run."""
    run = tmp_path / "run"
    keys = ["comm.gradient_compression=int8", "train.checkpoint_every=2"]
    saved = hopperjax.train(config(run, *keys, "mesh.data=8", "train.stop_after=2"), console=False)
    moved = hopperjax.train(
        config(run, *keys, "mesh.data=4", "mesh.tensor=2", "train.stop_after=4"), console=False
    )
    assert moved.state.comm["sent"].shape[1] != saved.state.comm["sent"].shape[1]
    assert np.abs(np.asarray(moved.state.comm["sent"])).max() > 0  # two steps' residuals
    off = hopperjax.train(config(run, "train.checkpoint_every=2", "mesh.data=4", "mesh.tensor=2",
                                 "train.stop_after=6"), console=False)  # fmt: skip
    assert off.state.comm is None
    assert [r["step"] for r in off.history if "loss" in r] == [4, 5]
    on_again = config(run, *keys, "mesh.data=8")
    assert hopperjax.train(on_again, console=False).state.comm is not None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["mesh.data=1", "comm.gradient_compression=int8"], "needs mesh.data > 1"),
        (["comm.block_size=8"], "expected 16 <= values per scale <= 65536"),
        (["comm.gradient_compression=int4"], "int4"),
    ],
)
def test_bad_compression_keys_name_the_key(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message) as info:
        build_components(config(tmp_path, *overrides), devices=jax.devices()[:1])
    assert info.value.key.startswith("comm.")


@pytest.mark.parametrize(
    ("recipe", "message"),
    [("dta_davis.yaml", "index into each other"), ("multi30k_t5.yaml", "weighs rows unequally")],
)
def test_workloads_it_cannot_serve_are_refused(recipe, message, tmp_path):
    from hopperjax import workloads

    name = hopperjax.load_config(REPO / "configs" / recipe, validate_values=False).workload
    cfg = hopperjax.load_config(
        REPO / "configs" / recipe,
        [*workloads.get(name).smoke_overrides, "mesh.data=8", "comm.gradient_compression=int8",
         f"run_dir={tmp_path}"],
    )  # fmt: skip
    with pytest.raises(ConfigError, match=message) as info:
        build_components(cfg)
    assert info.value.key == "comm.gradient_compression"


def test_a_mesh_change_restarts_residuals_even_when_their_shapes_agree(tmp_path):
    """Two meshes can give residuals of one shape; a change of mesh.* or comm.* restarts them
    all the same (their values belong to other parameter slices)."""
    from hopperjax import config as config_lib
    from hopperjax.trainer import resume

    cfg = config(tmp_path, "mesh.data=8", "comm.gradient_compression=int8")
    abstract = build_components(cfg).abstract_state
    leaves = resume.state_leaves(abstract)

    class SameShapes:
        def state_leaves(self, step):
            return leaves

    tmp_path.mkdir(exist_ok=True)
    saved = config(tmp_path, "mesh.data=4", "mesh.tensor=2", "comm.gradient_compression=int8")
    (tmp_path / "config.yaml").write_text(config_lib.dump_yaml(saved))
    assert resume.check_resumable(cfg, tmp_path, abstract, SameShapes(), 4) == ("comm",)
    (tmp_path / "config.yaml").write_text(config_lib.dump_yaml(cfg))
    assert resume.check_resumable(cfg, tmp_path, abstract, SameShapes(), 4) == ()
    # Without compression anywhere a mesh change restarts nothing.
    plain = config(tmp_path, "mesh.data=8")
    plain_leaves = resume.state_leaves(build_components(plain).abstract_state)

    class Plain:
        def state_leaves(self, step):
            return plain_leaves

    moved = config(tmp_path, "mesh.data=4", "mesh.tensor=2")
    (tmp_path / "config.yaml").write_text(config_lib.dump_yaml(moved))
    assert resume.check_resumable(plain, tmp_path, abstract.replace(comm=None), Plain(), 4) == ()


def test_encodings_survive_as_integers():
    """The payload is bits, not a float a compiler pass could widen: every non-finite input
    comes back non-finite (loss scaling then skips the step)."""
    comp = _compression("int8", error_feedback=False)
    rng = np.random.default_rng(0)
    grads = _group_grads(comp, rng)
    bad = np.asarray(grads[1]).copy()
    bad[3, 7] = np.inf
    grads[1] = jax.device_put(bad, grads[1].sharding)
    out, _ = jax.jit(comp.reduce)(grads, None, jax.random.key(0))
    assert not np.isfinite(np.asarray(out[1])).all()
    assert jnp.isfinite(out[0]).all()


# comm.overlap ------------------------------------------------------------------------------------


def test_overlap_default_sets_nothing():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert overlap.apply("default", env) is None
    assert env == {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def test_overlap_aggressive_sets_flags_and_keeps_the_users():
    env = {"XLA_FLAGS": "--xla_gpu_enable_pipelined_all_gather=false --xla_dump_to=/tmp/x"}
    line = overlap.apply("aggressive", env)
    flags = env["XLA_FLAGS"].split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    # The user's setting stays, and comes last (XLA takes the last one).
    assert "--xla_gpu_enable_pipelined_all_gather=true" not in flags
    assert flags[-2:] == ["--xla_gpu_enable_pipelined_all_gather=false", "--xla_dump_to=/tmp/x"]
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert line.startswith("hopperjax: comm.overlap=aggressive: XLA_FLAGS += ")
    assert "1 already set by you, kept" in line
    before = dict(env)
    overlap.apply("aggressive", env)  # idempotent
    assert env == before
    with pytest.raises(ValueError, match=r"comm\.overlap"):
        overlap.apply("max", {})


def test_overlap_refuses_a_started_backend(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    jax.devices()  # this process's backend runs
    with pytest.raises(RuntimeError, match="before JAX starts"):
        overlap.apply("off")


def test_overlap_flags_are_known_to_this_xla(tmp_path):
    """Every flag of both modes parses (XLA aborts the process on an unknown one): one CLI run
    with ``off`` and the environment already holding ``aggressive``'s flags. The CLI sets its
    flags before JAX starts, before the environment's, which win (here the tests' own, one
    device, and ``aggressive``'s scheduler flag): its first console line says what it set and
    what it kept, and the run's config records the mode (``off``, which YAML would read as
    false)."""
    aggressive = " ".join(overlap.FLAGS["aggressive"])
    env = {**os.environ, "XLA_FLAGS": f"{xla_flags(1)} {aggressive}"}
    keys = [*TINY, "train.steps=1", "train.eval_every=1", "train.eval_batches=1",
            "comm.overlap=off"]  # fmt: skip
    command = [sys.executable, "-m", "hopperjax.train", "--config", QUICKSTART, *keys]
    done = subprocess.run(
        [*command, f"run_dir={tmp_path}"], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first == (
        f"hopperjax: comm.overlap=off: XLA_FLAGS += {overlap.FLAGS['off'][1]} "
        "(1 already set by you, kept)"
    ), first
    assert "overlap: 'off'" in (tmp_path / "config.yaml").read_text()
