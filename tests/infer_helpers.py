"""Helpers of the inference tests: a workload's smoke model at init as a ``Restored`` (no run,
no training) with a few of its training batches, and its predictions on a host batch."""

from __future__ import annotations

import jax
import numpy as np

import hopperjax
from hopperjax import workloads
from hopperjax.infer import Restored


def restored_from_init(name: str, tmp_path, *overrides: str) -> tuple[Restored, list]:
    from hopperjax.trainer import build_components

    config = hopperjax.load_config(
        None, [f"workload={name}", *workloads.get(name).smoke_overrides, "mesh.data=1",
               f"run_dir={tmp_path}", *overrides],
    )  # fmt: skip
    parts = build_components(config, devices=jax.devices()[:1])
    state = parts.init_state()
    variables = {"params": state.params, **(state.model_state or {})}
    batches = [b for _, b in zip(range(3), iter(parts.datasets.train), strict=False)]
    return Restored(config, parts.workload, parts.model, variables, 0), batches


def first(outputs):
    return outputs[0] if isinstance(outputs, tuple) else outputs


def predict_batch(restored: Restored, batch) -> np.ndarray:
    """The workload's predictions on a host batch, preprocessed as evaluation does (jitted, as
    evaluation is: one compile instead of one per operation)."""
    workload = restored.workload

    @jax.jit
    def predict(variables, batch):
        batch = workload.preprocess(batch, jax.random.key(0), train=False)
        return first(workload.predict(restored.model, variables, batch))

    return np.asarray(predict(restored.variables, batch), np.float32)
