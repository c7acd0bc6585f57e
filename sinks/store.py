"""The contract between a sink job and its store, and the rules every store shares.

The job owns batching, retries, progress, dead letters, truncate positions and the check
that the store still holds what the job wrote. A store owns only how it writes a batch
and how it reads back what it holds:

- its bookkeeping record (`load`/`save`): one small JSON document kept in the store
  itself, written after every batch's writes (the last batch id, each table's newest
  truncate, the batch whose dead letters went out, and whatever the store adds);
- `truncate`: delete a table's rows below a position (the job has recorded it first);
- `clear`: forget the state the topics rebuild (a store found lost or stale);
- the writes, declared by `writes`: a `RowStore` (sinks.rows) takes each key's last change
  as the event's JSON on the executors; a `TableStore` (the warehouse) takes a table's typed
  rows on the driver.

A store is one folder and one registration in sinks.stores, whose protocols say what else
the folder gives (its check, its reader for `cdc verify`, its rebuild, its throwaway server).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

if TYPE_CHECKING:
    from sinks.batch import TableBatch
    from sinks.handover import LiveSide
    from sinks.pipeline import Feed

log = logging.getLogger(__name__)

#: (commit LSN, change LSN, commit time in ms) of a truncate
Truncate = tuple[int, int, int]


class RowCounter(Protocol):
    """Each table's rows in a store (by table topic; None: the store has no such table yet),
    asked again and again; `close` lets go of its clients."""

    def count(self, topics: list[str]) -> dict[str, int | None]: ...

    def close(self) -> None: ...


class StoreLost(Exception):
    """The store does not hold what the job committed (a server restarted without its data,
    a restored backup, a stale replica): the job clears it and replays the topics."""


class SinkStopped(Exception):
    """The job stopped on purpose: a record it must not skip, or a change the store cannot take."""


class StoreUnavailable(Exception):
    """The store did not answer, or refused for now (429/5xx, a lost race): the batch is read
    again after a backoff."""


@dataclass
class Bookkeeping:
    """What a job keeps in its store about itself (the store's `load`/`save` hold it)."""

    #: the last batch id whose writes are in the store; -1: none since the checkpoint began
    batch: int = -1
    #: topic -> its newest truncate applied: every row of the table below it is gone
    truncates: dict[str, Truncate] = field(default_factory=dict)
    #: the last batch id whose dead letters were sent (a batch read again sends none again)
    letters: int = -1
    #: what the store keeps beside these (its own keys)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_record(self) -> dict[str, Any]:
        return {
            **self.extra, "batch": self.batch, "letters": self.letters,
            "truncates": {topic: list(t) for topic, t in sorted(self.truncates.items())},
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Bookkeeping:
        extra = {k: v for k, v in record.items() if k not in ("batch", "letters", "truncates")}
        truncates = {topic: (int(t[0]), int(t[1]), int(t[2])) for topic, t in record.get("truncates", {}).items()}
        return cls(int(record.get("batch", -1)), truncates, int(record.get("letters", -1)), extra)

    def cut(self, topic: str) -> tuple[int, int] | None:
        """The position every change of `topic` must be above (its newest truncate's)."""
        found = self.truncates.get(topic)
        return (found[0], found[1]) if found else None

    def truncated(self, topic: str, truncates: list[Truncate]) -> Truncate | None:
        """Take a batch's truncates of `topic`; the newest one when it is newer than the table's."""
        newest = max(truncates, default=None)
        if newest is None or (topic in self.truncates and newest[:2] <= self.truncates[topic][:2]):
            return None
        self.truncates[topic] = newest
        return newest


class Store(ABC):
    """A derived store the job keeps equal to the source tables."""

    #: how the job hands it a batch: "rows", each key's last change as the event's JSON,
    #: written on the executors (sinks.rows.RowStore); "tables", a table's typed rows on the
    #: driver, in steps (TableStore)
    writes: ClassVar[Literal["rows", "tables"]]
    #: the job's name: its checkpoint folder, its progress record, its bookkeeping
    name: str
    #: the store in a message, credentials masked ("Redis at redis://host:6379/0")
    where: str
    #: where the job reads the store's records: None, the table topics; else a feed the store
    #: keeps itself (sinks.pipeline.Feed: the warehouse's history reads its change log)
    feed: Feed | None = None
    #: how the store's client names errors worth a retry (the batch fails on an executor, and
    #: the driver sees the error as text): an unreachable server, a refusal for now
    transient: tuple[str, ...] = ()
    #: the live job's side of a rebuild that pauses it for its switch (sinks.handover: the
    #: Delta warehouse's); None: the store's rebuild does not pause its live job
    handover: LiveSide | None = None

    def open(self, resumed: bool) -> None:  # noqa: B027 (most stores have nothing to do)
        """Before the query starts (`resumed`: the checkpoint holds committed batches):
        settings, reachability; raise StoreLost for what the store lost."""

    @abstractmethod
    def load(self) -> dict[str, Any] | None:
        """The bookkeeping record the store holds (None: none)."""

    @abstractmethod
    def save(self, record: dict[str, Any]) -> None:
        """Keep the bookkeeping record (replacing the one held)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every row the topics rebuild, and the bookkeeping record."""

    @abstractmethod
    def truncate(self, topic: str, truncate: Truncate) -> None:
        """Delete every row of `topic`'s table whose position is below the truncate's."""

    def close(self) -> None:  # noqa: B027 (most stores hold no connection)
        """After the job."""


class TableStore(Store):
    """A store of typed columns (the warehouse): one table of a batch at a time, in steps.
    The job runs a step for every table of the batch before the next step, so what the first
    step writes (the current state) waits for no table's later steps. Steps of different
    tables run in parallel threads: a step touches only its own table's files and state."""

    writes = "tables"

    @abstractmethod
    def steps(self) -> tuple[Callable[[TableBatch], None], ...]: ...

    def after_tables(self, batches: list[TableBatch], batch_id: int, lineage: str | None) -> None:  # noqa: B027
        """After every table's steps: the writes that span the batch's tables (one commit for
        all of them). `lineage`: the checkpoint's query id, with `batch_id` what keys an
        idempotent write."""


def check_resumed(store: Store, record: dict[str, Any] | None, committed: int | None, lineage: str | None) -> Bookkeeping:
    """The bookkeeping of a store the job goes on writing: `committed`, the checkpoint's last
    committed batch (None: none yet); `lineage`, the checkpoint's query id (None: a new
    checkpoint). A record of another checkpoint with none committed is a replay's start
    (batch ids start again at 0); a record of the same one is the job's own, committed or
    not. With batches committed, a store that holds no record, or one older than the last
    committed batch, lost writes; one batch ahead is a batch written but not committed,
    which the job reads again."""
    state = Bookkeeping.from_record(record) if record is not None else None
    own = state is not None and lineage is not None and state.extra.get("checkpoint") == lineage
    if committed is None and not own:
        state = state or Bookkeeping()
        state.batch = state.letters = -1
    elif committed is not None:
        if state is None:
            raise StoreLost(f"{store.where} holds no trace of the batches this job committed")
        if state.batch < committed:
            raise StoreLost(
                f"{store.where} is behind: it holds the writes of batch {state.batch}, and the job committed "
                f"batch {committed} (a restored backup or a stale replica)"
            )
    assert state is not None
    state.extra["checkpoint"] = lineage
    return state


def check_batch(store: Store, record: dict[str, Any] | None, batch_id: int) -> None:
    """Before a batch commits: the store still holds the previous batch's bookkeeping (or this
    batch's, when it is read again)."""
    held = None if record is None else Bookkeeping.from_record(record).batch
    if held is None or held not in (batch_id - 1, batch_id):
        count = "no record" if held is None else f"the writes of batch {held}"
        raise StoreLost(f"{store.where} lost writes: it holds {count}, and this job wrote batch {batch_id - 1}")
