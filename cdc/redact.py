"""Keep secrets out of logs: passwords in DSNs never reach a log line or an error."""

from __future__ import annotations

import re

_URI_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s]*):[^@\s]*@", re.IGNORECASE)
_KV_PASSWORD = re.compile(r"(?P<head>(?<![?&])\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)[^&\s]*", re.IGNORECASE)


def redact_dsn(text: str) -> str:
    """Mask the password of a libpq DSN, URI or key=value form, anywhere inside `text`."""
    text = _URI_PASSWORD.sub(r"\g<head>:***@", text)
    text = _KV_PASSWORD.sub(r"\g<head>***", text)
    return _QUERY_PASSWORD.sub(r"\g<head>***", text)
