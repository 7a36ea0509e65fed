"""Input pipelines (grain) and device prefetch."""

from hopperjax.data.pipeline import Datasets, build_datasets, make_iterator
from hopperjax.data.prefetch import DevicePrefetcher, to_global_batch
from hopperjax.data.text import BYTE_VOCAB_SIZE, ByteWindows, embedded_corpus

__all__ = [
    "BYTE_VOCAB_SIZE",
    "ByteWindows",
    "Datasets",
    "DevicePrefetcher",
    "build_datasets",
    "embedded_corpus",
    "make_iterator",
    "to_global_batch",
]
