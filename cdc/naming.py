"""Names: SQL identifiers and literals, table patterns, Kafka topic names.

Topic names are part of the public contract (`<prefix>.<schema>.<table>`), so the
escape that turns PostgreSQL identifiers into Kafka's alphabet must be stable,
documented and injective: two different tables must never share a topic, or
their keys would overwrite each other under compaction.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

__all__ = [
    "TOPIC_MAX_LENGTH",
    "PREFIX_MAX_LENGTH",
    "IDENTIFIER_MAX_BYTES",
    "TablePattern",
    "find_topic_collisions",
    "is_table_topic",
    "table_of_topic",
    "parse_table_pattern",
    "parse_topic_name",
    "qualified",
    "quote_ident",
    "quote_literal",
    "split_list",
    "topic_name",
    "validate_prefix",
]

TOPIC_MAX_LENGTH = 249
"""Kafka's limit on topic name length."""

PREFIX_MAX_LENGTH = 200
"""Our limit on the prefix, so that ordinary schema and table names still fit."""

IDENTIFIER_MAX_BYTES = 63
"""PostgreSQL stores at most NAMEDATALEN-1 bytes of an identifier (default build)."""

# Keywords that PostgreSQL's own quote_ident() quotes: every category except
# "unreserved" (reserved, column-name and type/function-name keywords). Taken from
# pg_get_keywords() of PostgreSQL 15 plus the PostgreSQL 16-17 additions, so a name
# written bare in a canonical pattern stays valid SQL on every supported server.
_QUOTED_KEYWORDS = frozenset(
    """
    all analyse analyze and any array as asc asymmetric authorization between bigint binary
    bit boolean both case cast char character check coalesce collate collation column
    concurrently constraint create cross current_catalog current_date current_role
    current_schema current_time current_timestamp current_user dec decimal default
    deferrable desc distinct do else end except exists extract false fetch float for foreign
    freeze from full grant greatest group grouping having ilike in initially inner inout int
    integer intersect interval into is isnull join json json_array json_arrayagg json_exists
    json_object json_objectagg json_query json_scalar json_serialize json_table json_value
    lateral leading least left like limit localtime localtimestamp merge_action national
    natural nchar none normalize not notnull null nullif numeric offset on only or order out
    outer overlaps overlay placing position precision primary real references returning
    right row select session_user setof similar smallint some substring symmetric
    system_user table tablesample then time timestamp to trailing treat trim true union
    unique user using values varchar variadic verbose when where window with xmlattributes
    xmlconcat xmlelement xmlexists xmlforest xmlnamespaces xmlparse xmlpi xmlroot
    xmlserialize xmltable
    """.split()
)

_BARE_IDENT = re.compile(r"[a-z_][a-z0-9_$]*")
# PostgreSQL's whitespace, not Python's: U+00A0 and friends are identifier characters.
_SQL_SPACE = " \t\n\r\f\v"
_PATTERN_FIX = "write it as schema.table, e.g. public.orders"


# --------------------------------------------------------------------------- SQL


def quote_ident(name: str) -> str:
    """Quote an identifier for SQL, always, so no keyword or case folding can bite.

    Raises ValueError for names PostgreSQL cannot hold: empty (a zero-length
    delimited identifier is a syntax error) or containing NUL.
    """
    if not name:
        raise ValueError("empty SQL identifier: PostgreSQL names are never empty")
    if "\x00" in name:
        raise ValueError(
            f"SQL identifier {name!r} contains a NUL character: PostgreSQL names cannot hold it"
        )
    return '"' + name.replace('"', '""') + '"'


def qualified(schema: str, table: str) -> str:
    """`"schema"."table"`: the unambiguous form for generated SQL."""
    return quote_ident(schema) + "." + quote_ident(table)


def quote_literal(s: str) -> str:
    """Quote a string literal, assuming standard_conforming_strings=on (the default
    since 9.1, and pinned by our sessions): only the single quote needs doubling,
    backslashes are ordinary characters."""
    if "\x00" in s:
        raise ValueError(
            f"SQL string {s!r} contains a NUL character: PostgreSQL text cannot hold it"
        )
    return "'" + s.replace("'", "''") + "'"


def _written(name: str) -> str:
    """The shortest SQL spelling of one identifier (bare where SQL allows it)."""
    if _BARE_IDENT.fullmatch(name) and name not in _QUOTED_KEYWORDS:
        return name
    return quote_ident(name)


def _shown(schema: str, table: str) -> str:
    """`"schema"."table"` for messages: never raises and stays on one line."""
    text = '"' + schema.replace('"', '""') + '"."' + table.replace('"', '""') + '"'
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


# ----------------------------------------------------------------- table patterns


@dataclass(frozen=True)
class TablePattern:
    """One entry of the capture list: a table, or every table of a schema.

    Names are held exactly as PostgreSQL stores them (already case-folded), so
    matching is plain string equality against pg_namespace/pg_class names.
    """

    schema: str
    table: str | None = None  # None means "every table in schema" (schema.*)

    def __post_init__(self) -> None:
        """Hold only names PostgreSQL can have, so __str__ always renders valid SQL."""
        for what, name in (("schema", self.schema), ("table", self.table)):
            if name is None and what == "table":
                continue
            if not name:
                raise ValueError(f"table pattern has an empty {what} name: {_PATTERN_FIX}")
            if "\x00" in name:
                raise ValueError(
                    f"table pattern {what} name {name!r} contains a NUL character: remove it"
                )

    def matches(self, schema: str, table: str) -> bool:
        """Whether the table `schema`.`table` (catalog spelling) is selected."""
        return schema == self.schema and (self.table is None or table == self.table)

    def __str__(self) -> str:
        """Canonical written form; parse_table_pattern(str(p)) == p."""
        table = "*" if self.table is None else _written(self.table)
        return _written(self.schema) + "." + table


def _is_ident_start(ch: str) -> bool:
    # PostgreSQL's scanner: ident_start = [A-Za-z\200-\377_]; every non-ASCII
    # character is made of high-bit bytes in UTF-8, so all of them qualify.
    return ch == "_" or ("a" <= ch <= "z") or ("A" <= ch <= "Z") or ch >= "\x80"


def _is_ident_cont(ch: str) -> bool:
    return _is_ident_start(ch) or ("0" <= ch <= "9") or ch == "$"


def _fold(name: str) -> str:
    """Fold an unquoted identifier the way PostgreSQL does in a UTF-8 database:
    ASCII A-Z only. Non-ASCII letters keep their case (PostgreSQL lower-cases them
    only in single-byte encodings): unquoted TËST is stored as tËst."""
    return name.translate(_ASCII_LOWER)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def parse_table_pattern(text: str) -> TablePattern:
    """Parse `schema.table` or `schema.*` with SQL's identifier rules.

    Unquoted names fold to lower case (ASCII letters, as PostgreSQL does);
    double-quoted names keep case, `""` is a literal quote, and dots or spaces
    inside quotes belong to the name. Errors are one-line ValueErrors that say
    what to write instead.
    """
    shown = repr(text)
    n = len(text)
    i = 0
    parts: list[str | None] = []  # None marks the * wildcard

    def skip_space(j: int) -> int:
        while j < n and text[j] in _SQL_SPACE:
            j += 1
        return j

    if "\x00" in text:
        raise ValueError(f"table pattern {shown} contains a NUL character: remove it")
    i = skip_space(i)
    if i == n:
        raise ValueError(f"table pattern {shown} is empty: {_PATTERN_FIX}")

    while True:
        which = "schema" if not parts else "table"
        ch = text[i] if i < n else ""
        if ch == '"':
            chunks: list[str] = []
            j = i + 1
            while True:
                close = text.find('"', j)
                if close < 0:
                    raise ValueError(
                        f"table pattern {shown} has an unclosed double quote at character "
                        f'{i + 1}: end the quoted name with " (write a quote inside it as "")'
                    )
                chunks.append(text[j:close])
                if close + 1 < n and text[close + 1] == '"':
                    chunks.append('"')
                    j = close + 2
                    continue
                i = close + 1
                break
            name: str | None = "".join(chunks)
            if not name:
                raise ValueError(
                    f'table pattern {shown} has an empty quoted {which} name (""): {_PATTERN_FIX}'
                )
        elif ch == "*":
            i += 1
            if i < n and _is_ident_cont(text[i]):
                raise ValueError(
                    f"table pattern {shown} has '*' inside a name: only a whole table name "
                    "can be the wildcard, e.g. public.*"
                )
            name = None
        elif ch and _is_ident_start(ch):
            j = i + 1
            while j < n and _is_ident_cont(text[j]):
                j += 1
            if j < n and text[j] == "*":
                raise ValueError(
                    f"table pattern {shown} has '*' inside a name: only a whole table name "
                    "can be the wildcard, e.g. public.*"
                )
            name = _fold(text[i:j])
            i = j
        elif ch in (".", ""):
            raise ValueError(f"table pattern {shown} has an empty {which} name: {_PATTERN_FIX}")
        else:
            raise ValueError(
                f"table pattern {shown} has an unexpected {ch!r} at character {i + 1}: "
                'double-quote names that contain it, e.g. "my-schema".orders'
            )
        if name is not None and len(name.encode("utf-8", "surrogatepass")) > IDENTIFIER_MAX_BYTES:
            raise ValueError(
                f"table pattern {shown} has a {which} name longer than PostgreSQL's "
                f"{IDENTIFIER_MAX_BYTES}-byte limit: write the name as PostgreSQL stored it"
            )
        parts.append(name)

        i = skip_space(i)
        if i == n:
            break
        if text[i] != ".":
            raise ValueError(
                f"table pattern {shown} has an unexpected {text[i]!r} at character {i + 1}: "
                'double-quote names that contain it, e.g. "my-schema".orders'
            )
        i = skip_space(i + 1)

    if len(parts) == 1:
        raise ValueError(f"table pattern {shown} has no schema: {_PATTERN_FIX}")
    if len(parts) > 2:
        raise ValueError(
            f"table pattern {shown} has {len(parts)} dot-separated names: {_PATTERN_FIX} "
            "(no database name; quote names that contain dots)"
        )
    schema, table = parts
    if schema is None:
        raise ValueError(
            f"table pattern {shown} has a wildcard schema: name the schema, "
            "only the table can be *, e.g. public.*"
        )
    return TablePattern(schema, table)


def split_list(text: str) -> list[str]:
    """Split a comma-separated environment value, keeping commas inside double
    quotes (quoted identifiers may contain them). Items are stripped; empty items
    are dropped, so "" and "a," are fine."""
    items: list[str] = []
    start = 0
    quoted = False
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted  # "" inside a quoted name toggles twice: still quoted
        elif ch == "," and not quoted:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [s for s in (item.strip(_SQL_SPACE) for item in items) if s]


# ------------------------------------------------------------------------ topics

_PREFIX_RE = re.compile(r"[A-Za-z0-9._-]+")
_KEPT_RE = re.compile(r"[A-Za-z0-9_]*")
_ESCAPE_RUN = re.compile(r"[^A-Za-z0-9_]+")
_ESCAPED_RE = re.compile(r"(?:[A-Za-z0-9_]|-[0-9a-f]{2})+")
_HEX_RUN = re.compile(r"(?:-[0-9a-f]{2})+")


def validate_prefix(prefix: str) -> str:
    """Check a topic prefix against Kafka's rules (and leave room for the names)."""
    if not prefix:
        raise ValueError("topic prefix is empty: set it to a short name, e.g. dbserver1")
    if len(prefix) > PREFIX_MAX_LENGTH:
        raise ValueError(
            f"topic prefix is {len(prefix)} characters, over the limit of "
            f"{PREFIX_MAX_LENGTH}: use a shorter prefix, e.g. dbserver1"
        )
    if not _PREFIX_RE.fullmatch(prefix):
        bad = "".join(sorted({ch for ch in prefix if not _PREFIX_RE.fullmatch(ch)}))
        raise ValueError(
            f"topic prefix {prefix!r} has characters Kafka does not allow ({bad!r}): "
            "use only ASCII letters, digits, '.', '_' and '-', e.g. dbserver1"
        )
    if prefix in (".", ".."):
        raise ValueError(
            f"topic prefix {prefix!r} is reserved by Kafka: use a name, e.g. dbserver1"
        )
    return prefix


def _escape(name: str) -> str:
    if _KEPT_RE.fullmatch(name):
        return name
    return _ESCAPE_RUN.sub(lambda m: "".join(f"-{b:02x}" for b in m.group().encode("utf-8")), name)


def _unescape(part: str) -> str | None:
    """The name `_escape` turned into `part`, or None if `_escape` never writes it."""
    if not _ESCAPED_RE.fullmatch(part):
        return None
    try:
        name = _HEX_RUN.sub(
            lambda m: bytes.fromhex(m.group().replace("-", "")).decode("utf-8"), part
        )
    except UnicodeDecodeError:
        return None
    # Reject non-canonical spellings (e.g. "-61" for "a"), so parse is a true inverse.
    return name if _escape(name) == part else None


@lru_cache(maxsize=4096)
def topic_name(prefix: str, schema: str, table: str) -> str:
    """`<prefix>.<schema>.<table>` with each name escaped into Kafka's alphabet.

    [A-Za-z0-9_] is kept; every other character becomes '-' plus two lowercase
    hex digits per UTF-8 byte. '.' never survives escaping, so the last two dots
    of a topic are always the separators and the mapping is injective.
    Cached: the producer asks once per record.
    """
    validate_prefix(prefix)
    if not schema or not table:
        raise ValueError(
            f"cannot name a topic for table {_shown(schema, table)}: "
            "schema and table names must be non-empty"
        )
    try:
        topic = f"{prefix}.{_escape(schema)}.{_escape(table)}"
    except UnicodeEncodeError:
        raise ValueError(
            f"cannot name a topic for table {_shown(schema, table)}: "
            "the name is not valid Unicode (lone surrogate)"
        ) from None
    if len(topic) > TOPIC_MAX_LENGTH:
        room = TOPIC_MAX_LENGTH - (len(topic) - len(prefix))
        fix = (
            f"use a topic prefix of at most {room} characters (now {len(prefix)})"
            if room >= 1
            else "no prefix is short enough; leave this table out of the capture or rename it"
        )
        raise ValueError(
            f"topic for table {_shown(schema, table)} would be {len(topic)} characters, "
            f"over Kafka's limit of {TOPIC_MAX_LENGTH}: {fix}"
        )
    return topic


def is_table_topic(prefix: str, name: str) -> bool:
    """`<prefix>.<schema>.<table>`: the internal topics (`<prefix>.__cdc_*`) have one segment."""
    return re.fullmatch(rf"{re.escape(prefix)}\.[^.]+\.[^.]+", name) is not None


def table_of_topic(topic: str) -> str:
    """The table a topic holds as SQL writes it (`public.orders`, `public."Odd Name"`), as the
    daemon's metrics and logs name it; the topic itself when it is not a table's."""
    try:
        _, schema, table = parse_topic_name(topic)
    except ValueError:
        return topic
    return str(TablePattern(schema, table))


def parse_topic_name(topic: str) -> tuple[str, str, str]:
    """Inverse of topic_name: (prefix, schema, table).

    The prefix may contain dots, escaped names never do, so split from the right.
    Only names topic_name can produce are accepted.
    """
    pieces = topic.rsplit(".", 2)
    if len(pieces) != 3:
        raise ValueError(
            f"topic {topic!r} is not <prefix>.<schema>.<table>: it needs at least two dots"
        )
    if len(topic) > TOPIC_MAX_LENGTH:
        raise ValueError(
            f"topic {topic!r} is longer than Kafka's limit of {TOPIC_MAX_LENGTH} characters"
        )
    prefix, schema_part, table_part = pieces
    validate_prefix(prefix)
    names = []
    for which, part in (("schema", schema_part), ("table", table_part)):
        name = _unescape(part)
        if name is None:
            raise ValueError(
                f"topic {topic!r} has a malformed {which} part {part!r}: topic_name writes "
                "only A-Z a-z 0-9 _ and -xx (two lowercase hex digits per UTF-8 byte)"
            )
        names.append(name)
    return prefix, names[0], names[1]


def find_topic_collisions(topics: Iterable[str]) -> list[tuple[str, str]]:
    """Pairs of distinct topics that Kafka refuses to hold side by side.

    Kafka rejects creating a topic whose name equals an existing one after
    replacing '.' with '_' (metric names), e.g. schema "s" + table "a_b"
    (p.s.a_b) and schema "s_a" + table "b" (p.s_a.b). Our escape keeps '_', so
    such pairs can occur: check the captured set before creating topics.
    """
    first: dict[str, str] = {}
    pairs: list[tuple[str, str]] = []
    for topic in dict.fromkeys(topics):
        key = topic.replace(".", "_")
        seen = first.setdefault(key, topic)
        if seen != topic:
            pairs.append((seen, topic))
    return pairs
