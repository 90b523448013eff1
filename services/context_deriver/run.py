"""`sessionlog serve context-deriver`."""

from __future__ import annotations

from sessionlog.log import SessionLog
from sessionlog.services import RunOptions

from .service import ContextDeriverService


async def start(log: SessionLog, options: RunOptions) -> ContextDeriverService:
    service = ContextDeriverService(log, from_seq=options.from_seq, rebuild=options.rebuild)
    await service.start()
    return service
