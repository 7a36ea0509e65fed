"""Workloads by name: the one extension seam (``base.Workload`` is the contract).

``get(name)`` finds a workload class: one added with ``register(name, cls)``, a module of this
package (``hopperjax.workloads.<name>``), or any importable module named by a dotted path
(``mypackage.my_workload``); a module names its class with a module-level ``WORKLOAD``. So a
user's own package adds a workload without editing hopperjax::

    from hopperjax import workloads
    workloads.register("toy", ToyWorkload)       # then `workload: toy` in a config

This module imports nothing from hopperjax at import time (``config.py`` asks it for the
``model:`` and ``data:`` schema of the configured workload); workload modules are imported by name
on first use.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Any

# Modules of this package that are not workloads.
_NOT_WORKLOADS = frozenset({"base"})
# Class attributes and methods every workload class has (``base.Workload`` declares them).
_REQUIRED = (
    "ModelConfig",
    "DataConfig",
    "build_model",
    "build_datasets",
    "batch_fields",
    "model_inputs",
    "loss",
    "eval_outputs",
    "summarize",
    "model_flops_per_step",
    "examples_per_step",
)

_registered: dict[str, type] = {}


class UnknownWorkload(LookupError):
    """No workload by that name; the message suggests the nearest known one."""


def register(name: str, cls: type) -> type:
    """Makes ``cls`` (a ``base.Workload`` subclass) the workload called ``name``; returns it.

    Raises:
      TypeError: ``cls`` lacks part of the contract or is still abstract.
    """
    missing = [attr for attr in _REQUIRED if not hasattr(cls, attr)]
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing or abstract:
        raise TypeError(
            f"workload {name!r}: {cls.__name__} does not implement "
            f"{', '.join(missing + abstract)} (see hopperjax.workloads.base.Workload)"
        )
    _registered[name] = cls
    return cls


def builtin_names() -> list[str]:
    """The workload modules of this package, e.g. ``["dta", "lm"]``."""
    return sorted(
        m.name
        for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_") and m.name not in _NOT_WORKLOADS
    )


def names() -> list[str]:
    """Every workload ``get`` finds without a dotted path: built-in and registered."""
    return sorted(set(builtin_names()) | set(_registered))


def get(name: str) -> Any:
    """The workload class called ``name``.

    Raises:
      UnknownWorkload: no such workload (the message names the nearest one), or its module does
        not define ``WORKLOAD``.
    """
    if name in _registered:
        return _registered[name]
    if name in builtin_names():
        module_name = f"{__name__}.{name}"
    elif "." in name:
        module_name = name
    else:
        near = difflib.get_close_matches(name, names(), n=1, cutoff=0.5)
        hint = f"; did you mean '{near[0]}'?" if near else f" (known: {', '.join(names())})"
        raise UnknownWorkload(f"unknown workload '{name}'{hint}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UnknownWorkload(f"cannot import workload module '{module_name}': {e}") from None
    cls = getattr(module, "WORKLOAD", None)
    if cls is None:
        raise UnknownWorkload(f"module '{module_name}' defines no WORKLOAD class")
    return register(name, cls)


def from_config(config: Any) -> Any:
    """The configured workload, bound to ``config`` (``get(config.workload)(config)``)."""
    return get(config.workload)(config)


__all__ = ["UnknownWorkload", "builtin_names", "from_config", "get", "names", "register"]
