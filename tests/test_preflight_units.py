"""The start-up's warnings about the source, without a server."""

from __future__ import annotations

import logging

import pytest

from cdc.source.catalog import CapturedTable
from cdc.source.preflight import TOAST_WARNINGS_EACH, _warn_toast_placeholders


def _tables(count: int) -> list[CapturedTable]:
    return [CapturedTable(16384 + i, "public", f"t{i}", "d", ("id",), True, ("body",)) for i in range(count)]


def test_a_few_tables_with_toast_placeholders_get_a_warning_each(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="cdc.source.preflight"):
        _warn_toast_placeholders(_tables(2))
    assert [r.getMessage()[:75] for r in caplog.records] == [
        "table public.t0 has TOASTable columns (body) under REPLICA IDENTITY DEFAULT",
        "table public.t1 has TOASTable columns (body) under REPLICA IDENTITY DEFAULT",
    ]
    assert 'ALTER TABLE "public"."t1" REPLICA IDENTITY FULL' in caplog.records[1].getMessage()


def test_a_wide_schemas_toast_placeholders_are_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="cdc.source.preflight"):
        _warn_toast_placeholders(_tables(1000))
    [record] = caplog.records
    shown = ", ".join(f"public.t{i}" for i in range(TOAST_WARNINGS_EACH))
    assert record.getMessage().startswith(
        f"1000 tables have TOASTable columns under REPLICA IDENTITY DEFAULT ({shown} and {1000 - TOAST_WARNINGS_EACH} "
        "more): an UPDATE that leaves a large value unchanged sends the placeholder __debezium_unavailable_value"
    )
    assert "set [source] set_replica_identity_full = true" in record.getMessage()
