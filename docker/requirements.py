"""The requirements setup.cfg lists: the core (`install_requires`) and the named extras.

    python requirements.py setup.cfg sinks,confluent > requirements.txt

docker/Dockerfile installs them before it copies the code, so a code change reuses the
dependency layers; setup.cfg stays the one list of pins. Standard library only: it runs
before anything is installed.
"""

from __future__ import annotations

import configparser
import sys


def requirements(setup_cfg: str, extras: list[str]) -> list[str]:
    parser = configparser.ConfigParser()
    parser.read(setup_cfg)
    lines = parser["options"]["install_requires"].splitlines()
    for extra in extras:
        lines += parser["options.extras_require"][extra].splitlines()
    return [line.strip() for line in lines if line.strip()]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1], [e for e in sys.argv[2].split(",") if e])))
