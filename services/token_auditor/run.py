"""`sessionlog serve token-auditor`."""

from __future__ import annotations

from sessionlog.log import SessionLog
from sessionlog.services import RunOptions

from .service import TokenAuditorService


async def start(log: SessionLog, options: RunOptions) -> TokenAuditorService:
    service = TokenAuditorService(log, from_seq=options.from_seq, rebuild=options.rebuild)
    await service.start()
    return service
