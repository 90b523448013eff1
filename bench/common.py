"""What every benchmark module shares: the quick/full sizing switch, percentiles, the machine's description and
helpers to start and stop the processes a benchmark measures.

`python -m bench --quick` sets `BENCH_QUICK=1` before any benchmark module is imported, so each module's sizes
(module constants built with `scale(full, quick)`) are the small ones: the quick run proves the suite works, the
full run gives the figures.
"""

from __future__ import annotations

import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

QUICK = os.environ.get("BENCH_QUICK") == "1"


def scale(full: int, quick: int) -> int:
    return quick if QUICK else full


def scalef(full: float, quick: float) -> float:
    return quick if QUICK else full


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def stats_ms(seconds: list[float]) -> dict[str, float]:
    """Median, p99 and mean of samples taken in seconds, in milliseconds."""
    return {
        "n": len(seconds),
        "p50_ms": pct(seconds, 0.5) * 1e3,
        "p99_ms": pct(seconds, 0.99) * 1e3,
        "mean_ms": statistics.fmean(seconds) * 1e3 if seconds else float("nan"),
    }


def machine() -> dict[str, Any]:
    """Cores, memory, Python and nats-server versions, load average now."""
    from sessionlog.embedded import binary_version, find_server_binary

    try:
        nats = binary_version(find_server_binary())
    except Exception as err:  # reported, not fatal: the benchmarks will fail on their own if it is missing
        nats = f"unknown ({err})"
    mem_gib = None
    try:
        with open("/proc/meminfo") as info:
            mem_gib = round(int(info.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nats_server": nats,
        "load_average": list(os.getloadavg()),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process (Linux /proc), in MiB."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU a process has used so far (Linux /proc; None elsewhere, or for no pid)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """A Python process of this interpreter with its output in `log_path` (read when it fails)."""
    out = open(log_path, "ab")  # noqa: SIM115 - the child holds it; closed by the OS when both are gone
    try:
        return subprocess.Popen(
            [sys.executable, *args], env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    finally:
        out.close()


def stop(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not ended within `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def clean_env(**overrides: str) -> dict[str, str]:
    """This process's environment without any SESSIONLOG_* a developer set, plus `overrides`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
    env.update(overrides)
    return env
