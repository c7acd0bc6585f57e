"""OpenSearch 2.19.3, one single-node cluster, from Maven Central's integ-test distribution.

The search index of the tests and the demo: a real OpenSearch, so that external
versions, ``index.gc_deletes`` and alias swaps behave as they will in production. The
integ-test zip is the bare server (one module, transport-netty4; no plugins, hence no
security, no painless, no ``_delete_by_query``). It runs on Java 17 (2.x refuses
newer JDKs' ergonomics) and refuses root: as root it runs as the system user
``cdc-opensearch``. The cached home is shared by every instance and never written:
each instance has its own config dir (``OPENSEARCH_PATH_CONF``), and the GC log and
crash files that jvm.options points at the home go to the instance's logs instead.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import urllib.request
from pathlib import Path

from cdc import jars
from cdc.local.process import (
    LOCALHOST,
    GroupProcess,
    ServerProcess,
    free_port,
    jit_options,
    reachable_dir,
    run_as,
    system_user,
    user_can_run,
)

SERVER_USER = "cdc-opensearch"
JAVA_OPTS = "-Xms512m -Xmx1g"  # 2 cores and 24 GiB shared with Kafka and Spark JVMs



def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


class LocalOpenSearch(ServerProcess):
    """A single-node OpenSearch on free 127.0.0.1 ports (HTTP and transport), security off.

    Layout: ``<data_dir>/opensearch.log`` (the node's console log) and
    ``<data_dir>/server`` holding ``config`` (rewritten on every start but the
    keystore), ``data`` (path.data), ``logs`` (path.logs, GC log), ``tmp`` and, when
    the server user cannot read the cached home (it sits under /root), ``home``: a
    hard-linked, root-owned view of it. When that user cannot reach ``data_dir``
    (pytest's tmp root is mode 0700), ``server`` is a symlink to a ``cdc-localos-*``
    directory under /tmp, which `close` deletes. Ready once the cluster is yellow. Its JVM
    runs C1 only (`jit_options`) unless `full_jit`.
    """

    NAME = "OpenSearch"
    STOP_DUMP = signal.SIGQUIT
    PORT_LOST = re.compile(r"BindHttpException|BindTransportException|Address already in use")
    START_TIMEOUT_S = 240.0  # ~12 s on a quiet machine; minutes when other JVMs are busy

    def __init__(
        self, data_dir: str | Path, port: int | None = None, *, stop_at_exit: bool = True, full_jit: bool = False
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.full_jit = full_jit
        self._auto_port = port is None
        self.port: int = port if port is not None else free_port()
        self.transport_port: int = free_port()
        self.stop_at_exit = stop_at_exit
        self.log_path = self.data_dir / "opensearch.log"
        self._server_dir: Path | None = None
        self._relocated = False

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"

    @staticmethod
    def _user() -> pwd.struct_passwd | None:
        return system_user(SERVER_USER) if os.geteuid() == 0 else None

    def _server(self, user: pwd.struct_passwd | None) -> Path:
        if self._server_dir is None:
            self._server_dir, self._relocated = reachable_dir(
                self.data_dir, "server", user, "cdc-localos-"
            )
        return self._server_dir

    def _home(self, server: Path, user: pwd.struct_passwd | None) -> Path:
        """The distribution's home as the server user can read it (the cache stays read-only)."""
        home = jars.distribution_home("opensearch")
        if user_can_run(user, home / "bin" / "opensearch"):
            return home
        view = server / "home"
        if not (view / ".complete").exists():
            shutil.rmtree(view, ignore_errors=True)
            shutil.copytree(home, view, symlinks=True, copy_function=_link_or_copy)
            (view / ".complete").touch()
        return view

    def _write_config(self, home: Path, server: Path, user: pwd.struct_passwd | None) -> Path:
        """This instance's config dir: the home's, with ports, paths and the home-relative
        paths of jvm.options (GC log, crash files, heap dumps) pointed at this instance."""
        dirs = {name: server / name for name in ("config", "data", "logs", "tmp")}
        for path in [*dirs.values(), dirs["config"] / "jvm.options.d"]:
            path.mkdir(mode=0o700, exist_ok=True)
        logs, data = dirs["logs"], dirs["data"]
        jvm = (home / "config" / "jvm.options").read_text()
        jvm = re.sub(r"(?<=[=:])logs/", f"{logs}/", jvm).replace("HeapDumpPath=data", f"HeapDumpPath={data}")
        settings = {
            "cluster.name": "cdc-local",
            "node.name": "local",
            "discovery.type": "single-node",
            "network.host": LOCALHOST,
            "http.port": self.port,
            "transport.port": self.transport_port,
            "path.data": str(data),
            "path.logs": str(logs),
            "action.auto_create_index": False,  # a write to an index the sink did not create is a bug
            "cluster.routing.allocation.disk.threshold_enabled": False,  # no read-only flip on a full CI disk
        }
        config = dirs["config"]
        (config / "jvm.options").write_text(jvm)
        shutil.copyfile(home / "config" / "log4j2.properties", config / "log4j2.properties")
        (config / "opensearch.yml").write_text(
            "# Written by cdc.local.opensearch on every start; edits are lost.\n"
            + "".join(f"{k}: {json.dumps(v)}\n" for k, v in settings.items())
        )
        if user is not None:
            for path in [*dirs.values(), *config.rglob("*")]:
                os.chown(path, user.pw_uid, user.pw_gid)
        return config

    # -- lifecycle ---------------------------------------------------------------------
    def _launch(self) -> GroupProcess:
        """The node, fetching the distribution on first use; as `cdc-opensearch` when root."""
        java_home, user = jars.java_home(), self._user()
        server = self._server(user)  # only now: a refused start leaves no relocated dir
        home = self._home(server, user)
        config = self._write_config(home, server, user)
        env = {
            **os.environ,
            "OPENSEARCH_JAVA_HOME": str(java_home),
            "OPENSEARCH_PATH_CONF": str(config),
            "OPENSEARCH_JAVA_OPTS": " ".join([JAVA_OPTS, *jit_options(self.full_jit)]),
            "OPENSEARCH_TMPDIR": str(server / "tmp"),
        }
        return GroupProcess([str(home / "bin" / "opensearch")], self.log_path, cwd=server, **run_as(user, env))

    def _ports(self) -> list[int]:
        return [self.port, self.transport_port]

    def _new_ports(self) -> None:
        self.port, self.transport_port = free_port(), free_port()

    def _ready(self) -> bool:
        query = "/_cluster/health?wait_for_status=yellow&timeout=1s"
        try:
            with urllib.request.urlopen(self.url + query, timeout=10) as resp:
                return json.load(resp).get("status") in ("yellow", "green")
        except (OSError, ValueError):  # not listening yet, 408 (not yellow yet), half an answer
            return False

    def close(self) -> None:
        """Stop; delete the server dir if it was relocated out of data_dir (nothing else would)."""
        self.stop()
        if self._relocated and self._server_dir is not None:
            shutil.rmtree(self._server_dir.parent, ignore_errors=True)
            (self.data_dir / "server").unlink(missing_ok=True)
            self._server_dir, self._relocated = None, False

    def __enter__(self) -> LocalOpenSearch:
        try:
            return self.start()
        except BaseException:
            self.close()  # __exit__ will not run: leave no relocated dir behind
            raise

    def __repr__(self) -> str:
        return f"LocalOpenSearch({self.url}, data_dir={str(self.data_dir)!r})"
