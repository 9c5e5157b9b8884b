"""The ``tandem`` command line and the process-level settings only a process's entry point
may make (CPU affinity of the pipeline's threads, the C allocator's thresholds)."""

from .commands import build_parser, entry, main, run_async

__all__ = ["build_parser", "entry", "main", "run_async"]
