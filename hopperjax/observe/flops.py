"""Device peak FLOP/s and MFU arithmetic.

MFU (model FLOPs utilization, PaLM appendix B) = model FLOPs per second / peak FLOP/s. Model FLOPs
count what the model needs (forward + backward = 3 x forward matmuls, attention included), not what
the compiled program does: remat recompute raises hardware FLOPs but not model FLOPs. Each model
computes its own (``models/<name>.py``), and its workload reports them per step.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from hopperjax import files

# Dense (no structured sparsity) vendor peak TFLOP/s per device, by compute dtype.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.0},
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
}
# Order matters: "H100 PCIe" devices also contain "H100".
_KIND_PATTERNS = (
    ("H200", "H200"),
    ("H100 PCIe", "H100 PCIe"),
    ("H100", "H100 SXM"),
    ("A100", "A100"),
)


def device_peak_kind(device_kind: str) -> str | None:
    """Our name for a device's row in ``PEAK_TFLOPS``, or None if we have no figures for it."""
    for pattern, kind in _KIND_PATTERNS:
        if pattern.lower() in device_kind.lower():
            return kind
    return None


@functools.cache
def measured_cpu_peak_tflops(
    device: jax.Device | None = None, size: int = 1024, repeats: int = 5
) -> float:
    """Best fp32 matmul throughput of ``device`` (default: JAX's default device), the CPU's
    stand-in for a datasheet peak."""
    x = jax.device_put(jnp.ones((size, size), jnp.float32), device)
    matmul = jax.jit(lambda a: a @ a)
    matmul(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def peak_cache_path() -> Path | None:
    """Where measured peaks are kept: ``$HOPPERJAX_CACHE_DIR/peaks.json`` (default
    ``$XDG_CACHE_HOME/hopperjax`` or ``~/.cache/hopperjax``); None without a home to keep it in."""
    root = files.cache_dir()
    return None if root is None else root / "peaks.json"


def _machine_key(device: jax.Device) -> str:
    cpu = platform.processor() or platform.machine()
    try:  # the model name, as lscpu shows it
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:  # the cores this process may use (a job's share), not the host's
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return (
        f"{platform.node()} | {cpu} | {cores} cores | {device.platform} {device.device_kind} | "
        f"jax {jax.__version__}"
    )


def cached_measured_peak(device: jax.Device) -> tuple[float, str]:
    """This machine's measured fp32 matmul peak, measured once and kept in ``peak_cache_path``
    so that MFU compares across runs (a peak measured on a busy machine every run would make a
    loaded run look more efficient). Delete the file, or its line, to measure again."""
    path = peak_cache_path()
    if path is None:
        return measured_cpu_peak_tflops(device), "measured fp32 matmul, not cached"
    key = _machine_key(device)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(key) if isinstance(cache, dict) else None
    value = entry.get("tflops") if isinstance(entry, dict) else None
    if (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    ):
        return float(value), f"measured fp32 matmul {entry.get('date', '?')}, cached"
    tflops = measured_cpu_peak_tflops(device)
    date = datetime.date.today().isoformat()
    cache = cache if isinstance(cache, dict) else {}
    cache[key] = {"tflops": tflops, "date": date}
    try:
        files.write_text(path, json.dumps(cache, indent=1) + "\n")
    except OSError:  # a read-only home: measured each run, as before
        return tflops, "measured fp32 matmul, not cached"
    return tflops, "measured fp32 matmul now, cached"


def peak_tflops(device: jax.Device, dtype: str) -> tuple[float, str]:
    """Peak TFLOP/s of one device for ``dtype`` (fp32, tf32, bf16, fp16, fp8) and its source.

    GPUs come from ``PEAK_TFLOPS``; a CPU (or an unknown GPU) from a short matmul measurement,
    made once per machine (``cached_measured_peak``).
    """
    kind = device_peak_kind(device.device_kind)
    if kind is not None and dtype in PEAK_TFLOPS[kind]:
        return PEAK_TFLOPS[kind][dtype], f"datasheet {kind} {dtype}"
    return cached_measured_peak(device)


@dataclasses.dataclass(frozen=True)
class Throughput:
    """Turns a measured step time into the throughput fields of a metrics record.

    Attributes:
      examples_per_step: global examples (tokens, pairs, ...) one step consumes.
      examples_name: what they are; the record's throughput key is ``<examples_name>_per_s``.
      model_flops_per_step: the workload's ``model_flops_per_step``.
      num_devices: devices in the mesh.
      peak_tflops_per_device: from ``peak_tflops``.
    """

    examples_per_step: int
    model_flops_per_step: float
    num_devices: int
    peak_tflops_per_device: float
    examples_name: str = "examples"

    def rates(self, step_time_s: float) -> dict[str, float]:
        achieved = self.model_flops_per_step / step_time_s / self.num_devices / 1e12
        return {
            f"{self.examples_name}_per_s": self.examples_per_step / step_time_s,
            "tflops_per_device": achieved,
            "mfu": achieved / self.peak_tflops_per_device,
        }
