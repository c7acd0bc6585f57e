"""A test process that outgrows its memory says where, before the kernel's OOM killer takes it
without a word: a pytest worker was killed at 17.7-18.3 GB twice on 2026-11-28, with no trace
of which test or thread grew. Past LIMIT_BYTES of resident memory (`CDC_TEST_MEMORY_LIMIT_MB`,
6 GiB by default; the largest worker measured held 606 MB) the guard writes every thread's
stack and the running test to stderr and to `memory-guard-<pid>.txt` under the temp dir, then
exits the process. It also keeps each test's growth, so the report names the tests that grew the
process most, and with `CDC_TEST_MEMORY_LOG` set appends every test's resident memory to that file."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

LIMIT_BYTES = int(os.environ.get("CDC_TEST_MEMORY_LIMIT_MB", "6144")) * 1024 * 1024
EXIT_CODE = 70
_PAGE = os.sysconf("SC_PAGE_SIZE")
LOG_ENV = "CDC_TEST_MEMORY_LOG"
_PAUSE = threading.Event()  # never set: the guard's pause between looks
TOP = 20

#: (growth in bytes, resident bytes after, test id) of every test that grew the process
_grown: list[tuple[int, int, str]] = []


def resident_bytes() -> int:
    """This process's resident memory (/proc/self/statm)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE


def record(test: str, before: int, after: int) -> None:
    """One test's growth, for the report and the log."""
    if after > before:
        _grown.append((after - before, after, test))
    log = os.environ.get(LOG_ENV)
    if log:
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"{os.getpid()}\t{after >> 20}\t{(after - before) >> 20}\t{test}\n")


def _most_grown() -> str:
    top = sorted(_grown, reverse=True)[:TOP]
    return "".join(f"  +{grew >> 20} MiB to {after >> 20} MiB: {test}\n" for grew, after, test in top)


def _stacks() -> str:
    """Every thread's stack, the main thread first (faulthandler stops at 100 threads, and a
    Spark session's py4j threads are more than that)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != threading.main_thread().ident)
    return "".join(f"Thread {names.get(ident, ident)} (most recent call last):\n{''.join(traceback.format_stack(frame))}\n"
                   for ident, frame in frames)


def _watch(limit: int, every_s: float) -> None:
    while True:
        used = resident_bytes()
        if used > limit:
            report = Path(tempfile.gettempdir()) / f"memory-guard-{os.getpid()}.txt"
            with open(report, "w", encoding="utf-8") as out:
                for stream in (sys.stderr, out):
                    print(f"memory guard: {used / 2**20:.0f} MiB resident, over {limit / 2**20:.0f} MiB, "
                          f"during {os.environ.get('PYTEST_CURRENT_TEST', 'no test')}; every thread:",
                          file=stream, flush=True)
                    print(f"the tests that grew it most:\n{_most_grown()}", file=stream, flush=True)
                    stream.write(_stacks())
                    stream.flush()
            os._exit(EXIT_CODE)
        _PAUSE.wait(every_s)  # not time.sleep: a test may patch it (and would record every look)


def start(limit: int = LIMIT_BYTES, every_s: float = 1.0) -> None:
    threading.Thread(target=_watch, args=(limit, every_s), name="memory-guard", daemon=True).start()


if __name__ == "__main__":  # a process that outgrows a tiny limit: for the guard's own test
    record("tests/test_x.py::test_before", 0, 1 << 20)
    start(limit=int(sys.argv[1]), every_s=0.05)
    hoard = [bytearray(1 << 20) for _ in range(64)]
    time.sleep(30)
