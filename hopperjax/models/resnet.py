"""ResNets for image classification: ResNet-18/34/50 (v1.5), the small, fast ResNet-9, and the
airbench network (no residuals; faster still).

NHWC throughout. Convolutions and the classifier compute in the policy's dtype on fp32 master
weights; BatchNorm keeps its statistics and normalization arithmetic in fp32 whatever the compute
dtype (Flax reduces in fp32 and the statistics are fp32 variables), and computes them over the
global batch: under the jitted SPMD step the mean over the batch axis spans every device.

- ``resnet18`` / ``resnet34``: basic blocks (two 3x3 convolutions); ``resnet50``: bottleneck
  blocks (1x1, 3x3, 1x1 with 4x expansion), stride on the 3x3 (v1.5).
- ``stem``: ``imagenet`` (7x7 stride-2 convolution, 3x3 stride-2 max pool) or ``cifar`` (one 3x3
  stride-1 convolution: 32x32 inputs keep their resolution).
- ``resnet9``: the DAWNBench CIFAR-10 network (Page, 2018): prep convolution, three stages that
  each double the width and max-pool, residual pairs after the first and third, a global max
  pool and a classifier whose logits are scaled by ``logit_scale`` (0.125 in its recipe). Its
  stem is its own (``stem`` is ignored).
- ``airbench``: the network of Jordan's airbench94 (2024, after tysam-code's hlb-CIFAR10): a
  frozen 2x2 whitening convolution (24 filters: the training patches' covariance eigenvectors
  scaled by 1 / sqrt(eigenvalue), and their negatives; its bias trains), GELU, then three
  groups of (3x3 convolution, 2x2 max pool, BatchNorm, GELU, 3x3 convolution, BatchNorm,
  GELU) of ``width``, ``4 width``, ``4 width`` channels, a global max pool and a bias-free
  classifier scaled by ``logit_scale`` (1/9 in its recipe). Its BatchNorms have no scale
  (fixed at 1). The whitening filters come from data (``whitening_filters``, computed by the
  workload from the training images); a model built without them (restore, export, inspect)
  starts from identity patches and takes the trained values from the checkpoint.

``zero_init_residual`` starts each ResNet-18/34/50 block's last BatchNorm scale at 0, so every
residual block begins as the identity (Goyal et al. 2017); ResNet-9's branches end in a ReLU and
keep theirs (see ``Residual``). Convolution kernels carry the logical axes
``conv_in`` / ``conv_out`` (the workload maps them to mesh axes); the stem's 3 input channels
are never split.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hopperjax import config as config_lib
from hopperjax.config import ConfigError, RematConfig
from hopperjax.memory.remat import remat_block
from hopperjax.models import layers
from hopperjax.precision import Policy

AIRBENCH_WIDTHS = (1, 4, 4)  # channels of airbench's three groups, in units of ``width``
WHITEN_KERNEL = 2  # the side of airbench's whitening patches
ARCHS = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3), "resnet50": (3, 4, 6, 3)}
BOTTLENECK = {"resnet50"}
EXPANSION = 4  # bottleneck output channels / inner channels
STAGE_STRIDES = (1, 2, 2, 2)
TRAIN = (2,)  # every block is called as block(x, train): train is a Python bool (remat: static)


@dataclasses.dataclass(frozen=True)
class ResNetConfig(config_lib.ModelConfig):
    """The ``model:`` group of image classification.

    ``arch``: ``resnet9``, ``resnet18``, ``resnet34``, ``resnet50``. ``width``: channels of the
    first stage (64 in the papers; every stage scales with it). ``stem``: ``cifar`` or
    ``imagenet`` (ResNet-18/34/50). ``num_classes``: classifier outputs. ``bn_momentum`` /
    ``bn_eps``: BatchNorm running-average decay and epsilon. ``logit_scale``: multiplies the
    logits (ResNet-9's recipe uses 0.125). ``init``: the kernels' initializer, ``he``
    (convolutions normal with variance 2 / fan-out, He et al. 2015 and torchvision's ResNets;
    the classifier LeCun normal) or ``torch`` (PyTorch's layer default for both, uniform with
    variance 1 / (3 fan-in), ~2.4x smaller in std for a square 3x3 layer). Behind BatchNorm
    the scale sets no activation, but it sets the effective learning rate (a weight's update
    relative to its norm): with weight decay a recipe tuned in PyTorch with its default
    initializer (ResNet-9's) trains differently from the He start. ``dirac``: ``torch``, then
    each convolution's first ``min(in, out)`` filters are the identity (a delta at the centre
    on their own input channel), so every layer starts close to passing its input on
    (airbench's initializer).
    ``whiten_images`` / ``whiten_eps``: airbench's whitening filters come from the 2x2 patches of
    this many training images (a seeded sample), eigenvalues floored by ``whiten_eps``.
    ``bn_bias_lr_scale``: other than 1, BatchNorm biases are a group of their own at this
    multiple of the learning rate, and decayed (biases are not otherwise) with the weight decay
    divided by it, so that lr x wd per step is the kernels': airbench's 64.
    """

    arch: Literal["resnet9", "resnet18", "resnet34", "resnet50", "airbench"] = "resnet18"
    width: int = 64
    stem: Literal["cifar", "imagenet"] = "cifar"
    num_classes: int = 10
    bn_momentum: float = 0.9
    bn_eps: float = 1e-5
    zero_init_residual: bool = True
    logit_scale: float = 1.0
    init: Literal["he", "torch", "dirac"] = "he"
    whiten_images: int = 5000
    whiten_eps: float = 5e-4
    bn_bias_lr_scale: float = 1.0

    def validate(self) -> None:
        """Raises ConfigError naming the ``model.*`` key of the first bad value."""
        for key in ("width", "num_classes", "bn_eps", "logit_scale", "whiten_images",
                    "whiten_eps", "bn_bias_lr_scale"):  # fmt: skip
            config_lib.positive(f"model.{key}", getattr(self, key))
        if not 0.0 <= self.bn_momentum < 1.0:
            raise ConfigError(
                "model.bn_momentum", f"expected 0 <= momentum < 1, got {self.bn_momentum}"
            )


# ---------------------------------------------------------------------------------------------
# Layers


def _kernel_init(scheme: str) -> Any:
    if scheme in ("torch", "dirac"):  # PyTorch's Conv2d / Linear default: kaiming_uniform(a=√5)
        torch_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")
        return _dirac(torch_init) if scheme == "dirac" else torch_init
    return nn.initializers.variance_scaling(2.0, "fan_out", "normal")  # He init, fan-out


def _dirac(base: Any) -> Any:
    """``base``, with a convolution kernel's [kh, kw, in, out] first ``min(in, out)`` filters
    replaced by the identity (1 at the centre tap of their own input channel). A dense kernel
    (2-D) keeps ``base``."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        kernel = base(key, shape, dtype)
        if len(shape) != 4:
            return kernel
        kh, kw, cin, cout = shape
        n = min(cin, cout)
        eye = jnp.zeros((kh, kw, cin, n), dtype).at[kh // 2, kw // 2, :n, :n].set(jnp.eye(n))
        return kernel.at[..., :n].set(eye)

    return init


def _conv(features: int, kernel: int, stride: int, policy: Policy, name: str, *, split_in=True,
          scheme: str = "he"):  # fmt: skip
    init = _kernel_init(scheme)
    axes = (None, None, "conv_in" if split_in else None, "conv_out")
    return layers.conv(
        policy,
        features,
        (kernel, kernel),
        strides=(stride, stride),
        padding=[(kernel // 2, kernel // 2)] * 2,
        use_bias=False,
        kernel_init=nn.with_logical_partitioning(init, axes),
        name=name,
    )


def _norm(config: ResNetConfig, policy: Policy, name: str, *, zero: bool = False,
          scale: bool = True):  # fmt: skip
    return nn.BatchNorm(
        momentum=config.bn_momentum,
        epsilon=config.bn_eps,
        dtype=policy.compute_dtype,
        param_dtype=jnp.float32,
        use_scale=scale,
        scale_init=nn.with_logical_partitioning(
            nn.initializers.zeros if zero else nn.initializers.ones, ("conv_out",)
        ),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("conv_out",)),
        name=name,
    )


class ConvBN(nn.Module):
    """Convolution, BatchNorm, then ReLU unless ``relu`` is false."""

    features: int
    kernel: int
    stride: int
    config: ResNetConfig
    policy: Policy
    relu: bool = True
    zero_scale: bool = False
    split_in: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = _conv(self.features, self.kernel, self.stride, self.policy, "conv",
                  split_in=self.split_in, scheme=self.config.init)(x)  # fmt: skip
        x = _norm(self.config, self.policy, "bn", zero=self.zero_scale)(
            x, use_running_average=not train
        )
        return nn.relu(x) if self.relu else x


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut (a strided 1x1 convolution where the shape changes)."""

    features: int
    stride: int
    config: ResNetConfig
    policy: Policy

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        c, p = self.config, self.policy
        y = ConvBN(self.features, 3, self.stride, c, p, name="a")(x, train)
        y = ConvBN(self.features, 3, 1, c, p, relu=False, zero_scale=c.zero_init_residual,
                   name="b")(y, train)  # fmt: skip
        if self.stride != 1 or x.shape[-1] != self.features:
            x = ConvBN(self.features, 1, self.stride, c, p, relu=False, name="shortcut")(x, train)
        return nn.relu(x + y)


class Bottleneck(nn.Module):
    """1x1 down, 3x3 (carrying the stride: v1.5), 1x1 up to ``4 x features``; a shortcut."""

    features: int
    stride: int
    config: ResNetConfig
    policy: Policy

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        c, p = self.config, self.policy
        out = self.features * EXPANSION
        y = ConvBN(self.features, 1, 1, c, p, name="a")(x, train)
        y = ConvBN(self.features, 3, self.stride, c, p, name="b")(y, train)
        y = ConvBN(out, 1, 1, c, p, relu=False, zero_scale=c.zero_init_residual, name="c")(y, train)
        if self.stride != 1 or x.shape[-1] != out:
            x = ConvBN(out, 1, self.stride, c, p, relu=False, name="shortcut")(x, train)
        return nn.relu(x + y)


class Residual(nn.Module):
    """ResNet-9's residual pair: x + relu(bn(conv(relu(bn(conv(x)))))).

    Its branch ends in a ReLU, so ``zero_init_residual`` does not apply here: a zero BatchNorm
    scale and bias there would give the ReLU only zeros, whose gradient is zero, and the branch
    would never train."""

    features: int
    config: ResNetConfig
    policy: Policy

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        c, p = self.config, self.policy
        y = ConvBN(self.features, 3, 1, c, p, name="a")(x, train)
        return x + ConvBN(self.features, 3, 1, c, p, name="b")(y, train)


class ConvGroup(nn.Module):
    """airbench's group: conv, 2x2 max pool, BatchNorm, GELU, conv, BatchNorm, GELU. Its
    BatchNorms have no scale."""

    features: int
    config: ResNetConfig
    policy: Policy

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        c, p = self.config, self.policy
        for i in range(2):
            x = _conv(self.features, 3, 1, p, f"conv{i}", scheme=c.init)(x)
            if i == 0:
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
            norm = _norm(c, p, f"bn{i}", scale=False)
            x = nn.gelu(norm(x, use_running_average=not train), approximate=False)
        return x


def identity_patches(channels: int = 3) -> jax.Array:
    """Whitening filters [k, k, channels, 2 * k * k * channels] that pass each patch value on
    (and its negative): the stand-in a model built without training images starts from."""
    k = WHITEN_KERNEL
    eye = jnp.eye(k * k * channels).reshape(k, k, channels, -1)
    return jnp.concatenate([eye, -eye], axis=-1)


def whitening_filters(images: Any, mean: Any, std: Any, eps: float) -> tuple:
    """airbench's whitening filters from uint8 images [N, H, W, C]: the eigenvectors of the
    (uncentred) covariance of every 2x2 patch of the normalized images, each divided by
    sqrt(its eigenvalue + ``eps``), largest first, then their negatives. Returns the
    [k, k, C, 2 k k C] kernel's values, flattened, as a tuple of floats (a hashable module
    attribute)."""
    k = WHITEN_KERNEL
    mean, std = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    n, h, w, c = np.shape(images)
    dims = k * k * c
    moment = np.zeros((dims, dims), np.float64)
    for start in range(0, n, 500):  # 500 images' patches at a time (~60 MB at 32x32), not all
        part = (np.asarray(images[start : start + 500], np.float32) / 255.0 - mean) / std
        patches = np.stack(
            [part[:, i : h - k + 1 + i, j : w - k + 1 + j] for i in range(k) for j in range(k)],
            axis=3,
        )  # [b, h', w', k*k, c]: the kernel's (row, column, channel) order once flattened
        flat = patches.reshape(-1, dims).astype(np.float64)
        moment += flat.T @ flat
    moment /= n * (h - k + 1) * (w - k + 1)
    values, vectors = np.linalg.eigh(moment)
    order = np.argsort(values)[::-1]
    scaled = vectors[:, order] / np.sqrt(values[order] + eps)  # [dims, dims]: one per column
    filters = np.concatenate([scaled, -scaled], axis=1).reshape(k, k, c, 2 * dims)
    return tuple(float(v) for v in filters.ravel())


# ---------------------------------------------------------------------------------------------
# Networks


class ResNet(nn.Module):
    """images [N, H, W, 3] (normalized, compute dtype) -> logits [N, num_classes] fp32."""

    config: ResNetConfig
    policy: Policy
    remat: RematConfig
    # airbench: its whitening kernel's values (``whitening_filters``), or None (identity patches)
    whitening: tuple[float, ...] | None = None

    @nn.compact
    def __call__(self, images: jax.Array, deterministic: bool = True) -> jax.Array:
        c, p = self.config, self.policy
        train = not deterministic
        x = images.astype(p.compute_dtype)
        body = {"resnet9": self._resnet9, "airbench": self._airbench}.get(c.arch, self._resnet)
        x = body(x, train)
        head = layers.dense(
            c.num_classes,
            axes=("conv_in", None),
            policy=p,
            std=1.0,  # unused: init below
            use_bias=c.arch != "airbench",
            kernel_init=nn.initializers.lecun_normal() if c.init == "he" else _kernel_init(c.init),
            name="head",
        )
        return head(x).astype(jnp.float32) * c.logit_scale

    def _resnet(self, x: jax.Array, train: bool) -> jax.Array:
        c, p = self.config, self.policy
        if c.stem == "imagenet":
            x = ConvBN(c.width, 7, 2, c, p, split_in=False, name="stem")(x, train)
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        else:
            x = ConvBN(c.width, 3, 1, c, p, split_in=False, name="stem")(x, train)
        block = remat_block(
            Bottleneck if c.arch in BOTTLENECK else BasicBlock, self.remat, static_argnums=TRAIN
        )
        for stage, (blocks, stride) in enumerate(zip(ARCHS[c.arch], STAGE_STRIDES, strict=True)):
            for i in range(blocks):
                x = block(c.width * 2**stage, stride if i == 0 else 1, c, p,
                          name=f"stage{stage}_block{i}")(x, train)  # fmt: skip
        return x.mean(axis=(1, 2))

    def _resnet9(self, x: jax.Array, train: bool) -> jax.Array:
        c, p = self.config, self.policy
        conv = remat_block(ConvBN, self.remat, static_argnums=TRAIN)
        residual = remat_block(Residual, self.remat, static_argnums=TRAIN)
        x = ConvBN(c.width, 3, 1, c, p, split_in=False, name="prep")(x, train)
        for stage, res in enumerate((True, False, True)):
            width = c.width * 2 ** (stage + 1)
            x = conv(width, 3, 1, c, p, name=f"stage{stage}")(x, train)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
            if res:
                x = residual(width, c, p, name=f"stage{stage}_res")(x, train)
        return x.max(axis=(1, 2))

    def _airbench(self, x: jax.Array, train: bool) -> jax.Array:
        c, p = self.config, self.policy
        channels = x.shape[-1]

        def whitening_init(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
            del key
            if self.whitening is None:
                return identity_patches(channels).astype(dtype)
            return jnp.asarray(self.whitening, dtype).reshape(shape)

        k = WHITEN_KERNEL
        whiten = layers.conv(
            p,
            2 * k * k * channels,
            (k, k),
            padding="VALID",
            use_bias=True,
            kernel_init=nn.with_logical_partitioning(whitening_init, (None, None, None, None)),
            name="whiten",
        )
        x = nn.gelu(whiten(x), approximate=False)
        group = remat_block(ConvGroup, self.remat, static_argnums=TRAIN)
        for i, units in enumerate(AIRBENCH_WIDTHS):
            x = group(c.width * units, c, p, name=f"group{i}")(x, train)
        return x.max(axis=(1, 2))  # at 32x32 the 3x3 map's max: airbench's MaxPool2d(3)


# ---------------------------------------------------------------------------------------------
# FLOPs


def _conv_flops(side: int, kernel: int, stride: int, cin: int, cout: int) -> tuple[int, int]:
    """(forward FLOPs per image, output side) of a 'same'-padded convolution."""
    out = -(-side // stride)
    return 2 * out * out * kernel * kernel * cin * cout, out


def forward_flops(config: ResNetConfig, image_size: int) -> tuple[int, int]:
    """(forward GEMM/convolution FLOPs per image, of which the first convolution's).

    Only convolutions and the classifier (what runs as GEMMs); BatchNorm, ReLU and pooling are
    elementwise and not counted.
    """
    c = config
    total = 0
    if c.arch == "airbench":
        k, side = WHITEN_KERNEL, image_size - WHITEN_KERNEL + 1
        cin = 2 * k * k * 3
        first = 2 * side * side * k * k * 3 * cin
        total = first
        for units in AIRBENCH_WIDTHS:
            width = c.width * units
            flops, side = _conv_flops(side, 3, 1, cin, width)
            side //= 2
            total += flops + _conv_flops(side, 3, 1, width, width)[0]
            cin = width
        return total + 2 * cin * c.num_classes, first
    if c.arch == "resnet9":
        first, side = _conv_flops(image_size, 3, 1, 3, c.width)
        total, cin = first, c.width
        for stage, res in enumerate((True, False, True)):
            width = c.width * 2 ** (stage + 1)
            flops, side = _conv_flops(side, 3, 1, cin, width)
            total += flops
            side //= 2
            if res:
                total += 2 * _conv_flops(side, 3, 1, width, width)[0]
            cin = width
        return total + 2 * cin * c.num_classes, first
    kernel, stride = (7, 2) if c.stem == "imagenet" else (3, 1)
    first, side = _conv_flops(image_size, kernel, stride, 3, c.width)
    total, cin = first, c.width
    if c.stem == "imagenet":
        side = (side + 2 - 3) // 2 + 1  # the 3x3 stride-2 max pool, padding 1
    for stage, (blocks, stage_stride) in enumerate(zip(ARCHS[c.arch], STAGE_STRIDES, strict=True)):
        width = c.width * 2**stage
        for i in range(blocks):
            s = stage_stride if i == 0 else 1
            if c.arch in BOTTLENECK:
                out = width * EXPANSION
                a, _ = _conv_flops(side, 1, 1, cin, width)
                b, new_side = _conv_flops(side, 3, s, width, width)
                d, _ = _conv_flops(new_side, 1, 1, width, out)
                total += a + b + d
            else:
                out = width
                a, new_side = _conv_flops(side, 3, s, cin, width)
                b, _ = _conv_flops(new_side, 3, 1, width, width)
                total += a + b
            if s != 1 or cin != out:
                total += _conv_flops(side, 1, s, cin, out)[0]
            cin, side = out, new_side
    return total + 2 * cin * c.num_classes, first


def train_flops_per_step(config: ResNetConfig, *, batch_size: int, image_size: int) -> float:
    """Forward + backward GEMM FLOPs of one step: 3 x forward, less the first convolution's
    input gradient, which nothing needs (the images are not trained). airbench's frozen
    whitening filters still get their gradient (the step's gradient norm counts it)."""
    forward, first = forward_flops(config, image_size)
    return float(batch_size * (3 * forward - first))
