"""The OpenSearch index: an index per table behind an alias named after its topic, kept by
`cdc sink search` (store.py, its client opensearch.py, its mappings and names shapes.py);
`cdc verify`'s side (read.py); `cdc search rebuild`'s generations (generations.py).

This module is what the registry and the config loader read at every start: its settings
and its registration, nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdc.config import opt, url_check, url_secrets
from sinks.stores import Registration

_check_url = url_check("an HTTP URL", ("http", "https"), "http://host:9200 or https:// for TLS", path_alone=False)


@dataclass
class SearchConfig:
    """`[search]`: the OpenSearch index (`cdc sink search`)."""

    url: str = opt(
        "http://127.0.0.1:9200", "OpenSearch's REST endpoint, `https://` for TLS; a password in it never reaches "
        "any output line", secret=url_secrets, check=_check_url,
    )
    username: str = opt("", "HTTP basic auth user, if not in the URL", optional=True)
    password: str = opt("", "HTTP basic auth password, if not in the URL; never in any output", optional=True,
                        secret=True)
    tls_cafile: str = opt("", "with `https://`: CA certificates (PEM) to verify the server", optional=True)
    refresh: str = opt(
        "batch", "when writes become searchable: `batch` (one refresh of the batch's indexes after its writes), "
        "`false` (the index's refresh interval, 1 s by default), or the bulk requests' `wait_for` or `true`",
        choices=("batch", "false", "wait_for", "true"),
    )
    bulk_bytes: int = opt(5 * 1024 * 1024, "largest `_bulk` request body, in bytes", low=1024)
    shards: int = opt(1, "primary shards of a new index", low=1, high=1024)
    replicas: int = opt(1, "replicas of a new index (0 on a one-node cluster keeps it green)", low=0, high=32)
    tables_per_index: int = opt(
        1, "tables one index holds: 1, an index of its own per table (`_id` = the key's JSON); more, tables "
        "packed into shared indexes, each behind its own filtered alias (`_id` = `<alias>:<key JSON>`), so "
        "that a schema of hundreds of tables fits the cluster's shard limit; change it with `cdc search rebuild`",
        low=1, high=10000,
    )
    marker_ttl_s: int = opt(
        7 * 86400, "how long a delete marker (a deleted row's position) lives: longer than any replay "
        "(a checkpoint deleted, a job stopped) may take to reach the delete", low=1,
    )


REGISTRATION = Registration(
    "search", "the OpenSearch index at [search] url",
    "OpenSearch, an index per table (or tables packed into shared indexes) behind an alias named after "
    "its topic, _id = the key's JSON, _source = the row",
    "Fill every table's index again from the topics, beside the current one, then swap the aliases "
    "in one step and drop the old indexes: readers never see an index missing or half full. Adopts "
    "new mappings (a column whose type changed). A running `cdc sink search` may go on; on [spark] "
    "master = spark://... it runs on the cluster.",
    settings=SearchConfig, package=__name__,
)
