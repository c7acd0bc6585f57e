"""The stores a sink job keeps, and the contract each one meets: `cdc sink <name>` runs the
job of the store registered under that name.

A store is one folder, `sinks/stores/<name>/`, and one `Registration` below. Its package
meets `StoreModule` (the store itself is a sinks.store.Store: a RowStore written on the
executors or a TableStore on the driver), its reader module meets `ReaderModule` (its side
of `cdc verify`), and its verbs module, if any, lists the verbs of its group beside its
rebuild. mypy checks the three stores against the two protocols (the block at the end).
Everything only about one store lives in its folder; nothing else in the product imports
from there (tests/test_layout.py): the job, `cdc verify`, `cdc top`, the demo and the CLI
go through this registry, which loads a store's modules by name when they are needed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from cdc.config import Config, ConfigError

if TYPE_CHECKING:
    import click
    from pyspark.sql import SparkSession

    from compaction.verify import Side
    from sinks.query import StopSignal
    from sinks.store import RowCounter, Store


class StoreModule(Protocol):
    """A store's package. It may also define `followers(spark, config)`: the stores the same
    process keeps from what this one holds, each by a query of its own (the warehouse's
    history, from its change log); and `find(config, topic, field, text)`: the keys of the
    rows whose `field` matches `text` (a full-text query; the demo asks it)."""

    def check(self, config: Config) -> None:
        """Its settings and its server, before any Spark starts: one line naming the fix."""

    def build(self, spark: SparkSession, config: Config) -> Store:
        """The store the job writes."""

    def rebuild(self, config: Config, stop: StopSignal) -> list[str]:
        """`cdc <name> rebuild`: the store filled again beside the one readers use, then
        switched (sinks.rebuild); the lines it prints, the last its summary."""

    def local(self, workdir: Path) -> tuple[Any, dict[str, str]]:
        """A throwaway server for the demo and the tests, and the settings (CDC_* names)
        that point the job at it."""

    def show(self, config: Config, topics: list[str]) -> list[str]:
        """What a reader finds there, a line per row."""

    def counter(self, config: Config) -> RowCounter:
        """Each table's rows there, cheap enough for `cdc top` to ask every few seconds."""


class ReaderModule(Protocol):
    """A store's side of `cdc verify`. It may also define `check(config)`: the settings the
    side needs, checked before verify reads anything."""

    def side(self, config: Config, spark: Callable[[], Any]) -> Side:
        """The digest of every row the store holds, computed where its data is (`spark`
        makes a Spark session, only if the side needs one)."""


@dataclass(frozen=True)
class Verb:
    """A verb of a store's group beside its rebuild (`cdc delta optimize`): `run(config,
    **options)` gives the lines it prints; the CLI adds --config and the one-line errors."""

    name: str
    help: str
    run: Callable[..., Iterable[str]]
    options: tuple[click.Option, ...] = ()


@dataclass(frozen=True)
class Registration:
    name: str
    module: str
    #: the module of `cdc verify`'s side of the store
    reader: str
    #: the `[section]` of the config file with the store's settings
    section: str
    #: what the store is, for `cdc sink --help`
    what: str
    #: what the job makes of the topics there, for `cdc demo`
    story: str
    #: what `cdc <name> rebuild` does, for its --help (the module's `rebuild(config, stop)`)
    rebuilds: str
    #: the module whose VERBS the store's group has beside its rebuild (light to import: the CLI
    #: lists them at start); none: the rebuild alone
    verbs: str = ""

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def load_reader(self) -> ModuleType:
        return importlib.import_module(self.reader)

    def more_verbs(self) -> list[Verb]:
        return list(importlib.import_module(self.verbs).VERBS) if self.verbs else []


STORES: dict[str, Registration] = {r.name: r for r in (
    Registration("delta", "sinks.stores.delta", "sinks.stores.delta.read", "delta", "the Delta warehouse under [delta] path",
                 "a Delta warehouse: current/ (the tables now), changes (every event, one log) and history/ (every "
                 "version)",
                 "Fill every table's current/ again from the topics in a folder of its own, then replace each "
                 "table's rows in one commit: readers read the version before it until then (time travel keeps "
                 "it). changes/ and history/ are not the topics' to restore (see rebuild-history). A running "
                 "`cdc sink delta` goes on, paused between two of its batches for the switch; on [spark] master = "
                 "spark://... it runs on the cluster.", verbs="sinks.stores.delta.verbs"),
    Registration("search", "sinks.stores.search", "sinks.stores.search.read", "search", "the OpenSearch index at [search] url",
                 "OpenSearch, an index per table behind an alias named after its topic, _id = the key's JSON, "
                 "_source = the row",
                 "Fill every table's index again from the topics, beside the current one, then swap the aliases "
                 "in one step and drop the old indexes: readers never see an index missing or half full. Adopts "
                 "new mappings (a column whose type changed). A running `cdc sink search` may go on; on [spark] "
                 "master = spark://... it runs on the cluster."),
    Registration("cache", "sinks.stores.cache", "sinks.stores.cache.read", "cache", "the Redis cache at [cache] url",
                 "Redis, GET <topic>:<key JSON> = the row",
                 "Fill the cache again from the topics into another Redis database ([cache] rebuild_db), then "
                 "swap it in with SWAPDB and flush the old one: GET readers never see the cache missing or half "
                 "full. A running `cdc sink cache` may go on; on [spark] master = spark://... it runs on the "
                 "cluster."),
)}


def registration(name: str) -> Registration:
    found = STORES.get(name)
    if found is None:
        raise ConfigError(f"unknown sink {name!r}: use one of {', '.join(STORES)}")
    return found


def check(name: str, config: Config) -> None:
    """The store's settings and its server, before any Spark starts."""
    registration(name).load().check(config)


def check_reader(name: str, config: Config) -> None:
    """The settings `cdc verify`'s side of the store needs, before it reads anything."""
    check_settings = getattr(registration(name).load_reader(), "check", None)
    if check_settings is not None:
        check_settings(config)


def reader(name: str, config: Config, spark: Callable[[], Any]) -> Side:
    """`cdc verify`'s side of the store (`spark` makes a Spark session, if the side needs one)."""
    side: Side = registration(name).load_reader().side(config, spark)
    return side


def rebuild(name: str, config: Config, stop: StopSignal) -> list[str]:
    """`cdc <name> rebuild`: the store filled again beside the one readers use, then switched
    (sinks.rebuild); what it did, a line each, the last its summary."""
    lines: list[str] = registration(name).load().rebuild(config, stop)
    return lines


def build(name: str, spark: SparkSession, config: Config) -> Store:
    store: Store = registration(name).load().build(spark, config)
    return store


def counter(name: str, config: Config) -> RowCounter:
    """Each table's rows in the store, for `cdc top` and the demo's live view."""
    made: RowCounter = registration(name).load().counter(config)
    return made


def build_all(name: str, spark: SparkSession, config: Config) -> list[Store]:
    """The store, then the stores its job's process keeps from what it writes (a module's
    optional `followers(spark, config)`: the warehouse's history, from its change log)."""
    module = registration(name).load()
    followers = getattr(module, "followers", None)
    return [build(name, spark, config), *(followers(spark, config) if followers else [])]


if TYPE_CHECKING:  # each registered store meets the contract
    from sinks.stores import cache, delta, search
    from sinks.stores.cache import read as cache_read
    from sinks.stores.delta import read as delta_read
    from sinks.stores.search import read as search_read

    _STORES: tuple[StoreModule, ...] = (delta, search, cache)
    _READERS: tuple[ReaderModule, ...] = (delta_read, search_read, cache_read)
