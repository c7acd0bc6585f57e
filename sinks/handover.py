"""The Delta warehouse's switch between `cdc delta rebuild` and a running `cdc sink delta`.

`current/` keeps no trace of a delete. Two writers that apply the same offsets in a
different order can bring back a row a later delete removed, with nothing left to tell
them apart: the rebuild's last pass re-inserting an updated row whose delete the live
job had already applied is exactly that. So the live job pauses at a batch boundary, the
rebuild brings its tables to exactly the offsets the live job planned last
(sinks.stores.delta.generations), overwrites `current/` with them, and lets the live job go on from
those offsets: at the switch both reflect the same records.

Files under `<path>/_cdc/` (through Hadoop's FileSystem; a file's age is its modification
time there):
- `live/<job>`: the live job's lease, written again every LEASE_S while it runs, deleted
  when it ends;
- `rebuild/pause`: the rebuild's request (a token), written again every LEASE_S while it
  holds the live job;
- `rebuild/paused`: the live job's answer (the token), once its query stopped between
  batches; deleted when it goes on.
A request older than STALE_S is a dead rebuild's: the live job removes it and goes on. A
lease older than STALE_S (or none) is a job that is not running: the rebuild does not wait
for it, and a job that starts meanwhile finds the request before its first batch.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from pyspark.sql import SparkSession

from sinks import hadoop
from sinks.store import SinkStopped

log = logging.getLogger(__name__)

LEASE_S = 5.0  # how often a holder writes its file again
STALE_S = 60.0  # a file not written again for this long is a dead holder's
POLL_S = 1.0  # how often the live job looks for a request between its batches
# Writing a file again (hadoop.write_bytes) renames the new one over it, which Hadoop's local
# file system does as a delete, then a rename: a reader finds it gone for a moment (often, while
# a thread writes it in a loop). A lease or a request found gone is looked
# at again after these before it counts as gone.
LOOK_AGAIN_S = (0.05, 0.25)

T = TypeVar("T")


def _again(look: Callable[[], T]) -> T:
    """What `look` finds; when nothing (None or False), what it finds after LOOK_AGAIN_S."""
    found = look()
    for gap_s in LOOK_AGAIN_S:
        if found is not None and found is not False:
            break
        time.sleep(gap_s)
        found = look()
    return found


def _folder(root: str) -> str:
    return hadoop.under(root, "_cdc")


class LiveSide:
    """The live job's side: its lease, the rebuild's request, the pause."""

    def __init__(self, spark: SparkSession, root: str, job: str) -> None:
        self.spark = spark
        self.lease = f"{_folder(root)}/live/{job}"
        self.request = f"{_folder(root)}/rebuild/pause"
        self.answer = f"{_folder(root)}/rebuild/paused"
        self._beat = 0.0
        self._looked = (0.0, False)  # (when, what was found): the query loop looks once per POLL_S

    def beat(self) -> None:
        """The lease, written again once LEASE_S has passed."""
        now = time.monotonic()
        if now - self._beat >= LEASE_S:
            hadoop.write_bytes(self.spark, self.lease, f"{socket.gethostname()} {os.getpid()}".encode())
            self._beat = now

    def requested(self, fresh: bool = True) -> bool:
        """Whether a rebuild asks the job to pause (`fresh`: looked at now, not up to POLL_S ago).
        A stale request (its rebuild died) is removed."""
        now = time.monotonic()
        if not fresh and now - self._looked[0] < POLL_S:
            return self._looked[1]
        age = hadoop.age_s(self.spark, self.request)
        if age is not None and age > STALE_S:
            log.warning("a Delta rebuild asked this job to pause and has not renewed its request for %.0f s; "
                        "going on (run `cdc delta rebuild` again)", age)
            hadoop.delete(self.spark, self.request)
            age = None
        self._looked = (now, age is not None)
        return age is not None

    def hold(self, stop: Callable[[], bool]) -> None:
        """Between two batches (the query stopped): answer the request, wait until the
        rebuild's switch is done (or its request went stale, or a stop), then go on."""
        token = _again(lambda: hadoop.read_bytes(self.spark, self.request))
        if token is None:
            return
        hadoop.write_bytes(self.spark, self.answer, token)
        log.info("paused between batches for the Delta rebuild's switch")
        started = time.monotonic()
        try:
            while not stop() and _again(self.requested):  # a request renewed meanwhile is still there
                self.beat()
                time.sleep(POLL_S)
        finally:
            hadoop.delete(self.spark, self.answer)
        log.info("going on after %.0f s paused for the Delta rebuild", time.monotonic() - started)

    def end(self) -> None:
        hadoop.delete(self.spark, self.lease)


class RebuildSide:
    """The rebuild's side: its request, kept fresh by a thread while it holds the live job."""

    def __init__(self, spark: SparkSession, root: str, job: str) -> None:
        self.spark = spark
        self.live = LiveSide(spark, root, job)
        self.token = uuid.uuid4().hex.encode()
        self._done = threading.Event()
        self._renewer: threading.Thread | None = None

    def request(self) -> None:
        hadoop.delete(self.spark, self.live.answer)  # an answer left by an earlier rebuild is not this one's
        hadoop.write_bytes(self.spark, self.live.request, self.token)
        self._renewer = threading.Thread(target=self._renew, name="delta-rebuild-request", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._done.wait(LEASE_S):
            if self.held():
                hadoop.write_bytes(self.spark, self.live.request, self.token)

    def wait_for_live(self, stop: Callable[[], bool]) -> str:
        """Until the live job paused ("paused") or is found not running ("not running")."""
        while True:
            if hadoop.read_bytes(self.spark, self.live.answer) == self.token:
                return "paused"
            if not self.live_running():
                return "not running"
            if stop():
                raise SinkStopped("the rebuild stopped while it waited for `cdc sink delta` to pause; current/ is "
                                  "untouched: run `cdc delta rebuild` again to go on from where it stopped")
            time.sleep(0.5)

    def live_running(self) -> bool:
        """Whether the live job holds a fresh lease."""
        age = _again(lambda: hadoop.age_s(self.spark, self.live.lease))
        return age is not None and age <= STALE_S

    def held(self) -> bool:
        """The request is still this rebuild's (a live job that found it stale removed it)."""
        return _again(lambda: hadoop.read_bytes(self.spark, self.live.request) == self.token)

    def release(self) -> None:
        self._done.set()
        if self._renewer is not None:
            self._renewer.join()
        if self.held():
            hadoop.delete(self.spark, self.live.request)
