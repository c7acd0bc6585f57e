"""What a table looks like in the search index: its alias, its mapping, its documents.

Pure functions of the table versions (sinks.versions), shared by the driver (index names and
mappings) and the executors (documents). The search type table of docs/sinks/search.md is this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import date, datetime, timedelta
from typing import Any

import orjson

from sinks.versions import Registry, Version

#: dates and timestamps: ISO text, or epoch ms beyond years 1-9999 (infinities included);
#: a value OpenSearch cannot read (timestamptz `infinity`) stays in `_source`, unindexed
DATE = {"type": "date", "format": "strict_date_optional_time||epoch_millis", "ignore_malformed": True}
TEXT = {"type": "text", "fields": {"keyword": {"type": "keyword", "ignore_above": 256}}}
KEYWORD = {"type": "keyword", "ignore_above": 256}
_KEYWORD_NAMES = ("io.debezium.data.Uuid", "io.debezium.data.Enum", "io.debezium.time.ZonedTime")
_KEYWORD_TYPES = ("inet", "cidr", "macaddr", "macaddr8")
_NUMBERS: dict[str, dict[str, Any]] = {
    "int16": {"type": "short"}, "int32": {"type": "integer"}, "int64": {"type": "long"},
    # NaN and the infinities are kept in _source, unindexed
    "float": {"type": "float", "ignore_malformed": True}, "double": {"type": "double", "ignore_malformed": True},
}
_TIMESTAMPS = {"io.debezium.time.Timestamp": 1000, "io.debezium.time.MicroTimestamp": 1}  # -> µs
_EPOCH = datetime(1970, 1, 1)
_EPOCH_DAY = date(1970, 1, 1).toordinal()
_MAX_DAY = date(9999, 12, 31).toordinal()


def alias_name(topic: str) -> str:
    """The alias readers use: the topic, with each capital letter as `-u` + the letter in
    lower case (a topic's own escapes are `-` + two hex digits, so no two topics meet).
    A name OpenSearch cannot hold is a ValueError naming the fix."""
    alias = "".join(f"-u{c.lower()}" if "A" <= c <= "Z" else c for c in topic)
    if alias[0] in "-_+." or len(alias.encode()) > 240:
        raise ValueError(
            f"topic {topic} gives the index name {alias!r}, which OpenSearch refuses (it must not start with "
            "-, _, + or . and must fit 255 bytes): use a [topic] prefix that starts with a lowercase letter or digit"
        )
    return alias


def index_name(alias: str, generation: int = 1) -> str:
    """The concrete index behind an alias (`-v`: never in an alias); each rebuild fills the
    next generation."""
    return f"{alias}-v{generation}"


def generation(alias: str, index: str) -> int:
    """The generation of one of the alias's concrete indexes (0 for any other name)."""
    found = re.fullmatch(re.escape(alias) + r"-v(\d+)", index)
    return int(found[1]) if found else 0


REBUILD_SUFFIX = "-rebuild"  # `-r`: never in an alias


def rebuild_alias(alias: str) -> str:
    """The hidden alias a rebuild writes through, beside the readers' `alias`."""
    return alias + REBUILD_SUFFIX


def markers_name(alias: str) -> str:
    """The table's delete markers (`-m`: never in an alias)."""
    return f"{alias}-markers"


def _field(connect: dict[str, Any], pg_type: str, flat: str, in_array: bool = False) -> dict[str, Any]:
    ctype, name = connect["type"], connect.get("name")
    if ctype == "array":
        element = pg_type[:-2] if pg_type.endswith("[]") else pg_type
        return _field(connect["items"], element, flat, in_array=True)  # OpenSearch fields hold lists
    if ctype == "struct":  # a point
        return {"properties": {"x": _NUMBERS["double"], "y": _NUMBERS["double"], "wkb": {"type": "binary"},
                               "srid": {"type": "integer"}}}
    if ctype == "boolean":
        return {"type": "boolean"}
    if ctype == "bytes":
        return {"type": "binary"}
    if name == "io.debezium.time.Date" or name in _TIMESTAMPS or name == "io.debezium.time.ZonedTimestamp":
        return DATE
    if ctype in _NUMBERS:
        return _NUMBERS[ctype]  # time and interval: µs as long
    if name == "io.debezium.data.Json":
        return TEXT if in_array else {"type": flat}
    if name in _KEYWORD_NAMES or pg_type in _KEYWORD_TYPES:
        return KEYWORD
    if pg_type in ("numeric", "money"):  # exact text in _source; searchable as double
        return {"type": "double", "ignore_malformed": True}
    return TEXT


#: each document's position (sinks.latest.position): stored and searchable, never in `_source`
POSITION = "_cdc_pos"
_POSITION_FIELD = {"type": "keyword", "store": True}


#: in a shared index, each document's table (its alias), which the table's filtered alias
#: selects: searchable, never in `_source`
TABLE = "_cdc_table"
_TABLE_FIELD = {"type": "keyword"}


def mapping(version: Version, flat: str = "flat_object", shared: bool = False) -> dict[str, Any]:
    """The index mapping of a table version: strict, so a field no version declared is a
    rejection, never a guessed type. `flat`: OpenSearch's flat_object, Elasticsearch's flattened.
    Beside the columns, the document's position (and in a shared index its table), out of
    `_source` (readers see the row)."""
    fields = {c.name: _field(c.connect, c.type, flat) for c in version.columns}
    if not shared:
        return {"dynamic": "strict", "_source": {"excludes": [POSITION]},
                "properties": {**fields, POSITION: _POSITION_FIELD}}
    return {"dynamic": "strict", "_source": {"excludes": [POSITION, TABLE]},
            "properties": {**fields, POSITION: _POSITION_FIELD, TABLE: _TABLE_FIELD}}


# --------------------------------------------------------------------------- shared indexes

#: the fields a shared index may map, under OpenSearch's `index.mapping.total_fields.limit` (1,000)
SHARED_FIELDS = 900


def shared_name(base: str, number: int, generation: int = 1) -> str:
    """A shared index of the prefix `base` (`[search] tables_per_index` > 1):
    `<base>-shared<n>-v<generation>` (`-s`: never in an alias)."""
    return f"{base}-shared{number}-v{generation}"


def shared_place(base: str, index: str) -> tuple[int, int] | None:
    """(number, generation) of a shared index of the prefix `base`; None for any other name."""
    found = re.fullmatch(re.escape(base) + r"-shared(\d+)-v(\d+)", index)
    return (int(found[1]), int(found[2])) if found else None


def shared_markers(base: str) -> str:
    """The delete markers of every table of a shared layout: one index, not one per table."""
    return f"{base}-markers"


def filtered(alias: str) -> dict[str, Any]:
    """What a table's alias on a shared index selects: its own documents."""
    return {"filter": {"term": {TABLE: alias}}}


def field_count(properties: dict[str, Any]) -> int:
    """The fields a mapping's properties count against `index.mapping.total_fields.limit`
    (objects and multi-fields included)."""
    return sum(1 + field_count(spec.get("properties", {})) + field_count(spec.get("fields", {}))
               for spec in properties.values())


def pack(tables: list[tuple[str, dict[str, Any]]], indexes: dict[str, tuple[int, dict[str, Any]]],
         per_index: int, fresh: Callable[[], str]) -> dict[str, str]:
    """Where each new table (alias, its fields) goes: the first of `indexes` (name -> tables it
    holds, its fields) with room for one more table, whose fields agree with the table's (a
    column named like another table's with another type cannot share its mapping) and stay
    under SHARED_FIELDS together; else a new one, named by `fresh()`. Alias -> index."""
    held = {name: (count, dict(fields)) for name, (count, fields) in indexes.items()}
    placed = {}
    for alias, fields in tables:
        fits = [name for name, (count, there) in held.items()
                if count < per_index and all(there.get(f, spec) == spec for f, spec in fields.items())
                and field_count({**there, **fields}) <= SHARED_FIELDS]
        name = fits[0] if fits else fresh()
        count, there = held.get(name, (0, {}))
        held[name] = (count + 1, {**there, **fields})
        placed[alias] = name
    return placed


# --------------------------------------------------------------------------- documents


def _date(days: Any) -> Any:
    if isinstance(days, int) and not isinstance(days, bool):
        day = days + _EPOCH_DAY
        return date.fromordinal(day).isoformat() if 1 <= day <= _MAX_DAY else days * 86_400_000
    return days


def _timestamp(unit_us: int) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            micros = value * unit_us
            try:
                return (_EPOCH + timedelta(microseconds=micros)).isoformat(timespec="microseconds")
            except OverflowError:
                return micros // 1000
        return value

    return convert


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value  # OpenSearch rejects it: the record goes to the dead-letter topic
    return value


def _converter(connect: dict[str, Any], in_array: bool = False) -> Callable[[Any], Any] | None:
    """How a column's event value becomes its `_source` value (None: unchanged)."""
    ctype, name = connect["type"], connect.get("name")
    if ctype == "array":
        inner = _converter(connect["items"], in_array=True)
        if inner is None:
            return None
        return lambda value: [None if x is None else inner(x) for x in value] if isinstance(value, list) else value
    if name == "io.debezium.time.Date":
        return _date
    if name in _TIMESTAMPS:
        return _timestamp(_TIMESTAMPS[name])
    if name == "io.debezium.data.Json" and not in_array:
        return _json
    return None


class Documents:
    """Rows (the events' `after`) into `_source` documents, by the version of their commit LSN."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._plans: dict[tuple[str, int], dict[str, Callable[[Any], Any]]] = {}

    def _plan(self, topic: str, lsn: int) -> dict[str, Callable[[Any], Any]]:
        version = self.registry.at(topic, lsn) or self.registry.versions(topic)[0]  # as the job decodes
        plan = self._plans.get((topic, version.from_lsn))
        if plan is None:
            plan = {c.name: f for c in version.columns if (f := _converter(c.connect)) is not None}
            self._plans[(topic, version.from_lsn)] = plan
        return plan

    def plain(self, topic: str) -> bool:
        """Whether every version of the table takes its rows as they are (no column to convert,
        none named like the position): a document is then the row's JSON with the position
        added (sinks.stores.search.store packs those column by column)."""
        return not any(c.name == POSITION or _converter(c.connect) is not None
                       for version in self.registry.versions(topic) for c in version.columns)

    def source(self, topic: str, lsn: int, row: dict[str, Any], position: str) -> dict[str, Any]:
        """The document of a row written at `position` (its commit LSN `lsn`)."""
        for name, convert in self._plan(topic, lsn).items():
            if row.get(name) is not None:
                row[name] = convert(row[name])
        row[POSITION] = position
        return row
