"""Where a small Delta commit's CPU goes, and what cuts it: one table, warm small writes.

    python bench/delta_commit.py [--rows 150000] [--changes 40] [--commits 20] [--warmup 15]
                                 [--variants default,no-materialize,...] [--jfr] [--keep]

Each variant runs in a child process of its own (a fresh driver JVM: some settings are
static). The child creates a table shaped like bench/sinks.py's backlog tables (int key,
text, numeric(12,2), timestamptz, bool, int, with `current/`'s metadata columns) holding
--rows rows in 4 files, then writes --warmup and then --commits small batches of --changes
changes each (half new keys, half updates of stored keys) with the variant's writer:

- `spark` variants: the sink's own `current` write (sinks.stores.delta.DeltaStore._current: the
  position-guarded MERGE) under the variant's session settings;
- `delta-rs`: the same batch handed to the driver as Arrow (`DataFrame.toArrow`) and merged
  by delta-rs (`deltalake.DeltaTable.merge`, the same conditions), no Spark job but the collect.

Per measured write: wall time, the CPU of the child's process group (Python driver + JVM), the
JVM's CPU per thread kind (from /proc: the JIT compilers, GC, executor tasks, the driver
threads that plan and commit (py4j's `Thread-N`), the rest), and Spark's jobs and tasks
(the status tracker, a job group per write). The medians are printed as a table.
With --jfr the default variant's JVM also records Java Flight Recorder samples; the report
adds the top packages of the executing frames.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import figures
from capture import group_cpu_seconds, thread_cpu

MARK = "@@commit "
#: session settings per variant, over the sink's own (sinks.spark.session_conf)
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "no-materialize": {"spark.databricks.delta.merge.materializeSource": "none"},
    "no-stats": {"spark.databricks.delta.stats.collect": "false"},
    "no-aqe": {"spark.sql.adaptive.enabled": "false"},
    "no-codegen": {"spark.sql.codegen.wholeStage": "false"},
    "c1-only": {"spark.driver.extraJavaOptions": "-Xss16m -XX:TieredStopAtLevel=1"},
    "no-checkpoint": {"spark.databricks.delta.checkpointInterval": "1000000"},
    "no-checksum": {"spark.databricks.delta.writeChecksumFile.enabled": "false"},
    "delta-rs": {},
}


def thread_kind(name: str) -> str:
    if "CompilerThre" in name:
        return "jit"
    if name.startswith(("GC Thread", "G1 ", "VM Thread", "GC ")):
        return "gc"
    if name.startswith("Executor task"):
        return "tasks"
    if name.startswith("Thread-"):
        return "driver"
    return "other"


def jvm_threads(pid: int) -> Counter[str]:
    out: Counter[str] = Counter()
    for name, seconds in thread_cpu(pid).items():
        out[thread_kind(name)] += seconds
    return out


def jvm_pid() -> int:
    """The driver JVM pyspark launched (our child process running java)."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
                comm = stat[stat.index("(") + 1:stat.rindex(")")]
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            if comm == "java" and ppid == os.getpid():
                return int(name)
    raise RuntimeError("no driver JVM found")


def child(args: argparse.Namespace) -> None:
    """One variant: a table, then timed writes; one JSON line per measured write."""
    import random

    from pyspark.sql import functions as F

    from sinks.batch import UNAVAILABLE, TableBatch
    from sinks.spark import build_session
    from sinks.stores.delta.store import DeltaStore, table_path

    conf = dict(VARIANTS[args.variant])
    if args.jfr:
        conf["spark.driver.extraJavaOptions"] = (
            conf.get("spark.driver.extraJavaOptions", "-Xss16m")
            + f" -XX:StartFlightRecording=filename={args.workdir}/{args.variant}.jfr,settings=profile"
        )
    spark = build_session(f"bench-commit-{args.variant}", conf=conf)
    sc = spark.sparkContext
    jvm = jvm_pid()
    root = f"{args.workdir}/{args.variant}"
    store = DeltaStore(spark, root)
    topic = "bench.public.t"
    path = table_path(root, "current", topic)
    columns_sql = (
        "id int, name string, amount decimal(12,2), at timestamp, flag boolean, qty int, _cdc_key string, "
        "_cdc_op string, _cdc_lsn long, _cdc_seq long, _cdc_ts timestamp, _cdc_tx_id long, _cdc_partition int, "
        "_cdc_offset long"
    )
    base = spark.range(args.rows).select(
        F.col("id").cast("int").alias("id"), F.md5(F.col("id").cast("string")).alias("name"),
        (F.col("id") * 1.5).cast("decimal(12,2)").alias("amount"), F.current_timestamp().alias("at"),
        (F.col("id") % 2 == 0).alias("flag"), (F.col("id") % 1000).cast("int").alias("qty"),
        F.concat(F.lit('{"id":'), F.col("id"), F.lit("}")).alias("_cdc_key"), F.lit("c").alias("_cdc_op"),
        F.lit(1).cast("long").alias("_cdc_lsn"), F.col("id").alias("_cdc_seq"), F.current_timestamp().alias("_cdc_ts"),
        F.lit(1).cast("long").alias("_cdc_tx_id"), (F.col("id") % 3).cast("int").alias("_cdc_partition"),
        F.col("id").alias("_cdc_offset"),
    )
    base.repartition(4).write.format("delta").save(path)
    columns = {f.name: f.dataType for f in base.schema.fields if not f.name.startswith("_cdc_")}
    rng = random.Random(7)
    next_id = args.rows

    def batch(n: int, lsn: int) -> Any:
        nonlocal next_id
        ids = list(range(next_id, next_id + n // 2)) + rng.sample(range(args.rows), n - n // 2)
        next_id += n // 2
        rows = [(i, f"n{i}", "1.25", i % 2 == 0, 1, json.dumps({"id": i}, separators=(",", ":")), "u", lsn, i,
                 1, i % 3, lsn * 1000 + k) for k, i in enumerate(ids)]
        frame = spark.createDataFrame(
            rows, "id int, name string, amount string, flag boolean, qty int, _cdc_key string, _cdc_op string, "
            "_cdc_lsn long, _cdc_seq long, _cdc_tx_id long, _cdc_partition int, _cdc_offset long",
        )
        latest = frame.select(
            "id", "name", F.col("amount").cast("decimal(12,2)").alias("amount"), F.current_timestamp().alias("at"),
            "flag", "qty", "_cdc_key", "_cdc_op", "_cdc_lsn", "_cdc_seq", F.current_timestamp().alias("_cdc_ts"),
            "_cdc_tx_id", "_cdc_partition", "_cdc_offset", F.array().cast("array<string>").alias(UNAVAILABLE),
            F.lit(False).alias("_cdc_delete"),
        ).localCheckpoint(eager=True)
        return TableBatch(topic, "public", "t", columns, ["id"], latest, latest, [], [], {0: 0}, n)

    def write_spark(b: Any) -> None:
        store._current(b)

    def write_rs(b: Any) -> None:
        from deltalake import DeltaTable as RsTable

        arrow = b.latest.drop(UNAVAILABLE, "_cdc_delete").toArrow()
        names = [f.name for f in arrow.schema]
        newer = "(s._cdc_lsn > t._cdc_lsn OR (s._cdc_lsn = t._cdc_lsn AND s._cdc_seq > t._cdc_seq))"
        values = {f'"{n}"': f's."{n}"' for n in names}
        (RsTable(path).merge(arrow, 't."_cdc_key" = s."_cdc_key"', source_alias="s", target_alias="t")
         .when_matched_update(updates=values, predicate=newer)
         .when_not_matched_insert(updates=values).execute())

    write = write_rs if args.variant == "delta-rs" else write_spark
    print(MARK + json.dumps({"event": "ready", "schema": columns_sql}), flush=True)
    for i in range(args.warmup + args.commits):
        b = batch(args.changes, 10 + i)
        group = f"w{i}"
        sc.setJobGroup(group, group)
        threads0, cpu0, t0 = jvm_threads(jvm), group_cpu_seconds(os.getpgid(0)) or 0.0, time.monotonic()
        py0 = time.process_time()
        write(b)
        wall = time.monotonic() - t0
        cpu, py = (group_cpu_seconds(os.getpgid(0)) or 0.0) - cpu0, time.process_time() - py0
        threads = jvm_threads(jvm)
        threads.subtract(threads0)
        tracker = sc.statusTracker()
        jobs = tracker.getJobIdsForGroup(group)
        tasks = 0
        for job in jobs:
            info = tracker.getJobInfo(job)
            for stage in info.stageIds if info else []:
                stage_info = tracker.getStageInfo(stage)
                tasks += stage_info.numTasks if stage_info else 0
        b.latest.unpersist()
        if i >= args.warmup:
            print(MARK + json.dumps({"event": "write", "wall": wall, "cpu": cpu, "python": py, "jobs": len(jobs),
                                     "tasks": tasks, "threads": dict(threads)}), flush=True)
    rows = spark.read.format("delta").load(path).count()
    print(MARK + json.dumps({"event": "done", "rows": rows}), flush=True)
    spark.stop()


def run_variant(args: argparse.Namespace, variant: str, workdir: Path) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "_child", "--variant", variant, "--workdir", str(workdir),
            "--rows", str(args.rows), "--changes", str(args.changes), "--commits", str(args.commits),
            "--warmup", str(args.warmup)] + (["--jfr"] if args.jfr and variant == "default" else [])
    log = workdir / f"{variant}.log"
    with log.open("wb") as err:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, start_new_session=True, timeout=7200)
    writes, rows = [], None
    for line in done.stdout.decode(errors="replace").splitlines():
        if line.startswith(MARK):
            event = json.loads(line[len(MARK):])
            if event["event"] == "write":
                writes.append(event)
            elif event["event"] == "done":
                rows = event["rows"]
    if done.returncode != 0 or not writes:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"variant {variant} failed ({done.returncode}); its log {log}:\n{tail}")
    return {"writes": writes, "rows": rows}


def jfr_packages(recording: Path, top: int = 12) -> list[tuple[str, int]]:
    """The packages of the top frames of JFR's execution samples, most sampled first."""
    jfr = Path(os.environ.get("JAVA_HOME", "/usr")) / "bin" / "jfr"
    done = subprocess.run([str(jfr), "print", "--json", "--events", "jdk.ExecutionSample", str(recording)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return []
    counts: Counter[str] = Counter()
    for event in json.loads(done.stdout)["recording"]["events"]:
        frames = event["values"]["stackTrace"]["frames"] if event["values"].get("stackTrace") else []
        names = [f["method"]["type"]["name"] for f in frames]
        # the first frame of ours or of a library worth naming, walking out from the top
        label = next((n for n in names if n.startswith(("org.apache.spark.sql.delta", "io.delta"))), None)
        label = label or next((n for n in names if n.startswith("org.apache.spark.sql.catalyst")), None)
        label = label or (names[0] if names else "?")
        counts[".".join(label.split(".")[:5])] += 1
    return counts.most_common(top)


def main() -> int:
    if sys.argv[1:2] == ["_child"]:
        parser = argparse.ArgumentParser()
        for flag in ("--variant", "--workdir"):
            parser.add_argument(flag, required=True)
        for flag in ("--rows", "--changes", "--commits", "--warmup"):
            parser.add_argument(flag, type=int, required=True)
        parser.add_argument("--jfr", action="store_true")
        child(parser.parse_args(sys.argv[2:]))
        sys.stdout.flush()
        os._exit(0)  # delta-rs may abort at interpreter exit: skip it, output flushed
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rows", type=int, default=150_000, help="rows in the table (default 150000)")
    parser.add_argument("--changes", type=int, default=40, help="changes per write (default 40)")
    parser.add_argument("--commits", type=int, default=20, help="measured writes per variant (default 20)")
    parser.add_argument("--warmup", type=int, default=15, help="writes before those, not measured (default 15)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--jfr", action="store_true", help="record the default variant with Java Flight Recorder")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    from sinks.spark import spark_environment

    os.environ.update(spark_environment())
    workdir = Path(tempfile.mkdtemp(prefix="bench-commit-"))
    command = " ".join(["python", "bench/delta_commit.py", *sys.argv[1:]])
    load0 = os.getloadavg()[0]
    results = {}
    try:
        for variant in variants:
            print(f"[{time.strftime('%H:%M:%S')}] {variant} ...", file=sys.stderr, flush=True)
            results[variant] = run_variant(args, variant, workdir)
        load1 = os.getloadavg()[0]
        title = f"One small Delta write: {args.changes} changes into a {args.rows:,}-row table"
        out = [f"\n## {title}\n",
               f"Command: `{command}`, {time.strftime('%Y-%m-%d %H:%M %Z')}; 1-minute load average {load0:.2f} "
               f"before, {load1:.2f} after; medians of {args.commits} writes after {args.warmup} of warm-up.\n"]
        kinds = ("driver", "tasks", "jit", "gc", "other")
        out.append("| writer (settings over the sink's) | wall s | CPU s (p10-p90) | Python CPU s | JVM: "
                   + " | ".join(kinds) + " | Spark jobs | tasks |")
        out.append("|---|" + "---:|" * (7 + len(kinds) - 2))
        for variant, result in results.items():
            writes = result["writes"]

            def med(values: list[float]) -> float:
                return statistics.median(values)

            cpus = sorted(w["cpu"] for w in writes)
            p10, p90 = cpus[len(cpus) // 10], cpus[min(len(cpus) - 1, len(cpus) * 9 // 10)]
            label = variant if variant == "delta-rs" else (
                f"spark {variant}" + (f" (`{json.dumps(VARIANTS[variant])}`)" if VARIANTS[variant] else ""))
            out.append(f"| {label} | {med([w['wall'] for w in writes]):.2f} | {med(cpus):.2f} ({p10:.2f}-{p90:.2f}) | "
                       f"{med([w['python'] for w in writes]):.2f} | "
                       + " | ".join(f"{med([w['threads'].get(k, 0.0) for w in writes]):.2f}" for k in kinds)
                       + f" | {med([w['jobs'] for w in writes]):.0f} | {med([w['tasks'] for w in writes]):.0f} |")
        recording = workdir / "default.jfr"
        if args.jfr and recording.exists():
            out.append("\nJFR execution samples of the default variant's JVM (whole run), by the first Delta, "
                       "Catalyst or top frame's package:\n")
            out += [f"- {package}: {count}" for package, count in jfr_packages(recording)]
        printed = "\n".join(out)
        print(printed)
        figures.write("delta_commit", printed, title=title,
                      versions={**figures.package_versions("pyspark", "pyarrow", "deltalake"), **figures.jvm_versions("spark")})
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"\nwork dir kept: {workdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
