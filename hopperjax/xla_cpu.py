"""``cpu_convolutions``: the library XLA:CPU runs convolutions with, set before JAX starts.

jaxlib 0.10's XLA:CPU hands convolutions to YNNPACK (its "library fusions") by default. On the
shapes of a ResNet that is slow for the weight gradient: ResNet-9's weight gradients at batch 64
on 2 AMD EPYC cores ran at 11-111 GFLOP/s (its 32x32 64 -> 128 layer's at 11: 858 ms) against
24-162 GFLOP/s (78: 125 ms) from XLA's own convolution (Eigen's), which also runs most input
gradients faster
(``tools/conv_bench.py``; docs/images.md has the table and the whole step: 29.6 s -> 10.8 s,
PyTorch's 10.1 s). So:

- ``eigen`` (the default): ``--xla_cpu_experimental_ynn_fusion_type=-individual_convolution``,
  which takes convolutions out of YNNPACK's fusions and leaves its other fusions (dots,
  elementwise, reductions) as they are.
- ``ynnpack``: nothing set; XLA's default, the baseline that shows what ``eigen`` buys.

GPU backends ignore the flag. XLA reads ``XLA_FLAGS`` once, when JAX starts its first backend,
and aborts the process on a flag it does not know, so ``apply`` sets the flag only where the
installed jaxlib carries it (its name in jaxlib's libraries, a ~50 ms read), and never overrides
the flag where the user's ``XLA_FLAGS`` already sets it. Like ``comm.overlap``
(``parallel/overlap.py``), it is applied by the entry points (``hopperjax.train``'s CLI,
``hopperjax.inspect``) and by ``hopperjax.train`` when it runs in a process whose JAX has not
started a backend yet.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import MutableMapping
from functools import cache
from pathlib import Path

MODES = ("eigen", "ynnpack")
FLAG_NAME = "--xla_cpu_experimental_ynn_fusion_type"
FLAGS: dict[str, tuple[str, ...]] = {
    "eigen": (f"{FLAG_NAME}=-individual_convolution",),
    "ynnpack": (),
}


@cache
def jaxlib_knows_flag(name: str = FLAG_NAME) -> bool:
    """Whether the installed jaxlib's shared libraries name the XLA flag ``name`` (without
    starting JAX: XLA aborts the process on an unknown flag)."""
    import jaxlib  # the package only: importing it starts no backend

    needle = name.lstrip("-").encode()
    for path in sorted(Path(jaxlib.__file__).parent.glob("*.so")):
        try:
            with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(needle) >= 0:
                    return True
        except (OSError, ValueError):  # unreadable, or empty (mmap refuses length 0)
            continue
    return False


def apply(mode: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Puts ``mode``'s flag in ``XLA_FLAGS`` before JAX starts. Idempotent.

    Returns:
      the console line saying what was set (or why nothing was), or None when there is nothing
      to say (``ynnpack``, or the flag already set as ``mode`` sets it).

    Raises:
      ValueError: an unknown mode (the config's Literal type refuses one first).
      RuntimeError: JAX has already started a backend, so XLA would not read the flag.
    """
    if mode not in MODES:
        raise ValueError(f"cpu_convolutions: expected one of {', '.join(MODES)}, got {mode!r}")
    environ = os.environ if environ is None else environ
    user = environ.get("XLA_FLAGS", "").split()
    if not FLAGS[mode] or any(f in user for f in FLAGS[mode]):
        return None
    mine = [f for f in user if f.split("=", 1)[0] == FLAG_NAME]
    if mine:
        return f"hopperjax: cpu_convolutions={mode} not applied: XLA_FLAGS sets {mine[-1]}, kept"
    if not jaxlib_knows_flag():
        return (
            f"hopperjax: cpu_convolutions={mode} not applied: this jaxlib has no "
            f"{FLAG_NAME} (its XLA:CPU default stays)"
        )
    if environ is os.environ and _backend_started():
        raise RuntimeError("cpu_convolutions must be applied before JAX starts a backend")
    environ["XLA_FLAGS"] = " ".join([*FLAGS[mode], *user])
    return None


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - a JAX without it: cannot tell, assume not
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started and started())
