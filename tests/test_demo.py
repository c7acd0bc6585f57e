"""The README's first command: `cdc demo` runs the pipeline on embedded defaults."""

from __future__ import annotations

import pytest

from tests.support import cdc


@pytest.mark.integration  # `cdc demo` starts its own PostgreSQL and Kafka
def test_demo_shows_events_landing_in_compacted_topics(tmp_path):
    result = cdc("demo", "--workdir", str(tmp_path / "demo"), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "topic demo.public.customers" in out and "topic demo.public.orders" in out
    assert 'key={"id":101}  tombstone' in out  # the delete
    assert 'key={"id":200}  op=c' in out and 'key={"id":102}  op=d' in out  # the key change
    assert 'key={"id":1}  op=r' in out and 'key={"id":2}  op=r' in out  # rows there before cdc: the snapshot
    assert "slot cdc: active" in out
    assert '"connector": "postgresql"' in out
