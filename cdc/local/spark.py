"""A Spark standalone cluster (one Master, one Worker) from pip's pyspark, no download.

What `spark://` sink jobs are submitted to in the tests and the demo: a real
cluster, so executors are separate JVMs that fetch the driver's jars and run the
driver's Python, as they would in production.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from cdc import jars
from cdc.local.process import (
    LOCALHOST,
    GroupProcess,
    ServiceUnavailable,
    free_port,
    register,
    unregister,
    wait_until,
)

_MASTER_URL = re.compile(r"Starting Spark master at (spark://\S+)")


class LocalSparkCluster:
    """A Master and one Worker on 127.0.0.1, files under `work_dir`.

    Layout: ``master.log``, ``worker.log``, ``worker/`` (the Worker's work dir:
    every application leaves its jars and executor logs there). The Worker offers
    `cores` and `memory` to executors.
    """

    START_TIMEOUT_S = 240.0  # each JVM takes 10-15 s alone, up to ~1 min on a busy 2-core machine

    def __init__(
        self, work_dir: str | Path, *, cores: int = 2, memory: str = "3g", stop_at_exit: bool = True
    ) -> None:
        self.work_dir = Path(work_dir).absolute()
        self.cores = cores
        self.memory = memory
        self.stop_at_exit = stop_at_exit
        self._master: GroupProcess | None = None
        self._worker: GroupProcess | None = None
        self._master_url: str | None = None

    @property
    def master_url(self) -> str:
        """``spark://127.0.0.1:P``, as the Master announced it (Spark moves to P+1 if P was taken)."""
        if self._master_url is None:
            raise ServiceUnavailable(f"{self!r} is not started: call start() first")
        return self._master_url

    @property
    def running(self) -> bool:
        return all(p is not None and p.alive() for p in (self._master, self._worker))

    def _spawn(self, name: str, main: str, *args: str) -> GroupProcess:
        home = jars.spark_home()
        env = {
            **os.environ,
            "JAVA_HOME": str(jars.java_home()),
            "SPARK_HOME": str(home),
            "SPARK_LOCAL_IP": LOCALHOST,
        }
        return GroupProcess(
            [str(home / "bin" / "spark-class"), main, *args],
            self.work_dir / f"{name}.log",
            cwd=self.work_dir,
            env=env,
        )

    def start(self) -> LocalSparkCluster:
        """Start the Master, then the Worker; return once the Worker has registered."""
        if self.running:
            return self
        self.work_dir.mkdir(parents=True, exist_ok=True)
        (self.work_dir / "worker").mkdir(exist_ok=True)
        if self.stop_at_exit:
            register(self)
        try:
            self._start_master()
            self._start_worker()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_master(self) -> None:
        self._master = self._spawn(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host", LOCALHOST, "--port", str(free_port()), "--webui-port", "0",
        )
        master = self._master
        wait_until(
            lambda: master.logged(r"I have been elected leader"),
            master,
            self.START_TIMEOUT_S,
            "the Spark Master",
        )
        found = _MASTER_URL.search(master.log_path.read_bytes()[master.log_offset :].decode(errors="replace"))
        if found is None:
            raise ServiceUnavailable(f"the Spark Master did not log its URL: {master.tail()}")
        self._master_url = found.group(1)

    def _start_worker(self) -> None:
        self._worker = self._spawn(
            "worker",
            "org.apache.spark.deploy.worker.Worker",
            self.master_url,
            "--host", LOCALHOST,
            "--cores", str(self.cores),
            "--memory", self.memory,
            "--webui-port", "0",
            "--work-dir", str(self.work_dir / "worker"),
        )
        worker = self._worker
        wait_until(
            lambda: worker.logged(r"Successfully registered with master"),
            worker,
            self.START_TIMEOUT_S,
            f"the Spark Worker of {self.master_url}",
        )

    def stop(self) -> None:
        """Stop the Worker (and its executors), then the Master; idempotent."""
        unregister(self)
        for proc in (self._worker, self._master):
            if proc is not None:
                proc.terminate(grace_s=30)
        self._worker = self._master = None
        self._master_url = None

    def __enter__(self) -> LocalSparkCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalSparkCluster({self._master_url or 'stopped'}, work_dir={str(self.work_dir)!r})"
