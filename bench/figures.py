"""A bench's results file: what it printed, as data, with what it ran on.

Each bench calls `write` with the report it printed. The file, bench/results/<name>.json,
holds the command as run, the UTC date, the machine, the load average before the run, the
versions measured, and the report's markdown tables as named tables (title, columns, rows,
notes). bench/render.py renders docs/benchmarks.md from these files, so a figure on that
page is always one a bench wrote, with the command that made it. A run replaces the file of
the same name (git keeps the history); set BENCH_RESULTS to write elsewhere, e.g. for a
smoke run at small settings.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
REQUIRED = ("bench", "name", "title", "command", "date", "machine", "load", "versions", "source", "tables")
SOURCE = "bench run"
TRANSCRIBED = "recorded before results files"  # copied once from the README's tables of the time

# taken when the bench imports this module, before it starts anything
STARTED = time.gmtime()
LOAD_BEFORE = os.getloadavg()[0]

DATE = re.compile(r"\d{4}-\d\d-\d\d(T\d\d:\d\dZ)?")  # transcribed runs may only know the day
_ALIGN_ROW = re.compile(r"^\|(\s*:?-+:?\s*\|)+$")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")


def utc(moment: time.struct_time) -> str:
    """ISO 8601 to the minute, the precision the pages show."""
    return time.strftime("%Y-%m-%dT%H:%MZ", moment)


def command(argv: list[str] | None = None) -> str:
    """The command as a user types it from the repository root, whatever the working directory."""
    argv = sys.argv if argv is None else argv
    return shlex.join(["python", f"bench/{Path(argv[0]).name}", *argv[1:]])


def machine() -> dict[str, Any]:
    """CPUs, memory, CPU model and kernel: what a figure on another machine differs by."""
    found: dict[str, Any] = {"cpus": os.cpu_count(), "memory_gib": None, "cpu_model": None,
                             "kernel": f"{platform.system()} {platform.release()}"}
    with contextlib.suppress(OSError):
        total = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        found["memory_gib"] = round(int(total.group(1)) / 2**20, 1) if total else None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                found["cpu_model"] = line.split(":", 1)[1].strip()
                break
    return found


def package_versions(*names: str) -> dict[str, str]:
    """Installed versions of the Python packages a bench uses; the missing are left out."""
    found = {}
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def jvm_versions(*names: str) -> dict[str, str]:
    """Versions of the JVM parts a bench runs (Kafka, Spark's Kafka source, Delta, OpenSearch,
    Debezium), from cdc.jars: bundles by their artifacts, distributions by their names."""
    from cdc.jars import BUNDLES, DISTRIBUTIONS

    found = {}
    for name in names:
        if name in DISTRIBUTIONS:
            found[name] = DISTRIBUTIONS[name].split(":")[2]
            continue
        for coordinate in BUNDLES[name]:
            group, artifact, version = coordinate.split(":")
            if not group.startswith("org.apache.logging"):
                part = artifact.split("_")[0]
                found["spark" if part.startswith("spark-sql-kafka") else part] = version
    return found


def program_version(name: str, argv: list[str]) -> dict[str, str]:
    """The version a server program reports (`postgres --version`, `redis-server --version`),
    its first dotted number; nothing when the program is missing."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout
        found = re.search(r"\d+\.\d+(\.\d+)?", out)
        if found:
            return {name: found.group(0)}
    return {}


def postgres_version() -> dict[str, str]:
    """The PostgreSQL server the benches start (the one cdc.local.postgres finds)."""
    from cdc.local.postgres import ServiceUnavailable, find_pg_bin_dir

    try:
        return program_version("postgresql", [str(find_pg_bin_dir() / "postgres"), "--version"])
    except ServiceUnavailable:  # no PostgreSQL here: the bench could not have run either
        return {}


def code_version() -> dict[str, str]:
    """The checkout measured: its commit, `+changes` when the work tree differs from it."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(HERE), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return {"cdc": head + ("+changes" if dirty else "")}
    return {}


def tables(report: str, title: str) -> tuple[list[str], list[dict[str, Any]]]:
    """A printed report's notes and markdown tables: a table is named by the heading above it
    (`title` before the first heading), or by its first column when it is not the heading's
    first; the text after a table up to the next is its notes. Command lines are dropped (the
    file has the command)."""
    notes: list[str] = []
    found: list[dict[str, Any]] = []
    heading: str | None = title
    lines = report.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.lower().startswith("command:"):
            continue
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
            continue
        if not line.startswith("|"):
            (found[-1]["notes"] if found else notes).append(line)
            continue
        block = [line]
        while i < len(lines) and lines[i].strip().startswith("|"):
            block.append(lines[i].strip())
            i += 1
        found.append(_table(heading, block))
        heading = None
    return notes, found


def _cells(line: str) -> list[str]:
    return [cell.strip().replace("\\|", "|") for cell in _CELL_SPLIT.split(line.strip()[1:-1])]


def _table(title: str | None, block: list[str]) -> dict[str, Any]:
    """A markdown table as data; with no title, its first column names it."""
    columns = _cells(block[0])
    title = title or columns[0][:1].upper() + columns[0][1:]
    align = "l" * len(columns)
    body = block[1:]
    if body and _ALIGN_ROW.match(body[0].replace(" ", "")):
        align = "".join("r" if cell.endswith(":") else "l" for cell in _cells(body[0]))
        body = body[1:]
    return {"title": title, "columns": columns, "align": align, "rows": [_cells(row) for row in body], "notes": []}


def write(bench: str, report: str, *, title: str, versions: dict[str, str], variant: str = "",
          load_during: tuple[float, float] | None = None, directory: Path | None = None,
          argv: list[str] | None = None) -> Path:
    """Write bench/results/<bench>[-<variant>].json from the report the bench printed. The
    variant names what the figures compare across (the stores, the tables): the latest run of
    one bench and variant replaces the previous."""
    notes, found = tables(report, title)
    if not found:
        raise ValueError(f"{bench}: the report has no table")
    name = f"{bench}-{variant}" if variant else bench
    load: dict[str, Any] = {"before": round(LOAD_BEFORE, 2)}
    if load_during:
        load["during"] = [round(load_during[0], 2), round(load_during[1], 2)]
    document = {
        "bench": bench,
        "name": name,
        "title": title,
        "command": command(argv),
        "date": utc(STARTED),
        "finished": utc(time.gmtime()),
        "machine": machine(),
        "load": load,
        "versions": {"python": platform.python_version(), **code_version(), **versions},
        "source": SOURCE,
        "notes": notes,
        "tables": found,
    }
    directory = directory or Path(os.environ.get("BENCH_RESULTS") or RESULTS)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(dump(document))
    print(f"results: {path}", file=sys.stderr)
    return path


_SCALAR = r'(?:"(?:[^"\\]|\\.)*"|-?[\d.eE+-]+|null|true|false)'
_FLAT_LIST = re.compile(rf"(?<!\"notes\": )\[\s*({_SCALAR}(?:,\s*{_SCALAR})*)\s*\]")


def dump(document: dict[str, Any]) -> str:
    """The one layout of a results file (a table row on a line, a note on a line), so that a
    rewrite changes only what changed."""
    text = json.dumps(document, indent=1, ensure_ascii=False)
    return _FLAT_LIST.sub(lambda m: json.dumps(json.loads(m.group(0)), ensure_ascii=False), text) + "\n"


def problems(document: dict[str, Any]) -> list[str]:
    """What a results file lacks to be rendered with its provenance; empty when it is whole."""
    found = [f"no {key!r}" for key in REQUIRED if key not in document]
    if not isinstance(document.get("machine"), dict) or not document["machine"].get("cpus"):
        found.append("no machine.cpus")
    if not isinstance(document.get("load"), dict):
        found.append("no load")
    if document.get("source") not in (SOURCE, TRANSCRIBED):
        found.append(f"source {document.get('source')!r} is neither {SOURCE!r} nor {TRANSCRIBED!r}")
    if not DATE.fullmatch(str(document.get("date", ""))):
        found.append(f"date {document.get('date')!r} is not YYYY-MM-DD[THH:MMZ]")
    if not document.get("tables"):
        found.append("no tables")
    for table in document.get("tables") or []:
        width = len(table.get("columns", []))
        if not table.get("title") or not width or len(table.get("align", "")) != width:
            found.append(f"table {table.get('title')!r}: no title, columns or align")
        found += [f"table {table.get('title')!r}: a row of {len(row)} cells for {width} columns"
                  for row in table.get("rows", []) if len(row) != width]
        run = table.get("run")  # a transcribed table from another run than the file's names that run
        if run is not None and (not run.get("command") or not DATE.fullmatch(str(run.get("date", "")))):
            found.append(f"table {table.get('title')!r}: its run lacks a command or a date")
    return found


def load_all(directory: Path = RESULTS) -> list[dict[str, Any]]:
    """Every results file in a directory, by name."""
    return [json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))]
