"""The one switch between the C accelerator (cdc/_speedups.c) and its pure-Python twins.

Each C function has a pure-Python twin that stays the reference and reports every error:
the C side returns None for whatever it does not handle, and the twin runs. Both paths
must stay proven end to end, so the choice is made here and nowhere else:

* `CDC_ACCEL=0` in the environment turns the accelerator off for the process (read once,
  at import); without a built extension the twins run anyway.
* A module with a fast path hands `bind` a function that (re)binds its C entry points
  from the module given, or to its twins for None; `select`/`selected` rebind them all,
  which is how tests compare the two paths in one process.

The hot paths then pay nothing for the switch: they call whatever was bound last.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

ENV_VAR = "CDC_ACCEL"

#: The built extension, whether or not it is in use (None: installed without a C compiler).
speedups: ModuleType | None
try:
    speedups = importlib.import_module("cdc._speedups")
except ImportError:
    speedups = None

_OFF = {"0", "false", "no", "off"}


def _wanted() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF


#: What the hot paths use: `speedups`, or None when it is not built or switched off.
native: ModuleType | None = speedups if _wanted() else None

Binder = Callable[[ModuleType | None], None]
_binders: list[Binder] = []


def bind(binder: Binder) -> None:
    """Register a module's binder and apply it to the current choice."""
    _binders.append(binder)
    binder(native)


def select(on: bool) -> None:
    """Use the C path (True) or the Python twins (False) from now on, in every module.

    Objects that picked their path when built (a relation's `TableEvents`, a
    `ChangeRenderer`, a producer's partition counts) keep it: build them after selecting.
    """
    global native
    if on and speedups is None:
        raise RuntimeError("the C accelerator (cdc._speedups) is not built")
    native = speedups if on else None
    for binder in _binders:
        binder(native)


@contextmanager
def selected(on: bool) -> Iterator[ModuleType | None]:
    """`select(on)` for the duration of a block, then back to the previous choice."""
    previous = native is not None
    select(on)
    try:
        yield native
    finally:
        select(previous)


def describe() -> str:
    """Which path runs, for `cdc --version` and the daemon's start-up line."""
    if native is not None:
        return "C accelerator"
    if speedups is not None:
        return f"pure Python, {ENV_VAR}=0"
    return "pure Python, C accelerator not built"
