"""Fork and resume as pure functions over a log (SPEC section 8).

They compute what the child (or the resumed session) must hold and refuse with SPEC codes; writing it is the
caller's job (a JSONL file, or the JetStream writer, which makes the session visible only when all is written).
"""

from __future__ import annotations

from typing import Final

import msgspec

from .errors import InvalidBoundary, OpenTurn
from .events import EndSeedData, encode_new_event
from .header import SessionHeader
from .repair import interrupted_turn_closers
from .session import Session

END_SEED: Final = "session/end-seed"


class ForkPlan(msgspec.Struct, frozen=True):
    """The child's events (the parent's bytes, then the end-seed when one is added) and its lineage."""

    events: tuple[bytes, ...]
    seed_length: int
    boundary: int | None

    def child_header(self, *, child_id: str, parent: SessionHeader, created_at: int) -> SessionHeader:
        """The child's session header with this plan's seed length (`SessionHeader.child` says what it keeps)."""
        return parent.child(child_id, seed_length=self.seed_length, created_at=created_at)


def check_boundary(session: Session, boundary: object) -> int | None:
    """The inclusive boundary seq a fork copies up to; None only for an empty source with no boundary."""
    if boundary is None:
        if not len(session):
            return None
        boundary = len(session) - 1
    if type(boundary) is not int or boundary < 0:
        raise InvalidBoundary(f"fork boundary must be a non-negative integer, got {boundary!r}")
    if boundary >= len(session):
        raise InvalidBoundary(
            f"fork boundary {boundary} is past the end of the log (last seq {len(session) - 1})"
            if len(session)
            else f"fork boundary {boundary} is past the end of an empty log"
        )
    for seq in range(boundary, -1, -1):
        kind = session[seq].type
        if kind == "turn/end":
            break
        if kind == "turn/start":
            raise OpenTurn(
                f"fork boundary {boundary} is inside turn {session[seq].data.turn}, opened at seq {seq} "
                "and not ended at or before the boundary",
                seq=boundary,
            )
    return boundary


def plan_fork(session: Session, boundary: object = None, *, now_ms: int) -> ForkPlan:
    """The child's log: the prefix up to `boundary` (inclusive) followed by a `session/end-seed`, which is not
    added again when the prefix already ends with one."""
    last = check_boundary(session, boundary)
    if last is None:
        return ForkPlan(events=(), seed_length=0, boundary=None)
    prefix = [session[s].raw for s in range(last + 1)]
    if session[last].type != END_SEED:
        seed_style = session[last].has_seq
        # The seed takes the time of the last copied event, so the same fork always gives the same bytes and a
        # retried fork continues what a dead one left (2026-12-02).
        seed_time = next((t for s in range(last, -1, -1) if (t := session[s].time) is not None), now_ms)
        prefix.append(encode_new_event(END_SEED, EndSeedData(), seq=last + 1 if seed_style else None, time=seed_time))
    return ForkPlan(events=tuple(prefix), seed_length=last + 1, boundary=last)


def resume_events(session: Session, *, now_ms: int) -> tuple[bytes, ...]:
    """What resume appends: the closers of an open turn (SPEC section 7), then a `session/end-seed` unless the
    log already ends with one."""
    closers = interrupted_turn_closers(session)
    if not closers and len(session) and session[len(session) - 1].type == END_SEED:
        return ()
    seq = len(session) + len(closers)
    seed = encode_new_event(END_SEED, EndSeedData(), seq=seq if session.has_seqs else None, time=now_ms)
    return (*closers, seed)


def next_header_reason(session: Session) -> str | None:
    """The reason of the `request/header` the next step must write first: `initial` when the log has none, `resume`
    when a `session/end-seed` (a resume) follows the latest one, else None (the folded header still holds)."""
    folded = session.fold_request_header()
    if folded is None:
        return "initial"
    resumed = any(session[seq].type == END_SEED for seq in range(folded.seq + 1, len(session)))
    return "resume" if resumed else None
