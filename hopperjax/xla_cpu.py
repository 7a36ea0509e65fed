"""``cpu_convolutions``: the library XLA:CPU runs convolutions with, set before JAX starts.

jaxlib 0.10's XLA:CPU hands convolutions to YNNPACK (its "library fusions") by default. On the
shapes of a ResNet that is slow for the weight gradient: ResNet-9's weight gradients at batch 64
on 2 AMD EPYC cores ran at 11-111 GFLOP/s (its 32x32 64 -> 128 layer's at 11: 858 ms) against
24-162 GFLOP/s (78: 125 ms) from XLA's own convolution (Eigen's), which also runs most input
gradients faster (``tools/conv_bench.py``; docs/images.md has the table and the whole step:
29.6 s -> 10.8 s, PyTorch's 10.1 s). So:

- ``eigen`` (the default): ``--xla_cpu_experimental_ynn_fusion_type=-individual_convolution``,
  which takes convolutions out of YNNPACK's fusions and leaves its other fusions (dots,
  elementwise, reductions) as they are.
- ``ynnpack``: nothing set; XLA's default, the baseline that shows what ``eigen`` buys.

GPU backends ignore the flag. XLA reads ``XLA_FLAGS`` once, when JAX starts its first backend,
and aborts the process on a flag it does not know, so ``apply`` sets the flag only where the
installed jaxlib accepts it (``jaxlib_accepts``: a JAX started with it in a subprocess, once per
jaxlib, the answer kept in the cache directory), and leaves ``XLA_FLAGS`` as the user set it
where it already names the flag or names a flag file. ``prepare_process`` applies it with
``comm.overlap`` in the train CLI, ``hopperjax.inspect`` and the step-timing tools and experiments
(``bench_loop``, ``find_batch``, ``cifar10_benchmark``, ``precision_compare``,
``compression_compare``, ``remat_tradeoff``); ``hopperjax.train`` applies it too, for library
callers and the other experiments, when it runs in a process whose JAX has not started yet.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import MutableMapping
from functools import cache
from pathlib import Path
from typing import Any

from hopperjax import files
from hopperjax.parallel import overlap

MODES = ("eigen", "ynnpack")
FLAG_NAME = "--xla_cpu_experimental_ynn_fusion_type"
FLAGS: dict[str, tuple[str, ...]] = {
    "eigen": (f"{FLAG_NAME}=-individual_convolution",),
    "ynnpack": (),
}
_PROBE_CACHE = "xla_flags.json"


def _jaxlib_key() -> str:
    """The installed jaxlib, as the probe's answers are kept: version, place and build time."""
    import jaxlib  # the package only: importing it starts no backend
    import jaxlib.version

    where = Path(jaxlib.__file__).parent
    stamp = max((p.stat().st_mtime_ns for p in where.glob("*.so")), default=0)
    return f"jaxlib {jaxlib.version.__version__} | {where} | {stamp}"


@cache
def jaxlib_accepts(flag: str) -> bool:
    """Whether a JAX started with ``XLA_FLAGS=flag`` runs (XLA aborts on a flag it does not
    know; a jaxlib's libraries also hold the names of removed flags, so only starting it tells).
    Asked once per jaxlib install: the answer is kept in ``files.cache_dir()``."""
    root = files.cache_dir()
    path = None if root is None else root / _PROBE_CACHE
    key = _jaxlib_key()
    try:
        kept: Any = json.loads(path.read_text()) if path else {}
    except (OSError, ValueError):
        kept = {}
    kept = kept if isinstance(kept, dict) else {}
    answers = kept.get(key) if isinstance(kept.get(key), dict) else {}
    if isinstance(answers.get(flag), bool):
        return answers[flag]
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    try:  # -P: the working directory stays off the child's path (a local jax.py)
        probe = subprocess.run(
            [sys.executable, "-P", "-c", "import jax; jax.devices()"],
            env=env,
            capture_output=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired):  # no answer: not set, and asked again next time
        return False
    accepted = probe.returncode == 0
    if not accepted and b"Unknown flag" not in probe.stderr:
        return False  # failed for another reason (memory, the environment): not kept
    if path is not None:
        kept[key] = {**answers, flag: accepted}
        with contextlib.suppress(OSError):  # a read-only home: probed in each process
            files.write_text(path, json.dumps(kept, indent=1) + "\n")
    return accepted


def apply(mode: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Puts ``mode``'s flag at the front of ``XLA_FLAGS`` before JAX starts. Idempotent.

    Args:
      mode: one of ``MODES``.
      environ: the environment to change (default ``os.environ``).

    Returns:
      the console line saying why nothing was set where that differs from what ``mode`` asks
      (the user's ``XLA_FLAGS`` names the flag or a flag file; this jaxlib lacks the flag), or
      None (set, or nothing to set).

    Raises:
      ValueError: an unknown mode (the config's Literal type refuses one first).
      RuntimeError: JAX has already started a backend, so XLA would not read the flag.
    """
    if mode not in MODES:
        raise ValueError(f"cpu_convolutions: expected one of {', '.join(MODES)}, got {mode!r}")
    environ = os.environ if environ is None else environ
    current = environ.get("XLA_FLAGS", "")
    if names_flag_file(current):  # a mode that sets nothing has nothing to say about it
        return (
            f"hopperjax: cpu_convolutions={mode} not applied: XLA_FLAGS names a flag file"
            if FLAGS[mode]
            else None
        )
    named = [f for f in current.split() if f.split("=", 1)[0] == FLAG_NAME]
    if named:
        if not FLAGS[mode] or named[-1] != FLAGS[mode][0]:
            return f"hopperjax: cpu_convolutions={mode} not applied: XLA_FLAGS sets {named[-1]}"
        return None
    if not FLAGS[mode]:
        return None
    if environ is os.environ and overlap.backend_started():
        raise RuntimeError("cpu_convolutions must be applied before JAX starts a backend")
    if not jaxlib_accepts(FLAGS[mode][0]):
        return (
            f"hopperjax: cpu_convolutions={mode} not applied: this jaxlib has no {FLAG_NAME} "
            f"(its XLA:CPU default stays)"
        )
    environ["XLA_FLAGS"] = f"{' '.join(FLAGS[mode])} {current}".strip()
    return None


def names_flag_file(xla_flags: str) -> bool:
    """Whether ``XLA_FLAGS`` names a file of flags (XLA reads a value that does not start with
    ``-`` so); flags put in front would make it a list of flags and the file unread."""
    return bool(xla_flags.strip()) and not xla_flags.lstrip().startswith("-")


def apply_or_say(mode: str) -> str | None:
    """``apply`` in this process; where JAX has already started, the line saying the flag could
    not be set (on CPU: GPUs ignore the flag) instead of an error."""
    try:
        return apply(mode)
    except RuntimeError:
        import jax

        if jax.default_backend() != "cpu":
            return None
        flags = " ".join(FLAGS[mode])
        return (
            f"hopperjax: cpu_convolutions={mode} not applied: JAX started first (call "
            f"hopperjax.xla_cpu.prepare_process(config) before it starts, or add {flags} to "
            f"XLA_FLAGS)"
        )


def prepare_process(config: Any) -> list[str]:
    """The XLA flags of ``config`` (``comm.overlap``, ``cpu_convolutions``) put in ``XLA_FLAGS``
    for a script's process: call it first, before anything starts JAX. Where JAX already runs,
    or ``XLA_FLAGS`` names a flag file, a line says what was not applied. Returns the lines to
    print, each once per process (``unsaid``)."""
    lines = []
    if names_flag_file(os.environ.get("XLA_FLAGS", "")):
        mode = config.comm.overlap
        if overlap.FLAGS[mode]:
            lines.append(f"hopperjax: comm.overlap={mode} not applied: XLA_FLAGS names a flag file")
        lines.append(apply(config.cpu_convolutions))
    else:
        try:
            lines.append(overlap.apply(config.comm.overlap))
        except RuntimeError:
            lines.append(
                f"hopperjax: comm.overlap={config.comm.overlap} not applied: JAX already started"
            )
        lines.append(apply_or_say(config.cpu_convolutions))
    return [line for line in lines if unsaid(line)]


def prepare_script(config_path: str, overrides: list[str]) -> None:
    """``prepare_process`` for a tool or experiment given ``--config`` and overrides: its lines
    go to stderr; a config that does not load is left for the script's own loading to report."""
    from hopperjax.config import ConfigError, load_config

    try:
        config = load_config(config_path, overrides)
    except ConfigError:
        return
    for line in prepare_process(config):
        print(line, file=sys.stderr, flush=True)


_SAID: set[str] = set()


def unsaid(line: str | None) -> str | None:
    """``line`` the first time this process has it to say, else None: the CLI says what it could
    not apply, and ``hopperjax.train``, which applies the key again for library callers, does not
    repeat it."""
    if line is None or line in _SAID:
        return None
    _SAID.add(line)
    return line
