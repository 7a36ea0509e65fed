"""Keeps the compiled step's freed host memory in the process heap between steps (XLA:CPU).

On the CPU backend every execution of a compiled step allocates its temporary buffer (XLA's
``temp_size_in_bytes``: 48 MiB for the nanoGPT recipe) from the C heap and frees it at the end.
With glibc's defaults a block that large is mapped fresh from the kernel by each ``malloc`` and
unmapped by ``free`` (it is above the mmap threshold, at most 32 MiB by default), and smaller
freed memory at the top of a heap is handed back too. Either way the next step page-faults the
whole buffer in again: for the nanoGPT recipe a third of the process's CPU time went to the kernel
and the step took ~1.9x as long (``python tools/bench_loop.py --config
configs/shakespeare_char_cpu.yaml data.path=... train.host_heap_pad_mib=0`` against the default).

Raising glibc's ``M_MMAP_THRESHOLD`` and ``M_TOP_PAD`` above the largest per-step allocation makes
that allocation come from the heap and stay there when freed, so every step reuses the same
pages; the memory stays with the process, which needs it again a few milliseconds later. Both must
be raised: the threshold alone still trims the heap, the pad alone only helps if set before the
runtime's first large allocation. This is a process-wide allocator setting (the loop applies it,
never the pure step), and only ever raised, so several runs in one process keep the largest.
Other C libraries (musl, macOS) are left alone and reported so.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from collections.abc import Iterable
from typing import Any

import jax

# glibc's mallopt parameters
M_TOP_PAD = -2  # bytes kept at the top of a heap when it is trimmed
M_MMAP_THRESHOLD = -3  # allocations at least this large are mapped from the kernel one by one
_MIB = 1 << 20
_lock = threading.Lock()
_applied = 0  # the largest pad set in this process, bytes


@dataclasses.dataclass(frozen=True)
class HeapSetting:
    """What ``keep_step_memory`` did: the pad in bytes (0: nothing set) and why."""

    pad_bytes: int
    reason: str

    def describe(self) -> str:
        if self.pad_bytes:
            return f"host heap keeps {self.pad_bytes / _MIB:.0f} MiB between steps ({self.reason})"
        return f"host heap: glibc default ({self.reason})"


def step_temp_bytes(compiled_steps: Iterable[Any]) -> int:
    """The largest temporary buffer any of the compiled executables allocates per execution."""
    largest = 0
    for compiled in compiled_steps:
        try:
            analysis = compiled.memory_analysis()
        except Exception:  # a backend without the analysis reports none
            analysis = None
        largest = max(largest, int(getattr(analysis, "temp_size_in_bytes", 0) or 0))
    return largest


def pad_for(temp_bytes: int) -> int:
    """The pad that covers a temp buffer of ``temp_bytes``: rounded up to 16 MiB, plus 16 MiB for
    the smaller allocations of the same step (runtime bookkeeping, the input batch)."""
    return (-(-temp_bytes // (16 * _MIB)) + 1) * 16 * _MIB


def keep_step_memory(
    pad_mib: int | None, *, compiled_steps: Iterable[Any] = (), backend: str | None = None
) -> HeapSetting:
    """Applies ``train.host_heap_pad_mib``.

    Args:
      pad_mib: None: automatic (CPU backend: ``pad_for`` the largest temp buffer of
        ``compiled_steps``; other backends: leave the allocator alone, their step memory is on the
        device). 0: leave the allocator alone. N > 0: keep N MiB.
      compiled_steps: the executables the loop runs (``jax.stages.Compiled``).
      backend: the platform the steps run on; None: ``jax.default_backend()``.
    """
    backend = backend or jax.default_backend()
    if pad_mib == 0:
        return HeapSetting(0, "train.host_heap_pad_mib=0")
    if pad_mib is None:
        if backend != "cpu":
            return HeapSetting(0, f"{backend} backend: step memory is on the device")
        temp = step_temp_bytes(compiled_steps)
        if not temp:
            return HeapSetting(0, "the compiled step reports no temporary buffer")
        wanted, reason = pad_for(temp), f"auto: step temp {temp / _MIB:.0f} MiB"
    else:
        wanted, reason = pad_mib * _MIB, "train.host_heap_pad_mib"
    return _raise_heap_pad(wanted, reason)


def _raise_heap_pad(nbytes: int, reason: str) -> HeapSetting:
    global _applied
    nbytes = min(nbytes, 2**31 - 1)  # mallopt takes an int
    libc = _glibc()
    if libc is None:
        return HeapSetting(0, "not glibc: allocator left alone")
    with _lock:
        if nbytes <= _applied:
            return HeapSetting(_applied, reason + ", already set in this process")
        for name, param in (("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD), ("M_TOP_PAD", M_TOP_PAD)):
            if libc.mallopt(param, nbytes) != 1:
                return HeapSetting(0, f"glibc refused mallopt({name}, {nbytes})")
        _applied = nbytes
    return HeapSetting(nbytes, reason)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc
