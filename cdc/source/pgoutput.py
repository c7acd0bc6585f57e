"""Decoder for PostgreSQL ``pgoutput`` logical replication messages (protocol v1 and v2).

Input is the payload of one XLogData ('w') message, i.e. the bytes after its 25-byte
header; the SQL function ``pg_logical_slot_*_binary_changes`` returns the same bytes.
Layouts follow "Logical Replication Message Formats" in the PostgreSQL manual.

This sits on the hot path (one call per row change), hence the shape of the code:
one tuple-indexed dispatch on the type byte, precompiled ``struct`` unpackers, one
``decode()`` per text column, and no per-field bounds checks. Truncation surfaces as
``IndexError``/``struct.error`` from the unpackers and is turned into ``DecodeError``
at the single ``except`` in ``Decoder.decode`` (``try`` is free in 3.11 until raised).

Protocol facts that are easy to get wrong (checked against real PostgreSQL 15 output):

* Inside a stream block (Stream Start .. Stream Stop) Relation, Type, Insert, Update,
  Delete, Truncate and Message carry an int32 xid after the type byte. For data
  changes that xid is the *subtransaction's* xid when the change was made in a
  subtransaction, not the top-level xid of the Stream Start.
* Message ('M') has that xid only inside stream blocks; the flags byte follows it.
  A transactional Message emitted in a subtransaction still carries the top-level
  xid (PostgreSQL 15), so a later Stream Abort of that subtransaction cannot be
  matched to it by xid.
* Origin ('O') never has an xid, even when sent right after a Stream Start.
* A key-only old tuple ('K') has one entry per column; non-key columns are sent as
  NULL ('n'), they are not left out.
* Stream Abort of a whole transaction has ``subxid == xid``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Final

from cdc import accel
from cdc.toast import UNCHANGED, Unchanged

__all__ = [
    "STREAM_STOP",
    "Begin",
    "Column",
    "Commit",
    "DecodeError",
    "Decoder",
    "Delete",
    "Insert",
    "Message",
    "Origin",
    "Relation",
    "StreamAbort",
    "StreamCommit",
    "StreamStart",
    "StreamStop",
    "Truncate",
    "TupleValue",
    "Type",
    "Update",
    "streamed_xid",
]

# Microseconds between the UNIX epoch and the PostgreSQL epoch (2000-01-01 UTC).
PG_EPOCH_OFFSET_US: Final = 946_684_800_000_000



TupleValue = str | bytes | Unchanged | None
"""One TupleData column: None ('n'), UNCHANGED ('u'), str ('t', UTF-8 text) or bytes ('b')."""

STREAM_STOP: Final = ord("E")  # the message that ends a block of a streamed transaction
_WITH_XID_WHEN_STREAMED: Final = frozenset(b"RYIUDTM")  # these carry their (sub)xid in a stream
_XID = struct.Struct("!I")


def streamed_xid(payload: memoryview | bytes, xid: int) -> int:
    """The (sub)transaction a message inside a streamed block belongs to (proto v2), else `xid`."""
    return _XID.unpack_from(payload, 1)[0] if payload[0] in _WITH_XID_WHEN_STREAMED else xid


class DecodeError(Exception):
    """Malformed pgoutput payload: unknown type byte, truncated or inconsistent data.

    ``kind`` is the message type byte (a 1-char str, or None for an empty payload) and
    ``offset`` the byte offset in the payload where decoding failed.
    """

    def __init__(self, message: str, kind: str | None = None, offset: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.offset = offset


class _Malformed(Exception):
    """Internal: a structural problem at a known offset; ``decode`` adds the type byte."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(reason)
        self.offset = offset
        self.reason = reason


# --------------------------------------------------------------------------- messages


@dataclass(slots=True)
class Begin:
    final_lsn: int
    commit_ts_us: int
    xid: int


@dataclass(slots=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts_us: int


@dataclass(slots=True)
class Origin:
    origin_lsn: int
    name: str


@dataclass(slots=True)
class Column:
    flags: int  # bit 1: part of the replica identity key
    name: str
    type_oid: int
    type_modifier: int


@dataclass(slots=True)
class Relation:
    xid: int | None
    oid: int
    namespace: str
    name: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: list[Column]


@dataclass(slots=True)
class Type:
    xid: int | None
    oid: int
    namespace: str
    name: str


@dataclass(slots=True)
class Insert:
    xid: int | None
    relation_oid: int
    new: list[TupleValue]


@dataclass(slots=True)
class Update:
    xid: int | None
    relation_oid: int
    old_kind: str | None  # 'K' key columns only, 'O' whole old row, None: not sent
    old: list[TupleValue] | None
    new: list[TupleValue]


@dataclass(slots=True)
class Delete:
    xid: int | None
    relation_oid: int
    old_kind: str  # 'K' or 'O'
    old: list[TupleValue]


@dataclass(slots=True)
class Truncate:
    xid: int | None
    options: int  # bit 1: CASCADE, bit 2: RESTART IDENTITY
    relation_oids: list[int]


@dataclass(slots=True)
class Message:
    xid: int | None
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


@dataclass(slots=True)
class StreamStart:
    xid: int
    first_segment: bool


@dataclass(slots=True)
class StreamStop:
    pass


@dataclass(slots=True)
class StreamCommit:
    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts_us: int


@dataclass(slots=True)
class StreamAbort:
    xid: int
    subxid: int


TRUNCATE_CASCADE: Final = 1
TRUNCATE_RESTART_IDENTITY: Final = 2

# --------------------------------------------------------------------------- helpers

_u32 = struct.Struct(">I").unpack_from
_u32x2 = struct.Struct(">II").unpack_from
_u32_i32 = struct.Struct(">Ii").unpack_from
_u64 = struct.Struct(">Q").unpack_from
_begin = struct.Struct(">QqI").unpack_from  # final LSN, commit ts, xid
_commit = struct.Struct(">BQQq").unpack_from  # flags, commit LSN, end LSN, commit ts
_stream_commit = struct.Struct(">IBQQq").unpack_from
_msg_head = struct.Struct(">BQ").unpack_from  # flags, LSN
_trunc_head = struct.Struct(">IB").unpack_from  # relation count, options

_BEGIN_LEN: Final = 1 + 20
_COMMIT_LEN: Final = 1 + 25
_STREAM_COMMIT_LEN: Final = 1 + 29


def _cstring(buf: bytes, pos: int) -> tuple[str, int]:
    """Read a NUL-terminated UTF-8 string at ``pos``; return it and the offset after the NUL."""
    end = buf.find(0, pos)
    if end < 0:
        raise _Malformed(pos, "unterminated string")
    return buf[pos:end].decode(), end + 1


def _py_tuple(buf: bytes, pos: int) -> tuple[list[TupleValue], int]:
    """Read TupleData at ``pos``; return the column values and the offset after them.

    Lengths are not checked per column: a length running past the end makes the
    returned offset exceed ``len(buf)``, which every caller rejects.
    """
    start = pos
    try:
        n = (buf[pos] << 8) | buf[pos + 1]
        pos += 2
        out: list[TupleValue] = []
        append = out.append
        while n:
            n -= 1
            kind = buf[pos]
            if kind == 116:  # 't' text; first, as it is by far the most common
                (size,) = _u32(buf, pos + 1)
                pos += 5
                append(buf[pos : pos + size].decode())
                pos += size
            elif kind == 110:  # 'n' NULL
                append(None)
                pos += 1
            elif kind == 117:  # 'u' unchanged TOASTed value
                append(UNCHANGED)
                pos += 1
            elif kind == 98:  # 'b' binary
                (size,) = _u32(buf, pos + 1)
                pos += 5
                append(buf[pos : pos + size])
                pos += size
            else:
                raise _Malformed(pos, f"unknown TupleData column kind {kind!r}")
    except (IndexError, struct.error):
        raise _Malformed(len(buf), f"TupleData starting at offset {start} is truncated") from None
    except UnicodeDecodeError as exc:
        if pos + size > len(buf):  # cut inside a multi-byte character
            raise _Malformed(len(buf), f"TupleData starting at offset {start} is truncated") from None
        raise _Malformed(pos, f"text column is not valid UTF-8: {exc.reason}") from None
    return out, pos


_tuple = _py_tuple


def _bind_accel(native: ModuleType | None) -> None:
    global _tuple
    if native is None:
        _tuple = _py_tuple
        return
    parse_tuple = native.parse_tuple

    def _c_tuple(buf: bytes, pos: int) -> tuple[list[TupleValue], int]:
        """The C twin; the Python one for what it leaves (binary columns, every error)."""
        return parse_tuple(buf, pos, UNCHANGED) or _py_tuple(buf, pos)

    _tuple = _c_tuple


accel.bind(_bind_accel)


def _end(buf: bytes, pos: int) -> None:
    """Require the message to end exactly at ``pos``.

    Short means truncated; long means we read it with the wrong layout (typically a
    wrong stream-block state, which shifts every field by the 4-byte xid).
    """
    if pos != len(buf):
        if pos > len(buf):
            raise _Malformed(len(buf), "truncated")
        raise _Malformed(pos, f"{len(buf) - pos} unexpected trailing byte(s)")


def _need(buf: bytes, size: int) -> None:
    if len(buf) != size:
        _end(buf, size)


# --------------------------------------------------------------------------- handlers
# Each handler takes (decoder, payload) and returns a message object.


def _begin_msg(dec: Decoder, buf: bytes) -> Begin:
    _need(buf, _BEGIN_LEN)
    final_lsn, ts, xid = _begin(buf, 1)
    return Begin(final_lsn, ts + PG_EPOCH_OFFSET_US, xid)


def _commit_msg(dec: Decoder, buf: bytes) -> Commit:
    _need(buf, _COMMIT_LEN)
    flags, commit_lsn, end_lsn, ts = _commit(buf, 1)
    return Commit(flags, commit_lsn, end_lsn, ts + PG_EPOCH_OFFSET_US)


def _origin_msg(dec: Decoder, buf: bytes) -> Origin:
    (lsn,) = _u64(buf, 1)
    name, pos = _cstring(buf, 9)
    _end(buf, pos)
    return Origin(lsn, name)


def _relation_msg(dec: Decoder, buf: bytes) -> Relation:
    if dec.in_stream:
        xid, oid = _u32x2(buf, 1)
        pos = 9
    else:
        xid = None
        (oid,) = _u32(buf, 1)
        pos = 5
    namespace, pos = _cstring(buf, pos)
    name, pos = _cstring(buf, pos)
    identity = chr(buf[pos])
    ncols = (buf[pos + 1] << 8) | buf[pos + 2]
    pos += 3
    columns = []
    for _ in range(ncols):
        flags = buf[pos]
        colname, pos = _cstring(buf, pos + 1)
        type_oid, typmod = _u32_i32(buf, pos)
        pos += 8
        columns.append(Column(flags, colname, type_oid, typmod))
    _end(buf, pos)
    return Relation(xid, oid, namespace or "pg_catalog", name, identity, columns)


def _type_msg(dec: Decoder, buf: bytes) -> Type:
    if dec.in_stream:
        xid, oid = _u32x2(buf, 1)
        pos = 9
    else:
        xid = None
        (oid,) = _u32(buf, 1)
        pos = 5
    namespace, pos = _cstring(buf, pos)
    name, pos = _cstring(buf, pos)
    _end(buf, pos)
    # Same convention as Relation: the server sends '' for pg_catalog.
    return Type(xid, oid, namespace or "pg_catalog", name)


def _insert_msg(dec: Decoder, buf: bytes) -> Insert:
    if dec.in_stream:
        xid, oid = _u32x2(buf, 1)
        pos = 9
    else:
        xid = None
        (oid,) = _u32(buf, 1)
        pos = 5
    if buf[pos] != 78:  # 'N'
        raise _Malformed(pos, f"expected 'N', got {buf[pos : pos + 1]!r}")
    new, pos = _tuple(buf, pos + 1)
    if pos != len(buf):
        _end(buf, pos)
    return Insert(xid, oid, new)


def _update_msg(dec: Decoder, buf: bytes) -> Update:
    if dec.in_stream:
        xid, oid = _u32x2(buf, 1)
        pos = 9
    else:
        xid = None
        (oid,) = _u32(buf, 1)
        pos = 5
    tag = buf[pos]
    if tag == 78:  # 'N': no old tuple
        old_kind = None
        old = None
    elif tag == 75 or tag == 79:  # 'K' / 'O'
        old_kind = chr(tag)
        old, pos = _tuple(buf, pos + 1)
        if buf[pos] != 78:
            raise _Malformed(pos, f"expected 'N', got {buf[pos : pos + 1]!r}")
    else:
        raise _Malformed(pos, f"expected 'K', 'O' or 'N', got {buf[pos : pos + 1]!r}")
    new, pos = _tuple(buf, pos + 1)
    if pos != len(buf):
        _end(buf, pos)
    return Update(xid, oid, old_kind, old, new)


def _delete_msg(dec: Decoder, buf: bytes) -> Delete:
    if dec.in_stream:
        xid, oid = _u32x2(buf, 1)
        pos = 9
    else:
        xid = None
        (oid,) = _u32(buf, 1)
        pos = 5
    tag = buf[pos]
    if tag != 75 and tag != 79:
        raise _Malformed(pos, f"expected 'K' or 'O', got {buf[pos : pos + 1]!r}")
    old, pos = _tuple(buf, pos + 1)
    if pos != len(buf):
        _end(buf, pos)
    return Delete(xid, oid, chr(tag), old)


def _truncate_msg(dec: Decoder, buf: bytes) -> Truncate:
    if dec.in_stream:
        (xid,) = _u32(buf, 1)
        pos = 5
    else:
        xid = None
        pos = 1
    count, options = _trunc_head(buf, pos)
    pos += 5
    _end(buf, pos + 4 * count)
    oids = list(struct.unpack_from(f">{count}I", buf, pos))
    return Truncate(xid, options, oids)


def _message_msg(dec: Decoder, buf: bytes) -> Message:
    if dec.in_stream:
        (xid,) = _u32(buf, 1)
        pos = 5
    else:
        xid = None
        pos = 1
    flags, lsn = _msg_head(buf, pos)
    prefix, pos = _cstring(buf, pos + 9)
    (size,) = _u32(buf, pos)
    pos += 4
    _end(buf, pos + size)
    return Message(xid, bool(flags & 1), lsn, prefix, buf[pos:])


def _stream_start_msg(dec: Decoder, buf: bytes) -> StreamStart:
    _need(buf, 6)
    (xid,) = _u32(buf, 1)
    dec.in_stream = True
    return StreamStart(xid, buf[5] == 1)


def _stream_stop_msg(dec: Decoder, buf: bytes) -> StreamStop:
    _need(buf, 1)
    dec.in_stream = False
    return StreamStop()


def _stream_commit_msg(dec: Decoder, buf: bytes) -> StreamCommit:
    _need(buf, _STREAM_COMMIT_LEN)
    xid, flags, commit_lsn, end_lsn, ts = _stream_commit(buf, 1)
    return StreamCommit(xid, flags, commit_lsn, end_lsn, ts + PG_EPOCH_OFFSET_US)


def _stream_abort_msg(dec: Decoder, buf: bytes) -> StreamAbort:
    _need(buf, 9)
    xid, subxid = _u32x2(buf, 1)
    return StreamAbort(xid, subxid)


def _unknown_msg(dec: Decoder, buf: bytes) -> object:
    raise _Malformed(0, "unknown message type")


_Handler = Callable[["Decoder", bytes], object]


def _dispatch_table() -> tuple[_Handler, ...]:
    table: list[_Handler] = [_unknown_msg] * 256
    for kind, handler in {
        "B": _begin_msg,
        "C": _commit_msg,
        "O": _origin_msg,
        "R": _relation_msg,
        "Y": _type_msg,
        "I": _insert_msg,
        "U": _update_msg,
        "D": _delete_msg,
        "T": _truncate_msg,
        "M": _message_msg,
        "S": _stream_start_msg,
        "E": _stream_stop_msg,
        "c": _stream_commit_msg,
        "A": _stream_abort_msg,
    }.items():
        table[ord(kind)] = handler
    return tuple(table)


_DISPATCH: Final = _dispatch_table()


class Decoder:
    """Stateful pgoutput decoder.

    State is needed because whether data messages carry an xid depends on being
    inside a stream block, which only the preceding Stream Start/Stop tell us.
    ``in_stream=True`` is for replaying spilled stream chunks, whose messages all
    came from inside stream blocks.
    """

    __slots__ = ("in_stream",)

    def __init__(self, in_stream: bool = False) -> None:
        self.in_stream = in_stream

    def decode(self, data: bytes | memoryview) -> object:
        """Decode one pgoutput message; raise ``DecodeError`` if it is malformed."""
        buf = data if type(data) is bytes else bytes(data)
        try:
            return _DISPATCH[buf[0]](self, buf)
        except _Malformed as exc:
            raise _error(buf, exc.offset, exc.reason) from None
        except (IndexError, struct.error):
            raise _error(buf, len(buf), "truncated") from None
        except UnicodeDecodeError as exc:
            raise _error(buf, None, f"name is not valid UTF-8: {exc.reason}") from None


def _error(buf: bytes, offset: int | None, reason: str) -> DecodeError:
    if not buf:
        return DecodeError("empty pgoutput message", None, 0)
    kind = chr(buf[0])
    where = "" if offset is None else f" at offset {offset}"
    return DecodeError(
        f"pgoutput message type {kind!r} ({len(buf)} bytes): {reason}{where}", kind, offset
    )
