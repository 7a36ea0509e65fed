"""Generic grain plumbing: what a workload's data sources become, and the iterator over them.

A workload composes its sources (``text``, ``molecules``, ...) into grain ``MapDataset``s of
batches: source -> this process's shard -> shuffle -> repeat -> map -> batch. Each process reads
only its own slice of the examples and batches ``global_batch / processes`` rows;
``DevicePrefetcher`` then assembles the global, sharded ``jax.Array`` on the mesh. Nothing here
knows a workload.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Generic, TypeVar

import grain
import numpy as np
from absl import flags

from hopperjax.config import DataConfig

Meta = TypeVar("Meta")

# Builds of a per-epoch view (``EpochBatches``): one at a time per process, so grain's reader
# threads reaching a new epoch together build it once.
_EPOCH_VIEW_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class ProcessShard:
    """Which block of every global batch this process reads: ``index`` of ``count`` blocks.

    Processes whose devices hold the same batch rows (a tensor-parallel group spanning
    processes) share a block and read the same examples (``parallel.process_batch_shard``).
    """

    index: int = 0
    count: int = 1

    def rows(self, global_batch: int) -> int:
        """This process's rows of a global batch of ``global_batch``."""
        return global_batch // self.count


@dataclasses.dataclass(frozen=True)
class Datasets(Generic[Meta]):
    """Per-process, batched datasets of one run, and what the workload knows about them.

    Attributes:
      train: infinite, shuffled each epoch, batches of ``batch_size / process count`` rows.
      eval: one pass over the held-out split, unshuffled, whole global batches only.
      meta: the workload's own typed facts about the data (a frozen dataclass: vocabulary,
        distinct molecules per batch, ...), read by its ``batch_fields`` and ``write_artifacts``.
    """

    train: Any
    eval: Any
    meta: Meta


@dataclasses.dataclass(frozen=True)
class EpochBatches:
    """Batches of ``source`` epoch after epoch (a grain ``RandomAccessDataSource`` of batches).

    Batch ``i`` is slot ``i % per_epoch`` of epoch ``i // per_epoch``: ``global_batch``
    consecutive examples of that epoch's permutation (seeded by ``seed`` and the epoch; the
    source's order when ``shuffle`` is false), of which this process takes its ``rows`` from
    ``offset``. An epoch's remainder (fewer than ``global_batch`` examples) is left out.
    ``epochs`` None is endless (training runs for train.steps). One gather per batch: reading
    and stacking record by record cost ~17 ms per 512 CIFAR images on one core, under what a GPU
    step consumes. The position is a batch index, so a run resumes exactly. Any source with
    ``len()`` and ``batch(indices)`` serves (decoded images, packed rows of text, ...). A source
    whose examples change every epoch (text segmented anew, ``parallel_text.Resampled``) has
    ``for_epoch(epoch)`` instead of ``batch``, returning that epoch's view (``len()`` examples
    and ``batch``), a pure function of the epoch so that resuming stays exact; the two latest
    views are kept.
    """

    source: Any  # len() and batch(order) -> a batch: images.ImageSet, parallel_text rows, ...
    global_batch: int
    rows: int
    offset: int = 0
    seed: int = 0
    shuffle: bool = True
    epochs: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.global_batch <= len(self.source):
            raise ValueError(
                f"a batch of {self.global_batch} needs at least that many examples, got "
                f"{len(self.source)}"
            )
        if not (
            self.offset >= 0 and self.rows > 0 and self.offset + self.rows <= self.global_batch
        ):
            raise ValueError(
                f"rows [{self.offset}, {self.offset + self.rows}) are not inside a batch of "
                f"{self.global_batch}"
            )

    def __len__(self) -> int:
        per_epoch = len(self.source) // self.global_batch
        return 2**62 if self.epochs is None else self.epochs * per_epoch

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        epoch, slot = divmod(int(index), len(self.source) // self.global_batch)
        start = slot * self.global_batch + self.offset
        return self._view(epoch).batch(self._order(epoch)[start : start + self.rows])

    def _view(self, epoch: int) -> Any:
        # The views of the two latest epochs: readers running ahead across an epoch's end, then
        # finishing the epoch before it, must not rebuild it.
        if not hasattr(self.source, "for_epoch"):
            return self.source
        view = self.__dict__.get("_view_cache", {}).get(epoch)
        if view is not None:
            return view
        with _EPOCH_VIEW_LOCK:
            cache = self.__dict__.get("_view_cache", {})
            if epoch not in cache:
                kept = sorted(cache)[-1:]  # a new dict, swapped in whole: readers see either
                cache = {**{e: cache[e] for e in kept}, epoch: self.source.for_epoch(epoch)}
                self.__dict__["_view_cache"] = cache
            return cache[epoch]

    def _order(self, epoch: int) -> np.ndarray:
        # One epoch's permutation kept per process; grain reads from several threads, so the
        # cache is replaced in one assignment and the order returned from a local.
        cached = self.__dict__.get("_cache")
        if cached is not None and cached[0] == epoch:
            return cached[1]
        n = len(self.source)
        rng = np.random.default_rng((self.seed, epoch))
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        self.__dict__["_cache"] = (epoch, order)
        return order

    def __getstate__(self) -> dict[str, Any]:  # worker processes compute their own
        return {k: v for k, v in self.__dict__.items() if k not in ("_cache", "_view_cache")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def make_iterator(dataset: grain.MapDataset, data: DataConfig) -> grain.DatasetIterator:
    """An iterator over ``dataset``, with ``data.workers`` worker processes when > 0, each reading
    ``data.read_buffer`` batches ahead with ``data.read_threads`` threads."""
    ds = dataset.to_iter_dataset(
        grain.ReadOptions(num_threads=data.read_threads, prefetch_buffer_size=data.read_buffer)
    )
    if data.workers > 0:
        # Known compromise: grain 0.2.18's worker start-up reads an absl flag and raises unless
        # absl has parsed the command line (google/grain#1355). We parse nothing with absl, so
        # declaring its (empty) flags parsed is harmless; remove once a fixed grain is released.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=data.workers, per_worker_buffer_size=data.worker_buffer_size
            )
        )
    return iter(ds)


def position_problem(state: Any, batches_consumed: int) -> str | None:
    """What is wrong with an iterator state restored after ``batches_consumed`` batches, or None.

    A position past the batches the run has consumed was edited or damaged: resuming from it
    would silently skip data. (States of other shapes, e.g. with worker processes, pass.)
    """
    position = state.get("next_index") if isinstance(state, dict) else None
    if isinstance(position, int) and not 0 <= position <= batches_consumed:
        return (
            f"the data iterator is at batch {position}, but the run has consumed "
            f"{batches_consumed} batches"
        )
    return None
