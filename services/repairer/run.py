"""`sessionlog serve repairer`."""

from __future__ import annotations

from sessionlog.log import SessionLog
from sessionlog.services import RunOptions

from .service import RepairerService


async def start(log: SessionLog, options: RunOptions) -> RepairerService:
    service = RepairerService(log, from_seq=options.from_seq, rebuild=options.rebuild)
    await service.start()
    return service
