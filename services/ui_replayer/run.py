"""`sessionlog serve ui-replayer`."""

from __future__ import annotations

from sessionlog.log import SessionLog
from sessionlog.services import RunOptions

from .service import UIReplayerService


async def start(log: SessionLog, options: RunOptions) -> UIReplayerService:
    service = UIReplayerService(log, from_seq=options.from_seq, rebuild=options.rebuild)
    await service.start()
    return service
