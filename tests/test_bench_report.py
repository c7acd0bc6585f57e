"""bench/sinks.py's report from a run's results, with no services: every table it promises is printed."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _sinks_bench():
    """bench/sinks.py as a module of its own name (the `sinks` package keeps its own)."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))  # after the project: `capture` is the bench's, `sinks` the package
    spec = importlib.util.spec_from_file_location("bench_sinks", BENCH / "sinks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_sinks"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def cache_bench(b, args: list[str]):
    """A SinksBench holding one cache run's results (1,000 records: the ceiling in 1 s, the
    apply in 4 s, Redis alone 0.5 CPU-s), as a run would leave them, with no services."""
    bench = b.SinksBench(b.parse_args(args))
    bench.load_before = (0.5, 0.5, 0.5)
    bench.records = 1000
    bench.runs = [
        b.SparkRun("ceiling", "-", 1000, 1000, seconds=1.0, cpu_s=1.0),
        b.SparkRun("apply", "cache", 1000, 1000, seconds=4.0, cpu_s=3.0),
    ]
    bench.alone["cache"] = b.Alone("cache", keys=600, seconds=1.0, server_cpu_s=0.5)
    return bench


def test_the_report_sets_each_apply_run_against_the_room_its_server_alone_leaves(monkeypatch):
    b = _sinks_bench()
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    bench = cache_bench(b, ["--changes", "1000", "--stores", "cache", "--max-offsets", "1000"])
    try:
        report = bench.report()
    finally:
        bench.close()
    # room: 2 cores / (1 ms of Spark + 0.5 ms of Redis per record) / 1,000 rows/s = 1.33; apply 0.25 of the ceiling
    assert ("| cache apply / the room its server alone leaves, maxOffsetsPerTrigger 1,000 | 0.19 (0.25 / 1.33) "
            "| >= 0.8 (**missed**) |") in report
