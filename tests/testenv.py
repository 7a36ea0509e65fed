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
# jaxlib does not know aborts the process, so the others (and the cpu_convolutions flag) are
# probed once, in a subprocess. One LLVM module per program instead of several compiled on
# threads: with two workers on two cores the threads only contend, and the split costs work of
# its own (~10 % less CPU time for the contract tests of two workloads, paired runs).
FAST_COMPILE = "--xla_backend_optimization_level=0"
PROBED = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")


def _accepted(flags: list[str]) -> bool:
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"],
        env={**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        timeout=300,
    )
    return probe.returncode == 0


def _test_xla_flags() -> str:
    if _SHARED not in os.environ:
        # The default cpu_convolutions' flag too, as the CLI sets it (hopperjax/xla_cpu.py). The
        # import brings in JAX, which reads XLA_FLAGS only when a backend starts.
        from hopperjax.xla_cpu import FLAGS

        optional = [*PROBED, *FLAGS["eigen"]]
        if _accepted([FAST_COMPILE, *optional]):
            flags = [FAST_COMPILE, *optional]
        else:
            flags = [FAST_COMPILE, *(f for f in optional if _accepted([FAST_COMPILE, f]))]
        os.environ[_SHARED] = " ".join(flags)
    return os.environ[_SHARED]


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process with this many fake CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {_test_xla_flags()}"
