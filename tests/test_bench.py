"""`python -m bench --quick` runs the whole suite at small sizes and writes a document with every section and a
number in each: the suite is proved to work; no time is asserted (the figures come from the full run)."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SECTIONS = {
    "bench_session": ["per_append", "ingest.events_per_s", "replace.after_over_before"],
    "bench_stores": [
        "raw_publish.sync.events_per_s",
        "raw_publish.async.events_per_s",
        "sessionlog_agent.events_per_s",
        "sessionlog_agent.flush.p99_ms",
        "sqlite_per_event.events_per_s",
        "sqlite_batched.events_per_s",
        "sqlite_read_100k.events_per_s",
        "naive.messages_per_s",
        "naive.originals_lost",
        "concurrent",
        "append_cost_by_size.naive",
        "append_cost_by_size.sessionlog",
    ],
    "bench_log": ["raw_publish.p99_ms", "writer_flush_each.p99_ms", "writer_streaming.events_per_s", "read_100k"],
    "bench_gateway": [
        "sizes.100.overhead_ms.p99",
        "sizes.100.proxies.passthrough.ttfb_ms.p99",
        "sizes.100.decode_ms",
        "record.100.overhead_ms.p50",
        "record.100.gateway_work_mean_ms",
    ],
    "bench_ui_audit": ["render.total_ms", "live_tail.after_flush_ack_ms.p99", "auditor.auditor_over_floor"],
    "bench_ui": ["overview.html_first_page.median_ms", "session.transcript_page.median_ms"],
    "bench_projections": [
        "lag",
        "derive",
        "rebuild.every_projection",
        "rebuild.floor_reads_events_per_s",
        "rebuild.best_of",
    ],
    "bench_fleet": [
        "single.per_projection",
        "single.mib_per_1000_sessions",
        "cluster.per_projection",
        "cluster.timeline",
    ],
}


def at(doc: Any, path: str) -> Any:
    for key in path.split("."):
        assert isinstance(doc, dict) and key in doc, f"{path}: no {key!r}"
        doc = doc[key]
    return doc


def numbers(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in numbers(v)]
    return []


def test_the_quick_run_writes_every_section_with_numbers(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out), "--plots", str(tmp_path / "plots")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=540,  # a bound that proves no hang, not a speed
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["quick"] is True
    for side in ("machine_before", "machine_after"):
        assert doc[side]["cores"] >= 1 and len(doc[side]["load_average"]) == 3
        assert doc[side]["nats_server"] and doc[side]["python"]
    for section, paths in SECTIONS.items():
        assert "error" not in doc[section], doc[section].get("error")
        for path in paths:
            found = numbers(at(doc[section], path))
            assert found, f"{section}.{path} holds no number"
            assert not all(math.isnan(x) for x in found), f"{section}.{path} holds only NaN"
    # every goal was judged on a figure of this run, and the table was printed
    goals = [row for row in doc["goals"] if row["target"]]
    assert len(goals) >= 12
    assert all(isinstance(row["figure"], float | int) for row in goals), [r for r in goals if r["figure"] is None]
    assert "each goal beside its figure" in done.stdout
    # the naive store lost the originals its compactions replaced; the log lost none
    assert doc["bench_stores"]["naive"]["originals_lost"] > 0
    agent = doc["bench_stores"]["sessionlog_agent"]
    assert agent["messages_readable_after"] == agent["messages_written"]
    # every rebuild was judged between two floor reads: one more floor read per round than there are projections
    rebuild = doc["bench_projections"]["rebuild"]
    every = rebuild["every_projection"]
    rounds = {len(x["over_adjacent_floors"]) for x in every.values()}
    assert len(rounds) == 1 and min(rounds) >= 1, rounds
    assert len(rebuild["floor_reads_events_per_s"]) == min(rounds) * (len(every) + 1)
    if sys.platform == "linux":  # CPU per request comes from /proc
        cpu = doc["bench_gateway"]["record"]["100"]["cpu_ms_per_request"]
        assert set(cpu) == {"gateway", "nats_server", "passthrough"} and cpu["gateway"] > 0, cpu


def test_replot_without_a_readable_results_file_says_so_and_writes_nothing(tmp_path: Path) -> None:
    missing, broken = tmp_path / "missing.json", tmp_path / "broken.json"
    broken.write_text("{not json")
    for out in (missing, broken):
        done = subprocess.run(
            [sys.executable, "-m", "bench", "--replot", "--no-plots", "--out", str(out)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr[-2000:]
        assert f"--replot reads the figures of a run from {out}" in done.stderr, done.stderr[-2000:]
        assert not out.with_suffix(".md").exists()
    assert not missing.exists()
    assert broken.read_text() == "{not json"


def _fleet_samples(times_and_lags: list[tuple[float, float]]) -> list[dict[str, Any]]:
    from bench.bench_fleet import PARTITIONS, PROJECTIONS

    owners = {p: {"0": list(range(PARTITIONS))} for p in PROJECTIONS}
    return [{"t": t, "lag_s": {p: [lag] * PARTITIONS for p in PROJECTIONS}, "owners": owners}
            for t, lag in times_and_lags]  # fmt: skip


def test_the_fleet_judges_recovery_on_samples_further_apart_than_a_second() -> None:
    """On a cluster a sample can take longer than a second: the lag is back once it stays under the threshold from
    one sample through the first sample a second or more later (a window of one sample used to never count)."""
    from bench.bench_fleet import PROJECTIONS, analyse

    before = [(t * 1.5, 0.3) for t in range(10)]  # threshold 0.3, samples 1.5 s apart
    after = [(16.0, 2.0), (17.5, 4.0), (19.0, 0.2), (20.5, 0.25), (22.0, 0.1), (23.5, 0.2)]
    result = analyse(PROJECTIONS[0], _fleet_samples(before + after), {"kill": 15.0})
    assert result["takeover_s"] == 1.0
    assert result["recovered_after_takeover_s"] == 3.0  # from 19.0 (taken at 16.0)
    # Back over the threshold within the second after: not yet recovered there.
    bumpy = [(16.0, 2.0), (19.0, 0.2), (19.6, 0.9), (20.1, 0.2), (21.5, 0.2)]
    result = analyse(PROJECTIONS[0], _fleet_samples(before + bumpy), {"kill": 15.0})
    assert result["recovered_after_takeover_s"] == pytest.approx(4.1)
    # Never a second under the threshold before the end: not recovered.
    result = analyse(PROJECTIONS[0], _fleet_samples([*before, (16.0, 2.0), (17.5, 0.2)]), {"kill": 15.0})
    assert result["recovered_after_takeover_s"] is None


def test_streamed_lines_are_judged_later_only_when_significantly_more_rounds_are() -> None:
    """Issue 13's "no later than without logging": a one-sided sign test on the rounds whose lines reached the
    client later and earlier through record mode (a round's lines share the machine's state, so the round is the
    unit). Exact values, then the row the report judges on them."""
    from bench.report import goals, sign_test

    assert sign_test(1, 0) == 0.5
    assert sign_test(0, 3) == 1.0
    assert sign_test(3, 0) == 0.125
    assert sign_test(2, 1) == 0.5  # P(X >= 2) of 3 fair coins: (3 + 1) / 8
    assert sign_test(15, 15) > 0.5
    assert 0.01 < sign_test(20, 10) < 0.05  # two in three rounds later, at 30 rounds: later
    assert sign_test(18, 12) > 0.05  # three in five: within chance

    def row(later: int, earlier: int) -> dict[str, Any]:
        lag = {
            "rounds_later": later,
            "rounds_earlier": earlier,
            "record_minus_without_logging_ms": {"p50": 0.004},
            "record_later_share": 0.55,
            "transit_ms": {"record": {"p50": 0.4, "p99": 1.0}, "without_logging": {"p50": 0.38, "p99": 1.1}},
        }
        doc = {"bench_gateway": {"record": {"100": {}, "chunk_lag": lag}}}
        return next(r for r in goals(doc) if r["goal"].startswith("streamed lines through record mode"))

    assert row(18, 12)["met"] is True
    assert row(18, 12)["figure"] == round(18 / 30, 3)
    assert "+4.0 µs" in row(18, 12)["note"]
    assert row(20, 10)["met"] is False
    assert row(0, 0)["met"] is None  # no round with a difference: not judged


def test_the_synthetic_sessions_are_ones_a_faithful_agent_would_log() -> None:
    """The benchmarks' sessions stand for a real agent's: every message is what its chunks assemble to, with its
    usage, so the token-auditor of a benchmark audits, as in production, without a finding per step (it used to
    find a tool call missing from the chunks of every first step, and log a line for each)."""
    from bench.bench_fleet import first_turn, later_turns
    from bench.synth import synthetic_log
    from sessionlog.audit import SessionAuditor
    from sessionlog.session import Session

    logs = {
        "synthetic": synthetic_log(600, compact_every=3),
        "fleet": first_turn() + later_turns(3),
        "plain": synthetic_log(200, deltas=5, tools=0),
    }
    for name, events in logs.items():
        auditor = SessionAuditor(name)
        auditor.feed(events, Session())
        report = auditor.report()
        assert report.chunks > 0, name
        assert [f.code for f in report.findings] == [], (name, report.findings[:2])
        assert report.ledger.total.output_tokens > 0, name


async def test_a_fleet_replica_still_starting_is_sampled_as_owning_nothing(tmp_path: Path) -> None:
    """A replica answers health before its projection has started (`state: starting`, no partitions): the fleet's
    sampler reads it as not answering yet, not as a component to read partitions from (a full run's fleet failed
    with KeyError 'partitions' on a replica added midway)."""
    import httpx

    from bench.bench_fleet import Replica
    from sessionlog.embedded import free_port

    replica = Replica("context-deriver", 0, f"nats://127.0.0.1:{free_port()}", tmp_path, 1)  # no server there
    try:
        async with httpx.AsyncClient() as client:
            answered: list[dict[str, Any]] = []
            for _ in range(200):  # bounded: the process answers within a second or two of starting
                try:
                    reply = await client.get(f"http://127.0.0.1:{replica.port}/healthz", timeout=1.0)
                    answered.append(reply.json()["components"]["context-deriver"])
                    break
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)
            assert answered == [{"live": True, "ready": False, "state": "starting"}], answered
            assert await replica.health(client) is None
    finally:
        replica.proc.kill()
        replica.proc.wait(10)
