"""Snapshot progress for humans: a live table on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger(__name__)

LOG_EVERY_S = 5.0


class Progress:
    def __init__(self, estimates: dict[str, int], mode: str = "auto") -> None:
        self.estimates = estimates
        self.rows = dict.fromkeys(estimates, 0)
        self.started = time.monotonic()
        self.tty = mode == "tty" or (mode == "auto" and sys.stderr.isatty())
        self.last_shown = 0.0
        self.lines_drawn = 0

    def add(self, table: str, rows: int) -> None:
        self.rows[table] = self.rows.get(table, 0) + rows

    def line(self, table: str, now: float) -> str:
        done, estimate = self.rows[table], max(self.estimates.get(table, 0), self.rows[table])
        rate = done / max(now - self.started, 1e-6)
        if estimate and done < estimate and rate > 0:
            eta = f"ETA {(estimate - done) / rate:,.0f} s"
        else:
            eta = "done" if done >= estimate else "ETA -"
        percent = 100.0 * done / estimate if estimate else 100.0
        return f"snapshot {table}: {done:,}/{estimate:,} rows ({percent:.0f}%), {rate:,.0f} rows/s, {eta}"

    def show(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_shown < (0.5 if self.tty else LOG_EVERY_S):
            return
        self.last_shown = now
        lines = [self.line(t, now) for t in self.rows]
        if self.tty:
            up = f"\x1b[{self.lines_drawn}F" if self.lines_drawn else ""
            sys.stderr.write(up + "".join(f"\x1b[2K{text}\n" for text in lines))
            sys.stderr.flush()
            self.lines_drawn = len(lines)
        else:
            for text in lines:
                if not text.endswith("done"):
                    log.info("%s", text)

    def close(self) -> None:
        total = sum(self.rows.values())
        elapsed = time.monotonic() - self.started
        if self.tty:
            self.show(force=True)
        log.info("snapshot read %s rows in %.1f s (%s rows/s)", f"{total:,}", elapsed, f"{total / max(elapsed, 1e-6):,.0f}")
