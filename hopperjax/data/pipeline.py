"""grain pipelines: source -> process shard -> shuffle -> repeat -> map -> batch -> workers.

Each process reads only its own slice of the examples and batches ``global_batch / processes``
rows; ``DevicePrefetcher`` then assembles the global, sharded ``jax.Array`` on the mesh.
"""

from __future__ import annotations

from typing import Any

import grain
import jax
from absl import flags

from hopperjax.config import Config, ConfigError
from hopperjax.data import text
from hopperjax.workloads.base import Datasets


def _text_tokens(config: Config) -> tuple[Any, int, text.CharVocabulary | None]:
    """(tokens: an array or a file path, their count, the character vocabulary or None)."""
    path = config.data.path if config.data.source == "text" else None
    if config.data.tokenizer == "chars":
        try:
            chars = text.read_chars(path)
        except ValueError as e:
            raise ConfigError("data.path", str(e), name_key=False) from None
        vocab = text.CharVocabulary.of(chars)
        tokens = vocab.encode(chars)
        return tokens, len(tokens), vocab
    source = path if path is not None else text.embedded_corpus()
    return source, text.byte_length(source), None


def build_datasets(
    config: Config, *, process_index: int | None = None, process_count: int | None = None
) -> Datasets:
    """Builds this process's train and eval datasets, as the run's workload reads them.

    Raises:
      ConfigError: the data cannot fill a batch (names the key to change).
    """
    from hopperjax.workloads import get_workload

    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    train = config.train
    eval_batch = train.eval_batch_size or train.batch_size
    for key, size in (
        ("train.batch_size", train.batch_size),
        ("train.eval_batch_size", eval_batch),
    ):
        if size % process_count:
            raise ConfigError(key, f"{size} is not divisible by {process_count} processes")
    return get_workload(config).build_datasets(
        config, process_index=process_index, process_count=process_count
    )


def build_text_datasets(config: Config, *, process_index: int, process_count: int) -> Datasets:
    """Token windows of a text file (or the embedded corpus) for language modeling.

    The first ``1 - data.eval_fraction`` of the tokens train, the rest evaluate. ``data.sampling:
    windows`` walks each split in ``seq_len`` strides (train shuffled per epoch); ``random`` draws
    every window at a uniform random offset with replacement, and then evaluates on
    ``train.eval_batches`` such batches of the eval split (the same ones at every evaluation).
    """
    data, train = config.data, config.train
    eval_batch = train.eval_batch_size or train.batch_size

    tokens, n, vocab = _text_tokens(config)
    split = int(n * (1.0 - data.eval_fraction))
    train_windows = text.ByteWindows(tokens, 0, split, data.seq_len)
    eval_windows = text.ByteWindows(tokens, split, n, data.seq_len)
    where = data.path or "the embedded corpus"
    unit = "characters" if vocab else "bytes"
    if len(train_windows) < process_count:
        raise ConfigError(
            "data.path" if data.path else "data.seq_len",
            f"{where} ({n} {unit}) is too small for one training window",
        )
    if len(eval_windows) < (1 if data.sampling == "random" else eval_batch):
        raise ConfigError(
            "data.eval_fraction",
            f"the eval split of {where} has {len(eval_windows)} windows of "
            f"{data.seq_len + 1} {unit}, fewer than one eval batch of {eval_batch}",
        )

    local_batch = train.batch_size // process_count
    if data.sampling == "random":
        if train.eval_batches is None:
            raise ConfigError("train.eval_batches", "required with data.sampling=random")
        train_ds = grain.MapDataset.source(
            text.RandomWindows(tokens, 0, split, data.seq_len, seed=config.seed)
        )[process_index::process_count]
        eval_ds = grain.MapDataset.source(
            text.RandomWindows(tokens, split, n, data.seq_len, seed=config.seed + 1)
        )[: train.eval_batches * eval_batch][process_index::process_count]
    else:
        train_ds = grain.MapDataset.source(train_windows)[process_index::process_count]
        if data.shuffle:
            # Shuffle before repeat: grain gives every epoch its own permutation of the same seed.
            train_ds = train_ds.shuffle(seed=config.seed)
        train_ds = train_ds.repeat(None)
        # Whole global batches only, so every process runs the same number of eval steps (a
        # process with one batch fewer would leave the others waiting in a collective).
        eval_ds = grain.MapDataset.source(eval_windows)
        eval_ds = eval_ds[: len(eval_ds) // eval_batch * eval_batch][process_index::process_count]
    train_ds = train_ds.map(text.to_lm_example).batch(local_batch, drop_remainder=True)
    eval_ds = eval_ds.map(text.to_lm_example).batch(
        eval_batch // process_count, drop_remainder=True
    )
    return Datasets(
        train=train_ds,
        eval=eval_ds,
        vocab_size=len(vocab) if vocab else text.BYTE_VOCAB_SIZE,
        info={"vocab": vocab.chars} if vocab else {},
    )


def make_iterator(dataset: grain.MapDataset, config: Config) -> grain.DatasetIterator:
    """An iterator over ``dataset``, with ``data.workers`` worker processes when > 0, each reading
    ``data.read_buffer`` batches ahead with ``data.read_threads`` threads."""
    ds = dataset.to_iter_dataset(
        grain.ReadOptions(
            num_threads=config.data.read_threads, prefetch_buffer_size=config.data.read_buffer
        )
    )
    if config.data.workers > 0:
        # Known compromise: grain 0.2.18's worker start-up reads an absl flag and raises unless
        # absl has parsed the command line (google/grain#1355). We parse nothing with absl, so
        # declaring its (empty) flags parsed is harmless; remove once a fixed grain is released.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=config.data.workers,
                per_worker_buffer_size=config.data.worker_buffer_size,
            )
        )
    return iter(ds)
