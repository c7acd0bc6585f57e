"""What a run needs from the machine itself: the loopback address, and commands on PATH,
with one error that names the package to install when something is missing. Shared by the
JVM parts' fetch (cdc.jars), which production sink jobs use, and the throwaway local
services (cdc.local)."""

from __future__ import annotations

import shutil

LOCALHOST = "127.0.0.1"


class ServiceUnavailable(RuntimeError):
    """A part or a local service cannot be fetched or started; the message names the fix, on one line."""


def require_command(name: str, install: str) -> str:
    """The path of `name` on PATH, or ServiceUnavailable saying how to install it."""
    path = shutil.which(name)
    if path is None:
        raise ServiceUnavailable(f"`{name}` not found: {install}")
    return path
