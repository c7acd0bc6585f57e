"""The docs are tested where they drift from the code: every `*.md` path the code and the docs
name is a file of the repository, every internal link and anchor resolves, every `cdc` verb and
option a page shows exists, every `[section] key` a page names is a setting, the README stays
short, the site builds with `mkdocs build --strict`, and the built site shows its navigation
and search box in headless Chromium."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import click
import markdown
import pytest

from cdc.cli import main
from cdc.config import SETTINGS
from tests.support import png_pixels

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
#: where the code names documents: the Python, CI's entry point and the container files
CODE = [
    *(p for p in sorted(ROOT.rglob("*.py")) if not {".git", "build", "site", "spark-warehouse"} & set(p.relative_to(ROOT).parts)
      and not p.relative_to(ROOT).parts[0].endswith(".egg-info")),
    ROOT / ".ci" / "run",
    *sorted(p for p in (ROOT / "docker").rglob("*") if p.is_file()),
]
MD_PATH = re.compile(r"(?<![\w/.-])((?:\.\.?/)*[\w-][\w./-]*\.md)\b")
#: Python-Markdown as MkDocs runs it for these pages (the same heading ids, the same links)
EXTENSIONS = ["tables", "attr_list", "admonition", "toc", "pymdownx.superfences"]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def resolves(name: str, mentioned_in: Path) -> bool:
    """A document name resolves from the repository's root, the mentioning file's folder or docs/,
    and never to a file outside the repository."""
    for base in (ROOT, mentioned_in.parent, DOCS):
        target = (base / name).resolve()
        if target.is_relative_to(ROOT) and target.is_file():
            return True
    return False


def test_every_md_path_named_in_the_code_and_the_docs_is_a_file_of_the_repository() -> None:
    missing = [
        f"{rel(path)}: {name}"
        for path in [*CODE, *PAGES, ROOT / "mkdocs.yml"]
        for name in MD_PATH.findall(path.read_text(encoding="utf-8", errors="replace"))
        if not resolves(name, path)
    ]
    assert not missing, "not in the repository (cite a page of docs/ instead):\n" + "\n".join(missing)


class _Links(HTMLParser):
    """Every href of a rendered page."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


def _ids(tokens: list[dict]) -> Iterator[str]:
    for token in tokens:
        yield token["id"]
        yield from _ids(token["children"])


def render(page: Path) -> tuple[set[str], list[str]]:
    """The page's heading ids (Python-Markdown's slugs, as MkDocs makes them) and its links."""
    md = markdown.Markdown(extensions=EXTENSIONS)
    html = md.convert(page.read_text(encoding="utf-8"))
    links = _Links()
    links.feed(html)
    return set(_ids(md.toc_tokens)), links.hrefs  # type: ignore[attr-defined]


RENDERED = {page: render(page) for page in PAGES}


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_internal_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for href in RENDERED[page][1]:
        if re.match(r"[a-z]+:", href):
            continue  # another site
        name, _, anchor = href.partition("#")
        target = (page.parent / name).resolve() if name else page
        if not target.is_relative_to(ROOT) or not target.is_file():
            broken.append(f"{href}: no such file")
        elif anchor and (target.suffix != ".md" or anchor not in RENDERED[target][0]):
            broken.append(f"{href}: no heading #{anchor} in {rel(target)}")
    assert broken == []


def _shown_commands(page: Path) -> Iterator[tuple[str, list[str]]]:
    """Each `cdc ...` command a page shows: a code block's line that runs it (at the line's start,
    after a prompt, `&&`, `;`, a pipe or `python -m`) and an inline code span that starts with it;
    the words after `cdc`, up to a shell separator, a closing parenthesis or the next command."""
    text = page.read_text(encoding="utf-8")
    lines = [line for block in re.findall(r"^ *```[^\n]*\n(.*?)^ *```", text, re.S | re.M) for line in block.splitlines()]
    prose = re.sub(r"^ *```[^\n]*\n.*?^ *```", "", text, flags=re.S | re.M)
    spans = [span.replace("\\|", "|") for span in re.findall(r"`([^`\n]+)`", prose) if span.startswith("cdc ")]
    for line, start in [*((line, r"(?:^\s*(?:\$\s+)?|&&\s*|;\s*|\|\s*|python -m )") for line in lines),
                        *((span, "^") for span in spans)]:
        for match in re.finditer(start + r"cdc (?=[a-z])", line):
            rest = re.split(r"\s(?:\||&&|;|#|>|2>)|\)|\bcdc ", line[match.end():], maxsplit=1)[0]
            yield line.strip(), rest.split()


def _options(command: click.Command) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts) if opt.startswith("-")} | {
        "--help", "-h"}


#: the store "Writing a store" adds: its verbs come with it
EXAMPLE_STORE = "mystore"
WORDS = re.compile(r"[a-z][a-z-]*(\|[a-z][a-z-]*)*")


def check_command(words: list[str]) -> str | None:
    """Why `cdc <words>` is not a command of the click tree, or None when it is."""
    verb = words[0].rstrip(",.:;?")
    if not WORDS.fullmatch(verb) or verb == EXAMPLE_STORE:
        return None  # a placeholder (cdc <verb>) or the example store's
    commands = []
    for name in verb.split("|"):
        command = main.commands.get(name)  # type: ignore[attr-defined]
        if command is None:
            return f"no verb {name!r}"
        commands.append(command)
    options = set().union(*map(_options, commands))
    rest = words[1:]
    if all(isinstance(c, click.Group) for c in commands) and rest and WORDS.fullmatch(sub := rest[0].rstrip(",.:;?")):
        subcommands = []
        for name in sub.split("|"):
            found = [c.commands[name] for c in commands if isinstance(c, click.Group) and name in c.commands]
            if not found:
                return f"no verb {verb} {name!r}"
            subcommands += found
        options = set().union(*map(_options, subcommands))
        rest = rest[1:]
    for word in rest:
        option = re.match(r"\[?(--?[a-z][a-z-]*)", word)
        if option and option.group(1) not in options:
            return f"no option {option.group(1)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_cdc_command_a_page_shows_exists(page: Path) -> None:
    wrong = [f"{line}: {why}" for line, words in _shown_commands(page) if (why := check_command(words))]
    assert wrong == []


def test_the_command_check_knows_a_wrong_verb_and_option() -> None:
    assert check_command(["delta", "rebuild", "--config", "F"]) is None
    assert check_command(["sink", "cache", "--once"]) is None
    assert check_command(["delta", "optimize|vacuum"]) is None
    assert check_command(["delta", "migrat"]) == "no verb delta 'migrat'"
    assert check_command(["top", "--onse"]) == "no option --onse"
    assert check_command(["rnu"]) == "no verb 'rnu'"


SETTING = re.compile(r"\[(" + "|".join(sorted({s.section for s in SETTINGS})) + r")\] ([a-z_]+)")
#: words that follow a section's name without naming a key ("a [source] section", "[source] in <path>")
NOT_KEYS = {"section", "in"}


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_setting_a_page_names_is_a_setting(page: Path) -> None:
    known = {(s.section, s.key) for s in SETTINGS}
    named = set(SETTING.findall(page.read_text(encoding="utf-8")))
    assert {f"[{section}] {key}" for section, key in named - known if key not in NOT_KEYS} == set()


def test_the_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines < 250, f"README.md has {lines} lines: move the detail to a page of docs/"


def test_ci_runs_the_test_command_the_readme_gives() -> None:
    """CI runs what a developer is told to run: the README's test command, with only the
    report options (the slowest tests, the JUnit file) added."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"&& (python -m pytest [^#\n]*?)\s+# the tests", readme)
    assert command, "README.md has no `... && python -m pytest ...   # the tests` line"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    run_tests = ci.split("run_tests() {", 1)[1].split("\n}", 1)[0].replace("\\\n", " ")
    ran = re.search(r"python -m pytest ([^|]*?)\|\|", run_tests)
    assert ran, ".ci/run's run_tests calls no `python -m pytest`"
    options = [o for o in ran.group(1).split() if not o.startswith(("--durations", "--junitxml", '"$'))]
    assert " ".join(["python -m pytest", *options]) == command.group(1).strip()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as CI builds it: strict, so a broken link or a page left out of the nav fails."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_mkdocs_build_strict_passes(site: Path) -> None:
    assert (site / "index.html").is_file() and (site / "sinks" / "cache" / "index.html").is_file()
    assert (site / "search" / "search_index.json").is_file()


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on a free 127.0.0.1 port (the search index is fetched, not read from file://)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(site)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.parametrize("page", ["", "sinks/cache/"], ids=["home", "store-page"])
def test_the_built_site_shows_navigation_and_search_in_chromium(
    page: str, served: str, tmp_path: Path
) -> None:
    chromium = shutil.which("chromium") or pytest.fail("chromium is missing: apt-get install chromium")
    headless = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1280,900", "--virtual-time-budget=5000"]
    url = served + page
    dom = subprocess.run([*headless, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert 'data-md-component="search"' in html and 'class="md-search"' in html
    assert 'class="md-nav' in html
    nav = html.split('class="md-nav', 1)[1]
    assert [label for label in ("Getting started", "Design", "Troubleshooting", "Redis cache", "Benchmarks")
            if label not in nav] == []
    shot = tmp_path / f"{page.strip('/').replace('/', '-') or 'home'}.png"
    taken = subprocess.run([*headless, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    width, height, pixels = png_pixels(shot)
    assert (width, height) == (1280, 900)
    assert len(set(pixels)) > 100  # text, the header's colour, the navigation: not a blank page
    if os.environ.get("CDC_DOCS_SHOTS"):
        keep = Path(os.environ["CDC_DOCS_SHOTS"])
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, keep / shot.name)
