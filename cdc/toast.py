"""UNCHANGED: a TOASTed value the server did not resend.

The decoder (`cdc.source.pgoutput`) puts it where an update's new tuple says 'u'; the
change rules (`cdc.events`) fill it from the old tuple or render Debezium's placeholder.
It lives apart from both so that neither side imports the other for it.
"""

from __future__ import annotations

from typing import Final


class Unchanged:
    """Type of ``UNCHANGED``: a TOASTed value the server did not resend ('u')."""

    __slots__ = ()
    _instance: Unchanged | None = None

    def __new__(cls) -> Unchanged:
        # A singleton so that ``value is UNCHANGED`` holds everywhere.
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED"

    def __reduce__(self) -> str:
        # Pickle/copy by name, so identity survives spilling to disk and deepcopy.
        return "UNCHANGED"


UNCHANGED: Final = Unchanged()
