"""Data pipeline tests: byte windows, process sharding, shuffling, iterator state, prefetch."""

from __future__ import annotations

import os
import pickle
import threading
import time

import jax
import numpy as np
import pytest
from conftest import corpus_bytes

import hopperjax
from hopperjax import build_datasets
from hopperjax.data import DevicePrefetcher, ProcessShard, make_iterator, text
from hopperjax.parallel import logical_sharding

SEQ_LEN = 32  # tiny_config's data.seq_len
BATCH = 16  # tiny_config's train.batch_size


@pytest.fixture
def text_config(tiny_config, corpus_file):
    """``text_config(*overrides)``: the tiny config reading ``corpus_file``."""
    return lambda *overrides: tiny_config(
        "data.source=text", f"data.path={corpus_file}", *overrides
    )


def _train_windows(data: bytes, eval_fraction: float = 0.1) -> list[bytes]:
    """Every training window of ``data``, computed independently of ByteWindows."""
    split = int(len(data) * (1.0 - eval_fraction))
    count = (split - 1) // SEQ_LEN
    return [data[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] for i in range(count)]


def _rows(batch: dict[str, np.ndarray]) -> list[bytes]:
    """Rebuilds each row's window of seq_len + 1 bytes from its inputs and targets."""
    inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    windows = np.concatenate([inputs, targets[:, -1:]], axis=1).astype(np.uint8)
    return [bytes(w) for w in windows]


def _first_rows(dataset, count: int) -> list[bytes]:
    rows: list[bytes] = []
    k = 0
    while len(rows) < count:
        rows.extend(_rows(dataset[k]))
        k += 1
    return rows[:count]


def _assert_batches_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


# ------------------------------------------------------------------------------------------------
# ByteWindows and the embedded corpus


def test_byte_windows_over_array():
    """Windows of seq_len + 1 bytes at stride seq_len; a partial last window is not emitted."""
    data = np.arange(23, dtype=np.uint8)
    windows = text.ByteWindows(data, 0, 23, seq_len=5)
    assert len(windows) == 4  # starts 0, 5, 10, 15; 20 would need bytes 20..25
    np.testing.assert_array_equal(windows[0], np.arange(0, 6))
    np.testing.assert_array_equal(windows[3], np.arange(15, 21))
    assert all(windows[i].shape == (6,) and windows[i].dtype == np.uint8 for i in range(4))
    # A sub-range: windows never read outside [start, stop).
    sub = text.ByteWindows(data, 4, 16, seq_len=5)
    assert len(sub) == 2
    np.testing.assert_array_equal(sub[1], np.arange(9, 15))
    assert len(text.ByteWindows(data, 0, 5, seq_len=5)) == 0  # 5 bytes < one window of 6
    assert len(text.ByteWindows(data, 0, 6, seq_len=5)) == 1


def test_to_lm_example_shifts_by_one():
    window = np.array([10, 20, 30, 40, 255], dtype=np.uint8)
    example = text.to_lm_example(window)
    np.testing.assert_array_equal(example["inputs"], [10, 20, 30, 40])
    np.testing.assert_array_equal(example["targets"], [20, 30, 40, 255])
    assert example["inputs"].dtype == np.int32 and example["targets"].dtype == np.int32


def test_file_backed_windows_match_array_and_pickle(tmp_path):
    """A file-backed source equals the array-backed one, before and after a pickle round trip."""
    data = corpus_bytes(3000)
    path = tmp_path / "small.txt"
    path.write_bytes(data)
    array = np.frombuffer(data, dtype=np.uint8)
    from_array = text.ByteWindows(array, 100, 2900, SEQ_LEN)
    from_file = text.ByteWindows(path, 100, 2900, SEQ_LEN)
    assert len(from_file) == len(from_array) == (2800 - 1) // SEQ_LEN
    for i in range(len(from_array)):
        np.testing.assert_array_equal(from_file[i], from_array[i])
    # from_file has now mapped the file; pickling must drop the mapping and re-map on demand.
    restored = pickle.loads(pickle.dumps(from_file))
    assert len(restored) == len(from_array)
    for i in range(len(from_array)):
        np.testing.assert_array_equal(restored[i], from_array[i])
    assert len(pickle.dumps(from_file)) < len(data)  # the bytes themselves are not pickled
    fresh = pickle.loads(pickle.dumps(text.ByteWindows(str(path), 0, 3000, SEQ_LEN)))
    np.testing.assert_array_equal(fresh[0], array[: SEQ_LEN + 1])


def test_embedded_corpus():
    corpus = text.embedded_corpus()
    assert corpus.dtype == np.uint8 and corpus.ndim == 1
    assert corpus.size > 10_000
    assert b"hopperjax" in corpus.tobytes()


# ------------------------------------------------------------------------------------------------
# build_datasets


def test_process_shards_are_disjoint_and_cover_train_windows(text_config, corpus_file):
    """Two processes' first epochs partition the training windows; each batches B/2 rows."""
    config = text_config()
    all_windows = _train_windows(corpus_file.read_bytes())
    assert len(set(all_windows)) == len(all_windows) > 100  # precondition: windows are unique
    epochs = []
    for index in range(2):
        ds = build_datasets(config, ProcessShard(index, 2))
        batch = ds.train[0]
        assert batch["inputs"].shape == (BATCH // 2, SEQ_LEN)
        assert batch["targets"].shape == (BATCH // 2, SEQ_LEN)
        assert ds.eval[0]["inputs"].shape == (BATCH // 2, SEQ_LEN)
        epoch_len = len(range(index, len(all_windows), 2))
        rows = _first_rows(ds.train, epoch_len)
        assert len(set(rows)) == epoch_len, f"process {index} repeats a window within an epoch"
        epochs.append(set(rows))
    assert not epochs[0] & epochs[1]
    assert epochs[0] | epochs[1] == set(all_windows)


def test_processes_get_the_same_number_of_eval_batches(tiny_config, tmp_path):
    """Every process must run the same number of eval steps, or multi-host eval deadlocks."""
    path = tmp_path / "odd.txt"
    path.write_bytes(corpus_bytes(9930))  # eval split: 993 bytes = 31 windows of 33
    config = tiny_config("data.source=text", f"data.path={path}")
    windows = text.ByteWindows(path, int(9930 * 0.9), 9930, SEQ_LEN)
    if len(windows) != 31:
        pytest.fail(f"precondition: expected 31 eval windows, got {len(windows)}")
    # Per-process eval batches of 16 / 2 = 8 rows: process 0 holds 16 windows, process 1 only 15.
    counts = [len(build_datasets(config, ProcessShard(i, 2)).eval) for i in range(2)]
    assert counts[0] == counts[1], f"eval batches per process: {counts}"


def test_eval_split_is_held_out(text_config, corpus_file):
    """Eval windows come from the tail of the file and never appear in training."""
    data = corpus_file.read_bytes()
    ds = build_datasets(text_config(), ProcessShard(0, 1))
    eval_rows = [row for k in range(len(ds.eval)) for row in _rows(ds.eval[k])]
    assert len(ds.eval) >= 1 and len(eval_rows) == len(ds.eval) * BATCH
    assert not set(_train_windows(data)) & set(eval_rows)
    tail = data[int(len(data) * 0.9) :]
    assert all(row in tail for row in eval_rows)


def test_shuffle_is_deterministic_per_seed_and_epoch(text_config, corpus_file):
    n = len(_train_windows(corpus_file.read_bytes()))
    first = build_datasets(text_config(), ProcessShard(0, 1)).train
    again = build_datasets(text_config(), ProcessShard(0, 1)).train
    other = build_datasets(text_config("seed=1"), ProcessShard(0, 1)).train
    two_epochs = _first_rows(first, 2 * n)
    epoch1, epoch2 = two_epochs[:n], two_epochs[n:]
    assert _first_rows(again, n) == epoch1
    other_epoch = _first_rows(other, n)
    assert other_epoch != epoch1
    assert set(other_epoch) == set(epoch1)
    assert epoch2 != epoch1
    assert set(epoch2) == set(epoch1)
    # Shuffled at all: the first epoch is not in file order.
    assert epoch1 != _train_windows(corpus_file.read_bytes())


def test_no_shuffle_reads_in_file_order(text_config, corpus_file):
    ds = build_datasets(text_config("data.shuffle=false"), ProcessShard(0, 1))
    windows = _train_windows(corpus_file.read_bytes())
    assert _first_rows(ds.train, len(windows)) == windows


def test_eval_split_smaller_than_one_batch_is_a_config_error(text_config):
    # 1% of 20 KB = 200 bytes = 6 windows of 33 bytes < one eval batch of 16.
    with pytest.raises(hopperjax.ConfigError) as excinfo:
        build_datasets(text_config("data.eval_fraction=0.01"), ProcessShard(0, 1))
    assert excinfo.value.key == "data.eval_fraction"
    # The same file with the default fraction is fine: the error is about the split's size.
    build_datasets(text_config(), ProcessShard(0, 1))


# ------------------------------------------------------------------------------------------------
# Iterators


def test_iterator_state_round_trip(text_config):
    """A fresh iterator given the state after 3 batches yields the original 4th batch."""
    config = text_config()
    train = build_datasets(config, ProcessShard(0, 1)).train
    original = make_iterator(train, config.data)
    third = [next(original) for _ in range(3)][-1]
    state = original.get_state()
    fourth = next(original)
    resumed = make_iterator(train, config.data)
    resumed.set_state(state)
    _assert_batches_equal(next(resumed), fourth)
    with pytest.raises(AssertionError):  # guard: consecutive batches differ
        _assert_batches_equal(third, fourth)


def _reader_pid(index):
    return np.int64(os.getpid())


def test_worker_process_yields_same_batches(text_config):
    """data.workers=1 reads in a grain worker process (another pid than this one; workers=0
    reads here) and yields the same first 4 batches as workers=0."""
    import grain

    pids = grain.MapDataset.range(4).map(_reader_pid)
    for workers, here in ((0, True), (1, False)):
        iterator = make_iterator(pids, text_config(f"data.workers={workers}").data)
        try:
            read_by = {int(next(iterator)) for _ in range(4)}
        finally:
            if hasattr(iterator, "close"):
                iterator.close()
        assert (read_by == {os.getpid()}) == here, (workers, read_by)

    in_process = text_config("data.workers=0")
    with_worker = text_config("data.workers=1")
    train = build_datasets(in_process, ProcessShard(0, 1)).train
    reference = make_iterator(train, in_process.data)
    expected = [next(reference) for _ in range(4)]
    iterator = make_iterator(train, with_worker.data)
    try:
        got = [next(iterator) for _ in range(4)]
    finally:
        iterator.close()  # stops the worker process now rather than at garbage collection
    for a, b in zip(got, expected, strict=True):
        _assert_batches_equal(a, b)


def test_read_options_bound_the_batches_read_ahead(text_config, monkeypatch):
    """data.read_threads / read_buffer reach grain (its own defaults read 500 batches ahead), and
    any setting yields the same batches in the same order."""
    import grain

    seen = []
    original = grain.MapDataset.to_iter_dataset

    def spy(self, read_options=None, **kwargs):
        seen.append(read_options)
        return original(self, read_options, **kwargs)

    monkeypatch.setattr(grain.MapDataset, "to_iter_dataset", spy)
    default = text_config()
    synchronous = text_config("data.read_threads=0", "data.read_buffer=1")
    train = build_datasets(default, ProcessShard(0, 1)).train
    threaded, inline = make_iterator(train, default.data), make_iterator(train, synchronous.data)
    assert [(o.num_threads, o.prefetch_buffer_size) for o in seen] == [(2, 8), (0, 1)]
    for _ in range(3):
        _assert_batches_equal(next(inline), next(threaded))


@pytest.mark.parametrize(("key", "value"), [("read_threads", -1), ("read_buffer", 0)])
def test_bad_read_options_name_the_key(text_config, key, value):
    with pytest.raises(hopperjax.ConfigError, match=rf"data\.{key}"):
        text_config(f"data.{key}={value}")


class _CountingIterator:
    """Wraps a grain iterator; sets ``ahead`` once ``target`` batches were read from it."""

    def __init__(self, iterator, target: int):
        self._iterator, self._target, self.produced = iterator, target, 0
        self.ahead = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._iterator)
        self.produced += 1
        if self.produced >= self._target:
            self.ahead.set()
        return batch

    def get_state(self):
        return self._iterator.get_state()

    def set_state(self, state):
        self._iterator.set_state(state)


def test_device_prefetcher_shards_and_resumes(text_config):
    """Global batches sharded over 8 devices; get_state names the next unconsumed batch."""
    config = text_config()
    mesh = hopperjax.build_mesh(config.mesh)
    assert mesh.devices.size == 8 and mesh.shape["data"] == 8
    sharding = logical_sharding(mesh, ("batch", "length"))
    train = build_datasets(config).train
    reference = make_iterator(train, config.data)
    expected = [next(reference) for _ in range(4)]

    source = _CountingIterator(make_iterator(train, config.data), target=5)
    prefetcher = DevicePrefetcher(source, sharding, depth=2)
    try:
        got = [next(prefetcher) for _ in range(3)]
        for batch, ref in zip(got, expected[:3], strict=True):
            for key in ("inputs", "targets"):
                array = batch[key]
                assert isinstance(array, jax.Array)
                assert array.shape == (BATCH, SEQ_LEN)
                assert array.sharding == sharding
                shards = array.addressable_shards
                assert len(shards) == 8 and len({s.device for s in shards}) == 8
                assert all(s.data.shape == (BATCH // 8, SEQ_LEN) for s in shards)
            _assert_batches_equal(batch, ref)
        # With depth 2 the producer reads batches 4 and 5 while we hold 3: wait until it has.
        assert source.ahead.wait(timeout=60), "prefetcher never read ahead"
        state = prefetcher.get_state()
    finally:
        prefetcher.close()
    assert not prefetcher._thread.is_alive(), "close() left the producer thread running"

    resumed = make_iterator(train, config.data)
    resumed.set_state(state)
    _assert_batches_equal(next(resumed), expected[3])


class _EndlessRows:
    """A grain-like iterator of tiny batches, forever."""

    def __init__(self):
        self.n = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.n += 1
        return {"x": np.full((8, 2), self.n, np.int32)}

    def get_state(self):
        return {"n": self.n}


def test_no_batch_is_copied_to_a_device_during_a_compiled_steps_first_run(monkeypatch):
    """run_alone (the loop's first run of each compiled step: cuDNN captures a CUDA graph then)
    holds off every prefetcher's copies, and they go on after it returns."""
    from hopperjax.data import prefetch

    copies: list[float] = []
    real = prefetch.to_global_batch

    def timed(*args, **kwargs):
        copies.append(time.perf_counter())
        return real(*args, **kwargs)

    monkeypatch.setattr(prefetch, "to_global_batch", timed)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    prefetcher = prefetch.DevicePrefetcher(_EndlessRows(), sharding, depth=10_000)
    window = {}

    def step():
        window["start"] = time.perf_counter()
        time.sleep(0.3)
        window["end"] = time.perf_counter()
        return jax.numpy.zeros(())

    try:
        deadline = time.monotonic() + 60
        while len(copies) < 3:  # the producer is busy copying
            assert time.monotonic() < deadline, "the prefetcher never copied a batch"
            time.sleep(0.01)
        prefetch.run_alone(step)
        time.sleep(0.1)
    finally:
        prefetcher.close()
    assert not [t for t in copies if window["start"] < t < window["end"]]
    assert any(t > window["end"] for t in copies)  # and resumed
    assert sum(t < window["start"] for t in copies) >= 3


class _EpochSource:
    """Ten examples whose values change every epoch (value = 100 * epoch + index)."""

    def __init__(self):
        self.built = []

    def __len__(self):
        return 10

    def for_epoch(self, epoch):
        self.built.append(epoch)
        values = 100 * epoch + np.arange(10)
        return type("View", (), {"batch": staticmethod(lambda order: {"x": values[order]})})()


def test_a_per_epoch_source_serves_each_epoch_its_own_view_built_once():
    from hopperjax.data import EpochBatches

    source = _EpochSource()
    batches = EpochBatches(source, global_batch=4, rows=4, seed=1)  # 2 batches per epoch
    seen = [batches[i]["x"] for i in range(6)]
    for i, x in enumerate(seen):
        epoch = i // 2
        assert ((x // 100) == epoch).all() and len(set((x % 100).tolist())) == 4
    assert source.built == [0, 1, 2]  # one build per epoch, however many batches read it
    np.testing.assert_array_equal(batches[3]["x"], seen[3])  # epoch 1, read after epoch 2
    assert source.built == [0, 1, 2]  # the two latest views are kept
    # Batch i depends on i alone: a fresh reader (a resumed run, a worker) reads the same.
    again = pickle.loads(pickle.dumps(EpochBatches(_EpochSource(), 4, rows=4, seed=1)))
    np.testing.assert_array_equal(again[5]["x"], seen[5])
