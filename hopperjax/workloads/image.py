"""Image classification: uint8 images in, class logits out (ResNet-9/18/34/50).

Data: image folders, CIFAR-10's binary or python release, or generated images
(``data/images.py``), decoded once on the host and batched as uint8. Augmentation runs on the
device inside the jitted step (``preprocess``): random crop of the reflect-padded image, horizontal
flip, cutout, then normalization; eval normalizes only (optionally averaging the logits of the
image and its mirror). Model: ``models/resnet.py``. Eval reports loss and top-1 accuracy over
every held-out image (the last batch is padded with masked rows, never dropped).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hopperjax import config as config_lib
from hopperjax.config import Config, ConfigError, RematConfig
from hopperjax.data import EpochBatches, image_shards
from hopperjax.data import images as image_data
from hopperjax.data.datasets import not_found
from hopperjax.data.errors import DataError
from hopperjax.models import resnet
from hopperjax.precision import Policy
from hopperjax.workloads.base import (
    Datasets,
    Field,
    ProcessShard,
    Workload,
    cross_entropy,
    path_labels,
)

SOURCES_WITH_PATH = ("folder", "cifar_binary", "cifar_python", "shards")
FROZEN = "frozen"  # param_labels: not trained (airbench's whitening filters)
NORM_BIAS = "norm_bias"  # param_labels: BatchNorm biases at model.bn_bias_lr_scale x the LR


@dataclasses.dataclass(frozen=True)
class ImageData(config_lib.DataConfig):
    """The ``data:`` group of image classification.

    ``source``: ``folder`` (``path/<split>/<class>/*.jpg|png``), ``cifar_binary``
    (``cifar-10-batches-bin``), ``cifar_python`` (``cifar-10-batches-py``), ``shards`` (a
    directory of ``tools/convert_images.py``: decoded pixels in ArrayRecord shards, never
    decoded again; read into memory at start, or a batch at a time with ``preload: false``) or
    ``synthetic``
    (``synthetic_images`` generated training images of ``synthetic_classes`` classes, a quarter
    as many held out). ``image_size``: the side of every (square) image; a folder image of
    another size is a bad record. ``train_split`` / ``eval_split``: the folders of a folder
    source, the splits of a shard directory. ``bad_records``: ``error`` (one line naming the
    file) or ``skip`` (counted).
    ``mean`` / ``std``: per-channel normalization of pixels scaled to [0, 1] (defaults: measured
    on the training images of ``data/cifar10``). ``crop_padding``: pixels of reflect
    padding before the random crop (0: no crop); ``flip``: random horizontal flips; ``cutout``:
    side of a random square set to the mean
    (0: off); ``tta_flip``: eval averages the logits of each image and its mirror.
    ``tta_translate``: eval also averages over the image shifted by this many pixels (reflect
    padded) up-left and down-right, each with its mirror when ``tta_flip``: the centre weighs
    half, the two shifts a quarter each (airbench's multi-crop; 0: off).
    ``label_smoothing``: of the cross-entropy targets (training loss only).
    ``resize``: folder images of any shape are scaled (shorter side to ``image_size``) and
    centre-cropped square on the host. ``preload``: decode every image when the run starts (in
    threads), or read every record of a shard directory into memory; false decodes each image
    (reads each record) when the pipeline reads it, in ``workers`` processes, for image sets
    larger than host memory. ``augment``: ``crop`` (the padded random crop above) or
    ``resized_crop`` (Inception-style: a random box of 8-100 % of the area and aspect 3/4-4/3,
    resized to ``crop_size``; eval takes the centre ``crop_size`` square). ``crop_size``: the
    side the model sees (default ``image_size``; with ``crop`` it must be ``image_size``).
    """

    source: Literal["folder", "cifar_binary", "cifar_python", "shards", "synthetic"] = "folder"
    path: str | None = None
    image_size: int = 32
    train_split: str = "train"
    eval_split: str = "test"
    bad_records: Literal["error", "skip"] = "error"
    synthetic_images: int = 2048
    synthetic_classes: int = 10
    mean: str = "0.4913,0.4821,0.4465"
    std: str = "0.2452,0.2428,0.2606"
    crop_padding: int = 4
    flip: bool = True
    cutout: int = 0
    tta_flip: bool = False
    tta_translate: int = 0
    label_smoothing: float = 0.0
    resize: bool = False
    preload: bool = True
    augment: Literal["crop", "resized_crop"] = "crop"
    crop_size: int | None = None

    @property
    def input_size(self) -> int:
        """The side of the images the model sees."""
        return self.crop_size or self.image_size

    def channel_stats(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(mean, std), three floats each. Raises ConfigError naming the key."""
        out = []
        for key in ("mean", "std"):
            text = getattr(self, key)
            try:
                values = tuple(float(v) for v in str(text).split(","))
            except ValueError:
                values = ()
            if len(values) != 3 or (key == "std" and min(values) <= 0):
                raise ConfigError(
                    f"data.{key}",
                    f"expected three comma-separated {'positive ' if key == 'std' else ''}"
                    f"numbers (R, G, B), got {config_lib.shown(text)}",
                )
            out.append(values)
        return out[0], out[1]


@dataclasses.dataclass(frozen=True)
class ImageMeta:
    """What a run's images are: class names, split sizes, bad images skipped."""

    classes: tuple[str, ...]
    train_images: int
    eval_images: int
    skipped: int = 0


class ImageClassification(Workload):
    ModelConfig = resnet.ResNetConfig
    DataConfig = ImageData
    examples_name = "images"
    mutable = ("batch_stats",)
    smoke_overrides = (
        "model.arch=resnet9",
        "model.width=4",
        "data.source=synthetic",
        "data.path=null",
        "data.synthetic_images=256",
        "data.preload=true",
        "data.resize=false",
        "data.augment=crop",
        "data.crop_size=null",
        "train.batch_size=16",
    )

    @classmethod
    def validate_config(cls, config: Config) -> None:
        m, d = config.model, config.data
        m.validate()
        if m.bn_bias_lr_scale != 1.0 and config.optim.name != "sgd":
            raise ConfigError(
                "model.bn_bias_lr_scale", f"needs optim.name=sgd, got {config.optim.name}"
            )
        config_lib.positive("data.image_size", d.image_size)
        d.channel_stats()
        if not 0 <= d.crop_padding < d.image_size:
            raise ConfigError(
                "data.crop_padding",
                f"expected 0 <= padding < data.image_size, got {d.crop_padding}",
            )
        if not 0 <= d.cutout <= d.image_size:
            raise ConfigError(
                "data.cutout", f"expected 0 <= cutout <= data.image_size, got {d.cutout}"
            )
        if not 0 <= d.tta_translate < d.image_size:
            raise ConfigError(
                "data.tta_translate",
                f"expected 0 <= shift < data.image_size, got {d.tta_translate}",
            )
        if not 0.0 <= d.label_smoothing < 1.0:
            raise ConfigError(
                "data.label_smoothing", f"expected 0 <= smoothing < 1, got {d.label_smoothing}"
            )
        if d.crop_size is not None:
            config_lib.positive("data.crop_size", d.crop_size)
            if d.crop_size > d.image_size or (d.augment == "crop" and d.crop_size != d.image_size):
                raise ConfigError(
                    "data.crop_size",
                    f"expected <= data.image_size={d.image_size} with data.augment=resized_crop, "
                    f"and = it with data.augment=crop; got {d.crop_size}",
                )
        if not d.preload:
            if d.source not in ("folder", "shards"):
                raise ConfigError("data.preload", "false needs data.source=folder or shards")
            if d.bad_records == "skip":
                raise ConfigError(
                    "data.bad_records",
                    "skip needs data.preload=true (images decoded when read cannot be left out)",
                )
        if d.resize and d.source != "folder":
            raise ConfigError("data.resize", "true needs data.source=folder")
        if d.source in SOURCES_WITH_PATH:
            if not d.path:
                raise ConfigError("data.path", f"required when data.source is '{d.source}'")
            if not Path(d.path).exists():
                raise ConfigError("data.path", not_found(d.path))
            if not Path(d.path).is_dir():
                raise ConfigError("data.path", f"not a directory: {d.path}")
            if d.source.startswith("cifar") and d.image_size != image_data.CIFAR_SIDE:
                raise ConfigError(
                    "data.image_size", f"CIFAR-10 images are 32x32, got {d.image_size}"
                )
        else:
            if d.path:
                raise ConfigError("data.path", "not used by data.source 'synthetic'")
            config_lib.positive("data.synthetic_images", d.synthetic_images)
            config_lib.positive("data.synthetic_classes", d.synthetic_classes)

    def build_model(self, policy: Policy, remat: RematConfig) -> resnet.ResNet:
        """The network; airbench's whitening filters are the training images' once
        ``build_datasets`` has read them, else identity patches (restore and export take the
        trained values from the checkpoint)."""
        return resnet.ResNet(
            config=self.config.model, policy=policy, remat=remat, whitening=self._whitening
        )

    _whitening: tuple[float, ...] | None = None

    def _fit_whitening(self, train: Any) -> None:
        """airbench: its whitening filters from ``model.whiten_images`` training images (a
        sample seeded by ``seed``; with several processes, process 0's filters)."""
        m = self.config.model
        count = min(m.whiten_images, len(train))
        order = np.sort(np.random.default_rng(self.config.seed).permutation(len(train))[:count])
        mean, std = self.config.data.channel_stats()
        images = train.batch(order)["images"]
        filters = resnet.whitening_filters(images, mean, std, m.whiten_eps)
        if jax.process_count() > 1:
            # Process 0's filters everywhere: another host's LAPACK may round, or choose an
            # eigenvector's sign, differently, and the replicated kernel must be one kernel.
            from jax.experimental import multihost_utils

            agreed = multihost_utils.broadcast_one_to_all(np.asarray(filters, np.float32))
            filters = tuple(float(v) for v in np.asarray(agreed))
        self._whitening = filters

    def param_labels(self, params: Any) -> Any | None:
        """airbench's whitening kernel is frozen; with ``model.bn_bias_lr_scale`` other than 1,
        BatchNorm biases are a group of their own."""
        m = self.config.model
        if m.arch != "airbench" and m.bn_bias_lr_scale == 1.0:
            return None

        def label(path: tuple[str, ...]) -> str:
            if path[-2:] == ("whiten", "kernel"):
                return FROZEN
            if m.bn_bias_lr_scale != 1.0 and path[-1] == "bias" and path[-2].startswith("bn"):
                return NORM_BIAS
            return "default"

        return path_labels(params, label)

    def group_optimizers(self, schedule: optax.Schedule) -> dict[str, Any]:
        """BatchNorm biases: the configured SGD at ``bn_bias_lr_scale`` x the learning rate,
        with the weight decay divided by it (the decay per step, lr x wd, stays the configured
        one, as in airbench's PyTorch parameter groups)."""
        o, m = self.config.optim, self.config.model
        groups: dict[str, Any] = {FROZEN: optax.set_to_zero()}
        if m.bn_bias_lr_scale != 1.0:
            scale = m.bn_bias_lr_scale
            groups[NORM_BIAS] = optax.chain(
                optax.add_decayed_weights(o.weight_decay / scale),
                optax.sgd(lambda step: scale * schedule(step), momentum=o.momentum,
                          nesterov=o.nesterov),
            )  # fmt: skip
        return groups

    def _read(self) -> tuple[Any, Any]:
        """(train, held-out): ``ImageSet``s, or with ``data.preload`` false ``ImageFiles``
        (folders) or ``image_shards.ImageRecords`` (shards)."""
        d = self.config.data
        try:
            if d.source == "synthetic":
                n, classes = d.synthetic_images, d.synthetic_classes
                seed = self.config.seed
                return (
                    image_data.synthetic(n, d.image_size, classes, seed),
                    image_data.synthetic(max(1, n // 4), d.image_size, classes, seed + 1),
                )
            if d.source == "shards":
                train = image_shards.read_image_shards(d.path, d.train_split)
                held = image_shards.read_image_shards(d.path, d.eval_split)
                side = d.image_size
                if train.shape != (side, side, 3):
                    raise ConfigError(
                        "data.image_size",
                        f"the shards in {d.path} hold {train.shape} images, expected "
                        f"({side}, {side}, 3)",
                    )
                return (train.load(), held.load()) if d.preload else (train, held)
            if d.source == "folder":
                read = dict(skip_bad=d.bad_records == "skip", resize=d.resize, preload=d.preload)
                train = image_data.read_folder(d.path, d.train_split, d.image_size, **read)
                held = image_data.read_folder(
                    d.path, d.eval_split, d.image_size, classes=train.classes, **read
                )
                return train, held
            binary = d.source == "cifar_binary"
            return (
                image_data.read_cifar(d.path, "train", binary=binary),
                image_data.read_cifar(d.path, "test", binary=binary),
            )
        except DataError as e:
            raise ConfigError("data.path", str(e), name_key=False) from None

    def build_datasets(self, shard: ProcessShard) -> Datasets[ImageMeta]:
        """This process's slice of the training images (shuffled every epoch, repeated) and of
        the held-out images (one pass in a fixed shuffled order, padded to whole global batches
        with masked rows).

        Raises ConfigError naming the key: a bad image (``data.path``), more classes than
        ``model.num_classes``, or a training split smaller than one batch.
        """
        config = self.config
        train_cfg = config.train
        eval_batch = train_cfg.eval_batch_size or train_cfg.batch_size
        train, held = self._read()
        if config.model.arch == "airbench":
            self._fit_whitening(train)
        if len(train.classes) > config.model.num_classes:
            raise ConfigError(
                "model.num_classes",
                f"the data has {len(train.classes)} classes, got {config.model.num_classes}",
            )
        if len(train) < train_cfg.batch_size:
            raise ConfigError(
                "train.batch_size",
                f"larger than the {len(train)} training images of the data",
            )
        index, count = shard.index, shard.count
        rows = shard.rows(train_cfg.batch_size)
        train_ds = grain.MapDataset.source(
            EpochBatches(
                train,
                global_batch=rows * count,
                rows=rows,
                offset=index * rows,
                seed=config.seed,
                shuffle=config.data.shuffle,
            )
        )
        # Folders list the held-out images class by class: a fixed permutation makes any prefix
        # (``train.eval_batches``) a fair sample of every class.
        held = held.take(np.random.default_rng(0).permutation(len(held)))
        eval_rows = shard.rows(eval_batch)
        eval_ds = grain.MapDataset.source(
            EpochBatches(
                held.padded(eval_batch),
                global_batch=eval_rows * count,
                rows=eval_rows,
                offset=index * eval_rows,
                shuffle=False,
                epochs=1,
            )
        )
        meta = ImageMeta(train.classes, len(train), len(held), train.skipped + held.skipped)
        return Datasets(train=train_ds, eval=eval_ds, meta=meta)

    def batch_fields(self, batch_size: int, datasets: Datasets | None) -> dict[str, Field]:
        side = self.config.data.image_size
        return {
            "images": Field((batch_size, side, side, 3), jnp.uint8, ("batch", None, None, None)),
            "labels": Field((batch_size,), jnp.int32, ("batch",)),
        }

    def axis_rules(self) -> tuple[tuple[str, Any], ...]:
        return (("conv_in", "fsdp"), ("conv_out", "tensor"))

    # ------------------------------------------------------------------------------------------
    # On-device preprocessing

    def preprocess(self, batch: Any, rng: jax.Array, *, train: bool) -> Any:
        """uint8 [B, H, W, 3] -> normalized fp32, augmented when ``train`` (one key per example,
        from the step's key: the same augmentation on resume)."""
        d = self.config.data
        x = batch["images"]
        side = d.input_size
        if train:
            crop_key, flip_key, cut_key = jax.random.split(rng, 3)
            keys = jax.random.split(crop_key, x.shape[0])
            if d.augment == "resized_crop":
                x = jax.vmap(lambda img, k: _random_resized_crop(img, k, side))(x, keys)
            elif d.crop_padding:
                x = jax.vmap(lambda img, k: _random_crop(img, k, d.crop_padding))(x, keys)
            if d.flip:
                flips = jax.random.bernoulli(flip_key, 0.5, (x.shape[0],))
                x = jnp.where(flips[:, None, None, None], x[:, :, ::-1], x)
        elif side < x.shape[1]:  # eval: the centre square the model sees
            top, left = (x.shape[1] - side) // 2, (x.shape[2] - side) // 2
            x = x[:, top : top + side, left : left + side]
        mean, std = d.channel_stats()
        x = (x.astype(jnp.float32) / 255.0 - jnp.asarray(mean)) / jnp.asarray(std)
        if train and d.cutout:
            x = _cutout(x, cut_key, d.cutout)
        return {**batch, "images": x}

    def model_inputs(self, batch: Any) -> tuple[Any, ...]:
        return (batch["images"],)

    def predict(self, model: Any, variables: dict[str, Any], batch: Any) -> jax.Array:
        d = self.config.data

        def view(x: jax.Array) -> jax.Array:  # the logits of x, averaged with its mirror's
            logits = model.apply(variables, x, deterministic=True)
            if d.tta_flip:
                logits = (logits + model.apply(variables, x[:, :, ::-1], deterministic=True)) / 2
            return logits

        x = batch["images"]
        logits = view(x)
        if d.tta_translate:
            s = d.tta_translate
            height, width = x.shape[1:3]
            padded = jnp.pad(x, ((0, 0), (s, s), (s, s), (0, 0)), mode="reflect")
            shifted = [padded[:, :height, :width], padded[:, 2 * s :, 2 * s :]]
            logits = logits / 2 + sum(view(v) for v in shifted) / 4
        return logits

    # ------------------------------------------------------------------------------------------
    # Loss and metrics

    def loss(self, outputs: jax.Array, batch: Any) -> jax.Array:
        return cross_entropy(outputs, batch["labels"], self.config.data.label_smoothing).mean()

    def eval_outputs(self, outputs: jax.Array, batch: Any) -> dict[str, jax.Array]:
        """Sums over the real (label >= 0) images of the batch; padding rows count nothing."""
        labels = batch["labels"]
        real = labels >= 0
        loss = cross_entropy(outputs, jnp.maximum(labels, 0))
        correct = (jnp.argmax(outputs, axis=-1) == labels) & real
        return {
            "loss_sum": jnp.where(real, loss, 0.0).sum(),
            "correct": correct.sum().astype(jnp.float32),
            "images": real.sum().astype(jnp.float32),
        }

    def summarize(self, outputs: list[dict[str, np.ndarray]]) -> dict[str, float]:
        totals = {k: sum(float(o[k]) for o in outputs) for k in outputs[0]}
        seen = max(totals["images"], 1.0)
        return {"eval_loss": totals["loss_sum"] / seen, "eval_accuracy": totals["correct"] / seen}

    def model_flops_per_step(self, batch_size: int, datasets: Datasets | None) -> float:
        return resnet.train_flops_per_step(
            self.config.model, batch_size=batch_size, image_size=self.config.data.input_size
        )

    def examples_per_step(self, batch_size: int) -> int:
        return batch_size


def _random_crop(image: jax.Array, key: jax.Array, padding: int) -> jax.Array:
    """A random ``H x W`` window of ``image`` reflect-padded by ``padding`` on each side."""
    height, width, channels = image.shape
    padded = jnp.pad(image, ((padding, padding), (padding, padding), (0, 0)), mode="reflect")
    top, left = jax.random.randint(key, (2,), 0, 2 * padding + 1)
    return jax.lax.dynamic_slice(padded, (top, left, 0), (height, width, channels))


def _random_resized_crop(image: jax.Array, key: jax.Array, side: int) -> jax.Array:
    """A random box of 8-100 % of ``image``'s area and aspect ratio 3/4-4/3, resized to
    ``side x side`` (antialiased bilinear) -> fp32 pixels in 0..255."""
    size = image.shape[0]
    area_key, aspect_key, top_key, left_key = jax.random.split(key, 4)
    area = jax.random.uniform(area_key, (), minval=0.08, maxval=1.0) * size * size
    log_aspect = jax.random.uniform(aspect_key, (), minval=jnp.log(3 / 4), maxval=jnp.log(4 / 3))
    aspect = jnp.exp(log_aspect)
    width = jnp.clip(jnp.sqrt(area * aspect), 1.0, size)
    height = jnp.clip(jnp.sqrt(area / aspect), 1.0, size)
    top = jax.random.uniform(top_key, ()) * (size - height)
    left = jax.random.uniform(left_key, ()) * (size - width)
    scale = jnp.stack([side / height, side / width])
    return jax.image.scale_and_translate(
        image.astype(jnp.float32), (side, side, image.shape[2]), (0, 1), scale,
        -jnp.stack([top, left]) * scale, method="linear", antialias=True,
    )  # fmt: skip


def _cutout(x: jax.Array, key: jax.Array, size: int) -> jax.Array:
    """Each image gets a ``size x size`` square (centre uniform over the image, clipped at the
    borders) set to 0: the channel mean after normalization."""
    batch, height, width, _ = x.shape
    centre = jax.random.randint(key, (batch, 2), 0, jnp.array([height, width]))
    rows = jnp.arange(height)[None, :] - (centre[:, :1] - size // 2)
    cols = jnp.arange(width)[None, :] - (centre[:, 1:] - size // 2)
    inside = ((rows >= 0) & (rows < size))[:, :, None] & ((cols >= 0) & (cols < size))[:, None, :]
    return jnp.where(inside[..., None], 0.0, x)


WORKLOAD = ImageClassification
