"""The Redis cache: GET <topic>:<key JSON> = the row, kept by `cdc sink cache` (store.py);
`cdc verify`'s side (read.py); `cdc cache rebuild`'s two databases and their switch
(generations.py).

This module is what the registry and the config loader read at every start: its settings
and its registration, nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdc.config import ConfigError, opt, url_check, url_secrets
from sinks.stores import Registration

_check_url = url_check(
    "a Redis URL", ("redis", "rediss", "unix"), "redis://host:port/db or rediss:// for TLS", path_alone=True
)


@dataclass
class CacheConfig:
    """`[cache]`: the Redis cache (`cdc sink cache`)."""

    url: str = opt(
        "redis://127.0.0.1:6379/0", "`redis://[user:password@]host:port/db`, `rediss://` for TLS; a password "
        "in it never reaches any output line", secret=url_secrets, check=_check_url,
    )
    password: str = opt("", "Redis password (AUTH), if not in the URL; never in any output", optional=True,
                        secret=True)
    tls_cafile: str = opt("", "with `rediss://`: CA certificates (PEM) to verify the server", optional=True)
    marker_ttl_s: int = opt(
        7 * 86400, "how long a delete marker (a deleted row's position) lives: longer than any replay "
        "(a checkpoint deleted, a job stopped) may take to reach the delete", low=1,
    )
    row_ttl_s: int = opt(
        0, "rows expire after this long without a write (`0`: never); at least marker_ttl_s", low=0,
    )
    rebuild_db: int = opt(
        -1, "the logical database `cdc cache rebuild` fills and then swaps in (SWAPDB): empty, or an unfinished "
        "rebuild's (`-1`: the one after the URL's)", low=-1,
    )

    def validate(self) -> None:
        if self.row_ttl_s and self.row_ttl_s < self.marker_ttl_s:
            raise ConfigError(
                f"[cache] row_ttl_s = {self.row_ttl_s} is shorter than marker_ttl_s = {self.marker_ttl_s}: a row "
                "would expire before a replayed delete is guarded; raise row_ttl_s (or 0: never)"
            )


REGISTRATION = Registration(
    "cache", "the Redis cache at [cache] url",
    "Redis, GET <topic>:<key JSON> = the row",
    "Fill the cache again from the topics into another Redis database ([cache] rebuild_db), then "
    "swap it in with SWAPDB and flush the old one: GET readers never see the cache missing or half "
    "full. A running `cdc sink cache` may go on; on [spark] master = spark://... it runs on the "
    "cluster.",
    settings=CacheConfig, package=__name__,
)
