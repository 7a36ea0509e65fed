"""Observability: metric sinks, profiler windows and trace summaries, hardware telemetry."""

from hopperjax.observe.gpu import GpuMonitor, device_memory_stats
from hopperjax.observe.metrics import MetricsWriter, read_metrics
from hopperjax.observe.profile import ProfileWindow, step_annotation
from hopperjax.observe.trace_summary import ProfileSummaryError, format_summary, summarize_trace

__all__ = [
    "GpuMonitor",
    "MetricsWriter",
    "ProfileSummaryError",
    "ProfileWindow",
    "device_memory_stats",
    "format_summary",
    "read_metrics",
    "step_annotation",
    "summarize_trace",
]
