"""How many rows each store holds per table, for `cdc top` and the demo's live view: cheap
enough to ask every few seconds while the jobs write.

- cache: the `<topic>:*` keys Redis has (a SCAN per table: the key set also holds deleted keys);
- search: `_count` through each table's alias;
- delta: the rows of `current/<schema>/<table>`, read by delta-rs in a child process that
  lives as long as the counter (delta-rs may abort its process at exit, and a warm child
  only reads the log's new commits).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from cdc.config import Config

# One request a line (a table path), one answer a line (its row count, or null when the table
# is not there yet); ends with os._exit when its input closes (delta-rs can abort at exit).
_DELTA_CHILD = r"""
import json, os, sys
from deltalake import DeltaTable, QueryBuilder
tables = {}
for line in sys.stdin:
    path = line.rstrip("\n")
    try:
        table = tables.get(path)
        if table is None:
            table = tables[path] = DeltaTable(path)
        else:
            table.update_incremental()
        count = QueryBuilder().register("t", table).execute("SELECT count(*) AS n FROM t").read_all()
        answer = int(count.column(0)[0].as_py())
    except Exception:
        tables.pop(path, None)
        answer = None
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
os._exit(0)
"""


class StoreCounter:
    """Row counts per table topic in the store of one sink job (`delta`, `search`, `cache`)."""

    def __init__(self, store: str, config: Config) -> None:
        self.store, self.config = store, config
        self._child: subprocess.Popen[str] | None = None
        self._client: Any = None

    def count(self, topics: list[str]) -> dict[str, int | None]:
        """None for a table the store does not have (yet)."""
        if self.store == "cache":
            return self._cache(topics)
        if self.store == "search":
            return self._search(topics)
        if self.store == "delta":
            return self._delta(topics)
        return {}

    def _cache(self, topics: list[str]) -> dict[str, int | None]:
        from sinks.cache import Settings

        if self._client is None:
            self._client = Settings.of(self.config.cache).client(retries=0)
        out: dict[str, int | None] = {}
        for topic in topics:
            out[topic] = sum(1 for _ in self._client.scan_iter(match=f"{_glob(topic)}:*", count=1000))
        return out

    def _search(self, topics: list[str]) -> dict[str, int | None]:
        from sinks.search import Settings
        from sinks.search_shapes import alias_name

        if self._client is None:
            self._client = Settings.of(self.config.search).client(retries=0)
        out: dict[str, int | None] = {}
        for topic in topics:
            status, answer = self._client.request("GET", f"/{alias_name(topic)}/_count")
            out[topic] = int(answer["count"]) if status == 200 else None
        return out

    def _delta(self, topics: list[str]) -> dict[str, int | None]:
        from sinks.delta import table_path

        if not self.config.delta.path:
            return {}
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen(
                [sys.executable, "-c", _DELTA_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True,
            )
        assert self._child.stdin is not None and self._child.stdout is not None
        out: dict[str, int | None] = {}
        for topic in topics:
            self._child.stdin.write(table_path(self.config.delta.path, "current", topic) + "\n")
            self._child.stdin.flush()
            out[topic] = json.loads(self._child.stdout.readline() or "null")
        return out

    def close(self) -> None:
        if self._child is not None:
            if self._child.stdin is not None:
                self._child.stdin.close()
            try:
                self._child.wait(10)
            except subprocess.TimeoutExpired:
                self._child.kill()
        if self._client is not None:
            self._client.close()


def _glob(text: str) -> str:
    """`text` matched literally in a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
