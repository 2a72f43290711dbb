"""A query's wall-clock deadline, seen by everything the query waits on.

`Runtime.answer(deadline_s=...)` (and `serve`'s X-D2R-Deadline-Ms) opens a `scope`; the code
that waits on something outside - the generator's HTTP calls, a free answering slot - asks
`remaining_s()` and waits no longer than that. A scope inside another keeps the earlier of the
two instants. Held in a context variable: per thread, per asyncio task, nothing to pass down the
generator protocol.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

from d2r_edge.errors import D2RError

_expires_at: ContextVar[float | None] = ContextVar("d2r_deadline", default=None)   # time.monotonic()


class DeadlineExceeded(D2RError):
    """The query's deadline passed before it could be answered (served as 504)."""

    exit_code = 11


@contextmanager
def scope(seconds: float | None) -> Iterator[None]:
    """Within the block, nothing waits past `seconds` from now (None: no deadline of its own)."""
    if seconds is None:
        yield
        return
    at = time.monotonic() + float(seconds)
    outer = _expires_at.get()
    token = _expires_at.set(at if outer is None else min(at, outer))
    try:
        yield
    finally:
        _expires_at.reset(token)


def remaining_s() -> float | None:
    """Seconds left before the current deadline (<= 0: passed); None when there is none."""
    at = _expires_at.get()
    return None if at is None else at - time.monotonic()


def bounded(timeout_s: float) -> float:
    """`timeout_s` cut to what the deadline leaves (may be <= 0: nothing may start)."""
    left = remaining_s()
    return timeout_s if left is None else min(timeout_s, left)
