"""What every throwaway local service shares: free ports, logs, process groups, clean-up.

Each service binds 127.0.0.1 on a free port, keeps its files under a directory the
caller chooses, runs in its own process group (so a stop or a kill -9 reaches every
process it spawned) and is stopped at interpreter exit if the caller forgot to.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pwd
import re
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, Self

from cdc.machine import LOCALHOST, ServiceUnavailable, require_command

log = logging.getLogger(__name__)

#: The JIT of a short-lived JVM: C1 only. Most of a JVM's CPU in its first minutes is the
#: optimising compiler's; a throwaway broker starts on about half the CPU with C1 alone, and
#: OpenSearch on less too. C1 alone gets a 48 MB code cache, which a busy JVM fills within
#: minutes (then it stops compiling and crawls): the tiered default back.
QUICK_JIT = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"


def jit_options(full_jit: bool) -> list[str]:
    """A throwaway server's JIT options: C1 only, unless `full_jit` (a bench measuring a warm server)."""
    return [] if full_jit else QUICK_JIT.split()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    Another process can still take it before the server binds it, so the services
    retry with a fresh port when they chose the port themselves.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOCALHOST, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
        try:
            sock.bind((LOCALHOST, port))
        except OSError:
            return False
        return True


def port_accepts(port: int) -> bool:
    try:
        socket.create_connection((LOCALHOST, port), timeout=1).close()
    except OSError:
        return False
    return True


def log_tail(path: Path, offset: int = 0, lines: int = 12) -> str:
    """The last lines of a log written since `offset`, on one line (errors stay one line)."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return f"(no log at {path})"
    kept = [ln.strip() for ln in text.splitlines() if ln.strip() and "GLIBC_" not in ln]
    return " | ".join(kept[-lines:]) or f"(log {path} is empty)"


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def log_has(path: Path, offset: int, pattern: str) -> bool:
    """Whether the log written since `offset` has a line matching `pattern` (a regex)."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            return re.search(pattern, fh.read().decode("utf-8", "replace")) is not None
    except OSError:
        return False


# -- servers that refuse root ---------------------------------------------------------------


def system_user(name: str) -> pwd.struct_passwd:
    """The unprivileged system user `name`, created once (we are root) if absent.

    Servers that refuse root (OpenSearch) run as such a user: no home, no login shell.
    """
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(name)
    useradd = require_command("useradd", "`apt-get install passwd`")
    result = subprocess.run(
        [useradd, "-r", "-M", "-s", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    try:
        return pwd.getpwnam(name)  # also when a concurrent run created it first
    except KeyError:
        raise ServiceUnavailable(
            f"cannot create the system user {name} (`useradd -r -M -s /usr/sbin/nologin {name}`): "
            f"{result.stderr.strip() or 'exit ' + str(result.returncode)}"
        ) from None


def run_as(user: pwd.struct_passwd | None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """subprocess keyword arguments that run a child as `user` (None: as ourselves).

    The child gets `user`'s own groups only (not root's supplementary ones) and its
    HOME/USER/LOGNAME on top of `env` (default: our environment).
    """
    if user is None:
        return {} if env is None else {"env": env}
    return {
        "user": user.pw_uid,
        "group": user.pw_gid,
        "extra_groups": os.getgrouplist(user.pw_name, user.pw_gid),
        "env": {
            **(os.environ if env is None else env),
            "HOME": user.pw_dir,
            "USER": user.pw_name,
            "LOGNAME": user.pw_name,
        },
    }


def _user_passes(user: pwd.struct_passwd | None, *test_args: str) -> bool:
    """Whether `test *test_args` holds for `user` (every parent directory must be searchable)."""
    result = subprocess.run(
        ["test", *test_args], stdin=subprocess.DEVNULL, cwd="/", check=False, timeout=30, **run_as(user)
    )
    return result.returncode == 0


def user_can_write(user: pwd.struct_passwd | None, path: Path) -> bool:
    return _user_passes(user, "-d", str(path), "-a", "-w", str(path), "-a", "-x", str(path))


def user_can_run(user: pwd.struct_passwd | None, path: Path) -> bool:
    return _user_passes(user, "-f", str(path), "-a", "-x", str(path))


def reachable_dir(
    base_dir: Path, name: str, user: pwd.struct_passwd | None, prefix: str
) -> tuple[Path, bool]:
    """``base_dir/name``: a directory (mode 0700) that `user` owns and can reach.

    pytest's tmp root and /root are mode 0700, so an unprivileged server user cannot
    reach a directory under them: its files then live in a fresh ``<prefix>*``
    directory under the temp dir, ``base_dir/name`` is a symlink to
    ``<that>/name``, and the caller deletes ``<that>`` when done. A later call finds
    the symlink again (a restart from a new object). Returns (the directory, relocated).
    """
    link = base_dir / name
    if link.is_symlink():
        target = Path(os.readlink(link))
        if target.is_dir():
            return target, True
        link.unlink()
    base_dir.mkdir(parents=True, exist_ok=True)
    if user is None:
        link.mkdir(mode=0o700, exist_ok=True)
        return link, False
    os.chown(base_dir, user.pw_uid, user.pw_gid)
    if user_can_write(user, base_dir):
        link.mkdir(mode=0o700, exist_ok=True)
        os.chown(link, user.pw_uid, user.pw_gid)
        return link, False
    for root in dict.fromkeys([tempfile.gettempdir(), "/tmp", "/var/tmp"]):
        if not os.path.isdir(root):
            continue
        cand = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        os.chown(cand, user.pw_uid, user.pw_gid)
        if user_can_write(user, cand):
            (cand / name).mkdir(mode=0o700)
            os.chown(cand / name, user.pw_uid, user.pw_gid)
            link.symlink_to(cand / name)
            return cand / name, True
        cand.rmdir()
    raise ServiceUnavailable(
        f"the {user.pw_name} OS user cannot reach {base_dir} nor a temp dir: "
        "pick a directory it can traverse"
    )


# -- clean-up -----------------------------------------------------------------------------


class Stoppable(Protocol):
    def stop(self) -> None: ...


_LIVE: dict[Stoppable, int] = {}  # running service -> pid of the process that started it


def register(service: Stoppable) -> None:
    """Stop `service` at interpreter exit unless it was stopped before."""
    _LIVE[service] = os.getpid()


def unregister(service: Stoppable) -> None:
    _LIVE.pop(service, None)


@atexit.register
def _stop_leftovers() -> None:
    """Never leave a server behind when a demo or a test run exits without stopping it."""
    for service, owner in list(_LIVE.items()):
        if owner == os.getpid():  # a forked child must not stop its parent's servers
            with contextlib.suppress(Exception):
                service.stop()


class GroupProcess:
    """A server process started in its own session, its output appended to a log file.

    `terminate` sends SIGTERM to the whole group and SIGKILL after a grace period;
    `kill9` is the crash a test inflicts. Both wait until every process of the group
    is gone, so the ports and data directories are free again afterwards.
    """

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        *,
        cwd: Path,
        env: dict[str, str] | None = None,
        preexec: Callable[[], None] | None = None,
        user: int | None = None,
        group: int | None = None,
        extra_groups: Sequence[int] | None = None,
    ) -> None:
        self.log_path = log_path
        self.log_offset = file_size(log_path)
        with log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                start_new_session=True,
                user=user,
                group=group,
                extra_groups=extra_groups,
                preexec_fn=preexec,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def logged(self, pattern: str) -> bool:
        """Whether this run of the process has logged a line matching `pattern`."""
        return log_has(self.log_path, self.log_offset, pattern)

    def tail(self) -> str:
        return log_tail(self.log_path, self.log_offset)

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def _group_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self.popen.poll()  # reap the leader so killpg stops seeing a zombie
            try:
                os.killpg(self.popen.pid, 0)
            except (ProcessLookupError, PermissionError):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def terminate(self, grace_s: float = 30.0, dump: signal.Signals | None = None) -> bool:
        """SIGTERM the group; SIGKILL whatever is left after `grace_s`, first sending `dump`
        (a JVM's SIGQUIT writes its threads to the log: why the shutdown hung). Whether it
        stopped by itself."""
        self._signal_group(signal.SIGTERM)
        if self._group_gone(grace_s):
            return True
        if dump is not None:
            self._signal_group(dump)
            time.sleep(1.0)
        self.kill9()
        return False

    def kill9(self) -> None:
        self._signal_group(signal.SIGKILL)
        self._group_gone(30)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)


def wait_until(
    ready: Callable[[], bool], proc: GroupProcess, timeout_s: float, what: str
) -> None:
    """Poll `ready` until it holds; ServiceUnavailable if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if not proc.alive():
            raise ServiceUnavailable(f"{what} exited with code {proc.popen.returncode}: {proc.tail()}")
        if time.monotonic() > deadline:
            raise ServiceUnavailable(f"{what} not ready after {timeout_s:.0f} s: {proc.tail()}")
        time.sleep(0.1)


class ServerProcess:
    """What every service that runs as one process group shares: whether it runs, its pid,
    a graceful stop, the crash a test inflicts, a restart on the same ports and data, and
    `with` (which stops it, or `close`s it where a subclass has more to clean up)."""

    NAME = "a server"
    START_TIMEOUT_S = 120.0
    STOP_GRACE_S = 60.0  # after SIGTERM, before SIGKILL
    STOP_DUMP: signal.Signals | None = None  # sent before that SIGKILL (a JVM: SIGQUIT, its threads to the log)
    PORT_LOST = re.compile(r"Address already in use")  # its log when another process won a port
    _proc: GroupProcess | None = None
    _auto_port = False  # ports chosen here (not by the caller) may be chosen again
    stop_at_exit = True
    port: int

    def _launch(self) -> GroupProcess:
        """Write the configuration and start the server's process group."""
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _ports(self) -> list[int]:
        return [self.port]

    def _new_ports(self) -> None:
        self.port = free_port()

    def start(self) -> Self:
        """Start; return once ready. A port another process took between `free_port` and the
        bind is retried on fresh ports, where the caller did not choose them."""
        if self.running:
            return self
        for attempt in range(4):
            may_retry = self._auto_port and attempt < 3
            if not all(port_is_free(p) for p in self._ports()):
                if may_retry:
                    self._new_ports()
                    continue
                ports = " or ".join(str(p) for p in self._ports())
                raise ServiceUnavailable(f"{self.NAME} cannot start: port {ports} is already in use")
            proc = self._proc = self._launch()
            try:
                wait_until(self._ready, proc, self.START_TIMEOUT_S, f"{self.NAME} on port {self.port}")
            except ServiceUnavailable:
                tail = proc.tail()
                self.kill9()
                if may_retry and self.PORT_LOST.search(tail):
                    self._new_ports()
                    continue
                raise
            self._auto_port = False  # from now on restarts keep these ports
            if self.stop_at_exit:
                register(self)
            return self
        raise AssertionError("unreachable")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.alive()

    @property
    def pid(self) -> int | None:
        """The server's pid (its process group's leader)."""
        return self._proc.pid if self._proc is not None else None

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL what is left after STOP_GRACE_S; idempotent."""
        unregister(self)
        if self._proc is not None:
            proc, self._proc = self._proc, None
            if not proc.terminate(grace_s=self.STOP_GRACE_S, dump=self.STOP_DUMP):
                log.warning("%s (pid %d) did not stop within %g s of SIGTERM: killed; its log: %s",
                            self.NAME, proc.pid, self.STOP_GRACE_S, proc.log_path)

    def kill9(self) -> None:
        """The crash: SIGKILL, no shutdown hook runs; `start` comes back on the same data."""
        unregister(self)
        if self._proc is not None:
            self._proc.kill9()
            self._proc = None

    def restart(self) -> None:
        """Graceful stop, then start on the same ports and data."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
