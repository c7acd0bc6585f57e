"""PostgreSQL's types as the catalog describes them: one `PgType` per type oid.

Builtins are known without a query; any other oid (enums, domains, arrays of them,
extension types) is resolved once from pg_type and cached by the catalog.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg


@dataclass(frozen=True, slots=True)
class PgType:
    """One pg_type row, resolved recursively (array element, domain base).

    ``labels`` holds an enum's labels in sort order (for the Enum schema's ``allowed``).
    """

    oid: int
    name: str
    kind: str
    element: PgType | None = None
    base: PgType | None = None
    base_typmod: int = -1
    labels: tuple[str, ...] = ()


# --------------------------------------------------------------------------- builtins

# (oid, typname, typtype, array oid): pg_catalog types as of PostgreSQL 15 that a user
# column can have. Types with a typelem that are not arrays (name, point, int2vector, ...)
# are deliberately not given an element: their text is not in array syntax.
_BUILTIN_ROWS: tuple[tuple[int, str, str, int], ...] = (
    (16, "bool", "b", 1000),
    (17, "bytea", "b", 1001),
    (18, "char", "b", 1002),
    (19, "name", "b", 1003),
    (20, "int8", "b", 1016),
    (21, "int2", "b", 1005),
    (22, "int2vector", "b", 1006),
    (23, "int4", "b", 1007),
    (24, "regproc", "b", 1008),
    (25, "text", "b", 1009),
    (26, "oid", "b", 1028),
    (27, "tid", "b", 1010),
    (28, "xid", "b", 1011),
    (29, "cid", "b", 1012),
    (30, "oidvector", "b", 1013),
    (114, "json", "b", 199),
    (142, "xml", "b", 143),
    (600, "point", "b", 1017),
    (601, "lseg", "b", 1018),
    (602, "path", "b", 1019),
    (603, "box", "b", 1020),
    (604, "polygon", "b", 1027),
    (628, "line", "b", 629),
    (650, "cidr", "b", 651),
    (700, "float4", "b", 1021),
    (701, "float8", "b", 1022),
    (718, "circle", "b", 719),
    (774, "macaddr8", "b", 775),
    (790, "money", "b", 791),
    (829, "macaddr", "b", 1040),
    (869, "inet", "b", 1041),
    (1033, "aclitem", "b", 1034),
    (1042, "bpchar", "b", 1014),
    (1043, "varchar", "b", 1015),
    (1082, "date", "b", 1182),
    (1083, "time", "b", 1183),
    (1114, "timestamp", "b", 1115),
    (1184, "timestamptz", "b", 1185),
    (1186, "interval", "b", 1187),
    (1266, "timetz", "b", 1270),
    (1560, "bit", "b", 1561),
    (1562, "varbit", "b", 1563),
    (1700, "numeric", "b", 1231),
    (1790, "refcursor", "b", 2201),
    (2202, "regprocedure", "b", 2207),
    (2203, "regoper", "b", 2208),
    (2204, "regoperator", "b", 2209),
    (2205, "regclass", "b", 2210),
    (2206, "regtype", "b", 2211),
    (2950, "uuid", "b", 2951),
    (2970, "txid_snapshot", "b", 2949),
    (3220, "pg_lsn", "b", 3221),
    (3614, "tsvector", "b", 3643),
    (3615, "tsquery", "b", 3645),
    (3734, "regconfig", "b", 3735),
    (3769, "regdictionary", "b", 3770),
    (3802, "jsonb", "b", 3807),
    (3904, "int4range", "r", 3905),
    (3906, "numrange", "r", 3907),
    (3908, "tsrange", "r", 3909),
    (3910, "tstzrange", "r", 3911),
    (3912, "daterange", "r", 3913),
    (3926, "int8range", "r", 3927),
    (4072, "jsonpath", "b", 4073),
    (4089, "regnamespace", "b", 4090),
    (4096, "regrole", "b", 4097),
    (4191, "regcollation", "b", 4192),
    (4451, "int4multirange", "m", 6150),
    (4532, "nummultirange", "m", 6151),
    (4533, "tsmultirange", "m", 6152),
    (4534, "tstzmultirange", "m", 6153),
    (4535, "datemultirange", "m", 6155),
    (4536, "int8multirange", "m", 6157),
    (5038, "pg_snapshot", "b", 5039),
    (5069, "xid8", "b", 271),
)


def _build_builtins() -> dict[int, PgType]:
    out: dict[int, PgType] = {}
    for oid, name, kind, array_oid in _BUILTIN_ROWS:
        scalar = PgType(oid, name, kind)
        out[oid] = scalar
        out[array_oid] = PgType(array_oid, "_" + name, "b", element=scalar)
    return out


BUILTIN_TYPES: dict[int, PgType] = _build_builtins()

_TYPE_QUERY = """
SELECT t.typname, t.typtype, t.typelem, t.typbasetype, t.typtypmod,
       (t.typelem <> 0 AND e.typarray = t.oid) AS is_array
FROM pg_catalog.pg_type t
LEFT JOIN pg_catalog.pg_type e ON e.oid = t.typelem
WHERE t.oid = %s
"""
_ENUM_QUERY = "SELECT enumlabel FROM pg_catalog.pg_enum WHERE enumtypid = %s ORDER BY enumsortorder"


def load_type(conn: psycopg.Connection, oid: int) -> PgType:
    """Resolve any type oid, recursing into array elements and domain bases.

    Builtins come from ``BUILTIN_TYPES`` without a query. Others run plain SELECTs on
    ``conn``; outside autocommit the caller owns the transaction this opens. Raises
    ``LookupError`` for an oid that pg_type does not know.
    """
    known = BUILTIN_TYPES.get(oid)
    if known is not None:
        return known
    row = conn.execute(_TYPE_QUERY, (oid,)).fetchone()
    if row is None:
        raise LookupError(f"type oid {oid} not found in pg_type")
    name, kind, elem, basetype, typmod, is_array = row
    if isinstance(kind, bytes):  # "char" columns may load as bytes depending on adapters
        kind = kind.decode()
    if kind == "d":
        return PgType(oid, name, kind, base=load_type(conn, basetype), base_typmod=typmod)
    if kind == "e":
        labels = tuple(r[0] for r in conn.execute(_ENUM_QUERY, (oid,)).fetchall())
        return PgType(oid, name, kind, labels=labels)
    if is_array:
        return PgType(oid, name, kind, element=load_type(conn, elem))
    return PgType(oid, name, kind)
