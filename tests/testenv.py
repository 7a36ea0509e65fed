"""The XLA flags of test processes, decided once per test run (see ``xla_flags``)."""

import os
import subprocess
import sys

# The controller of a pytest-xdist run loads this file before it starts its workers, which inherit
# its environment: the probe's answer, decided here once, reaches every worker and the
# CLI subprocesses the tests start.
_SHARED = "HOPPERJAX_TEST_XLA_FLAGS"

# LLVM optimization level 0 instead of XLA:CPU's default, and its older loop emitters instead of
# its fusion emitters: the suite's time is mostly compiling tiny programs, which these make faster
# (level 1 took ~25 % off the default's test time, level 0 ~25 % off level 1's; the emitters
# ~40 %). The programs (and so what the tests check) are the same HLO, only the CPU code generated
# for them is less tuned: a step runs 3-4x slower than at level 1 (the precision quality test and
# the README's example, 50 and 30 steps of larger models, take longer). An XLA flag the installed
# jaxlib does not know aborts the process, so the second is probed once, in a subprocess.
FAST_COMPILE = "--xla_backend_optimization_level=0"
PROBED = "--xla_cpu_use_fusion_emitters=false"


def _test_xla_flags() -> str:
    if _SHARED not in os.environ:
        flags = FAST_COMPILE
        probe = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices()"],
            env={**os.environ, "XLA_FLAGS": f"{flags} {PROBED}", "JAX_PLATFORMS": "cpu"},
            capture_output=True,
            timeout=300,
        )
        os.environ[_SHARED] = f"{flags} {PROBED}" if probe.returncode == 0 else flags
    return os.environ[_SHARED]


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process with this many fake CPU devices, and the convolutions of the
    default ``cpu_convolutions`` (as the CLI would set them; hopperjax/xla_cpu.py)."""
    from hopperjax import xla_cpu  # imports JAX, which reads XLA_FLAGS only when a backend starts

    convs = " ".join(xla_cpu.FLAGS["eigen"]) if xla_cpu.jaxlib_knows_flag() else ""
    return f"--xla_force_host_platform_device_count={devices} {_test_xla_flags()} {convs}".strip()
