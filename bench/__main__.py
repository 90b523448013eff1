"""Run every benchmark and print one JSON document: `python -m bench [NAME ...]`."""

from __future__ import annotations

import importlib
import json
import sys

BENCHMARKS = ["bench_session", "bench_gateway", "bench_ui_audit", "bench_ui", "bench_log", "bench_projections"]


def main(argv: list[str]) -> int:
    names = argv or BENCHMARKS
    results = {}
    for name in names:
        module = importlib.import_module(f"bench.{name}")
        results[name] = module.main()
    json.dump(results, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
