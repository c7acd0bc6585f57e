"""Render docs/benchmarks.md from the results files in bench/results/.

    python bench/render.py            # write the page
    python bench/render.py --check    # exit 1 when the page is not what the files render

The page is never edited by hand: every figure on it is one a bench wrote into its results
file (bench/figures.py), shown under the command, date, machine and load of the run that
made it. A test runs the check, so a results file committed without its page fails.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from typing import Any

import figures

PAGE = figures.HERE.parent / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Section:
    """One bench's part of the page: a stable heading and anchor, and what the bench measures."""

    bench: str
    heading: str
    anchor: str
    prose: str


INTRO = """\
Every figure on this page comes from a results file in `bench/results/`, written by the bench
that measured it (`bench/figures.py`): the command as run, the date, the machine, the load
average, the versions and the tables the bench printed. `python bench/render.py` renders this
page from those files and `tests/test_bench_results.py` fails when the page differs from what
they render, so it is never edited by hand. A new run of a bench replaces its results file;
measurements it supersedes stay in git's history, not here.

Runs marked *transcribed* were measured before the results files existed and copied once from
the tables the README then held, with the command, date and load it stated; a new run of the
same bench and variant replaces them.

Unless a run says otherwise, the machine has 2 cores, shared by everything the bench starts
(PostgreSQL, the Kafka broker, Spark, the stores' servers): a figure is one of the whole
stack on two cores, and moves with what else runs on them; the ratios move less."""

RUNNING = """\
Each bench starts its own throwaway services, runs from this checkout's `cdc` (not wherever
`pip install -e` points) and stops everything it started on exit, Ctrl-C included. Run them
from the repository root; `python bench/<bench>.py --help` lists the options. A completed run
prints its report and writes `bench/results/<bench>[-<variant>].json`; then
`python bench/render.py` updates this page. A smoke run at small settings should not replace
the figures here: `BENCH_RESULTS=/tmp/results python bench/...` writes its file elsewhere."""

SECTIONS = (
    Section("capture", "Capture", "capture", """\
`bench/capture.py` (options `--rows`, `--clients`, `--skip-latency`, `--profile DIR`, `--keep`)
starts PostgreSQL and one Apache Kafka broker and measures, on the same generated WAL (row
changes on a 6-column table, 60 % inserts and 40 % updates in transactions of 100-1,000 rows):
PostgreSQL's ceiling (`pg_recvlogical` with pgoutput to `/dev/null`, one pass before and one
after the cdc runs, the faster counting); each Kafka client alone producing as many ready-made
records of cdc's event size (acks=all, idempotent, cdc's producer settings); `cdc run` from the
slot to records acknowledged by the broker, with each client; commit-to-consumed latency under a
steady 2,000 transactions/s, against a broker floor (a paced producer straight to the broker);
peak RSS; and the CPU of each process (the broker's is its JVM's process group)."""),
    Section("snapshot", "Snapshots", "snapshots", """\
`bench/snapshot.py` (options `--rows`, `--clients`, `--parallelism 1,2,4`, `--split-rows`,
`--keep`) fills a 6-column table (integer primary key) and measures PostgreSQL's ceiling
(`COPY bench TO STDOUT` into `/dev/null`), each Kafka client alone producing as many ready-made
records of the snapshot events' size, and `cdc snapshot` from process start to exit (every
record acknowledged, the topic's end offsets checked against the rows) for each client and
parallelism, with peak RSS per process and the broker's CPU."""),
    Section("debezium", "Against Debezium", "debezium", """\
`bench/debezium.py` (options `--rows`, `--snapshot-rows`, `--rounds`, `--latency-tps`,
`--latency-s`, `--keep`) runs cdc (`client = "confluent"`) and the Debezium PostgreSQL
connector (Kafka Connect standalone) on one PostgreSQL and one broker in the same run,
alternating which goes first per round. Debezium is tuned as a throughput-minded user would
(`max.batch.size=8192`, `max.queue.size=65536`, `poll.interval.ms=10`, producer `linger.ms=5`
and `batch.size=1048576`, acks=all, JsonConverter without schemas, 3-partition topics for both).
Per round: a snapshot into a new slot and prefix; then, with both stopped, N row changes, and
each pipeline started and timed until its topic holds them all; then commit-to-append latency
while single-row updates are paced at 500/s (the broker's `LogAppendTime` minus the event's
`source.ts_us`). Rates run from the first record to the last (start-up shown apart); CPU is
that of each process group (cdc with its readers, Connect's JVM, the broker, PostgreSQL's
backends), sampled from `/proc`."""),
    Section("width", "Width: capture by table count", "width", """\
`bench/width.py` (options `--tables 1,100,1000`, `--changes`, `--writers`, `--skip-warmup`,
`--keep`) runs cdc and the Debezium connector as bench/debezium.py does (same tuning), each side
in turn, over a new database of N tables (`id int PRIMARY KEY, v int, note text`) per table
count, topics of one partition per table for both (Debezium's default and cdc's). Start-up: from
launching `cdc run` without an initial snapshot (`[snapshot] mode = "never"`) or creating the
connector (`snapshot.mode=no_data`) until its slot is active and every table's topic exists and
holds a first row (Debezium creates a topic at its table's first record). Drain: with the
pipeline stopped, pgbench writes single-row INSERT transactions round-robin over the tables; the
pipeline starts again and is timed until its topics hold them all. CPU per change of each process
group from `/proc`: cdc's daemon or Connect's JVM and the broker from the first record on,
PostgreSQL over the whole drain. An unrecorded pass over one table warms both sides' JVMs first."""),
    Section("verify", "cdc verify", "verify", """\
`bench/verify.py` (options `--rows`, `--stores`, `--client`, `--keep`) fills one table (int key,
text, numeric(12,2), timestamptz, bool, int), captures it with `cdc run`, fills the stores with
`cdc sink <store> --once`, then times, each in its own process on `local[2]`, Spark reading the
table's topic once (the sinks' Kafka options, into `count()`) and `cdc verify --json` against
every store: the command a user runs, its own Spark session included. The target is to stay
within 3× of that one read."""),
    Section("sinks", "Sinks", "sinks", """\
`bench/sinks.py` (options `--changes`, `--tables`, `--max-offsets`, `--stores
delta,search,cache,postgres,textbook`, `--fresh-rate`, `--fresh-seconds`, `--fresh-warmup`,
`--skip-freshness`, `--skip-rebuild`, `--skip-alone`, `--keep`, ...) creates tables (int key,
text, numeric(12,2), timestamptz, bool, int), writes a backlog (60 % inserts, 40 % updates,
transactions of 100-1,000 rows), captures it with `cdc run` and measures, each Spark run in a
child process of its own on `local[2]`, with the session start timed apart:

- **read ceiling**: the sink jobs' own stream of the topics (until 2026-12-07, Spark's Kafka
  source with the jobs' options), into a `foreachBatch` that only counts;
- **apply**, per store: the sink job `cdc sink <store> --once` runs, on the same backlog into a
  new store, checked afterwards (Delta: `current` holds the inserted rows, the change log and
  `history` every change; the other stores one row or document per key); the target is a
  fraction of the read ceiling;
- **the store's own work**: the search, cache and read-model servers alone (the sink's own
  writer fed by the bench, no Spark). With the read ceiling's CPU per record this gives the
  *room*: the fastest apply the machine's cores leave CPU for;
- **freshness**, per store: `cdc run` and `cdc sink <store>` streaming while a writer offers
  single-row transactions (half insert a marker row), after a warm-up; a reader polls the
  store and records, per marker, the time it became visible (searchable, for the index)
  after its commit;
- **rebuild**: `cdc search rebuild` over the index the apply run filled.

`--stores delta,textbook` also runs the job a Spark user would write instead
(`bench/textbook.py`: `foreachBatch`, the latest change per key, one Delta MERGE per source
table into `current` only: no change log, history, type versions, truncates, TOAST or dead
letters) on the same backlog and load, and counts the commits each job adds to the tables'
`_delta_log`."""),
    Section("row_stages", "Spark's stages per record", "row-stages", """\
`bench/row_stages.py` (options `--records`, `--tables`, `--batches`) runs the sink jobs' own
code on batches of Debezium envelopes held in memory (no Kafka, no store) and times each stage's
CPU, the driver's Python and its JVM: a scan of the batch (the floor), the parse into change
rows, the parse stored as each batch stores it, the batch's statistics, and the Arrow hand-over
to the Python workers."""),
    Section("delta_commit", "Delta: the cost of one commit", "delta-commit", """\
`bench/delta_commit.py` (options `--rows`, `--changes`, `--commits`, `--warmup`, `--variants`,
`--jfr`) times one small write into a table shaped like the backlog's, by the sink's own
`current` MERGE under setting variants and by delta-rs from the driver, with the CPU by JVM
thread kind (driver, executor tasks, JIT, GC) and the Spark jobs and tasks each write plans."""),
    Section("delta_stages", "Delta: the job's CPU per stage", "delta-stages", """\
`bench/delta_stages.py` (options `--changes`, `--tables`, `--batches`, `--inserts`, `--variants`)
takes the Delta job's CPU per change apart on synthetic change rows, without Kafka or
PostgreSQL: each micro-batch is stored as the job stores its read, decoded per table, MERGEd
into `current`, appended to the change log and MERGEd into `history`, with the CPU of the
process group per stage. Variants run the designs that might cut the work (deletion vectors, a
broadcast MERGE source, an unmaterialised source, the flat `history` table)."""),
)


def _natural(name: str) -> list[Any]:
    """Sort key putting `5-tables` before `50-tables`."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _when(date: str, finished: str | None = None) -> str:
    """`2026-11-24 09:33-09:34 UTC`; a transcribed run may only know its day."""
    shown = date.replace("T", " ").rstrip("Z")
    end = (finished or date).replace("T", " ").rstrip("Z")
    if end != shown:
        shown += "-" + (end[11:] if end[:10] == shown[:10] else end)
    return shown + (" UTC" if "T" in date else "")


def _load(load: dict[str, Any]) -> str:
    parts = []
    if load.get("before") is not None:
        parts.append(f"{load['before']:g} before")
    during = load.get("during")
    if isinstance(during, list):
        parts.append(f"{during[0]:g}-{during[1]:g} during")
    elif during:
        parts.append(f"{during} during")
    return "1-minute load average " + ", ".join(parts) if parts else "load average not recorded"


def _machine(machine: dict[str, Any]) -> str:
    parts = [f"{machine['cpus']} CPUs"]
    if machine.get("cpu_model"):
        parts.append(machine["cpu_model"])
    if machine.get("memory_gib"):
        parts.append(f"{machine['memory_gib']:g} GiB")
    if machine.get("kernel"):
        parts.append(machine["kernel"])
    return ", ".join(parts)


def _table(table: dict[str, Any]) -> list[str]:
    def row(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return [row(table["columns"]), "|" + "|".join("---:" if a == "r" else "---" for a in table["align"]) + "|",
            *(row(cells) for cells in table["rows"])]


def _paragraphs(notes: list[str]) -> list[str]:
    out: list[str] = []
    for note in notes:
        out += [note, ""]
    return out


def render_run(document: dict[str, Any]) -> list[str]:
    """One results file: its provenance, then its tables with their notes."""
    out = [f"### {document['title']} {{#results-{document['name']}}}", "",
           f"- Command: `{document['command']}`",
           f"- Run: {_when(document['date'], document.get('finished'))}, {_machine(document['machine'])}; "
           f"{_load(document['load'])}"]
    versions = ", ".join(f"{name} {version}" for name, version in document["versions"].items())
    out.append(f"- Versions: {versions or 'not recorded'}")
    if document["source"] == figures.TRANSCRIBED:
        out.append("- *Transcribed*: measured before results files, copied once from the README's tables")
    out += ["", *_paragraphs(document.get("notes", []))]
    for table in document["tables"]:
        if table["title"] != document["title"]:
            out += [f"**{table['title']}**", ""]
        run = table.get("run")
        if run:
            load = f"; {_load(run['load'])}" if run.get("load") else ""
            out += [f"From another run: `{run['command']}`, {_when(run['date'])}{load}.", ""]
        out += [*_table(table), "", *_paragraphs(table.get("notes", []))]
    return out


def render(documents: list[dict[str, Any]]) -> str:
    """The whole page from the results files: sections in a fixed order, newest run first."""
    known = {section.bench for section in SECTIONS}
    unknown = sorted({d["bench"] for d in documents} - known)
    if unknown:
        raise SystemExit(f"results of benches with no section in bench/render.py: {', '.join(unknown)}")
    out = ["<!-- Generated by `python bench/render.py` from bench/results/*.json, which the benches write: not edited by hand. -->",
           "", "# Benchmarks", "", INTRO, "", "## Running a bench {#running}", "", RUNNING, ""]
    for section in SECTIONS:
        runs = [d for d in documents if d["bench"] == section.bench]
        runs.sort(key=lambda d: _natural(d["name"]))
        runs.sort(key=lambda d: d["date"], reverse=True)
        out += [f"## {section.heading} {{#{section.anchor}}}", "", section.prose, ""]
        if not runs:
            out += ["No results yet.", ""]
        for document in runs:
            out += render_run(document)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/benchmarks.md is not the render")
    args = parser.parse_args(argv)
    documents = figures.load_all()
    broken = {d.get("name", "?"): figures.problems(d) for d in documents if figures.problems(d)}
    if broken:
        for name, problems in broken.items():
            print(f"bench/results/{name}.json: {'; '.join(problems)}", file=sys.stderr)
        return 1
    page = render(documents)
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE} is not what bench/results/ renders: run python bench/render.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
