"""Everything a run is made of, built from its config before any step runs.

The loop trains with these; compile-only tools (inspection, batch finders, benchmarks) lower the
same jitted steps without running them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import optax
from jax.sharding import Mesh, NamedSharding

from hopperjax.config import Config, ConfigError
from hopperjax.data import Datasets, build_datasets
from hopperjax.memory import offload
from hopperjax.models import build_model
from hopperjax.observe import flops
from hopperjax.optim import build_optimizer
from hopperjax.parallel import (
    batch_axis_size,
    build_mesh,
    logical_sharding,
    process_batch_shard,
    sharding_context,
)
from hopperjax.precision import PEAK_DTYPE, Policy, policy_from_config
from hopperjax.precision.fp8 import check_backend
from hopperjax.trainer.state import TrainState, create_train_state, state_shardings
from hopperjax.trainer.step import jit_steps
from hopperjax.workloads import Workload, get_workload


@dataclasses.dataclass(frozen=True)
class Components:
    """Everything the loop drives, built from a config before any step runs.

    Attributes:
      abstract_state: the TrainState as ``jax.ShapeDtypeStruct`` leaves carrying their shardings.
      state_shardings: the NamedSharding tree of the TrainState.
      batch_sharding: the NamedSharding of every batch field (a dict like the batch).
      batch_blocks: row blocks of a global batch; this process reads one (``datasets``).
      train_step, eval_step: the jitted (not yet compiled) steps from ``jit_steps``.
    """

    config: Config
    mesh: Mesh
    policy: Policy
    model: nn.Module
    tx: optax.GradientTransformation
    datasets: Datasets
    abstract_state: TrainState
    state_shardings: Any
    batch_sharding: dict[str, NamedSharding]
    batch_blocks: int
    train_step: Any
    eval_step: Any
    workload: Workload

    def batch_spec(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        """Shape, dtype and sharding of one global batch of ``batch_size`` rows."""
        fields = self.workload.batch_fields(self.config, batch_size, self.datasets)
        return {
            name: jax.ShapeDtypeStruct(f.shape, f.dtype, sharding=self.batch_sharding[name])
            for name, f in fields.items()
        }

    @property
    def model_flops_per_step(self) -> float:
        return self.workload.model_flops_per_step(
            self.config, self.config.train.batch_size, self.datasets
        )

    @functools.cached_property
    def _peak(self) -> tuple[float, str]:
        return flops.peak_tflops(self.mesh.devices.flat[0], PEAK_DTYPE[self.policy.name])

    @property
    def peak_source(self) -> str:
        return self._peak[1]

    def throughput(self) -> flops.Throughput:
        t = self.config.train
        return flops.Throughput(
            tokens_per_step=t.batch_size * self.workload.examples_per_batch_row(self.config),
            model_flops_per_step=self.model_flops_per_step,
            num_devices=self.mesh.size,
            peak_tflops_per_device=self._peak[0],
        )

    def init_state(self) -> TrainState:
        """A fresh TrainState, created directly with its shardings on the mesh."""
        # Outside the mesh context on purpose: flax's scan evaluates constant parameter inits
        # eagerly, and a mesh in scope would make it constrain concrete arrays.
        state, _ = create_train_state(
            self.model,
            self.tx,
            self.mesh,
            seed=self.config.seed,
            example_inputs=self._example_inputs(),
            shardings=self.state_shardings,
            loss_scale=initial_loss_scale(self.config, self.policy),
        )
        return state

    def _example_inputs(self) -> tuple[Any, ...]:
        spec = self.batch_spec(self.config.train.batch_size)
        return tuple(self.workload.model_inputs(spec))

    def _tracing(self) -> contextlib.ExitStack:
        """Mesh, rules and the policy's matmul precision in scope while tracing a step."""
        stack = contextlib.ExitStack()
        stack.enter_context(sharding_context(self.mesh))
        stack.enter_context(jax.default_matmul_precision(self.policy.matmul_precision))
        return stack

    def trace_train_step(self) -> jax.stages.Traced:
        """The train step traced for the configured batch: its jaxpr, not yet lowered."""
        with self._tracing():
            return self.train_step.trace(
                self.abstract_state, self.batch_spec(self.config.train.batch_size)
            )

    def lower_train_step(self, traced: jax.stages.Traced | None = None) -> jax.stages.Lowered:
        """The train step lowered for the configured batch (compile-only tools start here)."""
        traced = traced or self.trace_train_step()
        with self._tracing():
            return traced.lower()

    def lower_eval_step(self) -> jax.stages.Lowered:
        train = self.config.train
        with self._tracing():
            return self.eval_step.lower(
                self.abstract_state, self.batch_spec(train.eval_batch_size or train.batch_size)
            )


def initial_loss_scale(config: Config, policy: Policy) -> float | None:
    """The loss scale a fresh state starts from, or None when the policy does not scale."""
    return config.loss_scale.init_scale if policy.loss_scaling else None


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
    workload = get_workload(config)
    if t.microbatches > 1 and config.model.kind == "dta":
        raise ConfigError(
            "train.microbatches",
            "not supported by model.kind=dta: its batches share deduplicated drug/protein tables",
        )
    # Processes read disjoint examples unless their devices hold the same batch rows.
    block, blocks = process_batch_shard(logical_sharding(mesh, ("batch",)), t.batch_size)
    datasets = build_datasets(config, process_index=block, process_count=blocks)
    fields = workload.batch_fields(config, t.batch_size, datasets)
    batch_sharding = {name: logical_sharding(mesh, f.axes) for name, f in fields.items()}
    if config.model.kind == "gpt" and datasets.vocab_size > config.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"the data emits {datasets.vocab_size} token ids, got {config.model.vocab_size}",
        )
    policy = policy_from_config(config)
    check_backend(policy)
    model = build_model(config.model, policy, config.remat, dta=config.dta)
    tx, schedule = build_optimizer(
        config.optim, total_steps=t.steps, global_batch_size=t.batch_size
    )
    example = tuple(
        workload.model_inputs(
            {name: jax.ShapeDtypeStruct(f.shape, f.dtype) for name, f in fields.items()}
        )
    )
    loss_scale = initial_loss_scale(config, policy)
    abstract, shardings = state_shardings(
        model, tx, mesh, seed=config.seed, example_inputs=example, loss_scale=loss_scale
    )
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
    )
    return Components(
        config=config,
        mesh=mesh,
        policy=policy,
        model=model,
        tx=tx,
        datasets=datasets,
        abstract_state=abstract,
        state_shardings=shardings,
        batch_sharding=batch_sharding,
        batch_blocks=blocks,
        train_step=train_step,
        eval_step=eval_step,
        workload=workload,
    )
