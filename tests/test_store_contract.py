"""A store cdc does not ship (tests/stores/notes: rows in a SQLite file), registered as another
installed package would register it (the `cdc.stores` entry point group): the CLI's verbs and
help, the config loader and its settings table, `cdc sink`, `cdc verify`, `cdc top` and the
rebuild verb find it, with no file of the product changed."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support import acct_changes_captured, acct_rows, write_config

REPO = Path(__file__).resolve().parent.parent


def _installed(tmp_path: Path) -> dict[str, str]:
    """An environment where an installed package, cdc-notes-store, names tests.stores.notes in
    the `cdc.stores` entry point group (its dist-info on the path, as pip leaves it)."""
    site = tmp_path / "site"
    info = site / "cdc_notes_store-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cdc-notes-store\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[cdc.stores]\nnotes = tests.stores.notes:REGISTRATION\n")
    path = [str(site), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _cdc(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cdc", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)


def test_a_store_another_package_registers_joins_the_cli_and_the_config(tmp_path: Path) -> None:
    env = _installed(tmp_path)
    config = tmp_path / "cdc.toml"
    config.write_text(f'[notes]\npath = "{tmp_path / "notes.db"}"\n')

    assert "  notes     Maintain the SQLite notes file at [notes] path." in _cdc(env, "--help").stdout.splitlines()
    assert "Fill the file again from the topics beside the live one" in _cdc(env, "notes", "rebuild", "--help").stdout
    assert "`notes` (the SQLite notes file at [notes] path)" in " ".join(_cdc(env, "sink", "--help").stdout.split())
    shown = _cdc(env, "config", "--config", str(config))
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["notes"] == {"path": str(tmp_path / "notes.db")}
    assert "| `[notes] path` | (none) | string | the SQLite file the rows are kept in (made when missing) |" in \
        _cdc(env, "config", "--settings").stdout.splitlines()
    config.write_text('[notes]\npth = "x.db"\n')
    wrong = _cdc(env, "config", "--config", str(config))
    assert (wrong.returncode, wrong.stderr.strip()) == (
        1, "error: unknown key 'pth' in [notes]: did you mean 'path'? (remove it or fix the spelling)")
    config.write_text("[notes]\n")
    unset = _cdc(env, "sink", "notes", "--once", "--config", str(config))
    assert (unset.returncode, unset.stderr.strip()) == (
        1, "error: [notes] path is empty: set it to the SQLite file the rows go to")
    asked = _cdc(env, "verify", "--stores", "nope", "--config", str(config))
    assert "use delta, search, cache, postgres, notes" in asked.stderr

    # without the package, the product knows no such store
    plain = _cdc({**os.environ, "PYTHONPATH": str(REPO)}, "config", "--config", str(config))
    assert plain.returncode == 1 and plain.stderr.startswith("error: unknown section [notes]"), plain.stderr


def _notes(path: Path, topic: str) -> dict[int, tuple[int, str]]:
    with sqlite3.connect(path) as conn:
        rows = [orjson.loads(r[0]) for r in conn.execute(
            "SELECT row FROM rows WHERE topic = ? AND row IS NOT NULL", (topic,))]
    return {r["id"]: (r["version"], r["note"]) for r in rows}


@pytest.mark.integration
def test_a_store_another_package_registers_is_kept_verified_counted_and_rebuilt(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any
) -> None:
    env = _installed(tmp_path)
    daemon = acct_changes_captured(db, run_daemon)
    notes = tmp_path / "notes.db"
    config = str(write_config(tmp_path / "notes.toml", db.dsn, broker_servers, topic_prefix, ["public.*"],
                              notes={"path": str(notes)}, spark={"checkpoint_dir": str(tmp_path / "checkpoints")}))
    topic = f"{topic_prefix}.public.acct"

    done = _cdc(env, "sink", "notes", "--once", "--config", config)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "0 dead letters" in done.stdout
    assert _notes(notes, topic) == acct_rows(db)

    agreed = _cdc(env, "verify", "--stores", "notes", "--tables", "public.acct", "--config", config)
    assert agreed.returncode == 0, agreed.stdout + agreed.stderr[-3000:]
    rows = len(acct_rows(db))
    assert f"  notes  {rows} rows  ok" in agreed.stdout.splitlines(), agreed.stdout
    with sqlite3.connect(notes) as conn:
        conn.execute("UPDATE rows SET row = ? WHERE topic = ? AND key = ?",
                     (orjson.dumps({"id": 1, "version": -7, "note": "changed"}).decode(), topic, '{"id":1}'))
    tampered = _cdc(env, "verify", "--stores", "notes", "--tables", "public.acct", "--config", config)
    assert tampered.returncode == 1, tampered.stdout
    assert f"  notes  {rows} rows  MISMATCH: 0 missing, 0 extra, 1 different" in tampered.stdout.splitlines()
    assert '    different {"id":1}; version: postgres 1, notes -7; note: postgres "n1", notes "changed"' in \
        tampered.stdout.splitlines()

    top = _cdc(env, "top", "--once", "--config", config)
    assert top.returncode == 0, top.stderr[-3000:]
    assert "notes" in top.stdout

    rebuilt = _cdc(env, "notes", "rebuild", "--config", config)
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert rebuilt.stdout.splitlines() == [f"notes rebuild: {rows} rows moved over {notes}"]
    assert _notes(notes, topic) == acct_rows(db)  # the tampered row came back from the topics
    assert daemon.stop() == 0
