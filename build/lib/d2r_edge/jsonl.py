"""JSON lines as user files hold them: one parser for every reader.

`json.loads` raises RecursionError (not a JSONDecodeError) on input nested past
the interpreter's recursion limit, e.g. a line of 5,000 "[" characters; a
reader that catches only JSONDecodeError then dies on one hostile line. Here
that is one more malformed line.
"""

from __future__ import annotations

import json


def loads(text: str | bytes):
    """json.loads, with too-deep nesting reported as a JSONDecodeError like any malformed line."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text if isinstance(text, str) else "", 0) from None
