"""Observability: metric sinks (console, JSONL, TensorBoard)."""

from hopperjax.observe.metrics import MetricsWriter, read_metrics

__all__ = ["MetricsWriter", "read_metrics"]
