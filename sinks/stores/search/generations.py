"""`cdc search rebuild`'s generations: every table's index again from the topics, in the next
generation behind hidden aliases, then the readers' aliases swapped in one step.

Readers and a running search job keep the current indexes until the swap. The job's writes
to the old indexes that the rebuild had not read yet are in the topics before the swap, so
one more pass after it brings them over (position-guarded like every write), and a second
swap takes the tables first seen in that pass.
"""

from __future__ import annotations

from cdc.config import Config
from sinks.query import StopSignal
from sinks.stores.search.store import SearchStore


class Generations:
    """The rebuild's indexes beside the live ones (sinks.rebuild.Generations)."""

    last_pass = True

    def __init__(self, config: Config) -> None:
        self.rebuilt = SearchStore(config.search, config.topic.prefix, rebuild=True)
        self.name = self.rebuilt.name
        self.moved: list[tuple[str, list[str], str]] = []

    def swapped(self) -> bool:
        return False  # a rebuild stopped after its swap fills the next generation again

    def store(self, swapped: bool) -> SearchStore:
        return self.rebuilt  # after the swap, its indexes are the live ones

    def prepare(self, resumed: bool) -> None:
        pass

    def swap(self) -> list[tuple[str, list[str], str]]:
        self.moved = self.rebuilt.swap()
        return self.moved

    def finish(self) -> None:
        self.moved += self.rebuilt.swap()  # tables first seen in the last pass
        self.rebuilt.finish()


def rebuild_here(config: Config, stop: StopSignal) -> list[tuple[str, list[str], str, int]]:
    """`cdc search rebuild`: (alias, old indexes, new index, documents) per table."""
    from sinks.rebuild import rebuild

    generations, _ = rebuild(config, "search", lambda spark: Generations(config), stop,
                             "the current indexes are untouched")
    counts = generations.rebuilt.documents([alias for alias, _, _ in generations.moved])
    return [(alias, old, new, counts[alias]) for alias, old, new in generations.moved]
