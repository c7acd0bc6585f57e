"""The PostgreSQL read model: each captured table as a table of another PostgreSQL database,
`<schema_prefix><schema>.<table>`, kept by `cdc sink postgres` (store.py); its columns and
their conversions (columns.py); `cdc verify`'s side, hashed by that PostgreSQL (read.py);
`cdc postgres rebuild`'s schema generations and their switch (generations.py).

This module is what the registry and the config loader read at every start: its settings
and its registration, nothing heavy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cdc.config import ConfigError, check_dsn, dsn_secret_parts, opt
from sinks.stores import Registration

MAX_NAME = 63  # PostgreSQL's identifiers are cut at 63 bytes: a longer schema name would clash


def _check_prefix(where: str, value: str) -> None:
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", value) or len(value) > MAX_NAME - 8:
        raise ConfigError(f"{where} = {value!r} is not a lower-case schema name prefix: use letters, digits and "
                          "_, starting with a letter or _ (e.g. cdc_); the store owns the schemas it names")


@dataclass
class PostgresConfig:
    """`[postgres]`: the PostgreSQL read model (`cdc sink postgres`)."""

    dsn: str = opt(
        "", "libpq DSN or URI of the database the read model is kept in (PostgreSQL 15 or later). Its password "
        "never reaches any output line", optional=True, secret=dsn_secret_parts,
    )
    schema_prefix: str = opt(
        "cdc_", "each source schema's tables are kept in the schema of this prefix and its name (`cdc_public.acct`); "
        "the store owns those schemas (a rebuild replaces them)", check=_check_prefix,
    )
    marker_ttl_s: int = opt(
        7 * 86400, "how long a delete's marker (the deleted key's position, in `_cdc.deletes`) is kept: longer than "
        "a rebuild or a replay may take to reach the delete", low=1,
    )

    def validate(self) -> None:
        if self.dsn:
            check_dsn("[postgres] dsn", self.dsn)


def required_dsn(config: PostgresConfig) -> str:
    """The read model's DSN, or the one-line error naming the setting."""
    if not config.dsn:
        raise ConfigError("[postgres] dsn is empty: set it to the read model's database (a libpq DSN or URI)")
    return config.dsn


REGISTRATION = Registration(
    "postgres", "the PostgreSQL read model at [postgres] dsn",
    "PostgreSQL, a table per captured table (cdc_<schema>.<table>)",
    "Fill every table again from the topics into new schemas beside the live ones, then switch them in one "
    "transaction (the live schemas renamed away, the new ones renamed in) and drop the old ones: readers "
    "see the old tables or the rebuilt ones, never neither. A running `cdc sink postgres` may go on.",
    settings=PostgresConfig, package=__name__,
)
