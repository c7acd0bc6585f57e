"""A test process that outgrows its memory says where, before the kernel's OOM killer takes it
without a word: a pytest worker was killed at 17.7-18.3 GB twice on 2026-11-28, with no trace
of which test or thread grew. Past LIMIT_BYTES of resident memory (`CDC_TEST_MEMORY_LIMIT_MB`,
6 GiB by default; the largest worker measured held 606 MB) the guard writes every thread's
stack and the running test to stderr and to `memory-guard-<pid>.txt` under the temp dir, then
exits the process."""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

LIMIT_BYTES = int(os.environ.get("CDC_TEST_MEMORY_LIMIT_MB", "6144")) * 1024 * 1024
EXIT_CODE = 70
_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident memory (/proc/self/statm)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE


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
                    faulthandler.dump_traceback(stream, all_threads=True)
            os._exit(EXIT_CODE)
        time.sleep(every_s)


def start(limit: int = LIMIT_BYTES, every_s: float = 1.0) -> None:
    threading.Thread(target=_watch, args=(limit, every_s), name="memory-guard", daemon=True).start()


if __name__ == "__main__":  # a process that outgrows a tiny limit: for the guard's own test
    start(limit=int(sys.argv[1]), every_s=0.05)
    hoard = [bytearray(1 << 20) for _ in range(64)]
    time.sleep(30)
