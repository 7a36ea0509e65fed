"""Translation: a sentence in, its translation out (the encoder-decoder workload).

Data: parallel text (``data/parallel_text.py``): aligned files or TSV per split, or generated
pairs. A SentencePiece vocabulary of ``model.vocab_size`` pieces is trained on the training
split's source and target sentences together at a run's first start and saved as the run's
``spm.model``; a resumed run, and decoding, read that file. Examples are packed into rows of
``data.source_len`` / ``data.target_len`` tokens (segment ids and per-example positions keep them
apart); ``train.batch_size`` counts rows. Model: ``models/t5.py``. Eval reports per-token loss,
token accuracy and perplexity over the held-out split.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import grain
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from hopperjax import config as config_lib
from hopperjax.config import Config, ConfigError, RematConfig
from hopperjax.data import EpochBatches
from hopperjax.data import parallel_text as pt
from hopperjax.data.datasets import not_found
from hopperjax.data.errors import DataError
from hopperjax.models import decoding, t5
from hopperjax.precision import Policy
from hopperjax.scoring import translation_scores
from hopperjax.workloads.base import Datasets, Field, ProcessShard, Workload, cross_entropy

TOKENIZER_FILE = "spm.model"
FIELDS = ("source", "source_segments", "source_positions", "target", "target_inputs",
          "target_segments", "target_positions")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ParallelData(config_lib.DataConfig):
    """The ``data:`` group of translation.

    ``source``: ``files`` (``path`` holds ``<split>.<lang>[.gz]`` pairs or ``<split>.tsv``) or
    ``synthetic`` (``synthetic_pairs`` generated word-by-word English->German pairs, a quarter as
    many held out). ``source_lang`` / ``target_lang``: the file suffixes. ``source_len`` /
    ``target_len``: tokens per packed row on each side (longer examples are cut, and counted).
    ``tokenizer``: SentencePiece's ``unigram`` or ``bpe``. ``subword_alpha``: subword
    regularization of the training split (a unigram tokenizer), 0 for none: every epoch
    segments each sentence anew, drawn from its ``subword_nbest`` best segmentations with
    probability proportional to P ** alpha (Kudo 2018's l and alpha), and packs the rows again;
    held-out text is never sampled.
    ``bad_records``: ``error`` (one line
    naming file and line) or ``skip`` (pairs with an empty side, counted). ``label_smoothing``:
    of the training loss's targets. ``generate_pairs``: the first this many held-out pairs are
    translated for ``eval_bleu`` / ``eval_chrf`` when ``train.generate_every`` asks, by beam
    search with ``beams`` hypotheses (1: greedy) and GNMT's ``length_penalty``.
    """

    source: Literal["files", "synthetic"] = "files"
    path: str | None = None
    source_lang: str = "en"
    target_lang: str = "de"
    train_split: str = "train"
    eval_split: str = "val"
    source_len: int = 64
    target_len: int = 64
    tokenizer: Literal["unigram", "bpe"] = "unigram"
    subword_alpha: float = 0.0
    subword_nbest: int = 64
    bad_records: Literal["error", "skip"] = "error"
    synthetic_pairs: int = 2000
    label_smoothing: float = 0.0
    generate_pairs: int = 256
    beams: int = 4
    length_penalty: float = 0.6


@dataclasses.dataclass(frozen=True)
class TranslationMeta:
    """What a run's parallel text is: its tokenizer (serialized), pair and row counts, the
    training rows' padding fraction, examples cut to fit a row and pairs skipped, and the
    held-out pairs that generation metrics translate (``data.generate_pairs``)."""

    tokenizer: bytes
    train_pairs: int
    eval_pairs: int
    train_rows: int
    padding: float
    truncated: int
    skipped: int
    generate: pt.Pairs


class Translation(Workload):
    ModelConfig = t5.T5Config
    DataConfig = ParallelData
    examples_name = "tokens"
    row_mean_loss = False  # a mean over the real target tokens of the whole batch
    remat_names = t5.BLOCK_ACTIVATIONS
    fp8_layers = t5.FP8_LAYERS
    default_fp8_layers = tuple(x for x in t5.FP8_LAYERS if x != "lm_head")
    smoke_overrides = (
        "data.source=synthetic",
        "data.path=null",
        "data.synthetic_pairs=400",
        "data.source_len=32",
        "data.target_len=32",
        "model.vocab_size=48",
        "model.d_model=32",
        "model.n_heads=2",
        "model.encoder_layers=1",
        "model.decoder_layers=1",
        "model.mlp_dim=64",
        "model.dropout=0.0",
        "train.batch_size=16",
    )

    def __init__(self, config: Config):
        super().__init__(config)
        # Jitted decoders by their arguments (``translator``), so each compiles once.
        self._translators: dict[tuple[Any, ...], tuple[t5.T5, Callable[..., jax.Array]]] = {}

    @classmethod
    def validate_config(cls, config: Config) -> None:
        m, d = config.model, config.data
        m.validate()
        for key in ("source_len", "target_len"):
            if getattr(d, key) < 2:
                raise ConfigError(f"data.{key}", f"expected >= 2 tokens, got {getattr(d, key)}")
        config_lib.positive("data.generate_pairs", d.generate_pairs)
        if (
            config.train.generate_every is not None
            and importlib.util.find_spec("sacrebleu") is None
        ):
            raise ConfigError(
                "train.generate_every",
                "BLEU needs sacrebleu: pip install 'hopperjax[translate]' (or leave it null)",
            )
        if d.subword_alpha < 0:
            raise ConfigError("data.subword_alpha", f"expected >= 0, got {d.subword_alpha}")
        if d.subword_alpha > 0 and d.tokenizer != "unigram":
            raise ConfigError(
                "data.subword_alpha",
                f"samples a unigram model's n-best segmentations; data.tokenizer is "
                f"{d.tokenizer!r} (use unigram, or subword_alpha=0)",
            )
        if not 2 <= d.subword_nbest <= 512:  # SentencePiece's n-best range
            raise ConfigError(
                "data.subword_nbest",
                f"expected 2-512 segmentations to sample from, got {d.subword_nbest}",
            )
        config_lib.positive("data.beams", d.beams)
        if d.length_penalty < 0:
            raise ConfigError("data.length_penalty", f"expected >= 0, got {d.length_penalty}")
        if not 0.0 <= d.label_smoothing < 1.0:
            raise ConfigError(
                "data.label_smoothing", f"expected 0 <= smoothing < 1, got {d.label_smoothing}"
            )
        if d.source == "files":
            if not d.path:
                raise ConfigError("data.path", "required when data.source is 'files'")
            if not Path(d.path).exists():
                raise ConfigError("data.path", not_found(d.path))
            if not Path(d.path).is_dir():
                raise ConfigError("data.path", f"not a directory: {d.path}")
        else:
            if d.path:
                raise ConfigError("data.path", "not used by data.source 'synthetic'")
            config_lib.positive("data.synthetic_pairs", d.synthetic_pairs)

    def build_model(self, policy: Policy, remat: RematConfig) -> t5.T5:
        return t5.T5(config=self.config.model, policy=policy, remat=remat)

    # ------------------------------------------------------------------------------------------
    # Data

    def _read(self) -> tuple[pt.Pairs, pt.Pairs]:
        d = self.config.data
        if d.source == "synthetic":
            n = d.synthetic_pairs
            return pt.synthetic_pairs(n, self.config.seed), pt.synthetic_pairs(
                max(1, n // 4), self.config.seed + 1
            )
        read = dict(bad_records=d.bad_records)
        return (
            pt.read_pairs(d.path, d.train_split, d.source_lang, d.target_lang, **read),
            pt.read_pairs(d.path, d.eval_split, d.source_lang, d.target_lang, **read),
        )

    def _tokenizer(self, train: pt.Pairs) -> pt.Tokenizer:
        """The run's saved tokenizer when it has one (a resumed run), else one trained now."""
        saved = self.config.run_path / TOKENIZER_FILE
        vocab = self.config.model.vocab_size
        if saved.is_file():
            tokenizer = pt.Tokenizer.load(saved)
            if tokenizer.vocab_size != vocab:
                raise ConfigError(
                    "model.vocab_size",
                    f"{vocab}, but {saved} (this run's tokenizer) has {tokenizer.vocab_size} "
                    "pieces; use the same size or a new run_dir",
                )
            return tokenizer
        return pt.train_tokenizer(
            [*train.sources, *train.targets],
            vocab_size=vocab,
            model_type=self.config.data.tokenizer,
        )

    def build_datasets(self, shard: ProcessShard) -> Datasets[TranslationMeta]:
        """This process's rows of every training batch (packed once, rows reshuffled every
        epoch; packed anew every epoch under ``data.subword_alpha``, whose meta figures are
        epoch 0's) and of the held-out split (packed in order, one pass, padded with empty rows to
        whole global batches).

        Raises ConfigError naming the key: bad files (``data.path``), a tokenizer that cannot be
        trained (``model.vocab_size``), or fewer training rows than one batch.
        """
        config, d = self.config, self.config.data
        t = config.train
        try:
            train, held = self._read()
        except DataError as e:
            raise ConfigError("data.path", str(e), name_key=False) from None
        try:
            tokenizer = self._tokenizer(train)
        except DataError as e:
            raise ConfigError("model.vocab_size", str(e)) from None
        lengths = dict(source_len=d.source_len, target_len=d.target_len)
        if d.subword_alpha > 0:
            source, packed = pt.Resampled.build(
                tokenizer, train, alpha=d.subword_alpha, nbest=d.subword_nbest,
                seed=config.seed, **lengths,
            )  # fmt: skip
        else:
            order = np.random.default_rng(config.seed).permutation(len(train))
            packed = pt.pack(
                tokenizer.encode(train.sources), tokenizer.encode(train.targets), order, **lengths
            )
            source = packed
        held_packed = pt.pack(
            tokenizer.encode(held.sources),
            tokenizer.encode(held.targets),
            np.arange(len(held)),
            **lengths,
        )
        if packed.rows < t.batch_size:
            raise ConfigError(
                "train.batch_size",
                f"larger than the {packed.rows} packed rows of the training split",
            )
        rows, index, count = shard.rows(t.batch_size), shard.index, shard.count
        train_ds = grain.MapDataset.source(
            EpochBatches(source, rows * count, rows, index * rows, config.seed, d.shuffle)
        )
        eval_batch = t.eval_batch_size or t.batch_size
        eval_rows = shard.rows(eval_batch)
        eval_ds = grain.MapDataset.source(
            EpochBatches(
                held_packed.padded(eval_batch),
                eval_rows * count,
                eval_rows,
                index * eval_rows,
                shuffle=False,
                epochs=1,
            )
        )
        meta = TranslationMeta(
            tokenizer=tokenizer.proto,
            train_pairs=len(train),
            eval_pairs=len(held),
            train_rows=packed.rows,
            padding=packed.padding,
            truncated=packed.truncated + held_packed.truncated,
            skipped=train.skipped + held.skipped,
            generate=held.head(d.generate_pairs),
        )
        return Datasets(train=train_ds, eval=eval_ds, meta=meta)

    def batch_fields(self, batch_size: int, datasets: Datasets | None) -> dict[str, Field]:
        d = self.config.data
        return {
            name: Field(
                (batch_size, d.source_len if name.startswith("source") else d.target_len),
                jnp.int32,
                ("batch", "length"),
            )
            for name in FIELDS
        }

    def model_inputs(self, batch: Any) -> tuple[Any, ...]:
        return tuple(batch[k] for k in FIELDS if k != "target")

    # ------------------------------------------------------------------------------------------
    # Loss and metrics

    def loss(self, outputs: jax.Array, batch: Any) -> jax.Array:
        """Mean cross-entropy over the real target tokens (padding slots count nothing)."""
        real = (batch["target_segments"] > 0).astype(jnp.float32)
        losses = cross_entropy(outputs, batch["target"], self.config.data.label_smoothing)
        return (losses * real).sum() / jnp.maximum(real.sum(), 1.0)

    def eval_outputs(self, outputs: jax.Array, batch: Any) -> dict[str, jax.Array]:
        """Sums over the real target tokens, so that means over many batches are exact."""
        real = batch["target_segments"] > 0
        losses = cross_entropy(outputs, batch["target"])
        correct = (jnp.argmax(outputs, axis=-1) == batch["target"]) & real
        return {
            "loss_sum": jnp.where(real, losses, 0.0).sum(),
            "correct": correct.sum().astype(jnp.float32),
            "tokens": real.sum().astype(jnp.float32),
        }

    def summarize(self, outputs: list[dict[str, np.ndarray]]) -> dict[str, float]:
        totals = {k: sum(float(o[k]) for o in outputs) for k in outputs[0]}
        tokens = max(totals["tokens"], 1.0)
        loss = totals["loss_sum"] / tokens
        return {
            "eval_loss": loss,
            "eval_accuracy": totals["correct"] / tokens,
            "eval_perplexity": math.exp(min(loss, 50.0)),
        }

    def model_flops_per_step(self, batch_size: int, datasets: Datasets | None) -> float:
        d = self.config.data
        return t5.train_flops_per_step(
            self.config.model, rows=batch_size, source_len=d.source_len, target_len=d.target_len
        )

    def examples_per_step(self, batch_size: int) -> int:
        return batch_size * self.config.data.target_len

    # ------------------------------------------------------------------------------------------
    # Decoding

    def translator(
        self, model: t5.T5, *, batch: int, max_len: int | None = None, beams: int = 1,
        length_penalty: float = 0.6, cache: bool = True,
    ) -> Callable[[dict[str, Any], np.ndarray], jax.Array]:  # fmt: skip
        """A jitted ``(variables, source ids [batch, source_len]) -> target ids [batch,
        max_len]``: one sentence per row (ids after the sentence's ``EOS_ID`` are padding);
        greedy with ``beams=1``, else beam search (``models/decoding.py``), one decoder position
        per step with a key-value cache (``cache=False``: the whole prefix every step, the
        reference the cache is tested against). The same arguments return the same function,
        so it compiles once per workload instance."""
        max_len = max_len or self.config.data.target_len
        key = (id(model), batch, max_len, beams, length_penalty, cache)
        known = self._translators.get(key)
        if known is not None and known[0] is model:
            return known[1]

        @jax.jit
        def run(variables: dict[str, Any], source: jax.Array) -> jax.Array:
            segments = (source != pt.PAD_ID).astype(jnp.int32)
            positions = jnp.broadcast_to(jnp.arange(source.shape[1]), source.shape)
            encoded = model.apply(variables, source, segments, positions, method=t5.T5.encode)
            rows = jnp.repeat(jnp.arange(batch), beams)
            encoded, segments = encoded[rows], segments[rows]
            if cache:
                stepper = self._cached_stepper(model, variables, encoded, segments, max_len)
            else:

                def logits_fn(inputs: jax.Array) -> jax.Array:
                    target_positions = jnp.broadcast_to(jnp.arange(max_len), inputs.shape)
                    return model.apply(
                        variables, encoded, segments, inputs, jnp.ones_like(inputs),
                        target_positions, method=t5.T5.decode,
                    )  # fmt: skip

                stepper = decoding.uncached(logits_fn)
            if beams == 1:
                return decoding.greedy(stepper, batch, max_len)
            return decoding.beam_search(
                stepper, batch, max_len, beams=beams, length_penalty=length_penalty
            )

        self._translators[key] = (model, run)
        return run

    @staticmethod
    def _cached_stepper(model, variables, encoded, segments, max_len) -> decoding.Stepper:
        rows = encoded.shape[0]
        kwargs = dict(method=t5.T5.decode_step, cache_len=max_len)
        probe = (jnp.zeros((rows, 1), jnp.int32), jnp.zeros((rows, 1), jnp.int32))
        shapes = jax.eval_shape(
            lambda: model.apply(variables, encoded, segments, *probe, mutable=["cache"], **kwargs)
        )[1]["cache"]
        cache = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)

        def step_fn(previous: jax.Array, position: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
            logits, mutated = model.apply(
                {**variables, "cache": cache}, encoded, segments, previous,
                jnp.full_like(previous, position), mutable=["cache"], **kwargs,
            )  # fmt: skip
            return logits, mutated["cache"]

        return decoding.cached(step_fn, cache)

    def translate(
        self, model: t5.T5, variables: dict[str, Any], tokenizer: pt.Tokenizer,
        sentences: list[str], *, batch: int = 32, beams: int = 1, length_penalty: float = 0.6,
    ) -> list[str]:  # fmt: skip
        """``sentences`` translated, ``batch`` at a time (the last batch padded)."""
        run = self.translator(model, batch=batch, beams=beams, length_penalty=length_penalty)
        source_len = self.config.data.source_len
        out = []
        for start in range(0, len(sentences), batch):
            chunk = sentences[start : start + batch]
            ids = np.zeros((batch, source_len), np.int32)
            for row, encoded in enumerate(tokenizer.encode(chunk)):
                encoded = encoded[:source_len]
                encoded[-1] = pt.EOS_ID
                ids[row, : len(encoded)] = encoded
            # All processes decode the same sentences; the result may span their devices.
            result = np.asarray(multihost_utils.process_allgather(run(variables, ids), tiled=True))
            out.extend(tokenizer.decode(result[row]) for row in range(len(chunk)))
        return out

    def generation_metrics(
        self, model: t5.T5, variables: dict[str, Any], datasets: Datasets[TranslationMeta]
    ) -> dict[str, float]:
        """``eval_bleu`` and ``eval_chrf`` (sacrebleu) of the first ``data.generate_pairs``
        held-out pairs, translated by beam search (``data.beams``, ``data.length_penalty``)."""
        d, meta = self.config.data, datasets.meta
        tokenizer = pt.Tokenizer(meta.tokenizer, name=TOKENIZER_FILE)
        batch = min(self.config.train.eval_batch_size or self.config.train.batch_size, 64)
        hypotheses = self.translate(
            model, variables, tokenizer, list(meta.generate.sources), batch=batch,
            beams=d.beams, length_penalty=d.length_penalty,
        )  # fmt: skip
        scores = translation_scores(hypotheses, list(meta.generate.targets))
        return {"eval_bleu": scores["bleu"], "eval_chrf": scores["chrf"]}

    def next_commands(self, run_dir: Path) -> list[str]:
        where = shlex.quote(str(run_dir))
        return [f"python -m hopperjax.translate --run-dir {where} --input SENTENCES.txt"]

    def write_artifacts(self, datasets: Datasets, run_dir: Path, *, resuming: bool) -> None:
        """The run's tokenizer (``spm.model``); a run that resumes keeps the one it has."""
        path = run_dir / TOKENIZER_FILE
        if path.is_file() and path.read_bytes() == datasets.meta.tokenizer:
            return
        if resuming and path.is_file():
            raise ConfigError(
                "data.path",
                f"{path} differs from the tokenizer this run would use; use a new run_dir",
            )
        pt.Tokenizer(datasets.meta.tokenizer, name=str(path)).save(path)


WORKLOAD = Translation
