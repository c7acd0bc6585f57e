"""The proleptic Gregorian calendar in integers: epoch days and microseconds to dates and ISO text.

The events' value conversion (cdc.events.types) and the warehouse's read side for `cdc
verify` (sinks.stores.delta.read_spark, on Spark executors) both render timestamps this way, so it lives
apart from anything that needs PostgreSQL's client: BC dates and years beyond 9999 work
(``datetime`` cannot hold them).
"""

from __future__ import annotations

_MICROS_PER_DAY = 86_400_000_000


def days_from_civil(y: int, m: int, d: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (astronomical year: 1 BC = 0).

    Pure integer arithmetic, so BC dates and years beyond 9999 work (``datetime`` cannot).
    """
    y -= m <= 2
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def civil_from_days(z: int) -> tuple[int, int, int]:
    """Inverse of ``days_from_civil``."""
    z += 719468
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    d = doy - (153 * mp + 2) // 5 + 1
    m = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (m <= 2), m, d


def _iso_year(y: int) -> str:
    """Java ISO_LOCAL_DATE year: 4 digits, '+' beyond 9999, '-' before year 0."""
    if 0 <= y <= 9999:
        return f"{y:04d}"
    if y > 9999:
        return f"+{y}"
    return f"-{-y:04d}"


def _iso_fraction(micros: int) -> str:
    """Fraction of a second as Java prints it: only as many digits as needed."""
    if micros == 0:
        return ""
    return "." + f"{micros:06d}".rstrip("0")


def iso_utc(epoch_micros: int) -> str:
    """Epoch microseconds -> '2024-01-02T03:04:05.12Z' (Java ISO_OFFSET_DATE_TIME at UTC)."""
    days, rem = divmod(epoch_micros, _MICROS_PER_DAY)
    y, m, d = civil_from_days(days)
    secs, frac = divmod(rem, 1_000_000)
    hh, r = divmod(secs, 3600)
    mm, ss = divmod(r, 60)
    return f"{_iso_year(y)}-{m:02d}-{d:02d}T{hh:02d}:{mm:02d}:{ss:02d}{_iso_fraction(frac)}Z"
