"""Session ids: NATS-safe subject tokens (letters, digits, '-', '_'; 1 to 128 characters)."""

from __future__ import annotations

import re
from typing import Final

from .errors import InvalidSessionId

MAX_SESSION_ID: Final = 128
_SESSION_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")


def check_session_id(session_id: object) -> str:
    """Return the id unchanged, or raise `INVALID_SESSION_ID` saying what is wrong with it."""
    if not isinstance(session_id, str):
        raise InvalidSessionId(f"session id must be a string, got {type(session_id).__name__}")
    if not _SESSION_ID.fullmatch(session_id):
        shown = session_id if len(session_id) <= 40 else session_id[:40] + "..."
        raise InvalidSessionId(
            f"session id {shown!r} is not a safe subject token: use 1 to {MAX_SESSION_ID} letters, digits, '-' or '_'"
        )
    return session_id
