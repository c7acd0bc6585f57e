"""The accelerator switch: `CDC_ACCEL=0` turns the C path off for a process, `select` in one.

Whether the extension is built is only required where it can be: with a C compiler and
the Python headers present (CI installs both), an unbuilt extension is a broken install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from cdc import accel
from cdc.events.records import Column, TableEvents
from cdc.kafka import partitioner
from cdc.source.pgoutput import Decoder
from snapshot import copy_text


def _compiler_present() -> bool:
    include = sysconfig.get_paths()["include"]
    return any(shutil.which(cc) for cc in ("gcc", "cc")) and Path(include, "Python.h").is_file()


@pytest.mark.skipif(not _compiler_present(), reason="no C compiler with Python headers: the twins do all the work")
def test_the_accelerator_is_built():
    """setup.py builds it wherever it can; without it every row runs the slower Python twins."""
    assert accel.speedups is not None, "cdc._speedups is not built: run pip install -e . again"


def _version_line(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != accel.ENV_VAR}
    if env_value is not None:
        env[accel.ENV_VAR] = env_value
    done = subprocess.run(
        [sys.executable, "-m", "cdc", "--version"], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_cdc_accel_0_turns_the_c_path_off_for_the_process():
    assert _version_line("0").endswith("(pure Python, CDC_ACCEL=0)" if accel.speedups else "not built)")
    expected = "(C accelerator)" if accel.speedups else "(pure Python, C accelerator not built)"
    assert _version_line(None).endswith(expected)
    assert _version_line("1").endswith(expected)


@pytest.mark.skipif(accel.speedups is None, reason="the C accelerator is not built")
def test_select_rebinds_every_fast_path_and_selected_restores_it():
    before = accel.native
    with accel.selected(False):
        assert accel.native is None
        assert partitioner.fast_partition_for is partitioner.partition_for
        assert TableEvents("p", "db", "s", "t", "p.s.t", [Column("id", int, None, {})], [0]).c_encoder is None
        assert Decoder().decode(b"I\x00\x00\x40\x00N\x00\x01t\x00\x00\x00\x017").new == ["7"]
        assert copy_text.parse_line(b"1\t\\N\n") == ["1", None]
        with accel.selected(True):
            assert accel.native is accel.speedups
            assert partitioner.fast_partition_for is accel.speedups.partition_for
            assert TableEvents("p", "db", "s", "t", "p.s.t", [Column("id", int, None, {})], [0]).c_encoder is not None
            assert Decoder().decode(b"I\x00\x00\x40\x00N\x00\x01t\x00\x00\x00\x017").new == ["7"]
            assert copy_text.parse_line(b"1\t\\N\n") == ["1", None]
        assert accel.native is None
    assert accel.native is before


def test_selecting_an_unbuilt_accelerator_says_so(monkeypatch):
    monkeypatch.setattr(accel, "speedups", None)  # an install without a C compiler
    with pytest.raises(RuntimeError, match="not built"):
        accel.select(True)
