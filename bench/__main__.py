"""Run the benchmarks, write one JSON document and the plots, print the goals table.

`python -m bench [--quick] [--out FILE] [--plots DIR] [NAME ...]`. Each benchmark starts its own servers and
processes. The document holds every benchmark's figures, the machine (cores, Python, nats-server, load average
before and after) and the goals, each with the figure it is judged on.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

BENCHMARKS = [
    "bench_session",
    "bench_stores",
    "bench_log",
    "bench_gateway",
    "bench_ui_audit",
    "bench_ui",
    "bench_projections",
    "bench_fleet",
]
HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    parser.add_argument("--quick", action="store_true", help="small sizes: proves the suite works, in about a minute")
    parser.add_argument("--out", type=Path, default=None, help="the JSON document (default bench/results.json)")
    parser.add_argument("--plots", type=Path, default=None, help="folder of the PNG plots (default bench/plots)")
    parser.add_argument("--no-plots", action="store_true", help="write no plots")
    parser.add_argument("--replot", action="store_true", help="redraw plots and table from --out, judged again")
    args = parser.parse_args(argv)
    if args.quick:
        os.environ["BENCH_QUICK"] = "1"  # read by bench.common when the benchmark modules are imported
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    # Only a whole run replaces the committed results: a quick or partial one writes beside them (git-ignored).
    kind = "quick" if args.quick else "partial" if args.names else ""
    out = args.out or HERE / (f"results-{kind}.json" if kind else "results.json")
    plots = None if args.no_plots else (args.plots or HERE / (f"plots-{kind}" if kind else "plots"))

    from .common import machine
    from .report import goals, markdown, plot, print_summary

    if args.replot:  # the same figures drawn again and judged again (a plot or a row changed), nothing measured
        try:
            results = json.loads(out.read_text())
        except (OSError, ValueError) as exc:  # nothing to draw from: say so, and write nothing
            parser.error(f"--replot reads the figures of a run from {out}: {exc}")
        results["goals"] = goals(results)
        out.write_text(json.dumps(results, indent=1, default=float) + "\n")
        if plots is not None:
            plot(results, plots)
        out.with_suffix(".md").write_text(markdown(results))
        print_summary(results)
        return 0
    names = args.names or BENCHMARKS
    results: dict[str, Any] = {"quick": args.quick, "machine_before": machine(), "seconds": {}}
    failed = []
    for name in names:
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            module = importlib.import_module(f"bench.{name}")
            results[name] = module.main()
        except Exception:  # the others still run; the document says what failed
            results[name] = {"error": traceback.format_exc()}
            failed.append(name)
            print(results[name]["error"], file=sys.stderr)
        results["seconds"][name] = round(time.perf_counter() - started, 1)
    results["machine_after"] = machine()
    results["goals"] = goals(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=float) + "\n")
    if plots is not None:
        written = plot(results, plots)
        results["plots"] = [str(p) for p in written]
        out.write_text(json.dumps(results, indent=1, default=float) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    print_summary(results)
    print(f"bench: wrote {out}" + (f" and {len(results.get('plots', []))} plots in {plots}" if plots else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
