"""Everything a run is made of, built from its config before any step runs.

The loop trains with these; compile-only tools (inspection, batch finders, benchmarks) lower the
same jitted steps without running them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import optax
from jax.sharding import Mesh, NamedSharding

from hopperjax import workloads
from hopperjax.config import Config, ConfigError
from hopperjax.data import Datasets, ProcessShard
from hopperjax.memory import offload
from hopperjax.models.layers import check_attention
from hopperjax.observe import flops
from hopperjax.optim import build_optimizer
from hopperjax.parallel import (
    Rules,
    batch_axis_size,
    build_mesh,
    compress,
    logical_sharding,
    merge_rules,
    process_batch_shard,
    sharding_context,
)
from hopperjax.parallel.compress import Compression
from hopperjax.precision import PEAK_DTYPE, Policy, policy_from_config
from hopperjax.precision.fp8 import check_backend
from hopperjax.trainer.state import (
    TrainState,
    init_sharded,
    initializer,
    model_variables,
    shardings_of,
)
from hopperjax.trainer.step import jit_steps
from hopperjax.workloads.base import Workload


@dataclasses.dataclass(frozen=True)
class Components:
    """Everything the loop drives, built from a config before any step runs.

    Attributes:
      workload: the run's workload, bound to ``config``.
      rules: the logical-axis rules (ours with the workload's ``axis_rules``).
      init: makes a fresh (boxed) TrainState (``state.initializer``); traced once, for
        ``abstract_state``, and that trace reused from JAX's cache by ``init_state`` (with
        error-feedback compression, the compression-less init is traced first as well).
      abstract_state: the TrainState as ``jax.ShapeDtypeStruct`` leaves carrying their shardings.
      state_shardings: the NamedSharding tree of the TrainState.
      batch_sharding: the NamedSharding of every batch field (a dict like the batch).
      batch_blocks: row blocks of a global batch; this process reads one (``datasets``).
      train_step, eval_step: the jitted (not yet compiled) steps from ``jit_steps``.
      compression: the gradient compression over ``data`` (``comm.gradient_compression``), or
        None.
    """

    config: Config
    mesh: Mesh
    rules: Rules
    policy: Policy
    model: nn.Module
    tx: optax.GradientTransformation
    datasets: Datasets
    init: Callable[[], TrainState]
    abstract_state: TrainState
    state_shardings: Any
    batch_sharding: dict[str, NamedSharding]
    batch_blocks: int
    train_step: Any
    eval_step: Any
    workload: Workload
    compression: Compression | None = None

    def batch_spec(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        """Shape, dtype and sharding of one global batch of ``batch_size`` rows."""
        fields = self.workload.batch_fields(batch_size, self.datasets)
        return {
            name: jax.ShapeDtypeStruct(f.shape, f.dtype, sharding=self.batch_sharding[name])
            for name, f in fields.items()
        }

    @property
    def model_flops_per_step(self) -> float:
        return self.workload.model_flops_per_step(self.config.train.batch_size, self.datasets)

    @functools.cached_property
    def _peak(self) -> tuple[float, str]:
        return flops.peak_tflops(self.mesh.devices.flat[0], PEAK_DTYPE[self.policy.name])

    @property
    def peak_source(self) -> str:
        return self._peak[1]

    def throughput(self) -> flops.Throughput:
        t = self.config.train
        return flops.Throughput(
            examples_per_step=self.workload.examples_per_step(t.batch_size),
            examples_name=self.workload.examples_name,
            model_flops_per_step=self.model_flops_per_step,
            num_devices=self.mesh.size,
            peak_tflops_per_device=self._peak[0],
        )

    def init_state(self) -> TrainState:
        """A fresh TrainState, created directly with its shardings on the mesh."""
        # Outside the mesh context on purpose: flax's scan evaluates constant parameter inits
        # eagerly, and a mesh in scope would make it constrain concrete arrays.
        return init_sharded(self.init, self.state_shardings)

    def generation_metrics(self, state: TrainState) -> dict[str, float]:
        """The workload's generation metrics for ``state``'s model (``train.generate_every``),
        traced with the run's mesh, rules and matmul precision; offloaded parameters are copied
        to device memory first."""
        params = state.params
        if "params" in offload.offloaded_fields(self.config.offload):
            device = jax.tree.map(
                lambda s: s.with_memory_kind(offload.DEVICE_MEMORY), self.state_shardings.params
            )
            params = jax.device_put(params, device)
        variables = model_variables(params, state.fp8, state.model_state)
        with self.tracing():
            return self.workload.generation_metrics(self.model, variables, self.datasets)

    def tracing(self) -> contextlib.ExitStack:
        """Mesh, rules and the policy's matmul precision in scope while tracing a step."""
        stack = contextlib.ExitStack()
        stack.enter_context(sharding_context(self.mesh, self.rules))
        stack.enter_context(jax.default_matmul_precision(self.policy.matmul_precision))
        return stack

    def trace_train_step(self) -> jax.stages.Traced:
        """The train step traced for the configured batch: its jaxpr, not yet lowered."""
        with self.tracing():
            return self.train_step.trace(
                self.abstract_state, self.batch_spec(self.config.train.batch_size)
            )

    def lower_train_step(self, traced: jax.stages.Traced | None = None) -> jax.stages.Lowered:
        """The train step lowered for the configured batch (compile-only tools start here)."""
        traced = traced or self.trace_train_step()
        with self.tracing():
            return traced.lower()

    def lower_eval_step(self) -> jax.stages.Lowered:
        train = self.config.train
        with self.tracing():
            return self.eval_step.lower(
                self.abstract_state, self.batch_spec(train.eval_batch_size or train.batch_size)
            )


def initial_loss_scale(config: Config, policy: Policy) -> float | None:
    """The loss scale a fresh state starts from, or None when the policy does not scale."""
    return config.loss_scale.init_scale if policy.loss_scaling else None


def example_inputs(workload: Workload, spec: dict[str, Any]) -> tuple[Any, ...]:
    """Shapes of the model's inputs for a batch of ``spec`` (its fields as ShapeDtypeStructs),
    after the workload's preprocessing: what ``model.init`` is traced with."""
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    preprocessed = jax.eval_shape(
        lambda batch, rng: workload.preprocess(batch, rng, train=False), spec, key
    )
    return tuple(workload.model_inputs(preprocessed))


def build_datasets(
    config: Config, shard: ProcessShard | None = None, *, workload: Workload | None = None
) -> Datasets:
    """The run's datasets for this process (``shard`` of every global batch; default: one block
    per process), as its workload builds them.

    Raises:
      ConfigError: a batch size that the processes cannot split, or data that cannot serve the
        config (names the key).
    """
    shard = shard or ProcessShard(jax.process_index(), jax.process_count())
    t = config.train
    for key, size in (
        ("train.batch_size", t.batch_size),
        ("train.eval_batch_size", t.eval_batch_size or t.batch_size),
    ):
        if size % shard.count:
            raise ConfigError(key, f"{size} is not divisible by {shard.count} processes")
    workload = workload or workloads.from_config(config)
    return workload.build_datasets(shard)


def build_model(config: Config, policy: Policy | None = None) -> nn.Module:
    """The run's model, as its workload builds it (``policy``: default the config's)."""
    workload = workloads.from_config(config)
    return workload.build_model(policy or _policy(config, workload), config.remat)


def _policy(config: Config, workload: Workload) -> Policy:
    return policy_from_config(config, default_fp8_layers=workload.default_fp8_layers)


def _check_divisible(abstract_state: Any) -> None:
    """Raises ConfigError naming the mesh key when a mesh axis does not divide an array dimension
    it shards (say ``mesh.tensor=8`` with 4 attention heads): before anything is compiled."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(abstract_state)
    for path, leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "spec", None)
        if spec is None:
            continue
        for dim, axes in enumerate(spec):
            axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
            ways = math.prod(sharding.mesh.shape[a] for a in axes)
            if axes and leaf.shape[dim] % ways:
                name = jax.tree_util.keystr(path, simple=True, separator="/")
                sizes = " x ".join(f"mesh.{a}={sharding.mesh.shape[a]}" for a in axes)
                raise ConfigError(
                    f"mesh.{axes[0]}",
                    f"{sizes} does not divide dimension {dim} of {name} "
                    f"(shape {list(leaf.shape)}); choose a mesh whose axes divide the model's "
                    f"dimensions",
                )


def build_components(config: Config, *, devices: Sequence[jax.Device] | None = None) -> Components:
    """Builds mesh, model, optimizer, datasets, shardings and jitted steps; runs nothing.

    Raises:
      ConfigError: a value that only turns out bad against the devices or the data.
    """
    t = config.train
    mesh = build_mesh(config.mesh, devices)
    ways = batch_axis_size(mesh)
    eval_batch = t.eval_batch_size or t.batch_size
    for key, size in (("train.batch_size", t.batch_size), ("train.eval_batch_size", eval_batch)):
        if size % ways:
            raise ConfigError(key, f"{size} is not divisible by the data*fsdp mesh axes ({ways})")
    if (t.batch_size // t.microbatches) % ways:
        raise ConfigError(
            "train.microbatches",
            f"a microbatch of {t.batch_size // t.microbatches} rows is not divisible by the "
            f"data*fsdp mesh axes ({ways})",
        )
    offload.check_host_memory(mesh.devices.flat, config.offload, config.remat)
    workload = workloads.from_config(config)
    rules = merge_rules(workload.axis_rules())
    # Processes read disjoint examples unless their devices hold the same batch rows.
    block, blocks = process_batch_shard(logical_sharding(mesh, ("batch",), rules), t.batch_size)
    datasets = build_datasets(config, ProcessShard(block, blocks), workload=workload)
    fields = workload.batch_fields(t.batch_size, datasets)
    batch_sharding = {name: logical_sharding(mesh, f.axes, rules) for name, f in fields.items()}
    policy = _policy(config, workload)
    check_backend(policy)
    check_attention(policy.attention)
    model = workload.build_model(policy, config.remat)
    if workload.row_updates() is not None and t.microbatches > 1:
        raise ConfigError(
            "train.microbatches",
            f"{t.microbatches}: row-sparse embedding updates take one microbatch per step",
        )
    if workload.row_updates() is not None and config.optim.ema_decay:
        raise ConfigError(
            "optim.ema_decay",
            "lookahead averaging needs every parameter updated by the optimizer; this config's "
            "row-sparse embedding tables are updated beside it",
        )
    tx, schedule = build_optimizer(
        config.optim,
        total_steps=t.steps,
        global_batch_size=t.batch_size,
        param_labels=_param_labels(workload),
        group_optimizers=workload.group_optimizers,
    )
    example = example_inputs(
        workload, {name: jax.ShapeDtypeStruct(f.shape, f.dtype) for name, f in fields.items()}
    )
    make_init = functools.partial(
        initializer,
        model,
        tx,
        seed=config.seed,
        example_inputs=example,
        loss_scale=initial_loss_scale(config, policy),
    )
    init = make_init()
    abstract, shardings = shardings_of(init, mesh, rules)
    _check_divisible(abstract)
    compression = _compression(config, mesh, workload, abstract)
    if compression is not None and compression.error_feedback:  # the residuals join the state
        init = make_init(compression=compression)
        abstract, shardings = shardings_of(init, mesh, rules)
    offloaded = offload.offloaded_fields(config.offload)
    fetch = offload.make_fetch(shardings, offloaded)
    if offloaded:
        shardings = offload.with_memory_kind(shardings, offloaded, offload.HOST_MEMORY)
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
        )
    train_step, eval_step = jit_steps(
        model=model,
        tx=tx,
        schedule=schedule,
        state_shardings=shardings,
        batch_sharding=batch_sharding,
        workload=workload,
        loss_scale=config.loss_scale if policy.loss_scaling else None,
        microbatches=t.microbatches,
        fetch=fetch,
        compression=compression,
    )
    return Components(
        config=config,
        mesh=mesh,
        rules=rules,
        policy=policy,
        model=model,
        tx=tx,
        datasets=datasets,
        init=init,
        abstract_state=abstract,
        state_shardings=shardings,
        batch_sharding=batch_sharding,
        batch_blocks=blocks,
        train_step=train_step,
        eval_step=eval_step,
        workload=workload,
        compression=compression,
    )


def _compression(
    config: Config, mesh: Mesh, workload: Workload, abstract: TrainState
) -> Compression | None:
    """The run's gradient compression, bound to its parameters' layout; None when off.

    Raises:
      ConfigError: on ``comm.gradient_compression`` where it cannot apply (one data group, row
        tables, batches whose rows index each other, losses that weigh rows unequally,
        parameters sharded over ``data``).
    """
    comm = config.comm
    key = "comm.gradient_compression"
    if comm.gradient_compression == "none":
        return None
    if mesh.shape[compress.DATA_AXIS] == 1:
        raise ConfigError(key, "needs mesh.data > 1: it compresses the data-axis reduction")
    if workload.row_updates() is not None:
        raise ConfigError(key, "row-sparse embedding updates reduce their own rows; set none")
    if not workload.independent_rows:
        raise ConfigError(
            key,
            f"workload '{config.workload}' batches rows that index into each other (they cannot "
            f"be cut into data groups); set none",
        )
    if not workload.row_mean_loss:
        raise ConfigError(
            key,
            f"workload '{config.workload}' weighs rows unequally in its loss (a mean over real "
            f"tokens), which per-group losses would change; set none",
        )
    leaves, _ = jax.tree_util.tree_flatten_with_path(abstract.params)
    specs, shapes = [], []
    for path, leaf in leaves:
        spec = leaf.sharding.spec
        for axes in spec:
            axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
            if compress.DATA_AXIS in axes:
                name = jax.tree_util.keystr(path, simple=True, separator="/")
                raise ConfigError(key, f"parameter {name} is sharded over mesh.data; set none")
        specs.append(spec)
        shapes.append(tuple(leaf.shape))
    return Compression(
        scheme=comm.gradient_compression,
        error_feedback=comm.error_feedback,
        rounding=comm.rounding,
        block_size=comm.block_size,
        mesh=mesh,
        param_specs=tuple(specs),
        param_shapes=tuple(shapes),
    )


def _param_labels(workload: Workload) -> Callable[[Any], Any] | None:
    """optax's ``param_labels`` for the workload's groups; None when it has one optimizer
    (the callable returns None where the workload's config has none)."""
    if type(workload).param_labels is Workload.param_labels:
        return None

    def labels(params: Any) -> Any:
        # optax hands over the parameters as the state's init sees them (with logical-axis
        # boxes); the workload labels plain arrays. A tree of labels is a prefix of the boxed
        # tree, which is all multi_transform needs.
        return workload.param_labels(nn.meta.unbox(params))

    return labels
