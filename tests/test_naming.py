"""Names are public contract: topic names and their escape, table patterns and
the exact text of every error message."""

from __future__ import annotations

import random
import re

import pytest

from cdc.naming import (
    IDENTIFIER_MAX_BYTES,
    TOPIC_MAX_LENGTH,
    TablePattern,
    find_topic_collisions,
    parse_table_pattern,
    parse_topic_name,
    qualified,
    quote_ident,
    quote_literal,
    split_list,
    topic_name,
    validate_prefix,
)

KAFKA_LEGAL = re.compile(r"[A-Za-z0-9._-]+")
FIX = "write it as schema.table, e.g. public.orders"
QUOTE_FIX = 'double-quote names that contain it, e.g. "my-schema".orders'


# ------------------------------------------------------------------- SQL quoting


@pytest.mark.parametrize(
    ("name", "quoted"),
    [
        ('a"b', '"a""b"'),
        ("orders", '"orders"'),
        ("Orders", '"Orders"'),
        ("select", '"select"'),
        ("my table", '"my table"'),
        ('""', '""""""'),
        ("café", '"café"'),
    ],
)
def test_quote_ident_always_quotes(name: str, quoted: str) -> None:
    assert quote_ident(name) == quoted


def test_quote_ident_rejects_impossible_names() -> None:
    with pytest.raises(ValueError) as e:
        quote_ident("")
    assert str(e.value) == "empty SQL identifier: PostgreSQL names are never empty"
    with pytest.raises(ValueError) as e:
        quote_ident("a\x00b")
    assert str(e.value) == (
        "SQL identifier 'a\\x00b' contains a NUL character: PostgreSQL names cannot hold it"
    )


def test_qualified() -> None:
    assert qualified("s", "t") == '"s"."t"'
    assert qualified("my.schema", 'a"b') == '"my.schema"."a""b"'


@pytest.mark.parametrize(
    ("text", "literal"),
    [
        ("it's", "'it''s'"),
        ("", "''"),
        ("back\\slash", "'back\\slash'"),  # standard_conforming_strings: not an escape
        ("''", "''''''"),
        ("naïve", "'naïve'"),
    ],
)
def test_quote_literal(text: str, literal: str) -> None:
    assert quote_literal(text) == literal


def test_quote_literal_rejects_nul() -> None:
    with pytest.raises(ValueError) as e:
        quote_literal("a\x00")
    assert str(e.value) == (
        "SQL string 'a\\x00' contains a NUL character: PostgreSQL text cannot hold it"
    )


# ----------------------------------------------------------------- table patterns


@pytest.mark.parametrize(
    ("text", "schema", "table", "canonical"),
    [
        ("public.orders", "public", "orders", "public.orders"),
        ("public.*", "public", None, "public.*"),
        ("Sales.Orders", "sales", "orders", "sales.orders"),
        ('"Odd ""S"" . x".*', 'Odd "S" . x', None, '"Odd ""S"" . x".*'),
        ('"my.schema"."my table"', "my.schema", "my table", '"my.schema"."my table"'),
        ("public . orders", "public", "orders", "public.orders"),
        ("  public\t.\n orders  ", "public", "orders", "public.orders"),
        ('"café".tëst', "café", "tëst", '"café"."tëst"'),
        ('"Sales"."Orders"', "Sales", "Orders", '"Sales"."Orders"'),
        ('public."*"', "public", "*", 'public."*"'),  # a table literally named *
        ('"public".select', "public", "select", 'public."select"'),  # keywords get quoted
        ("public.user", "public", "user", 'public."user"'),
        ("public.abort", "public", "abort", "public.abort"),  # unreserved: bare
        ("a$b._x1", "a$b", "_x1", "a$b._x1"),
        ('"a-b".c', "a-b", "c", '"a-b".c'),
        ('"1st".t', "1st", "t", '"1st".t'),
    ],
)
def test_parse_table_pattern(text: str, schema: str, table: str | None, canonical: str) -> None:
    pattern = parse_table_pattern(text)
    assert pattern == TablePattern(schema, table)
    assert str(pattern) == canonical
    assert parse_table_pattern(canonical) == pattern


def test_unquoted_folding_is_ascii_only_as_in_a_utf8_database() -> None:
    # PostgreSQL lower-cases only A-Z in unquoted names of a UTF-8 database:
    # CREATE TABLE "café".TËST creates relname 'tËst' (checked against PG 15).
    assert parse_table_pattern('"café".TËST') == TablePattern("café", "tËst")
    assert parse_table_pattern("ÉCOLE.Élève") == TablePattern("École", "Élève")
    # Non-ASCII (even U+00A0) are identifier characters for PostgreSQL's scanner.
    assert parse_table_pattern("a\u00a0b.c") == TablePattern("a\u00a0b", "c")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("orders", f"table pattern 'orders' has no schema: {FIX}"),
        ("*", f"table pattern '*' has no schema: {FIX}"),
        ('"My Table"', f"table pattern '\"My Table\"' has no schema: {FIX}"),
        ("", f"table pattern '' is empty: {FIX}"),
        ("   ", f"table pattern '   ' is empty: {FIX}"),
        ("public.", f"table pattern 'public.' has an empty table name: {FIX}"),
        (".orders", f"table pattern '.orders' has an empty schema name: {FIX}"),
        ("a..b", f"table pattern 'a..b' has an empty table name: {FIX}"),
        ('"".t', f'table pattern \'"".t\' has an empty quoted schema name (""): {FIX}'),
        ('s.""', f'table pattern \'s.""\' has an empty quoted table name (""): {FIX}'),
        (
            '"abc.x',
            "table pattern '\"abc.x' has an unclosed double quote at character 1: "
            'end the quoted name with " (write a quote inside it as "")',
        ),
        (
            's."a""',
            'table pattern \'s."a""\' has an unclosed double quote at character 3: '
            'end the quoted name with " (write a quote inside it as "")',
        ),
        (
            "db.public.orders",
            f"table pattern 'db.public.orders' has 3 dot-separated names: {FIX} "
            "(no database name; quote names that contain dots)",
        ),
        (
            "*.orders",
            "table pattern '*.orders' has a wildcard schema: name the schema, "
            "only the table can be *, e.g. public.*",
        ),
        (
            "*.*",
            "table pattern '*.*' has a wildcard schema: name the schema, "
            "only the table can be *, e.g. public.*",
        ),
        (
            "public.ord*",
            "table pattern 'public.ord*' has '*' inside a name: only a whole table name "
            "can be the wildcard, e.g. public.*",
        ),
        (
            "public.*s",
            "table pattern 'public.*s' has '*' inside a name: only a whole table name "
            "can be the wildcard, e.g. public.*",
        ),
        (
            "pub-lic.orders",
            f"table pattern 'pub-lic.orders' has an unexpected '-' at character 4: {QUOTE_FIX}",
        ),
        (
            "2024.orders",
            f"table pattern '2024.orders' has an unexpected '2' at character 1: {QUOTE_FIX}",
        ),
        (
            "public.orders x",
            f"table pattern 'public.orders x' has an unexpected 'x' at character 15: {QUOTE_FIX}",
        ),
        (
            '"a"b.c',
            f"table pattern '\"a\"b.c' has an unexpected 'b' at character 4: {QUOTE_FIX}",
        ),
        ("a\x00.b", "table pattern 'a\\x00.b' contains a NUL character: remove it"),
        (
            "public." + "x" * 64,
            f"table pattern 'public.{'x' * 64}' has a table name longer than PostgreSQL's "
            "63-byte limit: write the name as PostgreSQL stored it",
        ),
        (
            '"' + "é" * 32 + '".t',  # 64 bytes in UTF-8
            f"table pattern '\"{'é' * 32}\".t' has a schema name longer than PostgreSQL's "
            "63-byte limit: write the name as PostgreSQL stored it",
        ),
    ],
)
def test_parse_table_pattern_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_table_pattern(text)
    assert str(e.value) == message
    assert "\n" not in str(e.value)


def test_error_messages_stay_on_one_line() -> None:
    for text in ["a\nb", 'x."a\nb', "a.b\n.c", "\n", "a.\n"]:
        with pytest.raises(ValueError) as e:
            parse_table_pattern(text)
        assert "\n" not in str(e.value)


def test_identifier_at_the_byte_limit_is_accepted() -> None:
    name = "x" * IDENTIFIER_MAX_BYTES
    assert parse_table_pattern(f"public.{name}").table == name


def test_table_pattern_matches() -> None:
    exact = parse_table_pattern("Sales.Orders")
    assert exact.matches("sales", "orders")
    assert not exact.matches("Sales", "Orders")  # catalog names are case-sensitive
    assert not exact.matches("sales", "orders2")
    every = parse_table_pattern("public.*")
    assert every.matches("public", "anything")
    assert not every.matches("other", "anything")
    star = parse_table_pattern('public."*"')
    assert star.matches("public", "*") and not star.matches("public", "orders")


def test_table_pattern_rejects_impossible_names() -> None:
    with pytest.raises(ValueError) as e:
        TablePattern("", "t")
    assert str(e.value) == f"table pattern has an empty schema name: {FIX}"
    with pytest.raises(ValueError) as e:
        TablePattern("s", "")
    assert str(e.value) == f"table pattern has an empty table name: {FIX}"
    with pytest.raises(ValueError) as e:
        TablePattern("s", "a\x00")
    assert str(e.value) == "table pattern table name 'a\\x00' contains a NUL character: remove it"


def test_table_pattern_canonical_round_trip_on_random_names() -> None:
    rng = random.Random(42)
    alphabet = "abcxyzXYZ_$09 .\"'-,*éË€\u00a0"
    for _ in range(3000):
        schema = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
        table = rng.choice([None, "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))])
        pattern = TablePattern(schema, table)
        assert parse_table_pattern(str(pattern)) == pattern


@pytest.mark.parametrize(
    ("text", "items"),
    [
        ('public.a, "x,y".b', ["public.a", '"x,y".b']),
        ("", []),
        ("   ", []),
        ("public.*", ["public.*"]),
        ("a.b,,c.d,", ["a.b", "c.d"]),
        (' "a"",b".c , d.e ', ['"a"",b".c', "d.e"]),  # "" inside quotes stays quoted
        ('"x,y"."p, q",z.*', ['"x,y"."p, q"', "z.*"]),
        ("\ta.b\n,\nc.d", ["a.b", "c.d"]),
    ],
)
def test_split_list(text: str, items: list[str]) -> None:
    assert split_list(text) == items


def test_split_list_then_parse() -> None:
    patterns = [parse_table_pattern(t) for t in split_list('Sales.Orders, "x,y".*')]
    assert patterns == [TablePattern("sales", "orders"), TablePattern("x,y", None)]


# --------------------------------------------------------------------- topic names


@pytest.mark.parametrize(
    ("schema", "table", "topic"),
    [
        ("public", "orders", "dbserver1.public.orders"),
        ("public", "Order_Items", "dbserver1.public.Order_Items"),
        ("a.b", "c", "dbserver1.a-2eb.c"),
        ("a", "b.c", "dbserver1.a.b-2ec"),
        ("my-schema", "t", "dbserver1.my-2dschema.t"),
        ("café", "tëst", "dbserver1.caf-c3-a9.t-c3-abst"),
        ("my schema", 'a"b', "dbserver1.my-20schema.a-22b"),
        ("a-2eb", "c", "dbserver1.a-2d2eb.c"),
        ("€", "😀", "dbserver1.-e2-82-ac.-f0-9f-98-80"),
    ],
)
def test_topic_name_examples(schema: str, table: str, topic: str) -> None:
    assert topic_name("dbserver1", schema, table) == topic
    assert parse_topic_name(topic) == ("dbserver1", schema, table)


def test_escape_of_single_characters() -> None:
    assert topic_name("p", ".", "-") == "p.-2e.-2d"
    assert topic_name("p", "é", "_") == "p.-c3-a9._"


def test_the_contract_example_does_not_collide() -> None:
    assert topic_name("p", "a.b", "c") != topic_name("p", "a", "b.c")


TRICKY = [
    'a"b',
    '""',
    '"',
    "a.b",
    ".",
    "..",
    "a..b",
    " ",
    "  ",
    "a b",
    "-",
    "--",
    "a-2eb",
    "a-2e",
    "-2e",
    "-2d2e",
    "a-c3-a9",
    "_",
    "__",
    "x_2e",
    "é",
    "É",
    "naïve",
    "日本語",
    "😀",
    "\u00a0",
    "\t",
    "\n",
    "\x01",
    "*",
    "'",
    "a,b",
    "NULL",
    "null",
    "select",
    "0",
    "$",
    "a$",
]


@pytest.mark.parametrize("schema", TRICKY)
def test_topic_round_trip_on_tricky_names(schema: str) -> None:
    for table in TRICKY:
        for prefix in ("p", "dbserver1", "a.b", "x.y.z", "-", "_", "a..b", "a-2e"):
            topic = topic_name(prefix, schema, table)
            assert KAFKA_LEGAL.fullmatch(topic)
            assert parse_topic_name(topic) == (prefix, schema, table)


def _random_identifier(rng: random.Random) -> str:
    pieces = [
        "a",
        "b",
        "Z",
        "_",
        ".",
        "-",
        "2e",
        "2d",
        "-2e",
        " ",
        '"',
        "é",
        "c3",
        "-c3",
        "😀",
        "0",
    ]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 6)))


def test_topic_names_are_collision_free_and_legal() -> None:
    rng = random.Random(1234)
    pairs = {(_random_identifier(rng), _random_identifier(rng)) for _ in range(5000)}
    # Add every way of re-splitting a dotted "schema.table" text: the classic trap.
    for schema, table in list(pairs)[:500]:
        joined = f"{schema}.{table}"
        for i, ch in enumerate(joined):
            if ch == "." and 0 < i < len(joined) - 1:
                pairs.add((joined[:i], joined[i + 1 :]))
    topics: dict[str, tuple[str, str]] = {}
    for schema, table in pairs:
        topic = topic_name("dbserver1", schema, table)
        assert KAFKA_LEGAL.fullmatch(topic) and len(topic) <= TOPIC_MAX_LENGTH
        assert topic not in topics, (topics.get(topic), (schema, table))
        topics[topic] = (schema, table)
        assert parse_topic_name(topic) == ("dbserver1", schema, table)


def test_topic_name_length_limit() -> None:
    schema = "s" * 63
    table = "t" * 63
    longest = "p" * (TOPIC_MAX_LENGTH - 63 - 63 - 2)
    assert len(topic_name(longest, schema, table)) == TOPIC_MAX_LENGTH
    with pytest.raises(ValueError) as e:
        topic_name(longest + "p", schema, table)
    assert str(e.value) == (
        f'topic for table "{schema}"."{table}" would be 250 characters, over Kafka\'s '
        "limit of 249: use a topic prefix of at most 121 characters (now 122)"
    )


def test_topic_name_too_long_for_any_prefix() -> None:
    schema = "é" * 31  # 62 UTF-8 bytes -> 186 characters escaped
    with pytest.raises(ValueError) as e:
        topic_name("p", schema, "t" * 63)
    assert str(e.value) == (
        f'topic for table "{schema}"."{"t" * 63}" would be 252 characters, over Kafka\'s '
        "limit of 249: no prefix is short enough; leave this table out of the capture "
        "or rename it"
    )


def test_topic_name_rejects_impossible_names() -> None:
    with pytest.raises(ValueError) as e:
        topic_name("p", "", "t")
    assert str(e.value) == (
        'cannot name a topic for table ""."t": schema and table names must be non-empty'
    )
    with pytest.raises(ValueError) as e:
        topic_name("p", "s", "\ud800")
    assert str(e.value) == (
        'cannot name a topic for table "s"."\\ud800": the name is not valid Unicode '
        "(lone surrogate)"
    )


def test_topic_name_message_stays_on_one_line() -> None:
    with pytest.raises(ValueError) as e:
        topic_name("p" * 200, "a\nb", "t" * 60)
    assert "\n" not in str(e.value)
    assert '"a\\nb"' in str(e.value)


def test_topic_name_validates_the_prefix() -> None:
    with pytest.raises(ValueError) as e:
        topic_name("my prefix", "s", "t")
    assert str(e.value).startswith("topic prefix 'my prefix' has characters")


@pytest.mark.parametrize("prefix", ["dbserver1", "a", "a.b", "a_b-c", "...", "-", "_", "x" * 200])
def test_validate_prefix_accepts(prefix: str) -> None:
    assert validate_prefix(prefix) == prefix


@pytest.mark.parametrize(
    ("prefix", "message"),
    [
        ("", "topic prefix is empty: set it to a short name, e.g. dbserver1"),
        (".", "topic prefix '.' is reserved by Kafka: use a name, e.g. dbserver1"),
        ("..", "topic prefix '..' is reserved by Kafka: use a name, e.g. dbserver1"),
        (
            "x" * 201,
            "topic prefix is 201 characters, over the limit of 200: use a shorter prefix, "
            "e.g. dbserver1",
        ),
        (
            "my server/é",
            "topic prefix 'my server/é' has characters Kafka does not allow (' /é'): "
            "use only ASCII letters, digits, '.', '_' and '-', e.g. dbserver1",
        ),
        (
            "a\nb",
            "topic prefix 'a\\nb' has characters Kafka does not allow ('\\n'): "
            "use only ASCII letters, digits, '.', '_' and '-', e.g. dbserver1",
        ),
    ],
)
def test_validate_prefix_errors(prefix: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        validate_prefix(prefix)
    assert str(e.value) == message


@pytest.mark.parametrize(
    ("topic", "message"),
    [
        ("orders", "topic 'orders' is not <prefix>.<schema>.<table>: it needs at least two dots"),
        (
            "p.orders",
            "topic 'p.orders' is not <prefix>.<schema>.<table>: it needs at least two dots",
        ),
        (".s.t", "topic prefix is empty: set it to a short name, e.g. dbserver1"),
        ("...s.t", "topic prefix '..' is reserved by Kafka: use a name, e.g. dbserver1"),
    ]
    + [
        (
            f"p.{part}.t",
            f"topic 'p.{part}.t' has a malformed schema part {part!r}: topic_name writes "
            "only A-Z a-z 0-9 _ and -xx (two lowercase hex digits per UTF-8 byte)",
        )
        for part in [
            "",  # empty name
            "a-",  # dangling escape
            "a-2",  # short escape
            "a-2E",  # upper-case hex
            "a-zz",  # not hex
            "-61",  # 'a' escaped although it is kept
            "-5f",  # '_' escaped although it is kept
            "-c3",  # truncated UTF-8 sequence
            "-ed-a0-80",  # UTF-8 of a surrogate
            "-c0-ae",  # overlong encoding of '.'
        ]
    ]
    + [
        (
            "p.s.a b",
            "topic 'p.s.a b' has a malformed table part 'a b': topic_name writes "
            "only A-Z a-z 0-9 _ and -xx (two lowercase hex digits per UTF-8 byte)",
        ),
        (
            "p" * 248 + ".s.t",
            f"topic '{'p' * 248}.s.t' is longer than Kafka's limit of 249 characters",
        ),
    ],
)
def test_parse_topic_name_errors(topic: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_topic_name(topic)
    assert str(e.value) == message


def test_find_topic_collisions() -> None:
    # Kafka refuses topics equal after '.' -> '_' (metric names); the escape keeps '_'.
    a = topic_name("p", "s", "a_b")
    b = topic_name("p", "s_a", "b")
    assert (a, b) == ("p.s.a_b", "p.s_a.b")
    assert find_topic_collisions([a, b, "p.x.y", a]) == [(a, b)]
    assert find_topic_collisions(["p.s.t", "p.s.u"]) == []
