"""Keep secrets out of every line cdc prints or logs.

Two nets. By shape: a DSN's password (`password=...`, `user:...@`, `?password=`) is masked
wherever a DSN is quoted. By value: every secret the configuration holds (settings marked
secret in cdc/config.py's table, and the password inside `[source] dsn`) is removed from any
text, whichever library wrote it: libpq quotes the malformed part of a DSN in its own errors,
which no shape can predict. `install()` puts the value net on the root logger's handlers, on
uncaught exceptions' tracebacks (a bug still shows its traceback, without the secret) and the
CLI passes its error line through `redact()`.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import traceback
from collections.abc import Iterable
from types import TracebackType
from urllib.parse import quote, unquote

MASK = "***"

MIN_ANYWHERE = 4
"""Secrets (or pieces of a DSN's password) this long are masked anywhere in a text; shorter ones
only as a whole token (no letter or digit next to them), so "p" does not eat every word with a p."""

_URI_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s]*):[^@\s]*@", re.IGNORECASE)
_KV_PASSWORD = re.compile(r"(?P<head>(?<![?&])\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)[^&\s]*", re.IGNORECASE)

# Where a password may sit in a DSN as written, generously (up to the next key, the last '@'):
# for a DSN libpq cannot parse, or parses differently from what its author meant.
_URI_USERINFO = re.compile(r"^\s*[a-z][a-z0-9+.-]*://[^:/@?]*:(?P<pw>[^?]*)@", re.IGNORECASE)
_KV_REGION = re.compile(
    r"(?<![?&\w])password\s*=\s*(?:'(?P<quoted>(?:[^'\\]|\\.)*)'?|(?P<bare>.*?))(?=\s+[A-Za-z_]\w*\s*=|$)",
    re.IGNORECASE | re.DOTALL,
)
_QUERY_REGION = re.compile(r"[?&]password=(?P<pw>[^&]*)", re.IGNORECASE)
_PIECES = re.compile(r"[\s'\"/@:?&=\\%]+")


def redact_dsn(text: str) -> str:
    """Mask the password of a libpq DSN, URI or key=value form, anywhere inside `text`."""
    text = _URI_PASSWORD.sub(r"\g<head>:***@", text)
    text = _KV_PASSWORD.sub(r"\g<head>***", text)
    return _QUERY_PASSWORD.sub(r"\g<head>***", text)


def dsn_secrets(dsn: str) -> list[str]:
    """The password of a DSN as libpq reads it, and where it is written if libpq reads it otherwise
    (or not at all): that text and its pieces, which libpq's errors quote one at a time."""
    from psycopg import Error
    from psycopg.conninfo import conninfo_to_dict

    try:
        parsed = conninfo_to_dict(dsn).get("password")
    except Error:
        parsed = None
    out = [str(parsed)] if parsed else []
    regions = [m.group("pw") for m in (_URI_USERINFO.match(dsn), *_QUERY_REGION.finditer(dsn)) if m]
    regions += [m.group("quoted") if m.group("quoted") is not None else m.group("bare") for m in _KV_REGION.finditer(dsn)]
    for region in regions:
        if region and unquote(region) != parsed and region != parsed:
            out += [region, unquote(region), *(p for p in _PIECES.split(region) if p)]
    return out


def _variants(secret: str) -> set[str]:
    """How a secret may be spelled in output: as is, percent-encoded, escaped (repr, JSON, libpq)."""
    out = {
        secret, quote(secret, safe=""), quote(secret), repr(secret)[1:-1], ascii(secret)[1:-1],
        json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1],
        secret.replace("\\", "\\\\").replace("'", "\\'"),
    }
    return {v for v in out if v}


class Redactor:
    """Masks the given secrets (in any spelling) and DSN-shaped passwords in a text."""

    def __init__(self, secrets: Iterable[str]) -> None:
        variants = set().union(*(_variants(s) for s in secrets if s))
        longest_first = sorted(variants, key=len, reverse=True)
        anywhere = [re.escape(v) for v in longest_first if len(v) >= MIN_ANYWHERE]
        short = [re.escape(v) for v in longest_first if len(v) < MIN_ANYWHERE]
        parts = anywhere + ([rf"(?<![^\W_])(?:{'|'.join(short)})(?![^\W_])"] if short else [])
        self._pattern = re.compile("|".join(parts)) if parts else None

    def __call__(self, text: str) -> str:
        if self._pattern is not None:
            text = self._pattern.sub(MASK, text)
        return redact_dsn(text)


_active = Redactor([])


def display_url(url: str) -> str:
    """A service URL (Redis, OpenSearch) without its password, for messages."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redact(text: str) -> str:
    """`text` without any secret of the installed configuration (and no DSN password)."""
    return _active(text)


class RedactingFormatter(logging.Formatter):
    """Formats as its wrapped formatter would, then removes secrets: the message, its arguments
    and any traceback alike, whichever logger wrote the record."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        return redact(self.inner.format(record))


#: what an operator filters log lines by, passed as `extra=` where a line has them
FIELDS = ("table", "lsn", "batch", "store")


class JsonFormatter(RedactingFormatter):
    """One JSON object per line (`[daemon] log_format = "json"`): time, level, the process's
    component, the logger, the message and the `FIELDS` a line carries. Each string is
    redacted before encoding, so a masked secret never breaks the JSON."""

    def __init__(self, component: str) -> None:
        super().__init__(None)
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        from datetime import UTC, datetime

        when = datetime.fromtimestamp(record.created, UTC)
        line: dict[str, object] = {
            "ts": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "component": self.component,
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                line[name] = redact(value) if isinstance(value, str) else value
        if record.exc_info:
            line["error"] = redact(self.formatException(record.exc_info))
        return json.dumps(line, ensure_ascii=False, default=lambda v: redact(str(v)))


def json_component() -> str | None:
    """The `component` of this process's JSON log lines, None when it logs text: the JVMs it
    starts (Spark's driver) log as it does."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, JsonFormatter):
            return handler.formatter.component
    return None


def redact_json_line(line: str) -> str | None:
    """A JSON object line another program wrote (Spark's JVM), every string in it redacted and
    encoded as JsonFormatter encodes; None when `line` is not a JSON object. Parsed, not
    searched as text: a DSN's `password=\\S+` shape would eat the rest of a compact line."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return json.dumps(_redacted(value), ensure_ascii=False) if isinstance(value, dict) else None


def _redacted(value: object) -> object:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: _redacted(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_redacted(item) for item in value]
    return value


def install(secrets: Iterable[str]) -> None:
    """Mask these secrets from now on: in `redact()`, on every handler of the root logger and in
    the traceback of an uncaught exception (main thread and others). Idempotent."""
    global _active
    _active = Redactor(secrets)
    for handler in logging.getLogger().handlers:
        if not isinstance(handler.formatter, RedactingFormatter):
            handler.setFormatter(RedactingFormatter(handler.formatter))
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook


def setup_logging(level: str, secrets: list[str], log_format: str = "text", component: str = "cdc") -> None:
    """Log to stderr, every line without the configuration's secrets (whichever library logs);
    the Kafka clients' own chatter is silenced (cdc reports their failures itself).
    `log_format` "json": one JSON object per line (JsonFormatter), tagged with `component`."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if log_format == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter(component))
    for noisy in ("kafka", "confluent_kafka"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    logging.getLogger("py4j").setLevel(logging.WARNING)  # a line per call between Python and Spark's JVM
    install(secrets)


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    sys.stderr.write(redact("".join(traceback.format_exception(kind, value, tb))))


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
    sys.stderr.write(redact(f"Exception in thread {name}:\n{text}"))
