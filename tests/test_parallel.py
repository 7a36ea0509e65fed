"""Data, FSDP, tensor and hybrid layouts: same numerics, real placement, expected collectives."""

import jax
import numpy as np
import pytest
from conftest import REPO

import hopperjax
from hopperjax import inspect as inspect_lib
from hopperjax.checkpoint import Checkpointer
from hopperjax.trainer import build_components

# 8 heads and an MLP of 256 so that every layout below divides every sharded dimension.
MODEL = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=8",
    "model.max_len=32",
    "data.seq_len=32",
    "train.batch_size=16",
    "train.steps=10",
    "train.log_every=1",
    "train.eval_every=100",
    "train.eval_batches=1",
    "train.checkpoint_every=100",
    "optim.warmup_steps=2",
]
# layout -> per-device shard shape of blocks/mlp_in/kernel [layers=2, embed=64, mlp=256]
LAYOUTS = {
    "dp8": (["mesh.data=8"], (2, 64, 256)),
    "fsdp8": (["mesh.data=1", "mesh.fsdp=8"], (2, 8, 256)),
    "tp8": (["mesh.data=1", "mesh.tensor=8"], (2, 64, 32)),
    "dp2_fsdp2_tp2": (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], (2, 32, 128)),
    "fsdp4_tp2": (["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"], (2, 16, 128)),
}


def config(tmp_path, *overrides):
    return hopperjax.load_config(
        REPO / "configs" / "quickstart.yaml", [*MODEL, f"run_dir={tmp_path}", *overrides]
    )


def losses(result):
    return np.array([r["loss"] for r in result.history if "loss" in r])


@pytest.fixture(scope="module")
def single_device_losses(tmp_path_factory):
    result = hopperjax.train(
        config(tmp_path_factory.mktemp("one"), "mesh.data=1"),
        devices=jax.devices()[:1],
        console=False,
    )
    return losses(result)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_device_and_places_shards(layout, single_device_losses, tmp_path):
    overrides, mlp_in_shard = LAYOUTS[layout]
    result = hopperjax.train(config(tmp_path, *overrides), console=False)
    np.testing.assert_allclose(losses(result), single_device_losses, rtol=1e-4)
    kernel = result.state.params["blocks"]["mlp_in"]["kernel"]
    assert kernel.shape == (2, 64, 256)
    assert {s.data.shape for s in kernel.addressable_shards} == {mlp_in_shard}
    # Adam's moments are placed exactly like the parameters they belong to.
    mu = result.state.opt_state[1][0].mu["blocks"]["mlp_in"]["kernel"]
    assert mu.sharding.is_equivalent_to(kernel.sharding, kernel.ndim)


def _report(layout):
    return inspect_lib.inspect_config(config("runs/inspect-writes-nothing", *LAYOUTS[layout][0]))


def _kinds(report, *, in_layers: bool | None = None):
    return {
        c["kind"]
        for c in report["collectives"]
        if in_layers is None or ("/while" in c["op_name"]) == in_layers
    }


def test_fsdp_shards_params_and_optimizer_state_eight_ways():
    dp, fsdp = _report("dp8"), _report("fsdp8")
    dp_bytes, fsdp_bytes = dp["memory"]["argument_bytes"], fsdp["memory"]["argument_bytes"]
    # Arguments = params + Adam mu + nu (+ a few scalars and the batch).
    assert dp_bytes >= 3 * dp["params"]["bytes"]
    assert 7.5 < dp_bytes / fsdp_bytes <= 8.0


def test_each_layout_has_the_collectives_it_needs_and_no_others():
    dp = _report("dp8")
    assert _kinds(dp) == {"all-reduce"}  # gradients only; weights never move
    fsdp = _report("fsdp8")
    assert "all-gather" in _kinds(fsdp, in_layers=True)  # weights gathered layer by layer
    # Gradients reduced back to shards: reduce-scatter on GPU; XLA:CPU emits all-reduce + slice.
    assert _kinds(fsdp, in_layers=True) & {"reduce-scatter", "all-reduce"}
    tp = _report("tp8")
    assert "all-reduce" in _kinds(tp, in_layers=True)  # row-parallel outputs inside each block
    assert _kinds(tp) <= {"all-reduce", "reduce-scatter"}  # no weight all-gathers


def test_checkpoint_restores_across_mesh_shapes(tmp_path):
    straight = hopperjax.train(
        config(tmp_path / "a", "train.stop_after=6", "mesh.data=8"), console=False
    )
    run_dir = tmp_path / "b"
    saved = hopperjax.train(config(run_dir, "train.stop_after=4", "mesh.data=8"), console=False)
    moved = config(run_dir, "train.stop_after=6", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2")
    parts = build_components(moved)
    checkpointer = Checkpointer(run_dir / "checkpoints", every=100, keep=2)
    restored, _ = checkpointer.restore(4, parts.abstract_state)
    checkpointer.close()
    for a, b in zip(jax.tree.leaves(saved.state), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kernel = restored.params["blocks"]["mlp_in"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(2, 16, 128)}

    resumed = hopperjax.train(moved, console=False)
    expected = {r["step"]: r["loss"] for r in straight.history if "loss" in r}
    got = {r["step"]: r["loss"] for r in resumed.history if "loss" in r}
    assert sorted(got) == [4, 5]
    np.testing.assert_allclose([got[s] for s in got], [expected[s] for s in got], rtol=1e-4)


def test_cross_node_split_must_match_the_process_count():
    from hopperjax.config import ConfigError, MeshConfig

    with pytest.raises(ConfigError) as info:
        hopperjax.build_mesh(MeshConfig(data=8, dcn_data=2))
    assert info.value.key == "mesh.dcn_data" and "1 processes" in str(info.value)
