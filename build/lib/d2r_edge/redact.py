"""Secrets out of text that is shown or kept: upstream bodies, exception text, log lines.

Text from outside (an upstream server's error body, a transport error's message) may quote a
key back (providers answer 401 with "Incorrect API key provided: sk-..."). It never reaches a
client, a record or a metric label; the server log keeps a short excerpt with every known key
value (`register_secret`: the generator's key, the server's own) and every key-shaped token
(`sk-...`, `Bearer ...`, `api_key=...`) masked, control characters escaped so one body is one
log line.
"""

from __future__ import annotations

import logging
import re
import threading
from urllib.parse import urlsplit, urlunsplit

MASK = "[redacted]"
MIN_SECRET_CHARS = 6          # shorter values would mask ordinary words
_lock = threading.Lock()
_secrets: frozenset[str] = frozenset()

_SHAPES = (
    re.compile(r"\b(?:sk|pk|rk)-[A-Za-z0-9_\-]{6,}"),                      # OpenAI-style keys
    re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/\-]{6,}=*"),        # Authorization values
    re.compile(r"(?i)\b((?:x-)?api[_-]?key|access[_-]?token|token|secret|password|authorization)"
               r"([\"']?\s*[:=]\s*[\"']?)[^\s\"',;&}]{4,}"),                 # key=value, "key": "value"
)


def register_secret(value: str | None) -> None:
    """Mask `value` wherever it appears from now on (a key read from the environment)."""
    global _secrets
    if not value or len(value) < MIN_SECRET_CHARS or value in _secrets:
        return
    with _lock:
        _secrets = _secrets | {value}


def redact(text: str) -> str:
    """`text` with known secrets and key-shaped tokens replaced by MASK."""
    for value in sorted(_secrets, key=len, reverse=True):   # longest first: one key may contain another
        text = text.replace(value, MASK)
    text = _SHAPES[0].sub(MASK, text)
    text = _SHAPES[1].sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    return _SHAPES[2].sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)


def excerpt(text: str, limit_chars: int = 300) -> str:
    """Untrusted text for a log line: cut to `limit_chars`, secrets masked, control characters
    (newlines included) escaped so the excerpt cannot forge log lines."""
    cut = text[:limit_chars]
    shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut)
    return redact(shown) + ("..." if len(text) > limit_chars else "")


def safe_url(url: str) -> str:
    """`url` as it may be shown: scheme, host, port and path; user:password@, query and fragment
    (where keys are sometimes passed) dropped."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = host if parts.port is None else f"{host}:{parts.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    except ValueError:     # a malformed port: show nothing of it rather than all of it
        return "<unparseable URL>"


class RedactingFilter(logging.Filter):
    """A handler filter: every record's rendered message passes through `redact` (the last line of
    defence; the places that log outside text redact it themselves)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:         # a broken format string: leave it to the handler to report
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True
