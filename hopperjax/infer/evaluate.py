"""A restored (or quantized) model's quality and latency, through the workload seam only.

``evaluate`` scores the eval split as training's evaluation does (preprocess, ``predict``,
``eval_outputs``, ``summarize``; plus ``generation_metrics`` for workloads that generate), so a
quantized model's figures compare one to one with the float model's. ``latency`` times the
jitted ``predict`` on one batch.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from hopperjax.infer.restore import Restored
from hopperjax.precision import policy_from_config
from hopperjax.workloads.base import Datasets


def _predict_fn(restored: Restored) -> Any:
    workload, model = restored.workload, restored.model

    @jax.jit
    def predict(variables: dict[str, Any], batch: Any) -> Any:
        batch = workload.preprocess(batch, jax.random.key(0), train=False)
        return workload.eval_outputs(workload.predict(model, variables, batch), batch)

    return predict


def evaluate(
    restored: Restored, datasets: Datasets, *, limit: int | None = None, generate: bool = True
) -> dict[str, float]:
    """The workload's eval metrics over the eval split (its first ``limit`` batches), and its
    generation metrics when it has them and ``generate`` is set, traced under the run's matmul
    precision as training's evaluation is."""
    predict = _predict_fn(restored)
    outputs = []
    with _precision(restored):
        for batch in itertools.islice(datasets.eval, limit):
            outputs.append(predict(restored.variables, batch))
        metrics = restored.workload.summarize(jax.device_get(outputs))
        if generate and restored.workload.generates():
            workload = restored.workload
            metrics.update(
                workload.generation_metrics(restored.model, restored.variables, datasets)
            )
    return metrics


def _precision(restored: Restored) -> Any:
    config, workload = restored.config, restored.workload
    policy = policy_from_config(config, default_fp8_layers=workload.default_fp8_layers)
    return jax.default_matmul_precision(policy.matmul_precision)


def latency(restored: Restored, batch: Mapping[str, Any], *, repeats: int = 20) -> float:
    """Median seconds of one jitted ``predict`` (with preprocessing) on ``batch``, compiled and
    warmed up first."""
    predict = _predict_fn(restored)
    times = []
    with _precision(restored):
        jax.block_until_ready(predict(restored.variables, batch))
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(predict(restored.variables, batch))
            times.append(time.perf_counter() - start)
    return float(np.median(times))


def first_batches(batches: Iterable[Any], n: int) -> list[Any]:
    """The first ``n`` batches of an iterable (calibration, latency)."""
    return list(itertools.islice(batches, n))
