"""The streaming replication protocol over psycopg's low-level libpq connection.

psycopg 3 has no replication API, but `replication=database` connections accept the
walsender commands and libpq's COPY_BOTH mode carries the stream both ways. The
walsender renders values, so the connection pins the session settings (cdc.source.session).
"""

from __future__ import annotations

import select
import struct
import time
from dataclasses import dataclass

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cdc.naming import quote_ident, quote_literal
from cdc.source.session import libpq_options

PG_EPOCH_US = 946_684_800_000_000  # 2000-01-01 in microseconds since the UNIX epoch
_STATUS = struct.Struct("!cQQQqB")
_XLOG_HEADER = struct.Struct("!QQq")
_KEEPALIVE = struct.Struct("!Qq?")


class ReplicationLost(Exception):
    """The replication connection broke; the caller reconnects from the last confirmed LSN.

    `sqlstate` is the server's error code when it sent one (as on psycopg's errors), so the
    caller can tell a dropped or invalidated slot from a connection that merely broke."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def format_lsn(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def pinned_conninfo(dsn: str, **extra: str) -> str:
    """`dsn` with the pinned settings appended to any `options` the user gave."""
    params = conninfo_to_dict(dsn)
    params["options"] = f"{params.get('options', '')} {libpq_options()}".strip()
    params.update(extra)
    return make_conninfo("", **params)


@dataclass(frozen=True)
class SlotCreated:
    slot: str
    consistent_point: int
    snapshot_name: str | None


class ReplicationConnection:
    """One walsender connection: slot creation, START_REPLICATION, the COPY_BOTH stream."""

    def __init__(self, dsn: str, connect_timeout_s: int = 10) -> None:
        try:
            self.conn = psycopg.connect(
                pinned_conninfo(dsn, replication="database", connect_timeout=str(connect_timeout_s)),
                autocommit=True,
            )
        except psycopg.Error as exc:
            raise ReplicationLost(str(exc).strip().splitlines()[0], exc.sqlstate) from None
        self.pgconn = self.conn.pgconn
        self.streaming = False

    def create_slot(self, slot: str, export_snapshot: bool = False) -> SlotCreated:
        mode = "export" if export_snapshot else "nothing"
        row = self.conn.execute(
            f"CREATE_REPLICATION_SLOT {quote_ident(slot)} LOGICAL pgoutput (SNAPSHOT '{mode}')"
        ).fetchone()
        assert row is not None
        return SlotCreated(row[0], parse_lsn(row[1]), row[2])

    def start(self, slot: str, start_lsn: int, publication: str, protocol_version: int, streaming: bool) -> None:
        options = [
            f"proto_version '{protocol_version}'",
            f"publication_names {quote_literal(quote_ident(publication))}",
            "messages 'true'",  # logical messages carry snapshot signals and watermarks
        ]
        if streaming:
            options.append("streaming 'on'")
        command = f"START_REPLICATION SLOT {quote_ident(slot)} LOGICAL {format_lsn(start_lsn)} ({', '.join(options)})"
        self.pgconn.send_query(command.encode())
        result = self.pgconn.get_result()
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            # get_error_message() is decoded text (psycopg >= 3.2); a result's error_message is bytes
            message = self.pgconn.get_error_message() if result is None else result.error_message.decode(errors="replace")
            raise ReplicationLost(message.strip() or "START_REPLICATION failed", _sqlstate(result))
        self.pgconn.nonblocking = 1
        self.streaming = True

    def read(self, timeout_s: float, limit: int = 5000) -> list[memoryview]:
        """Up to `limit` raw CopyData messages, waiting up to `timeout_s` for the first one."""
        pgconn = self.pgconn
        out: list[memoryview] = []
        try:
            while len(out) < limit:
                nbytes, data = pgconn.get_copy_data(1)
                if nbytes > 0:
                    out.append(data)
                    continue
                if nbytes == -1:
                    raise self._ended()
                if nbytes < -1:
                    raise ReplicationLost(pgconn.get_error_message().strip())
                if out or timeout_s <= 0:
                    break
                readable, _, _ = select.select([pgconn.socket], [], [], timeout_s)
                if not readable:
                    break
                pgconn.consume_input()
                timeout_s = 0
        except psycopg.Error as exc:
            raise ReplicationLost(str(exc).strip() or "replication connection lost", exc.sqlstate) from None
        return out

    def _ended(self) -> ReplicationLost:
        """Why the server ended the stream, with its error code when it sent an error."""
        result = self.pgconn.get_result()
        if result is not None and result.error_message:
            return ReplicationLost(result.error_message.decode(errors="replace").strip(), _sqlstate(result))
        return ReplicationLost("the server ended the replication stream")

    def send_status(self, flush_lsn: int, reply: bool = False) -> None:
        """Standby status update: written/flushed/applied all set to the confirmed LSN."""
        now = int(time.time() * 1_000_000) - PG_EPOCH_US
        try:
            self.pgconn.put_copy_data(_STATUS.pack(b"r", flush_lsn, flush_lsn, flush_lsn, now, 1 if reply else 0))
            while self.pgconn.flush() == 1:
                select.select([], [self.pgconn.socket], [], 1.0)
        except psycopg.Error as exc:
            raise ReplicationLost(str(exc).strip() or "replication connection lost", exc.sqlstate) from None

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # closing a broken connection must not hide the original error
            pass


def _sqlstate(result: pq.abc.PGresult | None) -> str | None:
    code = None if result is None else result.error_field(pq.DiagnosticField.SQLSTATE)
    return None if code is None else code.decode()


XLOG_DATA = ord("w")  # CopyData kinds of the replication stream: WAL data,
KEEPALIVE = ord("k")  # and the walsender's keepalive


def parse_xlogdata(message: memoryview) -> tuple[int, int, memoryview]:
    """(start LSN, server WAL end, pgoutput payload) of a 'w' message."""
    start, wal_end, _ = _XLOG_HEADER.unpack_from(message, 1)
    return start, wal_end, message[25:]


def parse_keepalive(message: memoryview) -> tuple[int, bool]:
    """(server WAL end, reply requested) of a 'k' message."""
    wal_end, _, reply = _KEEPALIVE.unpack_from(message, 1)
    return wal_end, reply
