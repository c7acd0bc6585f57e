"""A store cdc does not ship: the rows in a SQLite file, a row per key. Registered by the test
through the `cdc.stores` entry point group, as another package would register it, to prove
that a store joins the CLI, the job, `cdc verify`, `cdc top` and the config loader by its
folder alone."""

from __future__ import annotations

from dataclasses import dataclass

from cdc.config import opt
from sinks.stores import Registration


@dataclass
class NotesConfig:
    """`[notes]`: the SQLite file (`cdc sink notes`)."""

    path: str = opt("", "the SQLite file the rows are kept in (made when missing)", optional=True)


REGISTRATION = Registration(
    "notes", "the SQLite notes file at [notes] path", "SQLite, a row per key in one file",
    "Fill the file again from the topics beside the live one, then move it over the live one.",
    settings=NotesConfig, package=__name__,
)
