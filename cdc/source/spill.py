"""Local disk for streamed in-progress transactions (pgoutput proto v2, `streaming 'on'`).

A streamed transaction may still abort, so nothing of it may reach the topic before its
Stream Commit; holding it in memory would make memory grow with transaction size. Each
chunk message is appended to a per-transaction file and replayed at commit.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from cdc.source.pgoutput import streamed_xid

_HEADER = struct.Struct("!QII")  # change LSN, (sub)transaction xid, payload length
# Data messages carry their (sub)transaction xid right after the type byte inside a stream.


class SpillStore:
    """One append-only file per open streamed transaction, under `directory`."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._files: dict[int, BinaryIO] = {}
        self._aborted: dict[int, set[int]] = {}
        self.clear()

    def clear(self) -> None:
        """Forget every open transaction: after a reconnect the server streams them again."""
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._aborted.clear()
        if self.directory.exists():
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def append(self, xid: int, change_lsn: int, payload: memoryview | bytes) -> None:
        f = self._files.get(xid)
        if f is None:
            f = self._files[xid] = open(self.directory / f"{xid}.spill", "wb")  # noqa: SIM115 (kept open)
        f.write(_HEADER.pack(change_lsn, streamed_xid(payload, xid), len(payload)))
        f.write(payload)

    def abort(self, xid: int, subxid: int) -> None:
        """Stream Abort: the whole transaction, or just one subtransaction of it."""
        if subxid == xid:
            self.discard(xid)
        else:
            self._aborted.setdefault(xid, set()).add(subxid)

    def discard(self, xid: int) -> None:
        f = self._files.pop(xid, None)
        self._aborted.pop(xid, None)
        if f is not None:
            f.close()
            (self.directory / f"{xid}.spill").unlink(missing_ok=True)

    def replay(self, xid: int) -> Iterator[tuple[int, bytes]]:
        """(change LSN, payload) of every message of a committed transaction, in order."""
        f = self._files.get(xid)
        if f is None:
            return
        f.flush()
        aborted = self._aborted.get(xid, set())
        with open(self.directory / f"{xid}.spill", "rb", buffering=1 << 20) as reader:
            while header := reader.read(_HEADER.size):
                change_lsn, sub, length = _HEADER.unpack(header)
                payload = reader.read(length)
                if sub not in aborted:
                    yield change_lsn, payload
        self.discard(xid)

    @property
    def open_transactions(self) -> int:
        return len(self._files)
