"""Whether a run directory's checkpoints can be resumed with the config at hand.

A checkpoint restores into the state the config builds, so a change that alters the state's
structure (a model size, the optimizer, the precision's FP8 or loss-scale state, gradient
clipping's optimizer slot, ...) cannot resume. Two checks, both before any array is read:

- keys that define the run refuse any change: ``workload``, every ``model.*`` key, ``optim.name``;
- every other change is allowed unless the state it builds differs from the checkpoint's saved
  structure (paths, shapes, dtypes from the checkpoint's metadata); the error then names the keys
  that changed since the checkpoints were written, and the first array that differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import yaml

from hopperjax import config as config_lib
from hopperjax.checkpoint import Checkpointer
from hopperjax.config import Config, ConfigError

# Keys whose change is refused whatever it does to the state: they define what is trained.
RUN_DEFINING_PREFIXES = ("workload", "model.", "optim.name")
# Keys that can change the state's structure besides those: named first when it does not fit.
STATE_SHAPING_PREFIXES = (
    "precision",
    "loss_scale.",
    "fp8.",
    "optim.",
    "offload.",
    "remat.",
    "comm.",
)
# Keys that never shape the state.
_NAMING_KEYS = ("name", "run_dir")
_MISSING = "(absent)"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict -> ``{"dotted.key": value}``."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def state_leaves(abstract_state: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{dotted path: (shape, dtype name)}`` of a (possibly abstract) state, named as orbax
    names the arrays of a checkpoint."""

    def name(path: tuple[Any, ...]) -> str:
        keys = []
        for k in path:
            for attr in ("key", "name", "idx"):
                if hasattr(k, attr):
                    keys.append(str(getattr(k, attr)))
                    break
            else:
                keys.append(str(k))
        return ".".join(keys)

    leaves, _ = jax.tree_util.tree_flatten_with_path(abstract_state)
    return {name(path): (tuple(x.shape), str(x.dtype)) for path, x in leaves}


def first_difference(
    saved: dict[str, tuple[tuple[int, ...], str]], built: dict[str, tuple[tuple[int, ...], str]]
) -> str | None:
    """The first array where two states differ, described; None when they agree."""
    for name in sorted(set(saved) | set(built)):
        if name not in built:
            return f"the checkpoints hold {name}, which this config's state has not"
        if name not in saved:
            return f"this config's state has {name}, which the checkpoints have not"
        if saved[name] != built[name]:
            (s_shape, s_dtype), (b_shape, b_dtype) = saved[name], built[name]
            return (
                f"{name} is {b_dtype}{list(b_shape)} here and {s_dtype}{list(s_shape)} in "
                f"the checkpoints"
            )
    return None


# State fields a resume may start afresh when their layout changed, with the keys that decide the
# layout: gradient-compression residuals follow the mesh and the parameters' shards
# (parallel/compress.py), and two meshes can give residuals of the same shape, so a change of
# those keys restarts them too.
RESTARTABLE_FIELDS = {"comm": ("mesh.", "comm.")}


def _restartable(name: str) -> bool:
    return name.split(".", 1)[0] in RESTARTABLE_FIELDS


def changed_keys(run_dir: Path, config: Config) -> dict[str, tuple[Any, Any]]:
    """Every dotted key where ``run_dir``'s ``config.yaml`` and ``config`` differ, sorted, as
    ``{key: (old, new)}`` (``"(absent)"`` for a key one side lacks); empty when the directory has
    no ``config.yaml``. ``config`` goes through the same YAML round trip as the saved file, so a
    tuple and the list YAML reads back compare equal. A key the saved file lacks (added to the
    schema after the run was written) counts as its default, which by convention keeps the
    behaviour from before the key existed; the file is read as written where today's schema
    no longer loads it (a key since removed)."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return {}
    try:
        completed = config_lib.load_config(saved, validate_values=False)
        before = flatten(yaml.safe_load(config_lib.dump_yaml(completed)))
    except ConfigError:
        before = flatten(yaml.safe_load(saved.read_text()) or {})
    now = flatten(yaml.safe_load(config_lib.dump_yaml(config)))
    changed = {}
    for key in sorted(set(before) | set(now)):
        old, new = before.get(key, _MISSING), now.get(key, _MISSING)
        if old != new:
            changed[key] = (old, new)
    return changed


def check_resumable(
    config: Config, run_dir: Path, abstract_state: Any, checkpointer: Checkpointer, step: int
) -> tuple[str, ...]:
    """Raises ConfigError (naming the key) if ``config`` cannot resume ``run_dir``'s checkpoint
    of ``step``; does nothing for step 0 (a fresh start).

    Returns:
      the ``RESTARTABLE_FIELDS`` whose arrays do not fit the checkpoint's (another mesh, or
      compression switched on or off): the resume restores everything else and starts those
      afresh.
    """
    if not step:
        return ()
    changed = changed_keys(run_dir, config)
    for key, (old, new) in changed.items():
        if key.startswith(RUN_DEFINING_PREFIXES):
            raise ConfigError(
                key,
                f"changed from {old!r} to {new!r}, but {run_dir} holds checkpoints of the old "
                f"value; use a new run_dir",
            )
    saved, built = checkpointer.state_leaves(step), state_leaves(abstract_state)
    restart = []
    for field, layout_keys in RESTARTABLE_FIELDS.items():
        was = {k: v for k, v in saved.items() if k.split(".", 1)[0] == field}
        now_ = {k: v for k, v in built.items() if k.split(".", 1)[0] == field}
        if (was or now_) and (
            first_difference(was, now_) or any(k.startswith(layout_keys) for k in changed)
        ):
            restart.append(field)
    restart = tuple(restart)
    difference = first_difference(
        {k: v for k, v in saved.items() if not _restartable(k)},
        {k: v for k, v in built.items() if not _restartable(k)},
    )
    if difference is None:
        return restart
    suspects = sorted(
        (k for k in changed if k not in _NAMING_KEYS),
        key=lambda k: not k.startswith(STATE_SHAPING_PREFIXES),
    )
    what = ", ".join(f"{k} ({changed[k][0]!r} -> {changed[k][1]!r})" for k in suspects)
    key = suspects[0] if suspects else "run_dir"
    raise ConfigError(
        key,
        f"the train state this config builds does not fit the checkpoints in {run_dir} "
        f"(step {step}): {difference}; changed since they were written: {what or 'nothing'}; "
        f"use a new run_dir",
        name_key=False,
    )
