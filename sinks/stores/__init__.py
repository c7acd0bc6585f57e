"""The stores a sink job keeps, and the contract each one meets: `cdc sink <name>` runs the
job of the store registered under that name.

A store is one folder, `sinks/stores/<name>/`, and one `Registration` below. Its package
meets `StoreModule` (the store itself is a sinks.store.Store: a RowStore written on the
executors or a TableStore on the driver), its reader module meets `ReaderModule` (its side
of `cdc verify`), and its verbs module, if any, lists the verbs of its group beside its
rebuild. mypy checks the built-in stores against the two protocols (the block at the end).
Everything only about one store lives in its folder; nothing else in the product imports
from there (tests/test_layout.py): the job, `cdc verify`, `cdc top`, the demo and the CLI
go through this registry, which loads a store's modules by name when they are needed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from cdc.config import Config, ConfigError, add_store_section

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
    """A store, as its package's `REGISTRATION` gives it: its name (`cdc sink <name>`, its
    `[name]` section, its `cdc <name>` verbs), its words for the CLI and the demo, its settings,
    and the package holding its modules: `store` (a StoreModule), `read` (a ReaderModule)
    and, with `has_verbs`, `verbs` (a list VERBS)."""

    name: str
    #: what the store is, for `cdc sink --help`
    what: str
    #: what the job makes of the topics there, for `cdc demo`
    story: str
    #: what `cdc <name> rebuild` does, for its --help (the store module's `rebuild(config, stop)`)
    rebuilds: str
    #: the dataclass of its `[name]` section (cdc.config.opt fields; an optional `validate()`)
    settings: type
    #: the package of its modules (its folder)
    package: str
    has_verbs: bool = False

    @property
    def module(self) -> str:
        return f"{self.package}.store"

    @property
    def reader(self) -> str:
        return f"{self.package}.read"

    @property
    def verbs(self) -> str:
        return f"{self.package}.verbs" if self.has_verbs else ""

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def load_reader(self) -> ModuleType:
        return importlib.import_module(self.reader)

    def more_verbs(self) -> list[Verb]:
        return list(importlib.import_module(self.verbs).VERBS) if self.has_verbs else []


#: the stores cdc ships, by package; others join through the `cdc.stores` entry point group
#: (an installed package's `REGISTRATION`)
BUILT_IN = ("sinks.stores.delta", "sinks.stores.search", "sinks.stores.cache", "sinks.stores.postgres")


class _Stores(Mapping[str, Registration]):
    """Every store by its name, registered on first use: the built-in ones, then the entry
    points'. Not at import: a store's package imports this module for `Registration`, and a
    Spark worker unpickling a store's writer imports that package first."""

    def __init__(self) -> None:
        self._by_name: dict[str, Registration] = {}
        self._loaded = False

    def _all(self) -> dict[str, Registration]:
        if not self._loaded:
            self._loaded = True
            from importlib.metadata import entry_points

            for package in BUILT_IN:
                register(importlib.import_module(package).REGISTRATION)
            for entry in entry_points(group="cdc.stores"):
                register(entry.load())
        return self._by_name

    def __getitem__(self, name: str) -> Registration:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


STORES = _Stores()


def register(store: Registration) -> None:
    """A store joins: the CLI's verbs, the job, `cdc verify`, `cdc top`, the demo and the
    config loader (its `[name]` section) find it from here on."""
    known = STORES._by_name
    if store.name in known and known[store.name] != store:
        raise ValueError(f"a store named {store.name!r} is registered already")
    known[store.name] = store
    add_store_section(store.name, store.settings)


def load_all() -> None:
    """Register every store now (the config loader asks, by name, for their sections)."""
    STORES._all()


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


if TYPE_CHECKING:  # each built-in store meets the contract
    from sinks.stores.cache import read as cache_read
    from sinks.stores.cache import store as cache
    from sinks.stores.delta import read as delta_read
    from sinks.stores.delta import store as delta
    from sinks.stores.postgres import read as postgres_read
    from sinks.stores.postgres import store as postgres
    from sinks.stores.search import read as search_read
    from sinks.stores.search import store as search

    _STORES: tuple[StoreModule, ...] = (delta, search, cache, postgres)
    _READERS: tuple[ReaderModule, ...] = (delta_read, search_read, cache_read, postgres_read)

