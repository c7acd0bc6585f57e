"""COPY ... TO STDOUT text format: one row per line, tab-separated, backslash escapes.

A COPY text value is the type's output function result, the same text pgoutput sends, so
snapshot rows go through the very converters the streaming events use and give the same
key bytes. COPY TO escapes only backslash, the control characters below and NULL (`\\N`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import ModuleType

from cdc import accel

_ESCAPES = {"\\": "\\", "t": "\t", "n": "\n", "r": "\r", "b": "\b", "f": "\f", "v": "\v"}
_ESCAPE = re.compile(r"\\(.)")


def _unescape(match: re.Match[str]) -> str:
    char = match.group(1)
    try:
        return _ESCAPES[char]
    except KeyError:
        raise ValueError(f"unexpected COPY escape \\{char}") from None


def _py_parse_line(line: bytes | bytearray | memoryview) -> list[str | None]:
    """One COPY text line (with or without its newline) as column values, None for NULL."""
    text = bytes(line).decode()
    if text.endswith("\n"):
        text = text[:-1]
    fields = text.split("\t")
    if "\\" not in text:
        return fields  # type: ignore[return-value]
    return [None if f == "\\N" else _ESCAPE.sub(_unescape, f) if "\\" in f else f for f in fields]


_c_parse_line: Callable[[bytes | bytearray | memoryview], list[str | None] | None] | None = None


def _bind_accel(native: ModuleType | None) -> None:
    global _c_parse_line
    _c_parse_line = None if native is None else native.parse_copy_line


accel.bind(_bind_accel)


def parse_line(line: bytes | bytearray | memoryview) -> list[str | None]:
    """One COPY text line as column values, None for NULL: the C twin when selected, and the
    Python one for what it leaves (bad escapes, bad UTF-8) and whenever it is off."""
    if _c_parse_line is not None:
        values = _c_parse_line(line)
        if values is not None:
            return values
    return _py_parse_line(line)
