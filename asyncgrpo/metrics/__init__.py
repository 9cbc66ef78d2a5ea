"""Where a run's numbers go: metrics sinks (JSONL, TensorBoard, W&B) and the sample log; and how
a run directory's numbers are read back (runs.py: `load_run`, for plots, studies, the simulator)."""

from asyncgrpo.metrics.samples import SampleLogger, format_samples_table
from asyncgrpo.metrics.sinks import (
    JsonlSink,
    MetricsSink,
    MultiSink,
    SinkUnavailable,
    TensorBoardSink,
    WandbSink,
    numeric_items,
    open_sinks,
    require_sink_packages,
    set_aside_steps_after,
)

__all__ = [
    "JsonlSink",
    "MetricsSink",
    "MultiSink",
    "SampleLogger",
    "SinkUnavailable",
    "TensorBoardSink",
    "WandbSink",
    "format_samples_table",
    "numeric_items",
    "open_sinks",
    "require_sink_packages",
    "set_aside_steps_after",
]
