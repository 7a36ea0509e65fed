"""Typed run configuration: YAML file + dotted ``key=value`` overrides -> frozen ``Config``.

Every default lives in the dataclasses below. Loading is strict: an unknown key, a key given twice,
a value of the wrong type (a float key takes finite numbers only, an int key 64-bit integers) or an
out-of-range value raises ``ConfigError`` naming the dotted key, and the CLI turns that into one
line on stderr and exit code 2. Loading and validation never touch ``os.environ`` or
``jax.config``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import ipaddress
import math
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from hopperjax import workloads

# Longest message ConfigError keeps; values in messages are quoted with ``shown`` (at most
# SHOWN_CHARS), so only free text (a long path, a long list of changed keys) comes near it.
MAX_MESSAGE = 1000
SHOWN_CHARS = 80
# Step counts stay below this: the train state counts steps in int32.
MAX_STEPS = 2**31


class ConfigError(ValueError):
    """A bad configuration value; ``key`` is the dotted name of the offending key.

    The message is one line (line breaks become spaces) of at most ``MAX_MESSAGE`` characters (a
    longer one loses its middle), as the CLI prints it; the key it starts with is cut to
    ``SHOWN_CHARS``. Quote values in it with ``shown``.
    """

    def __init__(self, key: str, message: str, *, name_key: bool = True):
        self.key = key
        text = " ".join((f"{_cut(key)}: {message}" if key and name_key else message).splitlines())
        if len(text) > MAX_MESSAGE:
            half = (MAX_MESSAGE - 5) // 2
            text = f"{text[:half]} ... {text[-half:]}"
        super().__init__(text)


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded repr: it never builds the whole repr of a big value (a YAML alias bomb is
    a list of 9**9 items sharing a few objects), and it shows a huge int by its size (``repr``
    refuses ints of over 4,300 digits)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxlong = self.maxother = SHOWN_CHARS

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:
            return f"<{x.bit_length()}-bit integer>"
        return super().repr_int(x, level)


_SHORT_REPR = _ShortRepr()


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, cut to at most ``SHOWN_CHARS`` characters."""
    return _cut(_SHORT_REPR.repr(value))


def _cut(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Base of the ``model:`` group. The workload's module defines the fields (its model's
    sizes and options, ``models/<name>.py``); every one of them shapes the train state, so a run
    directory with checkpoints refuses a change to any of them."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Base of the ``data:`` group: the pipeline keys every workload has. The workload's module
    adds its source keys (``source``, ``path``, sequence lengths, ...) in a subclass.

    ``shuffle``: reshuffle the training examples every epoch. ``workers``: grain worker processes
    (0 = read in the training process). ``read_threads`` / ``read_buffer``: grain threads, and
    batches they read ahead, in each reading process (this one, or each of ``workers``). grain's
    own defaults (16 threads, 500 batches ahead) hold hundreds of batches in host memory and
    spend the step's CPU on a small host; ``device_prefetch`` already overlaps reading with the
    step. ``device_prefetch``: global batches transferred to the devices ahead of the step.
    """

    shuffle: bool = True
    workers: int = 0
    worker_buffer_size: int = 4
    read_threads: int = 2
    read_buffer: int = 8
    device_prefetch: int = 2


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Loop cadence. ``batch_size`` is global (all devices, all processes).

    ``microbatches``: K > 1 splits each global batch into K equal microbatches inside the jitted
    step and accumulates their fp32 gradients into one optimizer update (same update as the full
    batch; activation memory of one microbatch). ``eval_at_start``: also evaluate before the
    first step of a fresh run (logged as step 0). ``sync_every_step``: wait for each step to
    finish, as eager frameworks do, and log every step's own time (``step_times_s``); off, the
    loop keeps up to a few steps in flight and times log windows. ``host_heap_pad_mib``: host
    memory the C heap keeps between steps instead of returning it to the kernel
    (``memory/host_heap.py``); None: on the CPU backend, enough for the compiled step's temporary
    buffer, elsewhere nothing; 0: the allocator's default. ``generate_every``: every this many
    steps (a multiple of ``eval_every``) and at the end, the eval record also carries the
    workload's generation metrics (``Workload.generation_metrics``: text decoded and scored, e.g.
    translation's BLEU); None: never. Only workloads that define them take it.

    Step counts (``steps``, ``stop_after``, ``log_every``, ``eval_every``, ``checkpoint_every``)
    are below 2**31 (``MAX_STEPS``).
    """

    steps: int = 500
    batch_size: int = 32
    eval_batch_size: int | None = None
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int | None = None
    eval_at_start: bool = False
    sync_every_step: bool = False
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    async_checkpoint: bool = True
    stop_after: int | None = None
    microbatches: int = 1
    host_heap_pad_mib: int | None = None
    generate_every: int | None = None


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer and LR schedule; peak LR = ``base_lr`` scaled by batch / ``base_batch_size``.

    ``row_lr`` / ``row_eps``: row-wise Adagrad of row-sparse embedding tables, in the workloads
    that have them (recommendation's ``model.sparse_updates``); constant, not scheduled.

    Ranges: ``base_lr``, ``eps``, ``row_lr``, ``row_eps`` and ``clip_norm`` > 0;
    ``weight_decay`` >= 0; ``b1``, ``b2`` (adamw, lamb) and ``momentum`` (sgd, lars) in
    [0, 1); ``min_lr_ratio`` and ``warmup_init_ratio`` in [0, 1]; ``warmup_steps`` in
    [0, 2**31). ``warmup_init_ratio``: the warmup starts at this fraction of the peak (0: from
    about zero).

    ``ema_decay`` (0: off, else in (0, 1)): lookahead weight averaging (Zhang et al. 2019, as
    airbench runs it): at every ``ema_every``-th update from update ``ema_start`` on, an average
    of the weights moves toward them, ``avg <- rho avg + (1 - rho) w``, with ``rho = ema_decay x
    (update / train.steps) ** ema_ramp``, and the weights are set to it; the average starts as
    the weights of the first such update. The last update averages too, so the run ends on the
    average; between averaging updates the weights move on from it. The average (one fp32 copy
    of the parameters) lives in the optimizer state and resumes with it.
    """

    name: Literal["adamw", "sgd", "lamb", "lars"] = "adamw"
    base_lr: float = 1e-3
    base_batch_size: int | None = None
    lr_scaling: Literal["linear", "sqrt", "none"] = "linear"
    schedule: Literal["cosine", "linear", "constant", "rsqrt"] = "cosine"
    warmup_steps: int = 0
    warmup_init_ratio: float = 0.0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9
    nesterov: bool = False
    clip_norm: float | None = 1.0
    row_lr: float = 0.05
    row_eps: float = 1e-8
    ema_decay: float = 0.0
    ema_every: int = 1
    ema_start: int = 0
    ema_ramp: float = 0.0


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axis sizes; -1 takes all remaining devices (at most one axis).

    ``dcn_data`` / ``dcn_fsdp``: how many of the ``data`` / ``fsdp`` ways cross the slow links
    between nodes (one process per node). They must divide ``data`` / ``fsdp`` and multiply to the
    process count; the rest of each axis, and all of ``tensor``, stays on a node's fast links.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    dcn_data: int = 1
    dcn_fsdp: int = 1


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs through ``jax.distributed``; off unless ``auto`` or an address is set.

    ``auto`` lets JAX detect SLURM, Open MPI or Kubernetes from the environment; otherwise give the
    coordinator (process 0's ``host:port``), the process count and this process's id.
    ``coordinator_address``: a hostname, a dotted-quad IPv4 address or a bracketed IPv6 address
    (``[::1]:1234``), and a port in 1..65535. ``heartbeat_timeout_s``: a process that has not
    been heard from for this long counts as lost, and the others stop (JAX's default is 100 s).
    ``supervise``: the CLI trains in a child process and reports a lost peer as one line (exit 3)
    instead of JAX's native abort (``hopperjax.supervise``); false runs in the CLI's own process.
    """

    auto: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout_s: int = 300
    heartbeat_timeout_s: int = 30
    supervise: bool = True

    @property
    def enabled(self) -> bool:
        return self.auto or self.coordinator_address is not None


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling (``enabled`` null: on for fp16 only).

    Defaults follow PyTorch's GradScaler: start at 2^16, halve on a non-finite gradient (and skip
    that update), double after ``growth_interval`` finite steps in a row. ``init_scale`` > 0;
    ``factor`` > 1; ``growth_interval`` in [1, 2**31).
    """

    enabled: bool | None = None
    init_scale: float = 65536.0
    growth_interval: int = 2000
    factor: float = 2.0


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """FP8 matmuls for ``precision: fp8`` (delayed scaling: e4m3 forward, e5m2 gradients).

    ``layers``: comma-separated Dense layer names that run in FP8, from the workload's
    ``fp8_layers``; null: the workload's ``default_fp8_layers`` (a transformer's block
    projections). Everything else (embeddings, logits, norms, attention scores) stays in
    bf16/fp32.
    """

    backend: Literal["xla", "te"] = "xla"
    amax_history_length: int = 1024
    layers: str | None = None

    @property
    def layer_names(self) -> tuple[str, ...] | None:
        return None if self.layers is None else _names(self.layers)


@dataclasses.dataclass(frozen=True)
class RematConfig:
    """What each block of the model keeps for the backward pass (``memory/remat.py``).

    policy: none keeps every activation; full keeps only the block input and recomputes the rest;
    dots keeps matmul outputs; dots_no_batch keeps matmul outputs without batch dims (the
    projections, not attention scores); save_names keeps ``names``; offload keeps ``names`` on the
    device and moves ``offload_names`` to pinned host memory until the backward pass needs them.
    names / offload_names: comma-separated, from the activations the workload's model tags with
    ``checkpoint_name`` (its ``remat_names``; a transformer block's are
    ``models.transformer.BLOCK_ACTIVATIONS``).
    """

    policy: Literal["none", "full", "dots", "dots_no_batch", "save_names", "offload"] = "none"
    names: str = ""
    offload_names: str = ""

    @property
    def saved(self) -> tuple[str, ...]:
        return _names(self.names)

    @property
    def offloaded(self) -> tuple[str, ...]:
        return _names(self.offload_names)


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Train-state parts kept in pinned host memory between steps (``memory/offload.py``).

    The step streams them to the device for the update and writes them back: device memory
    between steps drops by their size, at the cost of a host<->device copy every step.
    """

    optimizer_state: bool = False
    params: bool = False


@dataclasses.dataclass(frozen=True)
class CommConfig:
    """How gradients travel between devices (``parallel/compress.py``, ``parallel/overlap.py``).

    ``gradient_compression``: none (XLA's fp32 all-reduce), bf16 or int8: the ``data``-axis
    reduction as an explicit reduce-scatter + all-gather of encoded chunks. ``error_feedback``:
    keep each device's encoding residual in the train state and add it to the next step's
    gradient. ``rounding``: nearest or stochastic (unbiased). ``block_size``: values per int8 scale,
    in [16, 65536]. ``overlap``: off, default (XLA's own scheduling, nothing set) or aggressive
    (latency-hiding scheduler, pipelined collectives, large combine thresholds): XLA flags set at
    the entry point before JAX starts, printed on the first console line.
    """

    gradient_compression: Literal["none", "bf16", "int8"] = "none"
    error_feedback: bool = True
    rounding: Literal["nearest", "stochastic"] = "nearest"
    block_size: int = 256
    overlap: Literal["off", "default", "aggressive"] = "default"


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """A jax.profiler trace of steps [start_step, start_step + num_steps) into run_dir/profile.

    Both in [0, 2**31).
    """

    start_step: int = 10
    num_steps: int = 0


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    """Hardware telemetry logged with the metrics (GPU: NVML; silent where unavailable)."""

    gpu: bool = True
    interval_s: float = 1.0


# The workload of a config that names none.
DEFAULT_WORKLOAD = "lm"


def workload_class(name: str) -> Any:
    """The workload class called ``name``; ConfigError on the ``workload`` key if there is none."""
    try:
        return workloads.get(name)
    except workloads.UnknownWorkload as e:
        raise ConfigError("workload", str(e), name_key=False) from None


def _group_default(group: str) -> Any:
    return lambda: getattr(workload_class(DEFAULT_WORKLOAD), group)()


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run. ``workload`` picks the task (``hopperjax.workloads``); its module supplies the
    dataclasses of the ``model`` and ``data`` groups, so ``model`` and ``data`` hold instances of
    the workload's subclasses of ``ModelConfig`` and ``DataConfig``. ``seed``: in [0, 2**32) (an
    unsigned 32-bit seed). ``attention``: the softmax-attention kernel of every model: "auto"
    (cuDNN flash attention on a GPU for bf16/fp16 shapes cuDNN takes, XLA otherwise), "xla", or
    "cudnn" (refused, naming the reason, where cuDNN cannot run it). ``cpu_convolutions``: the
    library XLA:CPU runs convolutions with, "eigen" (XLA's own; 2.7x faster on ResNet-9's step
    than YNNPACK on 2 CPU cores) or "ynnpack" (jaxlib's default): an XLA flag set before JAX
    starts (``hopperjax/xla_cpu.py``); GPUs ignore it."""

    name: str = "run"
    workload: str = DEFAULT_WORKLOAD
    run_dir: str | None = None
    seed: int = 0
    precision: Literal["fp32", "tf32", "bf16", "fp16", "fp8"] = "fp32"
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    cpu_convolutions: Literal["eigen", "ynnpack"] = "eigen"
    model: ModelConfig = dataclasses.field(default_factory=_group_default("ModelConfig"))
    data: DataConfig = dataclasses.field(default_factory=_group_default("DataConfig"))
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    loss_scale: LossScaleConfig = dataclasses.field(default_factory=LossScaleConfig)
    fp8: Fp8Config = dataclasses.field(default_factory=Fp8Config)
    remat: RematConfig = dataclasses.field(default_factory=RematConfig)
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    comm: CommConfig = dataclasses.field(default_factory=CommConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
    monitor: MonitorConfig = dataclasses.field(default_factory=MonitorConfig)

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name

    def replace(self, **overrides: Any) -> Config:
        """A validated copy with dotted-key overrides: ``replace(**{"train.steps": 5})``."""
        tree = to_dict(self)
        for key, value in overrides.items():
            _set_dotted(tree, key, value)
        return from_dict(tree)


# ----------------------------------------------------------------------------------------------
# Loading


def load_config(
    path: str | Path | None = None,
    overrides: typing.Sequence[str] = (),
    *,
    validate_values: bool = True,
) -> Config:
    """Loads a YAML config (safe loader), applies ``key=value`` overrides and validates the result.

    Args:
      path: YAML file; None starts from the schema defaults.
      overrides: strings like ``"train.steps=200"``; values are parsed as YAML scalars.
      validate_values: False checks keys and types only, not values against each other or the
        files they name: for a run's own ``config.yaml``, validated when the run was made, read
        where its data may not be (restoring parameters, exporting).

    Raises:
      ConfigError: naming the bad key, file or override.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError("--config", f"cannot read {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError("--config", f"{path}: not UTF-8 text (byte {e.start})") from None
        try:
            loaded = _load_yaml(text)
        except _DuplicateKey as e:
            raise ConfigError(e.key, f"given twice in {path} line {e.line}") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError("--config", f"{path}{where}: invalid YAML") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError("--config", f"{path}: expected a mapping at the top level")
        tree = loaded
        tree.setdefault("name", path.stem)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(item, "expected an override of the form key=value")
        key = key.strip()
        try:
            value = _load_yaml(raw, prefix=f"{key}.") if raw else ""
        except _DuplicateKey as e:
            raise ConfigError(e.key, f"given twice in override {shown(item)}") from None
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key, value)
    return from_dict(tree, validate_values=validate_values)


class _DuplicateKey(yaml.YAMLError):
    """A mapping gives ``key`` (dotted) twice, the second time on ``line``."""

    def __init__(self, key: str, line: int):
        super().__init__(key)
        self.key, self.line = key, line


class _Loader(yaml.SafeLoader):
    """The safe loader, refusing a key given twice in one mapping (PyYAML keeps the last).

    ``prefix`` starts the dotted name of the top-level keys (an override's key and a dot).
    """

    def __init__(self, text: str, prefix: str):
        super().__init__(text)
        self._prefixes: dict[yaml.Node, str] = {}  # mapping node -> dotted prefix of its keys
        self._prefix = prefix

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        prefix = self._prefixes.get(node, self._prefix)  # in a list: the top-level prefix
        seen = set()
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base' keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, collections.abc.Hashable):
                continue  # the base class refuses it
            if key in seen:
                raise _DuplicateKey(f"{prefix}{key}", key_node.start_mark.line + 1)
            seen.add(key)
            self._prefixes.setdefault(value_node, f"{prefix}{key}.")  # an alias: its first key
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str, prefix: str = "") -> Any:
    """``text`` parsed by the safe loader, refusing duplicate keys.

    Raises:
      _DuplicateKey: a mapping gives a key twice.
      yaml.YAMLError: not YAML; also for PyYAML's ValueError (an integer of over 4,300 digits)
        and RecursionError (lists nested deeper than the stack), which are no YAMLError.
    """
    loader = _Loader(text, prefix)
    try:
        return loader.get_single_data()
    except (ValueError, RecursionError) as e:
        raise yaml.YAMLError(type(e).__name__) from None
    finally:
        loader.dispose()


def from_dict(tree: dict[str, Any], *, validate_values: bool = True) -> Config:
    """Builds and validates a Config from a nested dict (``workload`` picks the model/data schema).

    ``validate_values``: see ``load_config``.
    """
    if not isinstance(tree, dict):
        raise ConfigError("--config", f"expected a mapping at the top level, got {shown(tree)}")
    name = _coerce("workload", tree.get("workload", DEFAULT_WORKLOAD), str)
    cls = workload_class(name)
    config = _build(Config, tree, prefix="", groups=_groups(cls), workload=name)
    if validate_values:
        validate(config)
    return config


def _groups(workload_cls: Any) -> dict[str, type]:
    """The dataclass of each workload-supplied group."""
    return {"model": workload_cls.ModelConfig, "data": workload_cls.DataConfig}


def to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def all_keys(
    cls: type = Config, prefix: str = "", *, workload: str = DEFAULT_WORKLOAD
) -> list[str]:
    """Every dotted key of the schema for ``workload``, e.g. ``["name", ..., "model.d_model"]``."""
    return _keys(cls, prefix, _groups(workload_class(workload)) if cls is Config else {})


def _keys(cls: type, prefix: str, groups: dict[str, type]) -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        name = prefix + field.name
        hint = groups.get(field.name, hints[field.name])
        if dataclasses.is_dataclass(hint):
            keys.extend(_keys(hint, name + ".", {}))
        else:
            keys.append(name)
    return keys


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Sets ``tree``'s dotted ``key`` to ``value``; a mapping for a group (``model={n_layers: 1}``)
    sets the keys it names and keeps the group's others."""
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), "is not a group of keys")
        node = child
    old = node.get(parts[-1])
    if isinstance(value, dict) and isinstance(old, dict):
        value = {**old, **value}  # a new dict: the old one may be a YAML alias's too
    node[parts[-1]] = value


def _unknown_key(name: str, value: Any, known: list[str], workload: str) -> ConfigError:
    # 'trian: {steps: 5}' -> 'trian.steps'; one level, as deep as the schema (and a recursive
    # YAML mapping has no bottom).
    if "." not in name and isinstance(value, dict) and len(value) == 1:
        ((child, value),) = value.items()
        name = f"{name}.{child}"
    if name.startswith(("model.", "data.")):  # another workload's key?
        owners = [w for w in _other_workloads(workload) if name in all_keys(workload=w)]
        if owners:
            return ConfigError(
                name,
                f"unknown key {shown(name)} for workload '{workload}' "
                f"(a key of workload '{owners[0]}')",
                name_key=False,
            )
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    return ConfigError(name, f"unknown key {shown(name)}{hint}", name_key=False)


def _other_workloads(workload: str) -> list[str]:
    others = []
    for name in workloads.names():
        if name == workload:
            continue
        try:
            workloads.get(name)
        except workloads.UnknownWorkload:  # a broken module is not this error's business
            continue
        others.append(name)
    return others


def _build(
    cls: type,
    tree: Any,
    prefix: str,
    groups: dict[str, type],
    known: list[str] | None = None,
    *,
    workload: str = DEFAULT_WORKLOAD,
) -> Any:
    """``cls`` from ``tree``; ``groups`` replaces the dataclass of some fields (``model``,
    ``data``) with the workload's; ``known`` is every key of the whole schema, for suggestions."""
    if not isinstance(tree, dict):
        raise ConfigError(prefix.rstrip("."), f"expected a mapping of keys, got {shown(tree)}")
    if known is None:
        known = _keys(cls, prefix, groups)
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    for key, value in tree.items():
        if key not in fields:
            raise _unknown_key(prefix + str(key), value, known, workload)
    kwargs = {}
    for name, value in tree.items():
        hint = groups.get(name, hints[name])
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, prefix + name + ".", {}, known, workload=workload)
        else:
            kwargs[name] = _coerce(prefix + name, value, hint)
    for name, group in groups.items():  # a group the tree leaves out: the workload's defaults
        kwargs.setdefault(name, group())
    return cls(**kwargs)


def _check_choice(key: str, value: Any, choices: tuple[Any, ...]) -> None:
    """Raises ConfigError naming ``key`` unless ``value`` is one of ``choices`` (never a bool)."""
    if isinstance(value, bool) or value not in choices:
        raise ConfigError(
            key, f"expected one of {', '.join(map(str, choices))}, got {shown(value)}"
        )


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Checks ``value`` against a type hint, with the few conversions a YAML user expects."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _coerce(key, value, inner)
    if origin is Literal:
        choices = typing.get_args(hint)
        # YAML 1.1 reads a bare off / on as a boolean; where the choice is spelled so, mean it.
        if isinstance(value, bool) and ("on" if value else "off") in choices:
            value = "on" if value else "off"
        _check_choice(key, value, choices)
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true or false, got {shown(value)}")
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(key, f"expected an integer, got {shown(value)}")
        if not -(2**63) <= value < 2**63:
            raise ConfigError(key, f"expected a 64-bit integer, got {shown(value)}")
        return value
    if hint is float:
        number = _number(value)
        if number is None:
            raise ConfigError(key, f"expected a number, got {shown(value)}")
        if not math.isfinite(number):
            raise ConfigError(key, f"expected a finite number, got {shown(value)}")
        return number
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            try:
                return str(value)
            except ValueError:  # an int of over 4,300 digits has no str()
                pass
        raise ConfigError(key, f"expected a string, got {shown(value)}")
    raise TypeError(f"unsupported config type {hint!r} for {key}")  # schema bug, not user input


def _number(value: Any) -> float | None:
    """``value`` as a float (inf past the float range), None if it is no number. Strings count:
    YAML 1.1 reads "1e-3" as one."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int past the float range
        return math.inf
    except ValueError:
        return None


# ----------------------------------------------------------------------------------------------
# Validation: pure checks of values against each other; device-dependent checks live in the mesh.


def _positive(key: str, value: int | float | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(key, f"expected a positive value, got {value!r}")


def positive(key: str, value: int | float | None, *, allow_none: bool = False) -> None:
    """Raises ConfigError on ``key`` unless ``value`` > 0 (or None, where allowed)."""
    _positive(key, value, allow_none=allow_none)


# Keys that count steps (each below MAX_STEPS).
_STEP_KEYS = (
    "train.steps",
    "train.stop_after",
    "train.log_every",
    "train.eval_every",
    "train.checkpoint_every",
    "train.generate_every",
    "optim.warmup_steps",
    "optim.ema_every",
    "optim.ema_start",
    "loss_scale.growth_interval",
    "profile.start_step",
    "profile.num_steps",
)


def _check_choices(group: Any, prefix: str = "") -> None:
    """Every choice-typed (``Literal``) field of ``group`` and of its nested groups holds one of
    its choices. The YAML path checks them as it reads them; a config built or changed in Python
    (``dataclasses.replace``, a ``T5Config(norm="lyaer")``) reaches ``validate`` unchecked."""
    hints = typing.get_type_hints(type(group))
    for field in dataclasses.fields(group):
        value, key = getattr(group, field.name), prefix + field.name
        if dataclasses.is_dataclass(value):
            _check_choices(value, key + ".")
            continue
        hint = hints[field.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        options = typing.get_args(hint) if union else (hint,)
        if value is None and type(None) in options:
            continue
        for option in options:
            if typing.get_origin(option) is Literal:
                _check_choice(key, value, typing.get_args(option))


def validate(config: Config) -> None:
    """Raises ConfigError for the first inconsistent value; never mutates anything.

    Generic groups here; the ``model`` and ``data`` groups, and what they must agree with, in
    the workload's ``validate_config``.
    """
    d, t, o = config.data, config.train, config.optim
    cls = workload_class(config.workload)
    _check_choices(config)
    for group, expected in _groups(cls).items():
        value = getattr(config, group)
        if not isinstance(value, expected):
            raise ConfigError(
                group,
                f"workload '{config.workload}' takes a {expected.__name__}, "
                f"got {type(value).__name__}",
            )
    if not 0 <= config.seed < 2**32:
        raise ConfigError("seed", f"expected 0 <= seed < 2**32, got {config.seed}")
    for key in _STEP_KEYS:
        group, name = key.split(".")
        steps = getattr(getattr(config, group), name)
        if steps is not None and steps >= MAX_STEPS:
            raise ConfigError(key, f"expected fewer than 2**31 steps, got {steps}")
    if d.workers < 0:
        raise ConfigError("data.workers", f"expected >= 0, got {d.workers}")
    _positive("data.worker_buffer_size", d.worker_buffer_size)
    if d.read_threads < 0:
        raise ConfigError("data.read_threads", f"expected >= 0, got {d.read_threads}")
    _positive("data.read_buffer", d.read_buffer)
    _positive("data.device_prefetch", d.device_prefetch)

    for key in (
        "steps",
        "batch_size",
        "log_every",
        "eval_every",
        "checkpoint_every",
        "keep_checkpoints",
    ):
        _positive(f"train.{key}", getattr(t, key))
    _positive("train.eval_batch_size", t.eval_batch_size, allow_none=True)
    _positive("train.eval_batches", t.eval_batches, allow_none=True)
    if t.stop_after is not None and not 0 < t.stop_after <= t.steps:
        raise ConfigError("train.stop_after", f"expected 0 < stop_after <= {t.steps}")
    _positive("train.microbatches", t.microbatches)
    if t.generate_every is not None:
        _positive("train.generate_every", t.generate_every)
        if t.generate_every % t.eval_every:
            raise ConfigError(
                "train.generate_every",
                f"must be a multiple of train.eval_every={t.eval_every}, got {t.generate_every}",
            )
        if not cls.generates():
            raise ConfigError(
                "train.generate_every",
                f"workload '{config.workload}' has no generation metrics; leave it null",
            )
    if t.batch_size % t.microbatches:
        raise ConfigError(
            "train.microbatches",
            f"must divide train.batch_size={t.batch_size}, got {t.microbatches}",
        )
    if t.host_heap_pad_mib is not None and not 0 <= t.host_heap_pad_mib < 2048:
        raise ConfigError(
            "train.host_heap_pad_mib",
            f"expected 0 <= MiB < 2048 or null, got {t.host_heap_pad_mib}",
        )

    _positive("optim.base_lr", o.base_lr)
    _positive("optim.base_batch_size", o.base_batch_size, allow_none=True)
    _positive("optim.clip_norm", o.clip_norm, allow_none=True)
    _positive("optim.eps", o.eps)
    _positive("optim.row_lr", o.row_lr)
    _positive("optim.row_eps", o.row_eps)
    for key, decay in (("b1", o.b1), ("b2", o.b2), ("momentum", o.momentum)):
        if not 0.0 <= decay < 1.0:
            raise ConfigError(f"optim.{key}", f"expected 0 <= {key} < 1, got {decay}")
    if o.warmup_steps < 0:
        raise ConfigError("optim.warmup_steps", f"expected >= 0, got {o.warmup_steps}")
    for key in ("min_lr_ratio", "warmup_init_ratio"):
        if not 0.0 <= getattr(o, key) <= 1.0:
            raise ConfigError(f"optim.{key}", f"expected a ratio in [0, 1], got {getattr(o, key)}")
    if o.weight_decay < 0:
        raise ConfigError("optim.weight_decay", f"expected >= 0, got {o.weight_decay}")
    if not 0.0 <= o.ema_decay < 1.0:
        raise ConfigError(
            "optim.ema_decay", f"expected 0 (off) or a decay in (0, 1), got {o.ema_decay}"
        )
    _positive("optim.ema_every", o.ema_every)
    if o.ema_start < 0:
        raise ConfigError("optim.ema_start", f"expected >= 0, got {o.ema_start}")
    if not o.ema_ramp >= 0:  # (NaN too)
        raise ConfigError("optim.ema_ramp", f"expected >= 0, got {o.ema_ramp}")
    if o.ema_decay and o.ema_start >= t.steps:
        raise ConfigError(
            "optim.ema_start",
            f"expected < train.steps={t.steps} (no update would be averaged), got {o.ema_start}",
        )

    ls = config.loss_scale
    _positive("loss_scale.init_scale", ls.init_scale)
    _positive("loss_scale.growth_interval", ls.growth_interval)
    if ls.factor <= 1.0:
        raise ConfigError("loss_scale.factor", f"expected > 1, got {ls.factor}")
    _positive("fp8.amax_history_length", config.fp8.amax_history_length)
    for name in config.fp8.layer_names or ():
        if name not in cls.fp8_layers:
            raise ConfigError(
                "fp8.layers",
                f"unknown layer {name!r}; workload '{config.workload}' has "
                f"{', '.join(cls.fp8_layers) or 'no FP8 layers'}",
            )
    _validate_remat(config.remat, cls.remat_names)
    prof = config.profile
    for key, steps in (("start_step", prof.start_step), ("num_steps", prof.num_steps)):
        if steps < 0:
            raise ConfigError(f"profile.{key}", f"expected >= 0, got {steps}")
    _positive("monitor.interval_s", config.monitor.interval_s)
    block = config.comm.block_size
    if not 16 <= block <= 65536:
        raise ConfigError(
            "comm.block_size", f"expected 16 <= values per scale <= 65536, got {block}"
        )

    mesh = config.mesh
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    if sum(1 for v in sizes.values() if v == -1) > 1:
        raise ConfigError("mesh", "at most one axis may be -1")
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}", f"expected a positive size or -1, got {size}")
    for axis in ("data", "fsdp"):
        dcn = getattr(mesh, f"dcn_{axis}")
        _positive(f"mesh.dcn_{axis}", dcn)
        if sizes[axis] != -1 and sizes[axis] % dcn:
            raise ConfigError(f"mesh.dcn_{axis}", f"must divide mesh.{axis}={sizes[axis]}")

    dist = config.distributed
    if dist.coordinator_address is not None:
        _check_address("distributed.coordinator_address", dist.coordinator_address)
        if dist.num_processes is None or dist.process_id is None:
            raise ConfigError(
                "distributed.coordinator_address",
                "needs distributed.num_processes and distributed.process_id too",
            )
        _positive("distributed.num_processes", dist.num_processes)
        if not 0 <= dist.process_id < dist.num_processes:
            raise ConfigError(
                "distributed.process_id",
                f"expected 0 <= id < {dist.num_processes}, got {dist.process_id}",
            )
    _positive("distributed.initialization_timeout_s", dist.initialization_timeout_s)
    _positive("distributed.heartbeat_timeout_s", dist.heartbeat_timeout_s)
    cls.validate_config(config)


# host:port, the host a name, a dotted quad or a bracketed IPv6 address.
_ADDRESS = re.compile(r"(?:\[(?P<ipv6>[^\]]+)\]|(?P<host>[A-Za-z0-9._-]+)):(?P<port>[0-9]+)")


def _check_address(key: str, address: str) -> None:
    """Raises ConfigError on ``key`` unless ``address`` is ``host:port`` (see DistributedConfig)."""
    match = _ADDRESS.fullmatch(address)
    if match is None:
        raise ConfigError(key, f"expected host:port ([IPv6]:port), got {shown(address)}")
    host, ipv6, port = match["host"], match["ipv6"], match["port"]
    try:
        if ipv6 is not None:
            ipaddress.IPv6Address(ipv6)
        elif re.fullmatch(r"[0-9.]+", host):  # all digits and dots: an IPv4 address or nothing
            ipaddress.IPv4Address(host)
    except ValueError:
        kind = "IPv4" if ipv6 is None else "IPv6"
        raise ConfigError(key, f"{shown(ipv6 or host)} is not an {kind} address") from None
    if len(port) > 5 or not 1 <= int(port) <= 65535:
        raise ConfigError(key, f"expected a port in 1..65535, got {shown(port)}")


def _validate_remat(remat: RematConfig, known: tuple[str, ...]) -> None:
    for key, names in (("remat.names", remat.saved), ("remat.offload_names", remat.offloaded)):
        for name in names:
            if name not in known:
                raise ConfigError(
                    key,
                    f"unknown activation {name!r}; expected some of "
                    f"{', '.join(known) or '(the model tags none)'}",
                )
    uses = {"save_names": ("remat.names",), "offload": ("remat.names", "remat.offload_names")}
    used = uses.get(remat.policy, ())
    for key, names in (("remat.names", remat.saved), ("remat.offload_names", remat.offloaded)):
        if names and key not in used:
            raise ConfigError(key, f"not used by remat.policy '{remat.policy}'")
    if remat.policy == "save_names" and not remat.saved:
        raise ConfigError("remat.names", "remat.policy 'save_names' needs at least one name")
    if remat.policy == "offload" and not remat.offloaded:
        raise ConfigError(
            "remat.offload_names", "remat.policy 'offload' needs at least one name to offload"
        )
    both = set(remat.saved) & set(remat.offloaded)
    if both:
        raise ConfigError(
            "remat.offload_names", f"{', '.join(sorted(both))} also in remat.names; pick one"
        )
