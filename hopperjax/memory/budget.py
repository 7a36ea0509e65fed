"""Device memory of a compiled step, and the search for the largest batch that fits a budget.

A probe compiles the train step for one batch size (``trainer/measure.py`` builds the run for
it) and reads XLA's memory analysis: arguments + outputs + temporaries - donated (aliased)
buffers is what the step needs on each device at its peak. The search runs over multiples of the
smallest legal batch (the data*fsdp mesh ways times the microbatch count). Peak memory is close to
affine in the batch size, so the next probe is the batch that the last two probes' line predicts
to fill the budget; a bisection fallback keeps the search finite when the line is off.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from hopperjax.config import Config, ConfigError
from hopperjax.optim import peak_learning_rate
from hopperjax.parallel import batch_axis_size, build_mesh

GIB = 2**30

_MEMORY_FIELDS = (
    "argument",
    "output",
    "temp",
    "alias",
    "generated_code",
    "host_argument",
    "host_output",
    "host_temp",
    "host_alias",
)


def compiled_memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    """XLA's per-device memory analysis as ``{field}_bytes`` plus ``peak_estimate_bytes``.

    Empty when the backend gives no analysis. ``host_*`` fields count pinned-host buffers on
    backends that place them (GPU, TPU); XLA:CPU keeps everything in one RAM and reports 0.
    """
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    out = {f"{f}_bytes": int(getattr(stats, f"{f}_size_in_bytes", 0) or 0) for f in _MEMORY_FIELDS}
    out["peak_estimate_bytes"] = (
        out["argument_bytes"]
        + out["output_bytes"]
        + out["temp_bytes"]
        - out["alias_bytes"]
        + out["generated_code_bytes"]
    )
    return out


def device_capacity_bytes(device: jax.Device) -> int | None:
    """The allocator's limit on ``device`` (HBM times the client's memory fraction), if known."""
    try:
        stats = device.memory_stats()
    except Exception:
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def default_budget_bytes(device: jax.Device, headroom: float = 0.05) -> int | None:
    """The device's capacity less ``headroom`` of it, left for fragmentation and the runtime."""
    capacity = device_capacity_bytes(device)
    return None if capacity is None else int(capacity * (1.0 - headroom))


@dataclasses.dataclass(frozen=True)
class Probe:
    """One compiled batch size: its per-device peak bytes, the compiled step's GEMM FLOPs and
    the model's own FLOPs (the workload's count; no recompute) per step and device."""

    batch_size: int
    peak_bytes: int
    flops_per_device: float
    model_flops_per_device: float
    fits: bool


class BatchRefused(Exception):
    """A probe's run refuses its batch size for a reason other than memory (the data holds
    fewer examples than one batch, say); the search then stops growing below it."""


# probe(config, batch_size) -> (peak bytes, GEMM FLOPs, model FLOPs), all per device and step;
# raises BatchRefused when the run cannot take that batch at all.
ProbeFn = Callable[[Config, int], tuple[int, float, float]]


@dataclasses.dataclass(frozen=True)
class BatchSearch:
    """The result of ``find_largest_batch`` for one remat policy and microbatch count.

    Attributes:
      batch_size: the largest global batch that fits, or None if even the smallest does not.
      proven_max: True when ``batch_size + unit`` was compiled and did not fit (not just capped).
      refused: why the run refused a larger batch (the data's size), when it did.
      learning_rate: the peak LR the linear (or configured) scaling rule gives that batch.
      probes: every compile, in the order they ran.
    """

    remat: str
    microbatches: int
    budget_bytes: int
    unit: int
    batch_size: int | None
    proven_max: bool
    learning_rate: float | None
    probes: tuple[Probe, ...]
    refused: str | None = None

    @property
    def best(self) -> Probe | None:
        fitting = [p for p in self.probes if p.fits]
        return max(fitting, key=lambda p: p.batch_size) if fitting else None


def find_largest_batch(
    config: Config,
    *,
    budget_bytes: int,
    probe: ProbeFn,
    devices: Sequence[jax.Device] | None = None,
    max_batch_size: int = 2**20,
    tolerance: float = 0.0,
    max_probes: int = 24,
) -> BatchSearch:
    """The largest global batch whose compiled train step fits ``budget_bytes`` per device.

    Args:
      config: the run; its remat policy, microbatch count, mesh and model are kept.
      budget_bytes: device memory the step may use at its peak.
      probe: ``probe(config, batch_size) -> (peak_bytes, flops, model_flops)`` per device
        (``trainer.measure.probe_batch`` compiles the step).
      devices: the mesh's devices (they set the smallest legal batch).
      max_batch_size: stop growing here (the result is then not proven maximal).
      tolerance: stop once the gap between the largest fit and the smallest miss is at most this
        fraction of the fit (0: exact to one unit; 0.05 saves compiles on big models).
    """
    unit = batch_axis_size(build_mesh(config.mesh, devices)) * config.train.microbatches
    max_n = max(1, max_batch_size // unit)
    probes: dict[int, Probe] = {}
    refused: list[str] = []

    def fits(n: int) -> bool | None:
        """Whether batch n * unit fits; None when the run refuses it."""
        try:
            peak, flops, model_flops = probe(config, n * unit)
        except BatchRefused as e:
            refused.append(str(e))
            return None
        probes[n] = Probe(n * unit, int(peak), flops, model_flops, peak <= budget_bytes)
        return probes[n].fits

    def result(lo: int | None, hi: int | None) -> BatchSearch:
        batch = None if lo is None else lo * unit
        return BatchSearch(
            remat=config.remat.policy,
            microbatches=config.train.microbatches,
            budget_bytes=budget_bytes,
            unit=unit,
            batch_size=batch,
            proven_max=hi == (lo or 0) + 1 and not refused_above,
            learning_rate=None if batch is None else peak_learning_rate(config.optim, batch),
            probes=tuple(probes.values()),
            refused=refused[-1] if refused_above else None,
        )

    refused_above = False  # hi is a batch the run refused, not one that missed the budget
    first = fits(1)
    if first is None:  # even the smallest batch: the run cannot be searched at all
        raise ConfigError("train.batch_size", refused[-1].removeprefix("train.batch_size: "))
    if not first:
        return result(None, 1)
    lo, hi = 1, None
    sides: list[bool] = []  # fit / miss of each probe after the first
    while len(probes) < max_probes:
        if hi is None and lo >= max_n:
            break
        if hi is not None and (hi - lo <= 1 or hi - lo <= tolerance * lo):
            break
        if hi is None:
            # Grow: aim where the line through the two largest fits meets the budget.
            fitting = sorted(n for n, p in probes.items() if p.fits)
            guess = None
            if len(fitting) >= 2:
                guess = _affine_guess(probes[fitting[-2]], probes[fitting[-1]], budget_bytes, unit)
            n = min(max(guess or 2 * lo, lo + 1), max_n)
        elif refused_above or (len(sides) >= 2 and sides[-1] == sides[-2]):
            # Bisect: below a refused batch memory says nothing of where the limit is; and
            # when the line keeps landing on one side, bisect once.
            n = (lo + hi) // 2
        else:
            guess = _affine_guess(probes[lo], probes[hi], budget_bytes, unit)
            n = (lo + hi) // 2 if guess is None else guess
        n = min(max(n, lo + 1), hi - 1) if hi is not None else n
        ok = fits(n)
        if ok is None:
            hi, refused_above = n, True
            continue
        sides.append(ok)
        if ok:
            lo = n
        else:
            hi, refused_above = n, False
    return result(lo, hi)


def _affine_guess(a: Probe, b: Probe, budget_bytes: int, unit: int) -> int | None:
    """The largest n whose batch n * unit the line through probes a and b keeps in the budget."""
    if b.batch_size == a.batch_size or b.peak_bytes == a.peak_bytes:
        return None
    slope = (b.peak_bytes - a.peak_bytes) / (b.batch_size - a.batch_size)
    if slope <= 0:
        return None
    return math.floor((a.batch_size + (budget_bytes - a.peak_bytes) / slope) / unit)


def search_table(searches: Sequence[BatchSearch]) -> str:
    """A markdown table: policy, microbatches, largest batch, peak, FLOPs, recompute, LR.

    Recompute is the compiled GEMM FLOPs over the model's own FLOPs (> 1: remat recomputes
    forward GEMMs).
    """
    lines = [
        "| remat | microbatches | largest batch | peak GiB/device | GFLOP/step/device "
        "| recompute | peak LR | compiles |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in searches:
        best = s.best
        if best is None:
            smallest = s.probes[0]
            lines.append(
                f"| {s.remat} | {s.microbatches} | none (batch {smallest.batch_size} needs "
                f"{smallest.peak_bytes / GIB:.2f} GiB) | | | | | {len(s.probes)} |"
            )
            continue
        marker = "" if s.proven_max else " (data)" if s.refused else " (cap)"
        ratio = best.flops_per_device / best.model_flops_per_device
        lines.append(
            f"| {s.remat} | {s.microbatches} | {best.batch_size}{marker} | "
            f"{best.peak_bytes / GIB:.3f} | {best.flops_per_device / 1e9:.2f} | x{ratio:.3f} | "
            f"{s.learning_rate:.3g} | {len(s.probes)} |"
        )
    return "\n".join(lines)


def searches_to_json(searches: Sequence[BatchSearch]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(s) for s in searches]
