"""The C accelerator of the per-row hot path (cdc/_speedups.c), or None where it was not built.

Each of its functions has a pure-Python twin that stays the reference and reports every
error: the C side returns None for whatever it does not handle, and the twin runs.
`setup.py` builds it when a C compiler is present; tests/test_speedups.py holds the two
to the same output.
"""

from __future__ import annotations

from types import ModuleType

native: ModuleType | None
try:
    from cdc import _speedups as native
except ImportError:  # installed without a C compiler: the twins do all the work
    native = None
