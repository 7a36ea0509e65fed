"""Recommendation: Criteo and MovieLens readers (files the tests write), bag lookups, the
hybrid layouts (tables row-sharded over tensor, batch over data) against one device, and the
model learning the synthetic set's structure."""

from __future__ import annotations

import gzip
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO

import hopperjax
from hopperjax import inspect as inspect_lib
from hopperjax import workloads
from hopperjax.data import interactions as ix
from hopperjax.data.errors import DataError
from hopperjax.data.grain_io import ProcessShard
from hopperjax.models import dlrm

SMOKE = ["workload=recommendation", *workloads.get("recommendation").smoke_overrides]


def _criteo_line(label, ints, cats):
    return "\t".join([str(label), *[str(x) for x in ints], *cats])


def test_criteo_reader_hashes_logs_and_names_bad_lines(tmp_path):
    cats = [f"{i:08x}" for i in range(26)]
    lines = [
        _criteo_line(1, [0, 3, "", -2, *[1] * 9], cats),
        _criteo_line(0, [""] * 13, ["", *cats[1:]]),  # empty fields are allowed
    ]
    path = tmp_path / "day.tsv.gz"
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    sizes = (100,) * 26
    rows = ix.read_criteo(path, sizes)
    np.testing.assert_array_equal(rows.labels, [1, 0])
    np.testing.assert_allclose(rows.dense[0, :4], np.log1p([0, 3, 0, 0]))  # empty, negative -> 0
    assert rows.sparse.shape == (2, 26, 1)
    assert rows.sparse[1, 0, 0] == 0  # the "missing" row
    assert ((rows.sparse[:, 1:] >= 1) & (rows.sparse[:, 1:] < 100)).all()
    assert rows.sparse[0, 5, 0] == ix.hash_id(cats[5].encode(), 100) == rows.sparse[1, 5, 0]

    bad = tmp_path / "bad.tsv"
    bad.write_text(lines[0] + "\n" + "1\t2\t3\n" + _criteo_line(2, [1] * 13, cats) + "\n")
    with pytest.raises(DataError, match=r"bad\.tsv line 2: 3 tab-separated fields, expected 40"):
        ix.read_criteo(bad, sizes)
    assert ix.read_criteo(bad, sizes, skip_bad=True).skipped == 2
    nonhex = tmp_path / "nonhex.tsv"
    nonhex.write_text(_criteo_line(1, [1] * 13, ["zz", *cats[1:]]) + "\n")
    with pytest.raises(DataError, match=r"nonhex\.tsv line 1: invalid literal"):
        ix.read_criteo(nonhex, sizes)


def test_movielens_layouts_and_an_id_beyond_its_table(tmp_path):
    (tmp_path / "u.data").write_text("1\t10\t4\t881250949\n3\t2\t1\t891717742\n")
    rows = ix.read_movielens(tmp_path / "u.data", (4, 11))
    np.testing.assert_array_equal(rows.sparse[:, :, 0], [[1, 10], [3, 2]])
    np.testing.assert_array_equal(rows.labels, [4.0, 1.0])
    assert rows.dense.shape == (2, 0)
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,31,2.5,1260759144\n")
    csv = ix.read_movielens(tmp_path / "ratings.csv", (2, 32))
    assert csv.labels.tolist() == [2.5] and csv.sparse[0, :, 0].tolist() == [1, 31]
    with pytest.raises(DataError, match=r"u\.data line 1: item id 10 is beyond the 5 rows.*"
                       r"model\.table_sizes"):  # fmt: skip
        ix.read_movielens(tmp_path / "u.data", (4, 5))
    hashed = ix.read_movielens(tmp_path / "u.data", (4, 5), hash_ids=True)
    assert (hashed.sparse[:, 1] < 5).all()
    (tmp_path / "broken.data").write_text("1\t2\n")
    with pytest.raises(DataError, match=r"broken\.data line 1: 2 fields"):
        ix.read_movielens(tmp_path / "broken.data", (4, 5))


def test_movielens_folds_train_through_the_workload_and_errors_name_the_key(tmp_path):
    rng = np.random.default_rng(0)
    for name, n in (("u1.base", 400), ("u1.test", 100)):
        lines = [f"{rng.integers(1, 20)}\t{rng.integers(1, 30)}\t{rng.integers(1, 6)}\t0"
                 for _ in range(n)]  # fmt: skip
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    overrides = [*SMOKE, "data.source=movielens", f"data.path={tmp_path}", "data.fold=1",
                 "data.synthetic_dense=0", "model.kind=mf", "model.table_sizes=20,30",
                 f"run_dir={tmp_path / 'run'}", "train.steps=4", "train.eval_every=4",
                 "train.checkpoint_every=4", "train.log_every=2"]  # fmt: skip
    result = hopperjax.train(hopperjax.load_config(None, overrides), console=False)
    [final] = [r for r in result.history if "eval_rmse" in r]
    assert final["eval_rows"] == 100 and np.isfinite(final["eval_rmse"])
    small = [*overrides[:-5], "model.table_sizes=20,10", f"run_dir={tmp_path / 'r2'}"]
    with pytest.raises(
        hopperjax.ConfigError,
        match=r"u1\.base line \d+: item id \d+ is beyond the 10 rows.*model\.table_sizes",
    ):
        hopperjax.train(hopperjax.load_config(None, small), console=False)
    with pytest.raises(hopperjax.ConfigError, match=r"model\.table_sizes"):
        hopperjax.load_config(None, [*overrides, "model.table_sizes=20,30,5"])
    with pytest.raises(hopperjax.ConfigError, match=r"model\.kind"):
        hopperjax.load_config(
            None, [*SMOKE, "model.kind=mf", "model.table_sizes=8,8", "data.synthetic_task=clicks"]
        )


def test_bags_ignore_padding_and_mean_pooling_divides_by_real_ids():
    table = jnp.arange(12.0).reshape(6, 2)
    ids = jnp.array([[1, 3, -1], [-1, -1, -1], [5, -1, -1]])
    np.testing.assert_allclose(dlrm.pooled_lookup(table, ids, "sum"), [[8, 10], [0, 0], [10, 11]])
    np.testing.assert_allclose(dlrm.pooled_lookup(table, ids, "mean"), [[4, 5], [0, 0], [10, 11]])


def test_placement_balances_groups_and_placed_lookups_read_each_tables_rows():
    sizes = (50, 10, 40, 30, 20, 5)
    p = dlrm.place_tables(sizes, 4)
    # Largest first onto the lightest group (ties: the lower): 50 | 40 | 30+5 | 20+10.
    assert (p.rows, p.slots) == (50, 2)
    assert p.group == (0, 3, 1, 2, 3, 2) and p.slot == (0, 1, 0, 0, 0, 1)
    spans = sorted((p.group[t], p.offset[t], p.offset[t] + n) for t, n in enumerate(sizes))
    for (g0, _, end), (g1, start, _) in itertools.pairwise(spans):
        assert g0 != g1 or end <= start  # no two tables share a row
    tables = [np.random.default_rng(t).normal(size=(n, 4)).astype(np.float32)
              for t, n in enumerate(sizes)]  # fmt: skip
    grouped = np.zeros((p.groups, p.rows, 4), np.float32)
    for t, table in enumerate(tables):
        grouped[p.group[t], p.offset[t] : p.offset[t] + len(table)] = table
    rng = np.random.default_rng(0)
    sparse = np.stack([rng.integers(-1, n, (7, 3)) for n in sizes], axis=1)  # [7, 6 tables, 3]
    ids = dlrm.placed_ids(p, jnp.asarray(sparse))
    assert ids.shape == (4, 7, 2, 3)
    rows = jax.vmap(lambda t, i: jnp.take(t, i, axis=0))(jnp.asarray(grouped), jnp.maximum(ids, 0))
    bags = dlrm.pool(rows, ids, "mean")  # [groups, batch, slots, dim]
    for t, table in enumerate(tables):
        expected = dlrm.pooled_lookup(jnp.asarray(table), jnp.asarray(sparse[:, t]), "mean")
        np.testing.assert_allclose(bags[p.group[t], :, p.slot[t]], expected, rtol=1e-6)
    assert (ids[:2, :, 1] == -1).all()  # groups 0 and 1 have an empty slot: all padding


LAYOUTS = {
    "data8": ["mesh.data=8"],
    "tensor8": ["mesh.data=1", "mesh.tensor=8"],
    "data2_tensor4": ["mesh.data=2", "mesh.tensor=4"],
    "data8_rows_everywhere": ["mesh.data=8", "model.table_sharding=all"],
}
# Tables of 64, 48 and 40 rows divide by 8; a click task with dense features and multi-hot bags.
RUN = [*SMOKE, "data.synthetic_task=clicks", "train.steps=6", "train.log_every=1",
       "train.eval_every=6", "train.checkpoint_every=6", "optim.base_lr=0.01"]  # fmt: skip


def _losses(result):
    return np.array([r["loss"] for r in result.history if "loss" in r])


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    config = hopperjax.load_config(
        None, [*RUN, "mesh.data=1", f"run_dir={tmp_path_factory.mktemp('one')}"]
    )
    return hopperjax.train(config, devices=jax.devices()[:1], console=False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hybrid_layouts_give_one_devices_losses_and_split_the_tables(layout, one_device, tmp_path):
    config = hopperjax.load_config(None, [*RUN, *LAYOUTS[layout], f"run_dir={tmp_path}"])
    result = hopperjax.train(config, console=False)
    np.testing.assert_allclose(_losses(result), _losses(one_device), rtol=1e-5, atol=1e-6)
    evals = [r for r in result.history if "eval_auc" in r]
    assert evals[-1]["eval_auc"] == pytest.approx(
        [r for r in one_device.history if "eval_auc" in r][-1]["eval_auc"], abs=1e-5
    )
    ways = 8 if config.model.table_sharding == "all" else config.mesh.tensor
    table = result.state.params["table_0"]["rows"]["embedding"]
    assert {s.data.shape for s in table.addressable_shards} == {(64 // ways, 8)}


# Table-wise: the three tables binned into 8 groups (five empty), a group per device at most.
PLACED = ["model.table_placement=tables", "model.table_groups=8"]


@pytest.fixture(scope="module")
def one_device_placed(tmp_path_factory):
    config = hopperjax.load_config(
        None, [*RUN, *PLACED, "mesh.data=1", f"run_dir={tmp_path_factory.mktemp('placed')}"]
    )
    return hopperjax.train(config, devices=jax.devices()[:1], console=False)


@pytest.mark.parametrize("layout", ["tensor8", "data2_tensor4", "data8_rows_everywhere"])
def test_table_wise_layouts_give_one_devices_losses_and_place_whole_tables(
    layout, one_device_placed, tmp_path
):
    config = hopperjax.load_config(None, [*RUN, *PLACED, *LAYOUTS[layout], f"run_dir={tmp_path}"])
    result = hopperjax.train(config, console=False)
    np.testing.assert_allclose(_losses(result), _losses(one_device_placed), rtol=1e-5, atol=1e-6)
    ways = 8 if config.model.table_sharding == "all" else config.mesh.tensor
    table = result.state.params["tables"]["rows"]["embedding"]
    assert table.shape == (8, 64, 8)  # 8 groups of the largest table's 64 rows
    assert {s.data.shape for s in table.addressable_shards} == {(8 // ways, 64, 8)}


def test_large_tables_stay_row_wise_beside_the_placed_ones(tmp_path):
    """``table_wise_max_rows=48``: the 48- and 40-row tables placed whole, the 64-row table split
    by rows; 8 devices give one device's losses."""
    mixed = [*PLACED, "model.table_wise_max_rows=48"]
    runs = []
    for name, layout, devices in (("one", ["mesh.data=1"], jax.devices()[:1]),
                                  ("eight", LAYOUTS["data2_tensor4"], None)):  # fmt: skip
        config = hopperjax.load_config(None, [*RUN, *mixed, *layout, f"run_dir={tmp_path / name}"])
        runs.append(hopperjax.train(config, devices=devices, console=False))
    np.testing.assert_allclose(_losses(runs[1]), _losses(runs[0]), rtol=1e-5, atol=1e-6)
    params = runs[1].state.params
    assert params["tables"]["rows"]["embedding"].shape == (8, 48, 8)
    assert "table_0" in params and "table_1" not in params
    row_wise = params["table_0"]["rows"]["embedding"]
    assert {s.data.shape for s in row_wise.addressable_shards} == {(16, 8)}


def test_table_wise_lookups_are_local_and_only_the_bags_travel():
    """inspect: at tensor=8 each device looks up its own tables and one all-gather brings every
    device the bags (8 groups x batch 64 x 1 slot x 8 dims x 4 bytes), where row-wise sharding
    all-reduces partial bags; with the tables and the batch over all 8 devices (data=8) the
    bags travel by all-to-all (a device's share: 1/8 of it), forward and backward."""

    def collectives(*layout):
        config = hopperjax.load_config(None, [*RUN, *PLACED, *layout, "run_dir=runs/inspect-x"])
        return inspect_lib.inspect_config(config)["collectives"]

    tensor8 = collectives(*LAYOUTS["tensor8"])
    lookups = [c for c in tensor8 if "tables" in c["op_name"]]
    assert [(c["kind"], c["bytes"]) for c in lookups] == [("all-gather", 8 * 64 * 1 * 8 * 4)]
    assert not [c for c in tensor8 if "gather" in c["op_name"] and c["kind"] == "all-reduce"]
    everywhere = collectives(*LAYOUTS["data8_rows_everywhere"])
    bags = [c for c in everywhere if "tables/sharding_constraint" in c["op_name"]]
    assert [(c["kind"], c["bytes"]) for c in bags] == [("all-to-all", 8 * 64 * 8 * 4 // 8)] * 2


def test_table_placement_keys_are_checked():
    with pytest.raises(hopperjax.ConfigError, match=r"model\.table_groups"):
        hopperjax.load_config(None, [*SMOKE, "model.table_placement=tables"])
    with pytest.raises(hopperjax.ConfigError, match=r"model\.table_groups"):
        hopperjax.load_config(None, [*SMOKE, "model.table_groups=4"])
    with pytest.raises(hopperjax.ConfigError, match=r"model\.table_wise_max_rows"):
        hopperjax.load_config(None, [*SMOKE, *PLACED, "model.table_wise_max_rows=10"])
    with pytest.raises(hopperjax.ConfigError, match=r"model\.table_placement"):
        hopperjax.load_config(None, [*SMOKE, *PLACED, "model.kind=mf", "model.table_sizes=8,8"])
    from hopperjax.trainer import build_components

    three = [*SMOKE, *PLACED[:1], "model.table_groups=3", "mesh.data=1", "mesh.tensor=8"]
    three = hopperjax.load_config(None, [*three, "run_dir=runs/x"])
    with pytest.raises(hopperjax.ConfigError, match=r"mesh\.tensor"):
        build_components(three)
    # Lookahead averaging would set row-sparse tables, updated beside the optimizer, to an
    # average of them that the optimizer never saw move.
    averaged = [*SMOKE, "model.sparse_updates=true", "optim.ema_decay=0.5", "run_dir=runs/x"]
    with pytest.raises(hopperjax.ConfigError, match=r"optim\.ema_decay"):
        build_components(hopperjax.load_config(None, averaged))


def test_inspect_lists_the_lookups_collective_and_a_tensor_share_of_the_state():
    """Row-sharded tables: each device gathers the rows it holds and one all-reduce sums the
    partial bags (batch 64 x 3 tables x 2 ids x 8 dims x 4 bytes); data parallelism instead
    moves only gradients. The per-device state shrinks by the tables' share."""

    def report(layout):
        config = hopperjax.load_config(None, [*RUN, *LAYOUTS[layout], "run_dir=runs/inspect-x"])
        return inspect_lib.inspect_config(config)

    data8, tensor8 = report("data8"), report("tensor8")
    lookups = [c for c in tensor8["collectives"] if "gather" in c["op_name"]]
    assert [c["kind"] for c in lookups] == ["all-reduce"]
    assert lookups[0]["bytes"] == 64 * 3 * 2 * 8 * 4
    assert not [c for c in data8["collectives"] if "gather" in c["op_name"]]
    table_bytes = (64 + 48 + 40) * 8 * 4 * 3  # params + Adam's two moments
    state = [r["offload"]["state_bytes_per_device"]["device"] for r in (data8, tensor8)]
    assert state[0] - state[1] == table_bytes * 7 // 8


def test_factorization_reaches_the_synthetic_noise_floor(tmp_path):
    """Ratings = a rank-4 user x item structure + biases + noise of std 0.5: a factorization
    that learns the structure gets a held-out RMSE near 0.5 (predicting the mean: ~0.9)."""
    overrides = [*SMOKE, "model.kind=mf", "model.table_sizes=60,50", "model.embed_dim=8",
                 "data.synthetic_dense=0", "data.synthetic_hot=1", "data.synthetic_rows=30000",
                 "data.synthetic_zipf=0.3", "data.synthetic_noise=0.5", "train.batch_size=512",
                 "train.steps=400", "train.eval_every=400", "train.log_every=100",
                 "train.checkpoint_every=400", "optim.base_lr=0.02", "optim.weight_decay=0.0",
                 "optim.warmup_steps=20", f"run_dir={tmp_path}"]  # fmt: skip
    result = hopperjax.train(hopperjax.load_config(None, overrides), console=False)
    [final] = [r for r in result.history if "eval_rmse" in r]
    assert final["eval_rmse"] < 0.6, final


def _criteo_file(path, n, seed=0, bad_every=0):
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        ints = [int(x) if x >= 0 else "" for x in rng.integers(-1, 50, 13)]
        cats = [f"{x:08x}" if x % 7 else "" for x in rng.integers(0, 2**32, 26)]
        lines.append(_criteo_line(int(rng.random() < 0.3), ints, cats))
        if bad_every and i % bad_every == bad_every - 1:
            lines.append("1\tnot enough fields")
    path.write_text("\n".join(lines) + "\n")


def test_converted_shards_hold_the_files_rows_and_train_the_same_batches(tmp_path):
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    import convert_interactions

    source = tmp_path / "day.tsv"
    _criteo_file(source, 300, bad_every=100)
    sizes = ",".join(["64"] * 26)
    out = tmp_path / "shards"
    argv = ["--source", str(source), "--out", str(out), "--table-sizes", sizes,
            "--chunk-rows", "128", "--bad-records", "skip"]  # fmt: skip
    assert convert_interactions.main(argv) == 0
    direct = ix.read_criteo(source, (64,) * 26, skip_bad=True)
    records = ix.read_interaction_shards(out, (64,) * 26)
    assert len(records) == len(direct) == 300 and records.skipped == direct.skipped == 3
    loaded = records.load()
    for field in ("dense", "sparse", "labels"):
        np.testing.assert_array_equal(getattr(loaded, field), getattr(direct, field))
    assert len(list(out.glob("all-*-of-00003.array_record"))) == 3  # 128 + 128 + 44 rows

    common = ["workload=recommendation", f"model.table_sizes={sizes}", "model.embed_dim=4",
              "model.bottom_mlp=8", "model.top_mlp=8", "train.batch_size=32",
              "data.bad_records=skip", "data.shuffle=true"]  # fmt: skip
    batches = []
    for extra in (
        ["data.source=criteo", f"data.path={source}"],
        ["data.source=criteo_shards", f"data.path={out}"],
        ["data.source=criteo_shards", f"data.path={out}", "data.preload=false"],
    ):
        config = hopperjax.load_config(None, [*common, *extra, f"run_dir={tmp_path / 'r'}"])
        workload = workloads.get("recommendation")(config)
        datasets = workload.build_datasets(ProcessShard())
        batches.append((next(iter(datasets.train)), list(datasets.eval)))
        assert datasets.meta.train_rows == 270 and datasets.meta.skipped == 3
    for train, held in batches[1:]:
        for key in train:
            np.testing.assert_array_equal(train[key], batches[0][0][key])
        assert len(held) == len(batches[0][1])
        for a, b in zip(held, batches[0][1], strict=True):
            np.testing.assert_array_equal(a["sparse"], b["sparse"])

    with pytest.raises(hopperjax.ConfigError, match=r"hashed to tables of 64,64"):
        other = ["data.source=criteo_shards", f"data.path={out}",
                 "model.table_sizes=" + ",".join(["128"] * 26)]  # fmt: skip
        config = hopperjax.load_config(None, [*common, *other, f"run_dir={tmp_path / 'q'}"])
        workloads.get("recommendation")(config).build_datasets(ProcessShard())
    # A failed conversion into the same directory leaves the complete set as it was.
    assert convert_interactions.main([*argv[:-2], "--bad-records", "error"]) == 2
    assert len(ix.read_interaction_shards(out, (64,) * 26)) == 300
    assert not list(out.glob(".*"))  # no parts left behind
    with pytest.raises(DataError, match=r"no dataset\.json"):
        ix.read_interaction_shards(tmp_path, (64,) * 26)


SPARSE_RUN = [*RUN, "model.sparse_updates=true", "optim.clip_norm=null", "optim.row_lr=0.1"]


# "mixed" holds both kinds (tables placed whole on devices and tables split by rows), so a
# placement of whole tables only adds no path of its own (CI time).
@pytest.mark.parametrize("placement", ["rows", "mixed"])
def test_row_sparse_updates_equal_dense_row_wise_adagrad(placement, tmp_path):
    """Two steps with row-sparse tables against a dense reference: the table's full gradient
    from jax.grad, then row-wise Adagrad on every row (untouched rows get a zero step). The
    MLPs' first update, here on 8 devices, equals that of dense tables on one device (no
    clipping mixes the two; later updates differ, as the tables then do). Table-wise, the grouped
    table [groups, rows, dim] is updated group by group on the devices holding it."""
    from hopperjax.data import to_global_batch
    from hopperjax.trainer import build_components

    placed = {"rows": [], "mixed": [*PLACED, "model.table_wise_max_rows=48"]}
    placed = placed[placement]
    config = hopperjax.load_config(None, [*SPARSE_RUN, *placed, "mesh.data=2", "mesh.tensor=4",
                                          f"run_dir={tmp_path}"])  # fmt: skip
    parts = build_components(config)
    state = parts.init_state()
    model, workload = parts.model, parts.workload
    lr, eps = config.optim.row_lr, config.optim.row_eps
    batches = iter(parts.datasets.train)
    names = [name for name in state.params if name.startswith("table")]
    acc = {name: np.zeros(state.params[name]["rows"]["embedding"].shape[:-1], np.float32)
           for name in names}  # fmt: skip

    @jax.jit  # one compile for both steps, not one per operation
    def table_grads(params, variables, batch):
        def loss(params):
            outputs = model.apply({**variables, "params": params}, batch["dense"], batch["sparse"])
            return workload.loss(outputs, batch)

        return jax.grad(loss)(params)

    for step in range(2):
        batch = to_global_batch(next(batches), parts.batch_sharding, blocks=parts.batch_blocks)
        before = jax.tree.map(np.asarray, state.params)
        grads = jax.tree.map(np.asarray, table_grads(state.params, state.model_state, batch))
        state, _ = parts.train_step(state, batch)
        if step == 0:
            first_update = jax.device_get(state.params)
            first_moment = _top_kernel_moment(state.opt_state)
        for name in names:
            g = grads[name]["rows"]["embedding"]
            acc[name] += (g**2).mean(-1)
            expected = before[name]["rows"]["embedding"] - lr * g / (
                np.sqrt(acc[name])[..., None] + eps
            )
            got = np.asarray(state.params[name]["rows"]["embedding"])
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
            stored = state.model_state["row_optimizer"][name]["rows"]["accumulator"]
            np.testing.assert_allclose(np.asarray(stored), acc[name], rtol=1e-5, atol=1e-9)
            assert (g == 0).all(axis=-1).any()  # some rows were not read: a real sparse case

    # Dense tables' first step on one device, on the first batch of the same data.
    dense = hopperjax.load_config(
        None, [*RUN, "optim.clip_norm=null", "mesh.data=1", *placed, f"run_dir={tmp_path / 'd'}"]
    )
    reference = build_components(dense, devices=jax.devices()[:1])
    first = to_global_batch(next(iter(reference.datasets.train)), reference.batch_sharding)
    a, _ = reference.train_step(reference.init_state(), first)
    np.testing.assert_allclose(np.asarray(a.params["top_0"]["kernel"]),
                               first_update["top_0"]["kernel"], rtol=1e-5, atol=1e-7)  # fmt: skip
    # The first update is ~ -lr sign(g) (Adam's first step); Adam's first moment, (1 - b1) g,
    # holds the gradient's size too, so a gradient scaled by a stray reduction shows.
    np.testing.assert_allclose(_top_kernel_moment(a.opt_state), first_moment, rtol=1e-4,
                               atol=1e-9)  # fmt: skip


def _top_kernel_moment(opt_state) -> np.ndarray:
    """Adam's first moment of the top MLP's first kernel, wherever the optimizer keeps it."""
    found = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]
             if "mu" in (keys := jax.tree_util.keystr(path)) and "top_0" in keys
             and "kernel" in keys]  # fmt: skip
    assert len(found) == 1, len(found)
    return np.asarray(found[0])


def test_row_sparse_step_memory_does_not_grow_with_table_rows():
    """inspect: 10x the table rows, same step temporaries (the dense gradient is never formed);
    with dense tables the temporaries grow with the rows."""

    def temp(sizes, *extra):
        config = hopperjax.load_config(
            None, [*RUN, f"model.table_sizes={sizes}", "mesh.data=8", "run_dir=runs/x", *extra]
        )
        return inspect_lib.inspect_config(config)["memory"]["temp_bytes"]

    small, large = "64,48,40", "64000,48000,40000"
    sparse = [temp(s, "model.sparse_updates=true") for s in (small, large)]
    dense = [temp(s) for s in (small, large)]
    assert sparse[1] <= sparse[0] * 1.05, sparse
    assert dense[1] > dense[0] * 10, dense


def test_row_sparse_updates_under_fp16_loss_scaling_train_to_finite_losses(tmp_path):
    """fp16 with dynamic loss scaling and row-sparse tables: the run trains to finite losses and
    its tables change (the gating itself is what apply_row_updates' finite= does; this test
    does not force a non-finite step)."""
    config = hopperjax.load_config(
        None, [*SPARSE_RUN, "precision=fp16", "train.steps=6", "mesh.data=1",
               f"run_dir={tmp_path}"],
    )  # fmt: skip
    one = jax.devices()[:1]
    result = hopperjax.train(config, devices=one, console=False)
    assert np.isfinite(_losses(result)).all()
    start = hopperjax.load_config(None, [*SPARSE_RUN, "precision=fp16", "train.steps=6",
                                         "mesh.data=1", f"run_dir={tmp_path / 'x'}"])  # fmt: skip
    from hopperjax.trainer import build_components

    initial = build_components(start, devices=one).init_state().params
    table = lambda p: np.asarray(p["table_0"]["rows"]["embedding"])
    assert not np.array_equal(table(initial), table(result.state.params))
