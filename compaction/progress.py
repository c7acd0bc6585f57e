"""The sink jobs' progress records, `<prefix>.__cdc_sinks`, read as a table (job -> latest).

Written by each sink job after every micro-batch (sinks.topics.ProgressLog); read by the
job when it starts again and by `cdc status`.
"""

from __future__ import annotations

from typing import Any

import orjson

from cdc.config import TopicConfig
from compaction.reader import read_topic

SINKS_SUFFIX = "__cdc_sinks"


def sinks_topic(prefix: str) -> str:
    return f"{prefix}.{SINKS_SUFFIX}"


def read_progress(config: TopicConfig) -> dict[str, dict[str, Any]]:
    """Every sink job's latest progress record, by job name ({} when no job ever ran)."""
    out: dict[str, dict[str, Any]] = {}
    try:
        for record in read_topic(config, sinks_topic(config.prefix), idle_timeout_s=10):
            if record.key is None:
                continue
            if record.value is None:  # a job that is gone (a finished rebuild)
                out.pop(record.key.decode(), None)
            else:
                out[record.key.decode()] = orjson.loads(record.value)
    except LookupError:
        return {}
    return out
