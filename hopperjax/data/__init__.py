"""Input: generic grain plumbing and device prefetch, plus one module per kind of source.

Sources (``text``, ``molecules``, ``images``, ``image_shards``, ``dta_batches``, ``dta_shards``)
know their file formats, never a workload or the trainer; a workload (``hopperjax/workloads/``)
composes them into ``Datasets``.
"""

from hopperjax.data.grain_io import (
    Datasets,
    EpochBatches,
    ProcessShard,
    make_iterator,
    position_problem,
)
from hopperjax.data.prefetch import DevicePrefetcher, run_alone, to_global_batch

__all__ = [
    "Datasets",
    "DevicePrefetcher",
    "EpochBatches",
    "ProcessShard",
    "make_iterator",
    "position_problem",
    "run_alone",
    "to_global_batch",
]
