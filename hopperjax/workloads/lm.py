"""Language modeling: token windows in, next-token cross-entropy out (the GPT workload).

Data: a local text file or hopperjax's own embedded sources (``data/text.py``), as bytes or as
characters; model: ``models/gpt.py``. Eval reports loss, next-token accuracy and perplexity.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from pathlib import Path
from typing import Any, Literal

import grain
import jax
import jax.numpy as jnp
import numpy as np

from hopperjax import config as config_lib
from hopperjax import files
from hopperjax.config import Config, ConfigError, RematConfig
from hopperjax.data import text
from hopperjax.data.datasets import not_found
from hopperjax.models import gpt
from hopperjax.models.transformer import BLOCK_ACTIVATIONS, BLOCK_DENSE_LAYERS
from hopperjax.precision import Policy
from hopperjax.workloads.base import Datasets, Field, ProcessShard, Workload, cross_entropy

VOCAB_FILE = "vocab.json"


@dataclasses.dataclass(frozen=True)
class TextData(config_lib.DataConfig):
    """The ``data:`` group of language modeling.

    ``source: embedded`` needs no file: it reads hopperjax's own sources; ``text`` reads
    ``path`` (any local file). ``tokenizer``: ``bytes`` (256 ids) or ``chars`` (the sorted
    distinct characters of the text, saved to the run's ``vocab.json``). ``sampling``:
    ``windows`` (seq_len strides, shuffled per epoch) or ``random`` (uniform random offsets with
    replacement; evaluation then uses ``train.eval_batches`` random batches of the eval split).
    ``eval_fraction``: the tail of the text held out for evaluation.
    """

    source: Literal["embedded", "text"] = "embedded"
    path: str | None = None
    tokenizer: Literal["bytes", "chars"] = "bytes"
    sampling: Literal["windows", "random"] = "windows"
    seq_len: int = 128
    eval_fraction: float = 0.1


@dataclasses.dataclass(frozen=True)
class TextMeta:
    """What a run's text data is: how many token ids it emits, and its characters (``chars``
    tokenizer) or None (bytes)."""

    vocab_size: int
    chars: str | None = None


class LanguageModeling(Workload):
    ModelConfig = gpt.GPTConfig
    DataConfig = TextData
    examples_name = "tokens"
    remat_names = BLOCK_ACTIVATIONS
    fp8_layers = gpt.FP8_LAYERS
    default_fp8_layers = BLOCK_DENSE_LAYERS
    smoke_overrides = (
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=2",
        "model.max_len=32",
        "data.seq_len=32",
        "train.batch_size=16",
        "train.eval_batches=2",
    )

    @classmethod
    def validate_config(cls, config: Config) -> None:
        m, d = config.model, config.data
        m.validate()
        config_lib.positive("data.seq_len", d.seq_len)
        if d.seq_len > m.max_len:
            raise ConfigError(
                "data.seq_len", f"must be <= model.max_len={m.max_len}, got {d.seq_len}"
            )
        if not 0.0 < d.eval_fraction < 1.0:
            raise ConfigError(
                "data.eval_fraction", f"expected 0 < fraction < 1, got {d.eval_fraction}"
            )
        if d.source == "text":
            if not d.path:
                raise ConfigError("data.path", "required when data.source is 'text'")
            if Path(d.path).is_dir():
                raise ConfigError("data.path", f"a directory, not a text file: {d.path}")
            if not Path(d.path).is_file():
                raise ConfigError("data.path", not_found(d.path))
        elif d.path:
            raise ConfigError(
                "data.path", f"not used by data.source '{d.source}'; set data.source=text"
            )
        if d.sampling == "random" and config.train.eval_batches is None:
            raise ConfigError("train.eval_batches", "required with data.sampling=random")

    def build_model(self, policy: Policy, remat: RematConfig) -> gpt.GPT:
        return gpt.GPT(config=self.config.model, policy=policy, remat=remat)

    def build_datasets(self, shard: ProcessShard) -> Datasets[TextMeta]:
        """Token windows of a text file (or the embedded corpus).

        The first ``1 - data.eval_fraction`` of the tokens train, the rest evaluate.
        ``data.sampling: windows`` walks each split in ``seq_len`` strides (train shuffled per
        epoch); ``random`` draws every window at a uniform random offset with replacement, and
        then evaluates on ``train.eval_batches`` such batches of the eval split (the same ones at
        every evaluation).

        Raises:
          ConfigError: the text cannot fill a batch, or emits more token ids than
            ``model.vocab_size`` (names the key to change).
        """
        config = self.config
        data, train = config.data, config.train
        eval_batch = train.eval_batch_size or train.batch_size
        tokens, n, vocab = self._tokens()
        vocab_size = len(vocab) if vocab else text.BYTE_VOCAB_SIZE
        if vocab_size > config.model.vocab_size:
            raise ConfigError(
                "model.vocab_size",
                f"the data emits {vocab_size} token ids, got {config.model.vocab_size}",
            )
        split = int(n * (1.0 - data.eval_fraction))
        train_windows = text.ByteWindows(tokens, 0, split, data.seq_len)
        eval_windows = text.ByteWindows(tokens, split, n, data.seq_len)
        where = data.path or "the embedded corpus"
        unit = "characters" if vocab else "bytes"
        if len(train_windows) < shard.count:
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

        index, count = shard.index, shard.count
        if data.sampling == "random":
            train_ds = grain.MapDataset.source(
                text.RandomWindows(tokens, 0, split, data.seq_len, seed=config.seed)
            )[index::count]
            eval_ds = grain.MapDataset.source(
                text.RandomWindows(tokens, split, n, data.seq_len, seed=config.seed + 1)
            )[: train.eval_batches * eval_batch][index::count]
        else:
            train_ds = grain.MapDataset.source(train_windows)[index::count]
            if data.shuffle:
                # Shuffle before repeat: grain gives every epoch its own permutation of one seed.
                train_ds = train_ds.shuffle(seed=config.seed)
            train_ds = train_ds.repeat(None)
            # Whole global batches only, so every process runs the same number of eval steps (a
            # process with one batch fewer would leave the others waiting in a collective).
            eval_ds = grain.MapDataset.source(eval_windows)
            eval_ds = eval_ds[: len(eval_ds) // eval_batch * eval_batch][index::count]
        train_ds = train_ds.map(text.to_lm_example).batch(
            shard.rows(train.batch_size), drop_remainder=True
        )
        eval_ds = eval_ds.map(text.to_lm_example).batch(shard.rows(eval_batch), drop_remainder=True)
        meta = TextMeta(vocab_size=vocab_size, chars=vocab.chars if vocab else None)
        return Datasets(train=train_ds, eval=eval_ds, meta=meta)

    def _tokens(self) -> tuple[Any, int, text.CharVocabulary | None]:
        """(tokens: an array or a file path, their count, the character vocabulary or None)."""
        data = self.config.data
        path = data.path if data.source == "text" else None
        if data.tokenizer == "chars":
            try:
                chars = text.read_chars(path)
            except ValueError as e:
                raise ConfigError("data.path", str(e), name_key=False) from None
            vocab = text.CharVocabulary.of(chars)
            tokens = vocab.encode(chars)
            return tokens, len(tokens), vocab
        source = path if path is not None else text.embedded_corpus()
        return source, text.byte_length(source), None

    def batch_fields(self, batch_size: int, datasets: Datasets | None) -> dict[str, Field]:
        tokens = Field((batch_size, self.config.data.seq_len), jnp.int32, ("batch", "length"))
        return {"inputs": tokens, "targets": tokens}

    def model_inputs(self, batch: Any) -> tuple[Any, ...]:
        return (batch["inputs"],)

    def loss(self, outputs: jax.Array, batch: Any) -> jax.Array:
        return cross_entropy(outputs, batch["targets"]).mean()

    def eval_outputs(self, outputs: jax.Array, batch: Any) -> dict[str, jax.Array]:
        """Sums over the batch, so that means over many batches are exact."""
        loss = cross_entropy(outputs, batch["targets"])
        correct = jnp.argmax(outputs, axis=-1) == batch["targets"]
        return {
            "loss_sum": loss.sum(),
            "correct": correct.sum().astype(jnp.float32),
            "tokens": jnp.asarray(loss.size, jnp.float32),
        }

    def summarize(self, outputs: list[dict[str, np.ndarray]]) -> dict[str, float]:
        totals = {k: sum(float(o[k]) for o in outputs) for k in outputs[0]}
        loss = totals["loss_sum"] / totals["tokens"]
        return {
            "eval_loss": loss,
            "eval_accuracy": totals["correct"] / totals["tokens"],
            "eval_perplexity": math.exp(min(loss, 50.0)),
        }

    def model_flops_per_step(self, batch_size: int, datasets: Datasets | None) -> float:
        return gpt.train_flops_per_step(
            self.config.model, batch_size=batch_size, seq_len=self.config.data.seq_len
        )

    def examples_per_step(self, batch_size: int) -> int:
        return batch_size * self.config.data.seq_len

    def next_commands(self, run_dir: Path) -> list[str]:
        return [f"python -m hopperjax.sample --run-dir {shlex.quote(str(run_dir))} --tokens 300"]

    def write_artifacts(self, datasets: Datasets, run_dir: Path, *, resuming: bool) -> None:
        """A character-level run's vocabulary (``vocab.json``: evaluation and sampling decode
        with it); a byte-level run removes a stale one.

        Raises: ConfigError naming data.path when checkpoints of another vocabulary are there
        (ids would mean other characters).
        """
        path = run_dir / VOCAB_FILE
        chars = datasets.meta.chars
        if chars is None:
            path.unlink(missing_ok=True)
            return
        if resuming and path.exists():
            before = json.loads(path.read_text())["chars"]
            if before != chars:
                raise ConfigError(
                    "data.path",
                    f"its vocabulary ({len(chars)} characters) differs from the one "
                    f"{run_dir} was trained with ({len(before)}); use a new run_dir",
                )
        files.write_text(path, json.dumps({"chars": chars}))

    def advice(self) -> list[str]:
        vocab = self.config.model.vocab_size
        if vocab % 128 == 0:
            return []
        padded = -(-vocab // 128) * 128
        return [
            f"pad model.vocab_size {vocab} -> {padded} (multiple of 128): the logits GEMM then "
            f"tiles exactly"
        ]

    def logits(self, model: Any, variables: dict[str, Any], tokens: jax.Array) -> jax.Array:
        """tokens [batch, length] int32 -> next-token logits [batch, length, vocab] (sampling)."""
        return self.predict(model, variables, {"inputs": tokens})

    def codec(self, run_dir: Path) -> Codec:
        """Text <-> token ids as this run's data made them (``hopperjax.sample`` uses it)."""
        return Codec.for_run(run_dir, self.config.data.tokenizer)


class Codec:
    """Text <-> token ids: bytes, or a character-level run's saved vocabulary."""

    def __init__(self, chars: text.CharVocabulary | None = None):
        self._chars = chars

    @classmethod
    def for_run(cls, run_dir: Path, tokenizer: str) -> Codec:
        """Raises FileNotFoundError when a character-level run has no ``vocab.json``."""
        if tokenizer != "chars":
            return cls()
        vocab = run_dir / VOCAB_FILE
        if not vocab.is_file():
            raise FileNotFoundError(f"{vocab}: missing; a character-level run saves it")
        return cls(text.CharVocabulary(json.loads(vocab.read_text())["chars"]))

    def __len__(self) -> int:
        return len(self._chars) if self._chars is not None else text.BYTE_VOCAB_SIZE

    def encode(self, chars: str, *, where: str = "text") -> np.ndarray:
        """Raises ValueError naming ``where`` for a character outside the vocabulary."""
        if self._chars is not None:
            return self._chars.encode(chars, where=where).astype(np.int32)
        return np.frombuffer(chars.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids: list[int]) -> str:
        if self._chars is not None:
            return self._chars.decode(ids)
        return bytes(ids).decode("utf-8", errors="replace")


WORKLOAD = LanguageModeling
