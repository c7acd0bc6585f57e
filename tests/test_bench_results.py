"""The benchmark page is rendered from the benches' results files, and only from them: the page
in the repository is what bench/render.py makes of bench/results/, every results file says
how its figures were made, and what a bench writes is what the page shows."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.test_bench_report import cache_bench

BENCH = Path(__file__).resolve().parents[1] / "bench"
RESULTS = BENCH / "results"


def _bench_module(name: str) -> ModuleType:
    """bench/<name>.py as `bench_<name>` (bench/sinks.py would shadow the `sinks` package)."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))  # after the project: `capture` and `figures` are the bench's
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def figures() -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    import figures

    return figures


@pytest.fixture(scope="module")
def render() -> ModuleType:
    return _bench_module("render")


def test_the_page_is_what_the_results_files_render(figures, render):
    page = render.PAGE.read_text()
    assert page == render.render(figures.load_all(RESULTS)), "run: python bench/render.py"
    assert render.main(["--check"]) == 0


def test_the_check_fails_on_a_page_edited_by_hand(render, tmp_path, monkeypatch):
    edited = tmp_path / "benchmarks.md"
    edited.write_text(render.PAGE.read_text() + "\nA figure typed in by hand.\n")
    monkeypatch.setattr(render, "PAGE", edited)
    assert render.main(["--check"]) == 1


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_results_file_says_how_its_figures_were_made(figures, render, path):
    document = json.loads(path.read_text())
    assert figures.problems(document) == []
    assert path.name == f"{document['name']}.json"
    assert document["name"] == document["bench"] or document["name"].startswith(document["bench"] + "-")
    assert document["bench"] in {section.bench for section in render.SECTIONS}
    assert path.read_text() == figures.dump(document), "rewrite it with figures.dump"


def test_a_results_file_missing_its_provenance_is_named(figures):
    assert "no 'command'" in figures.problems({"bench": "x", "tables": []})


REPORT = """
## A bench

Command: `python bench/a.py --rows 10`, 2026-11-29 03:00 UTC

Workload: 10 rows.

| pipeline | rows/s | note |
|---|---:|---|
| cdc | 1,000 | a \\| b |

What the table says.

### Latency

| pipeline | p99 |
|---|---:|
| cdc | 3.0 ms |

| target | verdict |
|---|---|
| p99 < 100 ms | met |
"""


def test_the_writer_writes_what_the_renderer_reads(figures, render, tmp_path):
    path = figures.write("capture", REPORT, title="A bench", versions={"kafka": "4.1.1"}, variant="small",
                         load_during=(0.5, 1.25), directory=tmp_path, argv=["/somewhere/bench/capture.py", "--rows", "10"])
    assert path == tmp_path / "capture-small.json"
    [document] = figures.load_all(tmp_path)
    assert figures.problems(document) == []
    assert document["command"] == "python bench/capture.py --rows 10"
    assert document["load"]["during"] == [0.5, 1.25]
    assert document["notes"] == ["Workload: 10 rows."]  # the command line is the file's, not a note
    first, latency, targets = document["tables"]
    assert (first["title"], first["columns"], first["align"]) == ("A bench", ["pipeline", "rows/s", "note"], "lrl")
    assert first["rows"] == [["cdc", "1,000", "a | b"]] and first["notes"] == ["What the table says."]
    assert (latency["title"], latency["rows"]) == ("Latency", [["cdc", "3.0 ms"]])
    assert targets["title"] == "Target"  # the heading's second table: named by its first column
    page = render.render([document])
    assert "- Command: `python bench/capture.py --rows 10`" in page
    assert "| cdc | 1,000 | a \\| b |" in page and "**Latency**" in page
    assert "{#results-capture-small}" in page


def test_the_sinks_bench_writes_its_report_as_a_results_file(figures, tmp_path, monkeypatch):
    b = _bench_module("sinks")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    argv = ["bench/sinks.py", "--changes", "1000", "--stores", "cache", "--max-offsets", "1000"]
    monkeypatch.setattr(sys, "argv", argv)
    bench = cache_bench(b, argv[1:])
    try:
        report = bench.report()
        path = bench.record(report, directory=tmp_path)
    finally:
        bench.close()
    assert path.name == "sinks-cache.json"
    document = json.loads(path.read_text())
    assert figures.problems(document) == []
    assert document["command"] == "python bench/sinks.py --changes 1000 --stores cache --max-offsets 1000"
    assert document["title"] == "Sink jobs vs. Spark's read ceiling" and "python" in document["versions"]
    rows = [row for table in document["tables"] for row in table["rows"]]
    assert ["cache apply / the room its server alone leaves, maxOffsetsPerTrigger 1,000", "0.19 (0.25 / 1.33)",
            ">= 0.8 (**missed**)"] in rows
