"""Containers without a Docker engine: Debian's podman (with runc) and a base image made here.

These machines run no Docker daemon and reach no image registry, but podman runs and
builds containers. Every call goes through `podman()`: runc with cgroupfs (podman's
default crun fails here, "cgroups in hybrid mode not supported") and explicit ulimits on
`run` and `build` (without them runc fails on setrlimit). The base image is Debian 12 made
by `debootstrap` from the mirror apt already uses and imported (`make_base_image`); the
project's two images (docker/Dockerfile's targets `capture`, the daemon without Spark or
a JVM, and `sinks`, the Spark jobs) build FROM it (`build_image`), with the machine's CA
bundle as a build secret for pip and Maven (TLS is re-signed here) and, for `sinks`,
pyspark's wheel from the host's pip cache (`wheelhouse`). Containers use the host's
network. Used by the container test tier and `.ci/run`.
"""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from cdc.local.process import ServiceUnavailable, require_command

#: The source checkout: the build context (docker/Dockerfile, setup.cfg, the packages).
ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
BASE_IMAGE = "localhost/debian:bookworm-local"
CAPTURE_IMAGE = "localhost/pg-cdc-capture:dev"
SINKS_IMAGE = "localhost/pg-cdc-sinks:dev"
#: docker/Dockerfile's final stages (`--target`) and the local tag of each, in build order
#: (sinks reuses capture's dependency and wheel layers).
TARGETS = {"capture": CAPTURE_IMAGE, "sinks": SINKS_IMAGE}
SUITE = "bookworm"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
GLOBAL_OPTIONS = ("--runtime", "runc", "--cgroup-manager=cgroupfs")
ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
INSTALL = "`apt-get install -y podman runc debootstrap`"


def podman_argv(*args: str) -> list[str]:
    """`podman` with the options every call needs here."""
    return [require_command("podman", INSTALL), *GLOBAL_OPTIONS, *args]


def podman(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one podman command to completion; with `check`, a failure is one line."""
    done = subprocess.run(podman_argv(*args), capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise ServiceUnavailable(f"podman {args[0]} failed (exit {done.returncode}): {_last_lines(done)}")
    return done


def _last_lines(done: subprocess.CompletedProcess[str], n: int = 6) -> str:
    lines = [ln.strip() for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    return " | ".join(lines[-n:]) or "no output"


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, check=False).returncode == 0


def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """The Debian archive apt uses here (deb822 `debian.sources` or a one-line `sources.list`)."""
    sources = apt_dir / "sources.list.d" / "debian.sources"
    if sources.is_file():
        for stanza in sources.read_text().split("\n\n"):
            fields = dict(
                line.split(":", 1) for line in stanza.splitlines() if ":" in line and not line.startswith("#")
            )
            suites = fields.get("Suites", "").split()
            if SUITE in suites and fields.get("URIs", "").strip():
                return fields["URIs"].split()[0]
    listing = apt_dir / "sources.list"
    if listing.is_file():
        for line in listing.read_text().splitlines():
            found = re.match(rf"\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+{SUITE}\s", line + " ")
            if found:
                return found.group(1)
    return DEFAULT_MIRROR


def make_base_image(name: str = BASE_IMAGE, mirror: str | None = None) -> bool:
    """Debian 12 (minbase) as image `name`, unless it exists already; True when made now.

    debootstrap into a temporary root (about half a minute), apt's downloaded packages and
    lists dropped (the image's first `apt-get update` fetches fresh ones), then
    `tar | podman import`.
    """
    if image_exists(name):
        return False
    debootstrap = require_command("debootstrap", INSTALL)
    with tempfile.TemporaryDirectory(prefix="cdc-debootstrap-") as tmp:
        root = Path(tmp) / "root"
        done = subprocess.run(
            [debootstrap, "--variant=minbase", SUITE, str(root), mirror or debian_mirror()],
            capture_output=True, text=True, timeout=1800, check=False,
        )
        if done.returncode != 0:
            raise ServiceUnavailable(f"debootstrap failed (exit {done.returncode}): {_last_lines(done)}")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (root / junk).glob("*"):
                if path.is_file():
                    path.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(
            podman_argv("import", "-", name), stdin=tar.stdout, capture_output=True, text=True,
            timeout=600, check=False,
        )
        assert tar.stdout is not None
        tar.stdout.close()
        if tar.wait() != 0 or imported.returncode != 0:
            raise ServiceUnavailable(f"podman import of {name} failed: {_last_lines(imported)}")
    return True


def pyspark_requirement(setup_cfg: Path = ROOT / "setup.cfg") -> str:
    """pyspark's pin in setup.cfg's `sinks` extra (the one list of pins), e.g. pyspark==4.2.0."""
    parser = configparser.ConfigParser()
    parser.read(setup_cfg)
    for line in parser["options.extras_require"]["sinks"].splitlines():
        if line.strip().startswith("pyspark"):
            return line.strip()
    raise ServiceUnavailable(f"no pyspark requirement in {setup_cfg} [options.extras_require] sinks")


def wheelhouse(folder: Path) -> Path:
    """pyspark's wheel in `folder`, from the host's pip cache when it holds it (seconds;
    otherwise pip builds it once from its 450 MB sdist, minutes): the image build then
    installs it instead of building it again inside."""
    folder.mkdir(parents=True, exist_ok=True)
    requirement = pyspark_requirement()
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(folder), requirement],
        capture_output=True, text=True, timeout=1800, check=False,
    )
    if done.returncode != 0:
        raise ServiceUnavailable(f"pip wheel {requirement} failed: {_last_lines(done)}")
    return folder


def build_argv(
    target: str, base: str = BASE_IMAGE, wheels: Path | None = None, ca_bundle: Path | None = CA_BUNDLE
) -> list[str]:
    """The `podman build` of one target of docker/Dockerfile (docs/deployment.md quotes it)."""
    argv = ["build", "--network", "host", *ULIMITS, "-f", str(DOCKERFILE), "--target", target, "-t", TARGETS[target],
            "--build-arg", f"BASE_IMAGE={base}"]
    if ca_bundle is not None:
        argv += ["--secret", f"id=ca,src={ca_bundle}"]
    if wheels is not None:
        argv += ["-v", f"{wheels}:/wheelhouse:ro", "--build-arg", "WHEELHOUSE=/wheelhouse"]
    return podman_argv(*argv, str(ROOT))


def build_image(target: str, base: str = BASE_IMAGE, log: Path | None = None) -> str:
    """Build the image of `target` (a key of TARGETS) from `base` (made first if missing);
    returns its tag.

    Layers, pip's cache and Maven's repository are reused between builds (a build with
    nothing changed takes seconds); for `sinks`, pyspark comes from the host's pip cache.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown image target {target!r}: one of {', '.join(TARGETS)}")
    if not DOCKERFILE.is_file():
        raise ServiceUnavailable(f"{DOCKERFILE} not found: build from a source checkout of the project")
    make_base_image(base)
    ca = CA_BUNDLE if CA_BUNDLE.is_file() else None
    tag = TARGETS[target]
    with tempfile.TemporaryDirectory(prefix="cdc-wheelhouse-") as tmp:
        wheels = wheelhouse(Path(tmp)) if target == "sinks" else None
        argv = build_argv(target, base, wheels, ca)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, check=False)
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise ServiceUnavailable(f"podman build of {tag} failed (exit {done.returncode}): {_last_lines(done)}")
    return tag


class Container:
    """One detached container of `image` on the host's network, removed by `remove()`.

    `volumes` maps host paths to container paths (a trailing `:ro` on the container path
    mounts read-only); `env` sets variables inside.
    """

    def __init__(
        self,
        image: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        volumes: Mapping[Path | str, str] | None = None,
        name: str | None = None,
    ) -> None:
        self.image, self.argv = image, list(argv)
        self.env, self.volumes = dict(env or {}), dict(volumes or {})
        self.name = name or f"cdc-{uuid.uuid4().hex[:10]}"
        self.started = False

    def run_options(self) -> list[str]:
        options = ["--name", self.name, "--network", "host", "--init", *ULIMITS]
        for key, value in self.env.items():
            options += ["-e", f"{key}={value}"]
        for host, inside in self.volumes.items():
            options += ["-v", f"{host}:{inside}"]
        return options

    def start(self) -> Container:
        podman("run", "-d", *self.run_options(), self.image, *self.argv, timeout=120)
        self.started = True
        return self

    def run(self, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        """Run to completion (then removed); its exit status and output, whatever they are."""
        self.started = True
        try:
            return podman("run", *self.run_options(), self.image, *self.argv, timeout=timeout, check=False)
        finally:
            self.remove()

    def exec(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return podman("exec", self.name, *argv, timeout=timeout, check=False)

    def running(self) -> bool:
        done = podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return done.stdout.strip() == "true"

    def logs(self) -> str:
        done = podman("logs", self.name, check=False)
        return done.stdout + done.stderr

    def stop(self, timeout_s: int = 60) -> int:
        """SIGTERM (SIGKILL after `timeout_s`); the exit status of its command."""
        podman("stop", "-t", str(timeout_s), self.name, timeout=timeout_s + 60)
        return self.exit_code()

    def exit_code(self) -> int:
        done = podman("inspect", "--format", "{{.State.ExitCode}}", self.name)
        return int(done.stdout.strip())

    def remove(self) -> None:
        if self.started:
            podman("rm", "-f", "-t", "5", self.name, check=False, timeout=120)
            self.started = False

    def __enter__(self) -> Container:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.remove()


def writable_by_image_user(path: Path, image: str) -> Path:
    """`path` as a directory the image's (non-root) user owns, for a bind mount."""
    path.mkdir(parents=True, exist_ok=True)
    ids = podman("run", "--rm", *ULIMITS, "--network", "none", image, "sh", "-c", "id -u; id -g").stdout.split()
    shutil.chown(path, int(ids[0]), int(ids[1]))
    return path
