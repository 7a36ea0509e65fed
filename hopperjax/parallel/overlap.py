"""``comm.overlap``: the XLA flags that schedule collectives behind compute, set at the entry point.

XLA reads ``XLA_FLAGS`` once, when JAX starts its first backend, so the entry points
(``hopperjax.train``, ``hopperjax.inspect``) call ``apply`` right after reading the config and
before anything touches a device, print what it set on their first console line, and the run's
``config.yaml`` records the mode. The only other flag hopperjax sets is ``cpu_convolutions``'s
(``xla_cpu.py``, whose ``prepare_process`` applies both).

- ``default``: nothing is set; XLA's own scheduling (on GPUs it already runs collectives
  asynchronously; recent XLA pipelines data-parallel collectives at its higher optimization
  levels).
- ``aggressive``: the latency-hiding scheduler; all-gather, reduce-scatter and all-reduce
  pipelined across a scanned model's layers; while-loop double buffering (the next layer's
  weights gathered during this one's compute); collectives on the highest-priority stream; large
  combine thresholds (fewer, larger collectives); and ``CUDA_DEVICE_MAX_CONNECTIONS=1``, one
  hardware queue, so kernels launch in the order XLA scheduled them (NVIDIA's JAX-Toolbox
  recommends it on Hopper; not on Blackwell, where the default is better).
- ``off``: the latency-hiding scheduler off and every collective synchronous: the baseline that
  shows what overlap buys.

The flags are GPU flags: a CPU backend accepts and ignores them. A flag the user already put in
``XLA_FLAGS`` wins (theirs come after ours).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

MODES = ("off", "default", "aggressive")
# Combine thresholds: NVIDIA's JAX-Toolbox examples use 1 GiB for all-reduce and divide it by the
# device count for the all-gathers and reduce-scatters of FSDP; these are for 8 GPUs.
_GIB = 1 << 30
FLAGS: dict[str, tuple[str, ...]] = {
    "off": (
        "--xla_gpu_enable_latency_hiding_scheduler=false",
        "--xla_gpu_disable_async_collectives=ALLREDUCE,ALLGATHER,REDUCESCATTER,"
        "COLLECTIVEPERMUTE,ALLTOALL",
    ),
    "default": (),
    "aggressive": (
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_gpu_enable_pipelined_all_gather=true",
        "--xla_gpu_enable_pipelined_reduce_scatter=true",
        "--xla_gpu_enable_pipelined_all_reduce=true",
        "--xla_gpu_enable_while_loop_double_buffering=true",
        "--xla_gpu_enable_highest_priority_async_stream=true",
        f"--xla_gpu_all_reduce_combine_threshold_bytes={_GIB}",
        f"--xla_gpu_all_gather_combine_threshold_bytes={_GIB // 8}",
        f"--xla_gpu_reduce_scatter_combine_threshold_bytes={_GIB // 16}",
    ),
}
ENV: dict[str, dict[str, str]] = {"aggressive": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}}


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def apply(mode: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Puts ``mode``'s flags in ``XLA_FLAGS`` (and its environment variables) before JAX starts.

    A flag (or variable) the environment already sets is left as the user set it. Idempotent.

    Returns:
      the console line saying what was set, or None for ``default`` (nothing set).

    Raises:
      ValueError: an unknown mode (the config's Literal type refuses one first).
      RuntimeError: JAX has already started a backend, so XLA would not read the flags.
    """
    if mode not in MODES:
        raise ValueError(f"comm.overlap: expected one of {', '.join(MODES)}, got {mode!r}")
    environ = os.environ if environ is None else environ
    if not FLAGS[mode] and not ENV.get(mode):
        return None
    if environ is os.environ and backend_started():
        raise RuntimeError("comm.overlap must be applied before JAX starts a backend")
    user = environ.get("XLA_FLAGS", "").split()
    taken = {_flag_name(f) for f in user}
    ours = [f for f in FLAGS[mode] if _flag_name(f) not in taken]
    environ["XLA_FLAGS"] = " ".join([*ours, *user])
    set_env = []
    for name, value in ENV.get(mode, {}).items():
        if name not in environ:
            environ[name] = value
            set_env.append(f"{name}={value}")
    kept = len(FLAGS[mode]) - len(ours)
    return (
        f"hopperjax: comm.overlap={mode}: XLA_FLAGS += {' '.join(ours) or '(nothing new)'}"
        + (f"; {' '.join(set_env)}" if set_env else "")
        + (f" ({kept} already set by you, kept)" if kept else "")
    )


def backend_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - a JAX without it: cannot tell, assume not
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started and started())
