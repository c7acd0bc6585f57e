"""The test processes' memory guard (tests/memory_guard.py), which every test session starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_test_process_that_outgrows_its_memory_names_where_before_it_dies(tmp_path: Path) -> None:
    """tests/memory_guard.py: past its limit, every thread's stack and the running test, then exit 70."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTEST_CURRENT_TEST": "tests/test_x.py::test_y (call)"}
    done = subprocess.run([sys.executable, "-m", "tests.memory_guard", str(32 * 1024 * 1024)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 70, done.stderr
    first = done.stderr.splitlines()[0]
    assert first.startswith("memory guard: ") and first.endswith(
        "MiB resident, over 32 MiB, during tests/test_x.py::test_y (call); every thread:"), first
    assert "the tests that grew it most:\n  +1 MiB to 1 MiB: tests/test_x.py::test_before\n" in done.stderr
    assert 'File "' in done.stderr and "Thread" in done.stderr
    (report,) = tmp_path.glob("memory-guard-*.txt")
    assert report.read_text().splitlines()[0] == first
