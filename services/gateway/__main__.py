"""`python -m services.gateway [--derivation auto|stream]`: run the gateway with the settings from the environment."""

from __future__ import annotations

import argparse
import contextlib
import logging

from sessionlog.process import tune_gc
from sessionlog.settings import Settings

from . import serve
from .config import GatewayConfig
from .serving import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the sessionlog gateway")
    parser.add_argument("--derivation", choices=["auto", "stream"], default=None)
    parser.add_argument("--no-raw-tee", action="store_true", help="do not publish raw bytes to the audit stream")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    settings = Settings()
    config = GatewayConfig.from_settings(settings)
    if args.derivation is not None:
        config = config.with_(derivation=args.derivation)
    if args.no_raw_tee:
        config = config.with_(raw_tee=False)
    tune_gc()
    with contextlib.suppress(KeyboardInterrupt):
        run(serve(settings, config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
