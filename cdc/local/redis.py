"""Redis from Debian's ``redis-server``: the cache of the tests and the demo.

No persistence (``--save "" --appendonly no``): the cache sink rebuilds it from the
compacted topics, so a kill -9 loses the data and the tests expect exactly that.
"""

from __future__ import annotations

import socket
from pathlib import Path

from cdc.local.process import (
    LOCALHOST,
    GroupProcess,
    ServerProcess,
    free_port,
    require_command,
)


class LocalRedis(ServerProcess):
    """A redis-server on a free 127.0.0.1 port, its working dir and ``redis.log`` in `data_dir`.

    Ready once it answers PING.
    """

    NAME = "Redis"
    START_TIMEOUT_S = 30.0
    STOP_GRACE_S = 30.0  # without persistence redis exits at once on SIGTERM

    def __init__(
        self, data_dir: str | Path, port: int | None = None, *, stop_at_exit: bool = True
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        self._auto_port = port is None
        self.port: int = port if port is not None else free_port()
        self.stop_at_exit = stop_at_exit
        self.log_path = self.data_dir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://{LOCALHOST}:{self.port}/0"

    def _argv(self, server: str) -> list[str]:
        return [
            server,
            "--port", str(self.port),
            "--bind", LOCALHOST,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.data_dir),
        ]  # fmt: skip

    def _launch(self) -> GroupProcess:
        server = require_command("redis-server", "`apt-get install redis-server`")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return GroupProcess(self._argv(server), self.log_path, cwd=self.data_dir)

    def _ready(self) -> bool:
        """PING in the inline protocol: no client library needed to know it serves."""
        try:
            with socket.create_connection((LOCALHOST, self.port), timeout=2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def __repr__(self) -> str:
        return f"LocalRedis({self.url}, data_dir={str(self.data_dir)!r})"
