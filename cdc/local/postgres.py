"""A throwaway PostgreSQL cluster with ``wal_level=logical`` for the tests and `cdc demo`.

The shared cluster on 5432, where a machine has one, runs with the default
``wal_level`` and must not be touched: this one is initdb'd privately on a free port.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from cdc.local.process import (
    LOCALHOST,
    ServiceUnavailable,
    file_size,
    free_port,
    log_tail,
    reachable_dir,
    register,
    run_as,
    unregister,
)


def _pg_version_key(bin_dir: str) -> tuple[int, ...]:
    name = Path(bin_dir).parent.name
    return tuple(int(p) for p in re.findall(r"\d+", name)) or (0,)


def find_pg_bin_dir() -> Path:
    """PostgreSQL server binaries that can do logical decoding with pgoutput.

    Order: ``$CDC_PG_BIN``; the highest ``/usr/lib/postgresql/*/bin`` holding
    initdb with pgoutput.so next to it (Debian's layout); ``pg_config --bindir``.
    """
    env = os.environ.get("CDC_PG_BIN")
    if env:
        path = Path(env)
        if not (path / "initdb").is_file():
            raise ServiceUnavailable(f"CDC_PG_BIN={env} has no initdb")
        return path
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_pg_version_key, reverse=True)
    for cand in candidates:
        path = Path(cand)
        if (path / "initdb").is_file() and (path.parent / "lib" / "pgoutput.so").is_file():
            return path
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir", "--pkglibdir"],
                capture_output=True,
                text=True,
                check=True,
                timeout=10,
            ).stdout.split("\n")
            bindir, pkglibdir = Path(out[0].strip()), Path(out[1].strip())
            if (bindir / "initdb").is_file() and (pkglibdir / "pgoutput.so").is_file():
                return bindir
    raise ServiceUnavailable(
        "no PostgreSQL server binaries with pgoutput found: run `apt-get install postgresql` "
        "(or point CDC_PG_BIN at a bin dir holding initdb, pg_ctl and postgres)"
    )


def _conf_value(value: str) -> str:
    return "'" + str(value).replace("'", "''") + "'"


_HBA = """\
# Written by cdc.local.postgres: a throwaway cluster reachable only from this machine.
local   all          all                    trust
host    all          all    127.0.0.1/32    trust
local   replication  all                    trust
host    replication  all    127.0.0.1/32    trust
"""


class LocalPostgres:
    """A throwaway PostgreSQL cluster with wal_level=logical on a free 127.0.0.1 port.

    Layout: ``<base_dir>/data`` (PGDATA), ``<base_dir>/postgres.log``, unix socket in
    ``<base_dir>``. initdb and postgres refuse to run as root, so as root they run as
    the ``postgres`` OS user, and ``base_dir`` is chowned to it. When that user
    cannot reach ``base_dir`` (pytest's tmp root is mode 0700, so is /root), the
    cluster lives in a ``cdc-localpg-*`` directory under /tmp instead,
    ``<base_dir>/data`` is a symlink to its PGDATA, and `close` deletes it.
    """

    DEFAULT_SETTINGS: dict[str, str] = {
        "wal_level": "logical",
        "max_replication_slots": "20",
        "max_wal_senders": "20",
        "listen_addresses": LOCALHOST,
        "fsync": "off",  # throwaway data: no reason to wait for the disk
        "full_page_writes": "off",
        "max_connections": "100",
        "logging_collector": "off",  # postmaster's stderr already goes to postgres.log
    }

    def __init__(
        self,
        base_dir: str | Path,
        port: int | None = None,
        settings: dict[str, str] | None = None,
        *,
        stop_at_exit: bool = True,
    ) -> None:
        self.base_dir = Path(base_dir).absolute()
        self._auto_port = port is None
        self.port: int = port if port is not None else free_port()
        self.settings: dict[str, str] = {**self.DEFAULT_SETTINGS, **(settings or {})}
        self.stop_at_exit = stop_at_exit
        self.log_path = self.base_dir / "postgres.log"
        self._bin_dir: Path | None = None
        self._cluster_dir: Path | None = None  # owns data/ and the unix socket
        self._relocated = False

    # -- discovery ---------------------------------------------------------------------
    @property
    def bin_dir(self) -> Path:
        """Server binaries (see `find_pg_bin_dir`); looked up once, on first use."""
        if self._bin_dir is None:
            self._bin_dir = find_pg_bin_dir()
        return self._bin_dir

    @property
    def data_dir(self) -> Path:
        """PGDATA (inside the relocated directory when base_dir is out of reach)."""
        return self._resolve_cluster_dir() / "data"

    @property
    def socket_dir(self) -> Path:
        return self._resolve_cluster_dir()

    def _server_user(self) -> pwd.struct_passwd | None:
        """The OS user that runs initdb/pg_ctl: ``postgres`` when we are root, else ourselves."""
        if os.geteuid() != 0:
            return None
        try:
            return pwd.getpwnam("postgres")
        except KeyError:
            raise ServiceUnavailable(
                "running as root needs a `postgres` OS user for initdb "
                "(`apt-get install postgresql` creates it); or run as a non-root user"
            ) from None

    def _run_kwargs(self) -> dict[str, Any]:
        return {"stdin": subprocess.DEVNULL, **run_as(self._server_user())}

    def _resolve_cluster_dir(self) -> Path:
        if self._cluster_dir is None:
            data, self._relocated = reachable_dir(
                self.base_dir, "data", self._server_user(), "cdc-localpg-"
            )
            self._cluster_dir = data.parent
        return self._cluster_dir

    # -- lifecycle ---------------------------------------------------------------------
    def dsn(self, dbname: str = "postgres", user: str = "postgres") -> str:
        """libpq DSN over TCP (replication connections are allowed from 127.0.0.1)."""
        return make_conninfo("", host=LOCALHOST, port=self.port, user=user, dbname=dbname)

    @property
    def running(self) -> bool:
        if self._cluster_dir is None and not (self.base_dir / "data").exists():
            return False
        if not (self.data_dir / "postmaster.pid").exists():
            return False
        result = subprocess.run(
            [str(self.bin_dir / "pg_ctl"), "status", "-D", str(self.data_dir)],
            capture_output=True,
            cwd=self.socket_dir,
            check=False,
            timeout=30,
            **self._run_kwargs(),
        )
        return result.returncode == 0

    def _initdb(self) -> None:
        data = self.data_dir
        user = self._server_user()
        if not data.exists():
            data.mkdir(mode=0o700)
            if user is not None:
                os.chown(data, user.pw_uid, user.pw_gid)
        offset = file_size(self.log_path)
        with self.log_path.open("ab") as log:
            result = subprocess.run(
                [
                    str(self.bin_dir / "initdb"),
                    "-D",
                    str(data),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--locale=C",
                    "--no-sync",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.socket_dir,
                check=False,
                timeout=300,
                **self._run_kwargs(),
            )
        if result.returncode != 0:
            raise ServiceUnavailable(
                f"initdb failed (exit {result.returncode}): {log_tail(self.log_path, offset)}"
            )
        (data / "pg_hba.conf").write_text(_HBA)
        with (data / "postgresql.conf").open("a") as fh:
            fh.write("\ninclude_if_exists = 'cdc_local.conf'\n")

    def _write_settings(self) -> None:
        settings = {
            **self.settings,
            "port": str(self.port),
            "unix_socket_directories": str(self.socket_dir),
        }
        lines = ["# Written by cdc.local.postgres on every start; edits are lost."]
        lines += [f"{name} = {_conf_value(value)}" for name, value in settings.items()]
        path = self.data_dir / "cdc_local.conf"
        path.write_text("\n".join(lines) + "\n")
        user = self._server_user()
        if user is not None:
            os.chown(path, user.pw_uid, user.pw_gid)

    def start(self) -> LocalPostgres:
        """initdb on first use, then start and wait until it accepts connections."""
        if self.running:
            return self
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        for attempt in range(4):
            self._write_settings()
            offset = file_size(self.log_path)
            t0 = time.monotonic()
            with self.log_path.open("ab") as log:
                # No -l: postmaster inherits this fd, so the log may live where the
                # server user cannot write. -w waits until it accepts connections.
                result = subprocess.run(
                    [
                        str(self.bin_dir / "pg_ctl"),
                        "start",
                        "-w",
                        "-t",
                        "60",
                        "-D",
                        str(self.data_dir),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.socket_dir,
                    start_new_session=True,
                    check=False,
                    timeout=120,
                    **self._run_kwargs(),
                )
            if result.returncode == 0 and self._wait_connectable(t0 + 30):
                self._auto_port = False  # from now on restarts keep this port
                if self.stop_at_exit:
                    register(self)
                return self
            tail = log_tail(self.log_path, offset)
            if self._auto_port and attempt < 3 and "already in use" in tail:
                self.port = free_port()  # lost the race for the port: try another
                continue
            with contextlib.suppress(Exception):
                self.stop(mode="immediate")
            raise ServiceUnavailable(f"PostgreSQL did not start on port {self.port}: {tail}")
        raise AssertionError("unreachable")

    def _wait_connectable(self, deadline: float) -> bool:
        while True:
            try:
                with psycopg.connect(self.dsn(), connect_timeout=5, autocommit=True) as conn:
                    conn.execute("SELECT 1")
                return True
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.1)

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m mode`` (smart, fast or immediate); a no-op when not running."""
        unregister(self)
        if self._cluster_dir is None and not (self.base_dir / "data").exists():
            return
        if not (self.data_dir / "postmaster.pid").exists():
            return
        offset = file_size(self.log_path)
        with self.log_path.open("ab") as log:
            result = subprocess.run(
                [
                    str(self.bin_dir / "pg_ctl"),
                    "stop",
                    "-w",
                    "-t",
                    "60",
                    "-m",
                    mode,
                    "-D",
                    str(self.data_dir),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.socket_dir,
                check=False,
                timeout=120,
                **self._run_kwargs(),
            )
        if result.returncode != 0 and (self.data_dir / "postmaster.pid").exists():
            raise RuntimeError(
                f"pg_ctl stop failed (exit {result.returncode}): {log_tail(self.log_path, offset)}"
            )

    def restart(self) -> None:
        """Stop (fast) and start again on the same port with the same data."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop; delete the cluster if it was relocated out of base_dir (nothing else would)."""
        self.stop()
        if self._relocated and self._cluster_dir is not None:
            shutil.rmtree(self._cluster_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                (self.base_dir / "data").unlink()
            self._cluster_dir, self._relocated = None, False

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -----------------------------------------------------------------------
    def create_database(self, name: str) -> str:
        """CREATE DATABASE `name`; returns its DSN."""
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.dsn(name)

    def drop_database(self, name: str, timeout: float = 30) -> None:
        """Drop its logical replication slots (ending walsenders that hold them), then the
        database itself, ending any other sessions (DROP refuses while slots exist)."""
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.dsn(), autocommit=True) as admin:
            while True:
                slots = admin.execute(
                    "SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = %s",
                    (name,),
                ).fetchall()
                if not slots:
                    break
                for slot_name, active_pid in slots:
                    if active_pid is not None:  # released once that walsender has exited
                        admin.execute("SELECT pg_terminate_backend(%s)", (active_pid,))
                        continue
                    with contextlib.suppress(
                        psycopg.errors.ObjectInUse, psycopg.errors.UndefinedObject
                    ):  # re-acquired meanwhile, or already gone: look again
                        admin.execute("SELECT pg_drop_replication_slot(%s)", (slot_name,))
                if time.monotonic() > deadline:
                    raise RuntimeError(f"could not drop replication slots {slots} of {name}")
                time.sleep(0.05)
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def __repr__(self) -> str:
        return f"LocalPostgres(port={self.port}, base_dir={str(self.base_dir)!r})"
