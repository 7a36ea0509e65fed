"""Hardware telemetry: an NVML sampler thread for the GPUs, and JAX's device memory counters.

Both feed the loop's log records as flat float keys (``gpu0_util_pct``, ``dev0_bytes_in_use_gib``)
so the metric sinks need no special cases. Neither touches device arrays, so neither adds a device
sync; NVML reads the driver's counters from a background thread.

Telemetry must never stop a run: where NVML is missing (no ``nvidia-ml-py``, no driver, a CPU
host) the monitor says why once and then reports nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import jax

_GIB = float(2**30)


def device_memory_stats() -> dict[str, float]:
    """JAX's allocator counters per local device, in GiB; ``{}`` where the backend has none (CPU).

    Returns:
      ``dev{i}_bytes_in_use_gib``, ``dev{i}_peak_bytes_in_use_gib`` and ``dev{i}_bytes_limit_gib``
      for each ``jax.local_devices()[i]`` whose ``memory_stats()`` reports them.
    """
    stats: dict[str, float] = {}
    for i, device in enumerate(jax.local_devices()):
        counters = device.memory_stats()  # A host-side query of the allocator; None on CPU.
        for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
            if counters and key in counters:
                stats[f"dev{i}_{key}_gib"] = counters[key] / _GIB
    return stats


class GpuMonitor:
    """Samples every GPU's utilization, memory, temperature and power on a background thread.

    ``snapshot()`` returns the mean of each reading over the samples since the previous snapshot,
    so a log record describes its whole log window rather than one instant.

    Known compromise: GPUs are numbered as NVML numbers them (every GPU on the host), which can
    differ from JAX's device ids when ``CUDA_VISIBLE_DEVICES`` hides or reorders GPUs.

    Args:
      interval_s: seconds between samples.
      log: called once, from the constructor, when NVML is unavailable (e.g. ``writer.info``).

    Attributes:
      available: whether NVML initialized and found at least one GPU.
      reason: why not, when ``available`` is False; else ``""``.
    """

    def __init__(self, interval_s: float = 1.0, *, log: Callable[[str], None] = print):
        self.interval_s = interval_s
        self.available = False
        self.reason = ""
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()  # Guards the sums and serializes NVML calls.
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml  # From the nvidia-ml-py package; absent on CPU-only installs.
        except ImportError:
            self.reason = "pynvml is not installed (pip install nvidia-ml-py)"
        else:
            self._nvml = pynvml
            try:
                pynvml.nvmlInit()
                count = pynvml.nvmlDeviceGetCount()
                self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            except Exception as e:  # NVMLError and its many subclasses; the type varies by cause.
                self.reason = f"NVML is unavailable: {e}"
            else:
                self.available = bool(self._handles)
                self.reason = "" if self.available else "NVML found no GPUs"
            if not self.available:
                self._shutdown_nvml()
        if not self.available:
            log(f"hopperjax: GPU monitor off: {self.reason}")

    @property
    def running(self) -> bool:
        """Whether the sampler thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Starts the sampler thread (a no-op when unavailable or already running)."""
        if not self.available or self._thread is not None:
            return
        self._stop.clear()
        # Daemon: a run that dies without close() must not hang on this thread at exit.
        self._thread = threading.Thread(target=self._run, name="hopperjax-gpu-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.sample()
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """Takes one sample of every GPU now (the thread calls this every ``interval_s``)."""
        if not self.available:
            return
        nvml = self._nvml
        readers: dict[str, Callable[[Any], float]] = {
            "util_pct": lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu,
            "mem_used_gib": lambda h: nvml.nvmlDeviceGetMemoryInfo(h).used / _GIB,
            "temp_c": lambda h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
            "power_w": lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1e3,  # NVML reports mW.
        }
        with self._lock:
            for i, handle in enumerate(self._handles):
                for name, read in readers.items():
                    # Each reading on its own: some boards lack one (no power sensor; MIG slices
                    # report no utilization), and the others are still worth logging.
                    try:
                        value = float(read(handle))
                    except Exception:  # NVMLError_NotSupported and kin: skip that reading.
                        continue
                    key = f"gpu{i}_{name}"
                    self._sums[key] = self._sums.get(key, 0.0) + value
                    self._counts[key] = self._counts.get(key, 0) + 1

    def snapshot(self) -> dict[str, float]:
        """Means of the readings since the previous snapshot; ``{}`` when unavailable.

        Takes a sample first if none was taken since the previous snapshot (a log window
        shorter than ``interval_s``), so a record never lacks the GPU keys only by timing.
        """
        if not self.available:
            return {}
        with self._lock:
            empty = not self._counts
        if empty:
            self.sample()
        with self._lock:
            means = {key: self._sums[key] / n for key, n in self._counts.items()}
            self._sums, self._counts = {}, {}
        return means

    def close(self) -> None:
        """Stops and joins the sampler thread and shuts NVML down. Idempotent; never raises."""
        self._stop.set()
        if self._thread is not None:
            # Bounded: a sample stuck in a wedged driver must not hang the end of the run (the
            # thread is a daemon, so it cannot keep the process alive either).
            self._thread.join(timeout=10.0)
            self._thread = None
        if self.available:
            self.available = False
            self.reason = "closed"
            self._shutdown_nvml()

    def _shutdown_nvml(self) -> None:
        # Any NVMLError: shutting down telemetry must not fail a run that is ending.
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()
