"""delta-rs (`deltalake`) in a child process of the driver: `cdc verify`'s reads of `current/`
(sinks.stores.delta.read) and the jobs' MERGEs of small batches into `current/` and `history/`
(sinks.stores.delta.store, sinks.stores.delta.history).

A process that used delta-rs can abort at interpreter exit (docs/development.md, Environment
quirks), so no cdc process loads it: a Spark-free child does, and ends with os._exit. It lives
as long as its user (a warm table reads only the log's new commits).

delta-rs writes only some of Delta's features. The child merges into a table only when its
protocol is one delta-rs writes right (WRITABLE_FEATURES, no column mapping) and none of its
data files holds a timestamp as Spark's INT96, which delta-rs reads as nanoseconds (a value
beyond years 1677-2262 in a file it rewrote would come back changed; the sink's Spark writes
INT64 µs, sinks.spark); it answers "declined" with the reason otherwise, and Spark merges
that table.
"""

from __future__ import annotations

import base64
import json
import logging
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Generator, Iterator
from typing import IO, Any

import pyarrow as pa
import pyarrow.ipc

log = logging.getLogger(__name__)

#: table features of a table delta-rs merges into (the first two: what a legacy writer version 2
#: implies; timestampNtz: what a `timestamp without time zone` column brings)
WRITABLE_FEATURES = frozenset({"appendOnly", "invariants", "timestampNtz"})
#: INT96 columns a table's older files (Spark's timestamps before sinks.spark wrote INT64) may
#: have that delta-rs reads right all the same: commit times, well inside years 1677-2262
SAFE_INT96 = frozenset({"_cdc_ts"})

# One request a line (JSON); each answer is frames (kind, length, bytes) ending with a "." frame:
# "j" a JSON object, "a" an Arrow IPC stream of one batch, "!" an error.
_CHILD = r"""
import base64, json, os, struct, sys
out = sys.stdout.buffer
def frame(kind, data=b""):
    out.write(struct.pack("!cQ", kind, len(data)) + data)
try:
    import pyarrow as pa
    import pyarrow.dataset as ds
    from deltalake import DeltaTable
    broken = None
except ImportError as exc:
    broken = f"delta-rs cannot be loaded ({exc}): pip install 'deltalake[pyarrow]'"
WRITABLE, SAFE_INT96 = set(json.loads(sys.argv[1])), set(json.loads(sys.argv[2]))
int96_free = set()  # data files read and found without an INT96 column beyond SAFE_INT96
def int96_columns(table):
    from urllib.parse import unquote, urlparse
    import pyarrow.parquet as pq
    for uri in table.file_uris():
        if uri in int96_free:
            continue
        schema = pq.read_metadata(unquote(urlparse(uri).path) if uri.startswith("file:") else uri).schema
        found = {schema.column(i).path for i in range(len(schema)) if schema.column(i).physical_type == "INT96"}
        if found - SAFE_INT96:
            return sorted(found - SAFE_INT96)
        int96_free.add(uri)
    return []
def unwritable(table):
    protocol = table.protocol()
    features = set(protocol.reader_features or []) | set(protocol.writer_features or [])
    if table.metadata().configuration.get("delta.columnMapping.mode", "none") != "none" or protocol.min_writer_version in (5, 6):
        features.add("columnMapping")
    features -= WRITABLE
    if features:
        return f"table features delta-rs does not write: {', '.join(sorted(features))}"
    old = int96_columns(table)
    if old:
        return (f"column {old[0]} has data files with Spark's INT96 timestamps, which delta-rs rewrites wrong beyond "
                "years 1677-2262 (until the table's next compaction rewrites them)")
    return None
tables = {}
try:
    for line in sys.stdin:
        ask = json.loads(line)
        try:
            if broken:
                raise RuntimeError(broken)
            path = ask["path"]
            table = tables.get(path)
            if table is not None:
                table.update_incremental()
            elif DeltaTable.is_deltatable(path):
                table = tables[path] = DeltaTable(path)
            if ask["op"] == "describe":
                facts = {"table": table is not None}
                if table is not None:
                    protocol = table.protocol()
                    files = pa.table(table.get_add_actions(flatten=True))
                    rows = files.column("num_records").to_pylist() if "num_records" in files.column_names else [None]
                    facts.update(
                        reader_version=protocol.min_reader_version,
                        reader_features=list(protocol.reader_features or []),
                        column_mapping=table.metadata().configuration.get("delta.columnMapping.mode", "none"),
                        bytes=sum(files.column("size_bytes").to_pylist()),
                        rows=None if None in rows else sum(rows),
                    )
                frame(b"j", json.dumps(facts).encode())
            elif ask["op"] == "merge":
                declined = "no table" if table is None else unwritable(table)
                if declined is None:
                    source = pa.ipc.open_stream(base64.b64decode(ask["source"])).read_all()
                    merge = table.merge(source, ask["on"], source_alias="s", target_alias="t")
                    for kind, predicate, values in ask["clauses"]:
                        if kind == "delete":
                            merge = merge.when_matched_delete(predicate=predicate)
                        elif kind == "update":
                            merge = merge.when_matched_update(updates=values, predicate=predicate)
                        else:
                            merge = merge.when_not_matched_insert(updates=values, predicate=predicate)
                    frame(b"j", json.dumps({"merged": merge.execute()}, default=str).encode())
                else:
                    frame(b"j", json.dumps({"declined": declined}).encode())
            elif table is not None:
                options = ds.ParquetReadOptions(coerce_int96_timestamp_unit="us")  # Spark writes INT96
                dataset = table.to_pyarrow_dataset(parquet_read_options=options)
                names = [c for c in ask["columns"] if c in dataset.schema.names]
                keys = ask.get("keys")
                where = None if keys is None else ds.field("_cdc_key").isin(keys)
                for batch in dataset.to_batches(columns=names, filter=where):
                    sink = pa.BufferOutputStream()
                    with pa.ipc.new_stream(sink, batch.schema) as writer:
                        writer.write_batch(batch)
                    frame(b"a", sink.getvalue().to_pybytes())
        except Exception as exc:
            tables.pop(ask.get("path"), None)  # read afresh next time
            frame(b"!", f"{type(exc).__name__}: {exc}".encode())
        frame(b".")
        out.flush()
finally:
    os._exit(0)
"""

#: a MERGE clause: ("delete" | "update" | "insert", its predicate, the columns it sets)
Clause = tuple[str, str, dict[str, str] | None]


def quote(name: str) -> str:
    """A column name quoted for delta-rs's (DataFusion's) SQL."""
    return '"' + name.replace('"', '""') + '"'


def remote(root: str) -> bool:
    """A warehouse delta-rs does not reach: its credentials and file systems are Spark's."""
    return "://" in root and not root.startswith("file:")


class ReaderError(RuntimeError):
    """delta-rs could not read or write a table (the caller falls back to Spark for it)."""


class DeltaRs:
    """delta-rs in a child process, one request at a time."""

    def __init__(self) -> None:
        self._errors: IO[bytes] = tempfile.TemporaryFile()
        self.child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(sorted(WRITABLE_FEATURES)),
                                       json.dumps(sorted(SAFE_INT96))],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._errors)
        self._lock = threading.Lock()

    def _frames(self, request: dict[str, Any]) -> Generator[tuple[bytes, bytes], None, None]:
        """The answer's frames; read to its end even when the caller stops early (the next
        answer starts after it). Hold the lock while iterating."""
        assert self.child.stdin is not None and self.child.stdout is not None
        try:
            self.child.stdin.write(json.dumps(request).encode() + b"\n")
            self.child.stdin.flush()
        except OSError as exc:  # it ended (its reason is read below)
            log.debug("the delta-rs child took no request: %s", exc)
        done = False
        try:
            while not done:
                head = self.child.stdout.read(9)
                if len(head) < 9:
                    done = True
                    self._errors.seek(0)
                    tail = self._errors.read().decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
                    raise ReaderError(f"the delta-rs child ended: {tail[0]}")
                kind, size = struct.unpack("!cQ", head)
                data = self.child.stdout.read(size)
                done = kind == b"."
                if not done:
                    yield kind, data
        finally:
            while not done:  # the caller stopped early
                kind, size = struct.unpack("!cQ", self.child.stdout.read(9))
                self.child.stdout.read(size)
                done = kind == b"."

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """A request answered by one JSON object (ReaderError for the child's error)."""
        with self._lock:
            frames = list(self._frames(request))
        for kind, data in frames:
            if kind == b"!":
                raise ReaderError(data.decode(errors="replace"))
        return dict(json.loads(frames[-1][1])) if frames else {}

    def describe(self, path: str) -> dict[str, Any]:
        """What the table's log says: whether it exists, its protocol, its data files' bytes and rows."""
        return self._answer({"op": "describe", "path": path})

    def batches(self, path: str, columns: list[str], keys: list[str] | None = None) -> Iterator[pa.RecordBatch]:
        """The table's rows (of these columns, those it has; of these keys) as they arrive
        (none when there is no table)."""
        with self._lock:
            frames = self._frames({"op": "read", "path": path, "columns": columns, "keys": keys})
            try:
                for kind, data in frames:
                    if kind == b"!":
                        raise ReaderError(data.decode(errors="replace"))
                    yield pa.ipc.open_stream(data).read_next_batch()
            finally:
                frames.close()

    def merge(self, path: str, source: pa.Table, on: str, clauses: list[Clause]) -> str | None:
        """MERGE `source` (alias `s`) into the table at `path` (alias `t`), in one commit; None
        when done, else why delta-rs declined the table (its features). ReaderError: it failed,
        having committed nothing or all."""
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, source.schema) as writer:
            writer.write_table(source)
        answer = self._answer({"op": "merge", "path": path, "on": on, "clauses": clauses,
                               "source": base64.b64encode(sink.getvalue().to_pybytes()).decode()})
        declined = answer.get("declined")
        return None if declined is None else str(declined)

    def close(self) -> None:
        end_child(self.child)
        self._errors.close()


def end_child(child: Any) -> None:
    """A child (a subprocess.Popen) let go: its input closed, it ends, or is killed after 10 s;
    its output closed."""
    if child.stdin is not None:
        child.stdin.close()
    try:
        child.wait(10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    if child.stdout is not None:
        child.stdout.close()
