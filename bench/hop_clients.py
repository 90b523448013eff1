"""Two pass-through proxies (`bench.passthrough`) side by side on one scripted provider, each on the gateway code
of its own checkout: this one, and `--baseline` (another checkout, e.g. main before a change to the gateway's
upstream client). Requests go direct, through this checkout's hop and through the baseline's, in turn, with the
same 100-message streamed body, so all three see the same machine. Printed as JSON: per hop, the added time to
first byte over direct (p50 / p99 of ttfb differences of percentiles) and the CPU seconds per request of the hop's
process (user + system, from /proc: Linux only), with the load average before and after.
`python -m bench.hop_clients --baseline /path/to/checkout [--requests 1500]`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from sessionlog.embedded import free_port

from .bench_gateway import _spawn, _stop, pct, record_body, record_history, ttfb

HERE = Path(__file__).resolve().parent.parent


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def measure(urls: dict[str, str], pids: dict[str, int], requests: int) -> dict[str, Any]:
    body = record_body(record_history(100))
    headers = {"content-type": "application/json"}
    times: dict[str, list[float]] = {name: [] for name in urls}
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(50):  # warm: connections open, code paths run once
            for url in urls.values():
                await ttfb(client, url, body, headers)
        cpu_before = {name: cpu_s(pid) for name, pid in pids.items()}
        order = list(urls)
        for i in range(requests):
            for name in order[i % len(order) :] + order[: i % len(order)]:  # each goes first in turn
                times[name].append(await ttfb(client, urls[name], body, headers))
        cpu_after = {name: cpu_s(pid) for name, pid in pids.items()}
    direct = times["direct"]
    out: dict[str, Any] = {"direct_ttfb_ms": {"p50": round(pct(direct, 0.5), 3), "p99": round(pct(direct, 0.99), 3)}}
    for name in pids:
        t = times[name]
        out[name] = {
            "added_ttfb_ms": {q: round(pct(t, n) - pct(direct, n), 3) for q, n in (("p50", 0.5), ("p99", 0.99))},
            "cpu_ms_per_request": round((cpu_after[name] - cpu_before[name]) / requests * 1000, 3),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout of the project")
    parser.add_argument("--requests", type=int, default=1500)
    args = parser.parse_args()
    baseline = args.baseline.resolve()
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "script.json"
        script.write_text(json.dumps([{"text": "ok", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}]))
        provider_port = free_port()
        provider = f"http://127.0.0.1:{provider_port}"
        env = {**os.environ, "PYTHONPATH": f"{HERE}:{HERE / 'shared'}"}
        try:
            procs.append(_spawn(["-m", "services.gateway.scripted", str(script), "--port", str(provider_port),
                                 "--cycle"], env, provider + "/healthz"))  # fmt: skip
            urls = {"direct": provider + "/v1/chat/completions"}
            pids = {}
            for name, root in (("this", HERE), ("baseline", baseline)):
                port = free_port()
                hop_env = {**env, "PYTHONPATH": f"{root}:{root / 'shared'}"}
                hop = ["-m", "bench.passthrough", "--port", str(port), "--upstream", urls["direct"]]
                os.chdir(root)  # `-m bench.passthrough` from that checkout
                procs.append(_spawn(hop, hop_env, f"http://127.0.0.1:{port}/healthz"))
                os.chdir(HERE)
                urls[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
                pids[name] = procs[-1].pid
            before = load()
            result = asyncio.run(measure(urls, pids, args.requests))
            result["load_before"], result["load_after"] = before, load()
            result["requests"] = args.requests
            result["baseline_checkout"] = str(baseline)
        finally:
            for proc in procs:
                _stop(proc)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
