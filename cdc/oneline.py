"""An exception as one line of a message: its first line, or its type when it says nothing."""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
