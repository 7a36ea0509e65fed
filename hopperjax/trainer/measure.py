"""Measurements that build a run first: a compile-only memory probe per batch size (the batch
finder's), and the median time of the compiled step."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import jax

from hopperjax.config import Config, ConfigError
from hopperjax.data import to_global_batch
from hopperjax.memory import budget, host_heap
from hopperjax.observe import hlo as hlo_lib
from hopperjax.parallel import batch_axis_size, build_mesh
from hopperjax.trainer.components import Components, build_components


def at_batch(
    config: Config, batch_size: int, *, devices: Sequence[jax.Device] | None = None
) -> Config:
    """``config`` at train batch ``batch_size`` for a probe or a timing, which never evaluates:
    the eval batch is the smallest the mesh takes, so that a small eval split (10 % of the
    embedded corpus, the package's own source, holds a few dozen windows of 2,049 bytes) cannot
    refuse a large train batch."""
    ways = batch_axis_size(build_mesh(config.mesh, devices))
    return config.replace(**{"train.batch_size": batch_size, "train.eval_batch_size": ways})


def probe_batch(
    config: Config, batch_size: int, *, devices: Sequence[jax.Device] | None = None
) -> tuple[int, float, float]:
    """(peak bytes, GEMM FLOPs, model FLOPs), per device, of the train step at ``batch_size``;
    compiled, never run."""
    try:
        parts = build_components(at_batch(config, batch_size, devices=devices), devices=devices)
    except ConfigError as e:
        if e.key == "train.batch_size":  # the data holds fewer examples than this batch
            raise budget.BatchRefused(str(e)) from None
        raise
    compiled = parts.lower_train_step().compile()
    memory = budget.compiled_memory(compiled)
    if not memory:
        raise ConfigError(
            "--budget-gb", f"the {jax.default_backend()} backend gives no memory analysis"
        )
    gemms, _ = hlo_lib.analyze(compiled.as_text(), num_devices=parts.mesh.size)
    return (
        memory["peak_estimate_bytes"],
        float(sum(g.flops for g in gemms)),
        parts.model_flops_per_step / parts.mesh.size,
    )


def find_largest_batch(
    config: Config,
    *,
    budget_bytes: int,
    devices: Sequence[jax.Device] | None = None,
    **search: object,
) -> budget.BatchSearch:
    """``budget.find_largest_batch`` with compiled probes of the run ``config`` describes."""
    return budget.find_largest_batch(
        config,
        budget_bytes=budget_bytes,
        probe=lambda c, b: probe_batch(c, b, devices=devices),
        devices=devices,
        **search,
    )


def measure_step_seconds(
    config: Config,
    *,
    steps: int = 10,
    warmup: int = 2,
    parts: Components | None = None,
    compiled: jax.stages.Compiled | None = None,
) -> float:
    """Median wall time of the compiled train step on a batch already on the devices, with the
    loop's host heap setting (``train.host_heap_pad_mib``), as a run would time it.

    ``parts`` / ``compiled``: the run's components and compiled step, when the caller has them.
    """
    parts = parts or build_components(config)
    compiled = compiled or parts.lower_train_step().compile()
    host_heap.keep_step_memory(config.train.host_heap_pad_mib, compiled_steps=[compiled])
    local = next(iter(parts.datasets.train))  # one real batch, reused: the input is not timed
    batch = to_global_batch(local, parts.batch_sharding, blocks=parts.batch_blocks)
    state = parts.init_state()
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
