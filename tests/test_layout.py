"""The tree reads as the data flow, and these rules keep it so: each layer imports only what
is upstream of it (source -> events -> kafka -> compaction -> sinks; snapshot beside the
daemon, upstream of the topics), the command line, the daemon, `cdc status` and `cdc verify`
on top of them all, and only the CLI talks to the terminal."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cdc", "snapshot", "compaction", "sinks")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    return {
        _module_name(path): ast.parse(path.read_text(), str(path))
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


MODULES = _modules()


def _imports_at(tree: ast.AST) -> set[str]:
    """Every module `tree` imports ("from a import b" counts as a.b too, since b may be a module)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def imports_of(module: str) -> set[str]:
    """Every module `module` imports, at the top or inside a function."""
    return _imports_at(MODULES[module])


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


#: the commands on top of every layer: they may import any of them, and no layer imports them
COMMANDS = ("cdc.daemon", "cdc.cli", "cdc.status", "cdc.top", "cdc.report", "cdc.verify", "cdc.topic_commands", "cdc.__main__")
#: and the throwaway local services (the demo's and the tests' servers)
APP = (*COMMANDS, "cdc.local")
TOP = (*APP, "snapshot", "compaction", "sinks")
RULES: dict[str, tuple[str, ...]] = {
    # the source side knows PostgreSQL only: no events, no Kafka, nothing built on it
    "cdc.source": ("cdc.events", "cdc.kafka", "kafka", "confluent_kafka", *TOP),
    # changes become records without knowing who sends them
    "cdc.events": ("cdc.kafka", "kafka", "confluent_kafka", *TOP),
    # the Kafka side sends records: it never reads PostgreSQL
    "cdc.kafka": ("cdc.source", "psycopg", *TOP),
    # snapshots render rows with the events' renderer, never by building decoder messages
    # (and, upstream of the topics, know nothing of compaction or the sinks)
    "snapshot": ("cdc.source.pgoutput", *APP, "compaction", "sinks"),
    # the topic read as a table is downstream of the topics and upstream of the sinks: no
    # PostgreSQL, no Spark (the command line reads topics with it)
    "compaction": ("cdc.source", "psycopg", *APP, "snapshot", "sinks", "pyspark", "delta"),
    # Spark executors import sinks: no PostgreSQL client, no C extension, no capture code
    "sinks": ("psycopg", "cdc._speedups", "cdc.source", *COMMANDS, "snapshot"),
}
#: a module a rule would bar from an import it needs: the PostgreSQL read model's store talks to
#: its PostgreSQL (the executors stage a batch's rows there, the driver merges them); no other
#: store's executors import it
EXEMPT: dict[str, tuple[str, ...]] = {"sinks.stores.postgres": ("psycopg",)}


@pytest.mark.parametrize("layer", sorted(RULES))
def test_each_layer_imports_only_upstream(layer: str) -> None:
    wrong = {
        module: sorted(name for name in imports_of(module) if _under(name, RULES[layer])
                       and not any(_under(module, (m,)) and _under(name, names) for m, names in EXEMPT.items()))
        for module in MODULES
        if _under(module, (layer,))
    }
    assert {m: names for m, names in wrong.items() if names} == {}
    assert wrong, f"no module under {layer}"  # the rule guards something


def test_the_rest_of_cdc_is_upstream_of_compaction_and_the_sinks() -> None:
    """Configuration, names, redaction and the other shared modules of `cdc` serve every layer,
    so they import none of the layers downstream of the topics (only the commands do)."""
    shared = [m for m in MODULES if _under(m, ("cdc",)) and not _under(m, APP)]
    wrong = {m: sorted(n for n in imports_of(m) if _under(n, ("snapshot", "compaction", "sinks"))) for m in shared}
    assert {m: names for m, names in wrong.items() if names} == {}
    assert "cdc.config" in shared



def test_production_code_takes_nothing_from_the_throwaway_services() -> None:
    """cdc.local starts servers for the demo and the tests. What a production run needs (the
    JVM parts a sink job fetches, the machine's loopback address) lives outside it, and a
    product module reaches into it only from a store's `local()` (its throwaway server) or
    from `cdc demo`."""
    wrong: dict[str, list[str]] = {}
    for module, tree in MODULES.items():
        if _under(module, ("cdc.local",)):
            continue
        allowed: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in ("local", "demo"):
                allowed |= _imports_at(node)
        names = sorted(n for n in imports_of(module) - allowed if _under(n, ("cdc.local",)))
        if names:
            wrong[module] = names
    assert wrong == {}
    assert "cdc.jars" in MODULES and "cdc.machine" in MODULES


def test_a_store_is_one_folder_that_only_the_registry_reaches() -> None:
    """Everything only about one store lives in `sinks/stores/<name>/`; the rest of the
    product (the job, the rebuild, verify, top, the demo, the CLI) gets the stores from the
    registry, `sinks.stores`, which loads them by name: no other module imports a store's."""
    from sinks.stores import STORES

    folders = {f"sinks.stores.{name}": name for name in STORES}
    wrong: dict[str, list[str]] = {}
    for module in MODULES:
        if module == "sinks.stores":  # the registry: its type check names each store's modules
            continue
        own = next((folder for folder in folders if _under(module, (folder,))), None)
        names = sorted(n for n in imports_of(module) if any(_under(n, (f,)) for f in folders if f != own))
        if names:
            wrong[module] = names
    assert wrong == {}
    # nor names one: its config section (`config.cache`, "[cache] url"), its name as a word
    # in a string, its classes (`CacheStore`, `SearchUnavailable`)
    def classes_of(inside: bool) -> set[str]:
        return {node.name for module, tree in MODULES.items() if _under(module, tuple(folders)) == inside
                for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}

    classes = classes_of(True) - classes_of(False)  # a store's own (its Generations meets the shared protocol)
    # a store's name that is also a word the rest of the product uses for something else: named
    # only by its section then (`config.postgres`, "[postgres]"), not as a bare string
    other_meaning = {"postgres": "the source database, in reports, the local services and connection helpers"}
    words = [name for name in STORES if name not in other_meaning]
    named: dict[str, list[str]] = {}
    for module, tree in MODULES.items():
        if module == "sinks.stores" or any(_under(module, (f,)) for f in folders):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in STORES and "config" in ast.unparse(node.value).lower():
                named.setdefault(module, []).append(ast.unparse(node))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value in words or any(f"[{name}]" in node.value for name in STORES)):
                named.setdefault(module, []).append(repr(node.value)[:60])
            elif isinstance(node, ast.Name) and node.id in classes:
                named.setdefault(module, []).append(node.id)
    assert named == {}
    for name, registration in STORES.items():  # and the registry names modules of the store's own folder
        for module in (registration.module, registration.reader, *([registration.verbs] if registration.verbs else [])):
            assert _under(module, (f"sinks.stores.{name}",)) and module in MODULES, (name, module)
        # a submodule imported sets its name on the package: it must not hide one of the
        # package's functions (`rebuild`, then `sinks.stores.<name>.rebuild` imported, is a module)
        package = MODULES[f"sinks.stores.{name}"]
        defined = {node.name for node in package.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        submodules = {m.rsplit(".", 1)[1] for m in MODULES if m.startswith(f"sinks.stores.{name}.")}
        assert defined & submodules == set(), name

def test_kafka_clients_are_made_in_one_place() -> None:
    """Every Kafka client gets its servers and security from `[topic]` in cdc.kafka (clients,
    the daemon's producer, the admin client): a client made elsewhere would miss a setting."""
    makers = {"KafkaConsumer", "KafkaProducer", "KafkaAdminClient", "Consumer", "Producer", "AdminClient"}
    allowed = ("cdc.kafka", "cdc.local")  # cdc.local: the throwaway broker's own readiness probe
    found = {}
    for module, tree in MODULES.items():
        if _under(module, allowed):
            continue
        calls = [
            node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in makers
        ]
        if calls:
            found[module] = calls
    assert found == {}


# Where the terminal is spoken to on purpose: the CLI and its demo; logging and the excepthooks
# (the redaction that keeps secrets out of every line); the live progress line of a snapshot;
# the Spark driver's own stderr, relayed as JSON lines.
TALKERS = {"cdc.cli", "cdc.local.demo", "cdc.redact", "snapshot.progress", "sinks.spark_log"}


def _talks_to_the_terminal(tree: ast.Module) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "print":
            lines.append(node.lineno)
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if (func.value.id, func.attr) in {("click", "echo"), ("click", "secho")}:
                lines.append(node.lineno)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute):
            inner = func.value
            if isinstance(inner.value, ast.Name) and inner.value.id == "sys" and inner.attr in ("stdout", "stderr"):
                lines.append(node.lineno)
    return lines


def test_only_the_cli_talks_to_the_terminal() -> None:
    talking = {m: _talks_to_the_terminal(tree) for m, tree in MODULES.items() if m not in TALKERS}
    assert {m: lines for m, lines in talking.items() if lines} == {}
    assert all(_talks_to_the_terminal(MODULES[m]) for m in TALKERS)  # each exception is still needed


def test_sinks_load_without_psycopg_or_the_c_extension() -> None:
    """What the rules above say statically, checked at run time over every sinks module."""
    allowed = tuple(m for m, names in EXEMPT.items() if "psycopg" in names)  # driver-only, by the rule's exemption
    modules = sorted(m for m in MODULES if _under(m, ("sinks",)) and not _under(m, allowed))
    probe = (
        f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'psycopg' or m == 'cdc._speedups'))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_command_line_starts_without_spark_or_any_store_client() -> None:
    """The capture image has no Spark, Delta or store clients, and every `cdc` command loads
    the store registry (its verbs, its config sections) at start: the registry and each
    store's package read only settings and names; a store's code loads when a verb runs."""
    probe = (
        "import sys, cdc.cli; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'pyspark', 'delta', 'deltalake', 'pyarrow', 'redis', "
        "'py4j'}), sorted(m for m in sys.modules if m.startswith('sinks.stores.') and m.count('.') > 2))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["[]", "['sinks.stores.delta.verbs']"]

