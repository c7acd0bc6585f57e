"""Health checks of the cdc image's containers (compose `healthcheck:`); standard library only.

    healthcheck.py url URL             the daemon: URL (its /metrics) answers 2xx
    healthcheck.py spark-master URL    a Spark master: its web UI's JSON says ALIVE, with a live worker
    healthcheck.py spark-app URL NAME  a sink job: the master at URL runs an application NAME

Exit 0 when healthy, 1 with one line on stderr otherwise.
"""

from __future__ import annotations

import json
import sys
import urllib.request


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return answer.read()


def master_state(url: str) -> dict:
    return json.loads(fetch(url.rstrip("/") + "/json/"))


def check(argv: list[str]) -> str | None:
    """None when healthy, else why not."""
    match argv:
        case ["url", url]:
            fetch(url)
            return None
        case ["spark-master", url]:
            state = master_state(url)
            if state.get("status") != "ALIVE":
                return f"master status {state.get('status')}"
            return None if state.get("aliveworkers", 0) > 0 else "no live worker"
        case ["spark-app", url, name]:
            apps = master_state(url).get("activeapps", [])
            running = [a for a in apps if a.get("name") == name and a.get("state") == "RUNNING"]
            return None if running else f"no running application {name} on {url}"
    return f"usage: {__doc__.splitlines()[2].strip()} ..."


if __name__ == "__main__":
    try:
        problem = check(sys.argv[1:])
    except (OSError, ValueError) as exc:
        problem = str(exc)
    if problem:
        sys.stderr.write(f"unhealthy: {problem}\n")
    sys.exit(1 if problem else 0)
