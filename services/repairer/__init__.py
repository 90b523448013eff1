"""repairer: closes turns whose writer died, from the log alone (SPEC section 7).

It tracks open turns (from the records, and at start from each session's last record) and writer leases. When
a session has an open turn and no live lease for longer than the grace period, it appends the closers of
`interrupted_turn_closers` with optimistic concurrency. The closers are deterministic, so two repairers racing
publish byte-identical records under the same message id: exactly one copy lands, the other sees the turn
closed. A writer that comes back after a repair is fenced by `LEASE_LOST` and must resume.

Endpoint (NATS micro service `sessionlog-repair`): `sessionlog.repair.close` `{"session"}` ->
`{"session", "closers": [events]}`, refused with `LEASE_HELD` while a live writer holds the session; a session
already closed answers `{"closers": []}`.
"""

from __future__ import annotations

from .service import Repairer, RepairerService

__all__ = ["Repairer", "RepairerService"]
