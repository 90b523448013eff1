"""The goals of issue 16 judged on one run's document, the summary table, and the plots (matplotlib, optional:
`pip install -e '.[bench]'`; without it the plots are skipped with a note and everything else is written)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def get(doc: Any, path: str) -> Any:
    """doc["a"]["b"]... for "a.b...", None when any step is missing."""
    for key in path.split("."):
        if not isinstance(doc, dict) or key not in doc:
            return None
        doc = doc[key]
    return doc


def _row(goal: str, target: str, figure: float | None, ok: bool | None, source: str, note: str = "") -> dict[str, Any]:
    return {"goal": goal, "target": target, "figure": figure, "met": ok, "source": source, "note": note}


def _sources(derivations: dict[str, int] | None) -> str:
    """A gateway's derivations by source, as a note ("watched 199, stream 1")."""
    return ", ".join(f"{k} {n}" for k, n in (derivations or {}).items() if n)


def _judge(value: float | None, test: Any) -> bool | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else bool(test(value))


def sign_test(later: int, earlier: int) -> float:
    """One-sided sign test: the chance of at least `later` of `later + earlier` untied pairs falling later if each
    fell either way with even odds. Small: one side is really later; about one half or more: no sign of it."""
    n = later + earlier
    return sum(math.comb(n, k) for k in range(later, n + 1)) / 2**n


def goals(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal with the figure it is judged on (None when its benchmark did not run), then figures without one."""
    rows = []
    v = get(r, "bench_log.ratios.streaming_over_raw_events_per_s.value")
    rows.append(_row("chunk streaming vs raw publish, one event per message", ">= 10x", v,
                     _judge(v, lambda x: x >= 10), "bench_log"))  # fmt: skip
    streaming = get(r, "bench_log.writer_streaming.events_per_s")
    sqlite_each = get(r, "bench_stores.sqlite_per_event.events_per_s")
    v = streaming / sqlite_each if streaming and sqlite_each else None
    rows.append(_row("chunk streaming vs SQLite row per event, committed per event", ">= 1x", v,
                     _judge(v, lambda x: x >= 1), "bench_log + bench_stores"))  # fmt: skip
    v = get(r, "bench_stores.ratios.agent_over_sqlite_per_event")
    rows.append(_row("agent session (same events) vs SQLite committed per event", ">= 1x", v,
                     _judge(v, lambda x: x >= 1), "bench_stores"))  # fmt: skip
    for q in ("p50", "p99"):
        v = get(r, f"bench_log.ratios.flush_each_{q}_over_raw_{q}.value")
        rows.append(_row(f"per-flush latency {q} vs raw sync publish", "<= 1.25x", v,
                         _judge(v, lambda x: x <= 1.25), "bench_log"))  # fmt: skip
    v = get(r, "bench_log.ratios.reader_events_over_floor.value")
    rows.append(_row("session read (100k events) vs raw read+decode floor", ">= 0.8", v,
                     _judge(v, lambda x: x >= 0.8), "bench_log"))  # fmt: skip
    every = get(r, "bench_projections.rebuild.every_projection") or {}
    if every:
        worst = min(every, key=lambda name: every[name]["over_floor"])
        v = every[worst]["over_floor"]
        note = ", ".join(f"{name} {x['over_floor']:.2f}" for name, x in every.items())
        rows.append(_row("cold rebuild of every projection vs floor (worst)", ">= 0.5", v,
                         _judge(v, lambda x: x >= 0.5), "bench_projections", note))  # fmt: skip
    sizes = get(r, "bench_gateway.sizes") or {}
    if sizes:
        checks = {k: s["check_p99_over_decode"] for k, s in sizes.items()}
        v = max(checks.values())
        rows.append(_row("gateway check p99 vs one decode, worst size", "<= 3x", v, _judge(v, lambda x: x <= 3),
                         "bench_gateway", ", ".join(f"{k}: {x:.2f}" for k, x in checks.items())))  # fmt: skip
        v = get(sizes, "100.overhead_ms.p99")
        rows.append(_row("gateway overhead p99 at 100 messages (check mode)", "< 2 ms", v,
                         _judge(v, lambda x: x < 2.0), "bench_gateway"))  # fmt: skip
        diffs = {k: get(s, "proxies.passthrough.gateway_minus_this_ms.p99") for k, s in sizes.items()}
        v = diffs.get("100")
        rows.append(_row("gateway p99 minus pass-through proxy p99, 100 messages", "<= 1 ms", v,
                         _judge(v, lambda x: x <= 1.0), "bench_gateway",
                         ", ".join(f"{k}: {x:.2f}" for k, x in diffs.items() if x is not None)))  # fmt: skip
        v = get(sizes, "100.agent_rounds.overhead_ms.p99")
        rows.append(_row("gateway overhead p99 at 100 messages, agent rounds (check mode)", "< 2 ms", v,
                         _judge(v, lambda x: x < 2.0), "bench_gateway",
                         _sources(get(sizes, "100.agent_rounds.derivations"))))  # fmt: skip
        v = get(sizes, "100.agent_rounds.gateway_minus_passthrough_ms.p99")
        rows.append(_row("agent rounds: gateway p99 minus pass-through p99, 100 messages", "<= 1 ms", v,
                         _judge(v, lambda x: x <= 1.0), "bench_gateway"))  # fmt: skip
    record = get(r, "bench_gateway.record") or {}
    if "100" in record:
        # Beside the p50, what moves it most from one minute to the next on a shared machine: the direct call, the
        # plain hop, and the gateway's own in-process time before forwarding (docs/performance.md).
        direct, hop = get(record, "100.direct_ttfb_ms.p50"), get(record, "100.passthrough_ttfb_ms.p50")
        work = get(record, "100.gateway_work_mean_ms")
        labelled = (("direct p50", direct), ("pass-through p50", hop), ("own work before forwarding, mean", work))
        context = ", ".join(f"{label} {x:.2f} ms" for label, x in labelled if x is not None)
        for q, limit in (("p50", 2.0), ("p99", 5.0)):
            v = get(record, f"100.overhead_ms.{q}")
            rows.append(_row(f"record mode overhead {q} at 100 messages (issue 13)", f"<= {limit:g} ms", v,
                             _judge(v, lambda x, lim=limit: x <= lim), "bench_gateway",
                             context if q == "p50" else ""))  # fmt: skip
        cpu = get(record, "100.cpu_ms_per_request") or {}
        if "gateway" in cpu:
            by_size = ", ".join(f"{k}: {get(x, 'cpu_ms_per_request.gateway'):.2f}" for k, x in record.items()
                                if k.isdigit() and get(x, "cpu_ms_per_request.gateway") is not None)  # fmt: skip
            others = ", ".join(f"{name.replace('_', '-')} {ms:.2f} ms" for name, ms in cpu.items() if name != "gateway")
            rows.append(_row("record mode gateway CPU per request at 100 messages, ms", "", cpu["gateway"], None,
                             "bench_gateway", f"{others}; gateway by size {by_size}"))  # fmt: skip
        tee = {k: get(x, "raw_tee") for k, x in record.items() if k.isdigit() and get(x, "raw_tee")}
        if tee:
            largest = max(tee, key=int)
            v = tee[largest]["stored_bytes_per_request"] / tee[largest]["request_bytes_per_request"]
            detail = ", ".join(f"{k}: {t['stored_bytes_per_request']:,} of {t['request_bytes_per_request']:,}"
                               for k, t in tee.items())  # fmt: skip
            rows.append(_row(f"raw tee bytes stored per request / the request's bytes, {int(largest):,} messages", "",
                             round(v, 3), None, "bench_gateway", f"stored of sent bytes: {detail}"))  # fmt: skip
        diffs = {k: get(x, "record_minus_passthrough_ms.p99") for k, x in record.items() if k.isdigit()}
        v = diffs.get("100")
        rows.append(_row("record mode p99 minus pass-through proxy p99, 100 messages", "<= 1 ms", v,
                         _judge(v, lambda x: x <= 1.0), "bench_gateway",
                         ", ".join(f"{k}: {x:.2f}" for k, x in diffs.items() if x is not None)))  # fmt: skip
        lag = get(record, "chunk_lag") or {}
        transit = lag.get("transit_ms") or {}
        later, earlier = lag.get("rounds_later"), lag.get("rounds_earlier")
        v = p = None
        detail = ""
        if later is not None and earlier is not None and later + earlier:
            v, p = round(later / (later + earlier), 3), sign_test(later, earlier)
            line_p50, share = get(lag, "record_minus_without_logging_ms.p50"), lag.get("record_later_share", 0)
            detail = (
                f"{later} rounds later, {earlier} earlier (one-sided sign test p = {p:.2g}); a line's "
                f"difference at p50 {line_p50 * 1000:+.1f} µs, {share:.0%} of lines later"
            )
        rows.append(_row("streamed lines through record mode vs without logging, rounds later (issue 13)",
                         "not significantly > 1/2 (p >= 0.05)", v, _judge(p, lambda x: x >= 0.05), "bench_gateway",
                         detail))  # fmt: skip
        logged, unlogged = get(transit, "record.p50"), get(transit, "without_logging.p50")
        if logged and unlogged:
            rows.append(_row("streamed chunk transit p50, record mode / the gateway without logging", "",
                             round(logged / unlogged, 3), None, "bench_gateway",
                             f"p50 {logged:.3f} vs {unlogged:.3f} ms, p99 {get(transit, 'record.p99'):.2f} vs "
                             f"{get(transit, 'without_logging.p99'):.2f} ms"))  # fmt: skip
    for where in ("single", "cluster"):
        fleet = get(r, f"bench_fleet.{where}")
        if not fleet or "error" in fleet:
            continue
        ttl = fleet["lease_ttl_s"]
        per = fleet["per_projection"]
        takeovers = {p: x["takeover_s"] for p, x in per.items()}
        v, ok, note = _worst(takeovers, lambda x, t=ttl: x <= 2 * t, per)
        rows.append(_row(f"takeover of a killed replica's partitions ({where})", f"<= {2 * ttl:g} s (2 TTLs)", v, ok,
                         "bench_fleet", note))  # fmt: skip
        recovered = {p: x["recovered_after_takeover_s"] for p, x in per.items()}
        v, ok, note = _worst(recovered, lambda x: x <= 10, per)
        rows.append(_row(f"lag back under its before-kill p99, after the takeover ({where})", "<= 10 s", v, ok,
                         "bench_fleet", note))  # fmt: skip
    for name, path, limit in (
        ("UI fleet overview, first page (median)", "bench_ui.overview.html_first_page.median_ms", 100.0),
        ("UI session page of a 100k-event session (median)", "bench_ui.session.transcript_page.median_ms", 200.0),
    ):
        v = get(r, path)
        rows.append(_row(name, f"< {limit:g} ms", v, _judge(v, lambda x, lim=limit: x < lim), "bench_ui"))
    # figures without a goal, beside the goals because they are the comparison a reader makes
    info = [
        ("agent session vs SQLite committed per flush point", "bench_stores.ratios.agent_over_sqlite_batched"),
        ("agent session vs raw async publish (all in flight)", "bench_stores.ratios.agent_over_raw_async"),
        ("naive array: originals lost at compactions (count)", "bench_stores.naive.originals_lost"),
        ("the log: originals lost (count, read back)", "bench_stores.sessionlog_agent.messages_written"),
        ("naive cost per message, largest / smallest array", "bench_stores.ratios.naive_p50_at_largest_over_smallest"),
        (
            "the log's cost per message, largest / smallest",
            "bench_stores.ratios.sessionlog_p50_at_largest_over_smallest",
        ),
        ("LiteLLM proxy overhead p99 at 100 messages, ms", "bench_gateway.sizes.100.proxies.litellm.overhead_ms.p99"),
    ]
    for name, path in info:
        v = get(r, path)
        if path.endswith("messages_written") and v is not None:
            v = v - (get(r, "bench_stores.sessionlog_agent.messages_readable_after") or 0)
        rows.append(_row(name, "", v, None, path.split(".")[0]))
    for entry in get(r, "bench_stores.concurrent") or []:
        flush = entry["flush"]
        rows.append(_row(f"{entry['sessions']} concurrent sessions, {entry['store']}: events/s", "",
                         entry["events_per_s"], None, "bench_stores",
                         f"flush p50 {flush['p50_ms']:.2f}, p99 {flush['p99_ms']:.2f} ms"))  # fmt: skip
    for where in ("single", "cluster"):
        for p, mib in (get(r, f"bench_fleet.{where}.mib_per_1000_sessions") or {}).items():
            rows.append(_row(f"{p} MiB per 1,000 resident sessions ({where})", "", mib, None, "bench_fleet"))
    return rows


def _worst(values: dict[str, float | None], test: Any, per: dict[str, Any]) -> tuple[float, bool, str]:
    """The worst projection's figure; one never seen within the run counts as the time watched, and not met."""
    unseen = [p for p, x in values.items() if x is None]
    if unseen:
        watched = min(per[p].get("watched_after_kill_s") or 0.0 for p in unseen)
        return watched, False, f"not seen within the {watched:.1f} s watched after the kill: {', '.join(unseen)}"
    worst = max(x for x in values.values() if x is not None)
    return worst, bool(test(worst)), _named(values)


def _named(values: dict[str, float | None]) -> str:
    return ", ".join(f"{name} {'-' if x is None else round(x, 2)}" for name, x in values.items())


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"
    return str(x)


def print_summary(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    before, after = r.get("machine_before", {}), r.get("machine_after", {})
    caption = (
        f"{before.get('cores')} cores, Python {before.get('python')}, nats-server {before.get('nats_server')}; "
        f"load average before {_load(before)}, after {_load(after)}"
    )
    table = Table(title="sessionlog benchmarks: each goal beside its figure", caption=caption)
    for column in ("goal", "target", "figure", "met", "note"):
        table.add_column(column, overflow="fold")
    for row in r.get("goals", []):
        met = {True: "[green]met[/]", False: "[red]NOT MET[/]", None: ""}[row["met"]]
        if row["target"] and row["met"] is None:
            met = "no figure"
        table.add_row(row["goal"], row["target"], _fmt(row["figure"]), met, row["note"])
    Console(width=160).print(table)


def _load(m: dict[str, Any]) -> str:
    load = m.get("load_average") or []
    return "/".join(f"{x:.2f}" for x in load) or "?"


# ---------------------------------------------------------------------------------------------- plots


def plot(r: dict[str, Any], folder: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for draw in (_throughput, _flush, _concurrency, _by_size, _gateway, _rebuild, _fleet_lag, _memory):
        fig = None
        try:
            fig, name = draw(plt, r)
        except (KeyError, TypeError, ValueError, IndexError) as err:  # a benchmark that did not run: no plot
            print(f"bench: plot {draw.__name__[1:]} skipped ({type(err).__name__}: {err})")
            if fig is not None:
                plt.close(fig)
            continue
        path = folder / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


def _bars(ax: Any, labels: list[str], values: list[float], *, log: bool = False, unit: str = "") -> None:
    bars = ax.barh(labels, values, color="#4c72b0")
    for bar, value in zip(bars, values, strict=True):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {_fmt(float(value))}", va="center")
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(unit)
    ax.invert_yaxis()


def _throughput(plt: Any, r: dict[str, Any]) -> tuple[Any, str]:
    s, lg = r["bench_stores"], r["bench_log"]
    items = [
        ("raw publish, sync, 1 event/msg", s["raw_publish"]["sync"]["events_per_s"]),
        ("raw publish, async, 1 event/msg", s["raw_publish"]["async"]["events_per_s"]),
        ("sessionlog: agent session", s["sessionlog_agent"]["events_per_s"]),
        ("sessionlog: chunk streaming", lg["writer_streaming"]["events_per_s"]),
        ("SQLite: commit per event", s["sqlite_per_event"]["events_per_s"]),
        ("SQLite: commit per flush point", s["sqlite_batched"]["events_per_s"]),
        ("naive array (messages/s)", s["naive"]["messages_per_s"]),
    ]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    _bars(ax, [a for a, _ in items], [b for _, b in items], log=True, unit="events/s (log scale)")
    ax.set_title("Appending one session: events/s (same workload, same run)")
    return fig, "append_throughput"


def _flush(plt: Any, r: dict[str, Any]) -> tuple[Any, str]:
    s, lg = r["bench_stores"], r["bench_log"]
    pairs = [
        ("raw sync publish", lg["raw_publish"]),
        ("writer, one event per flush", lg["writer_flush_each"]),
        ("writer, agent flush points", s["sessionlog_agent"]["flush"]),
        ("SQLite commit per event", s["sqlite_per_event"]["commit"]),
        ("SQLite commit per flush point", s["sqlite_batched"]["commit"]),
    ]
    items = [(name, x["p50_ms"], x["p99_ms"]) for name, x in pairs]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    y = range(len(items))
    ax.barh([i - 0.2 for i in y], [b for _, b, _ in items], height=0.4, label="p50")
    ax.barh([i + 0.2 for i in y], [c for _, _, c in items], height=0.4, label="p99")
    ax.set_yticks(list(y), [a for a, _, _ in items])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.legend()
    ax.set_title("Flush (durable write) latency")
    return fig, "flush_latency"


def _concurrency(plt: Any, r: dict[str, Any]) -> tuple[Any, str]:
    entries = r["bench_stores"]["concurrent"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    for store, marker in (("sessionlog", "o"), ("sqlite", "s")):
        mine = [e for e in entries if e["store"] == store]
        xs = [e["sessions"] for e in mine]
        a1.plot(xs, [e["events_per_s"] for e in mine], marker=marker, label=store)
        a2.plot(xs, [e["flush"]["p50_ms"] for e in mine], marker=marker, label=f"{store} p50")
        a2.plot(xs, [e["flush"]["p99_ms"] for e in mine], marker=marker, linestyle="--", label=f"{store} p99")
    for ax in (a1, a2):
        ax.set_xscale("log")
        ax.set_xlabel("concurrent sessions (4 writer processes)")
        ax.legend(fontsize=7)
    a1.set_ylabel("events/s")
    a2.set_ylabel("flush / commit ms")
    a2.set_yscale("log")
    a1.set_title("Throughput")
    a2.set_title("Flush latency")
    return fig, "concurrent_sessions"


def _by_size(plt: Any, r: dict[str, Any]) -> tuple[Any, str]:
    by = r["bench_stores"]["append_cost_by_size"]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for name, marker in (("naive", "s"), ("sessionlog", "o")):
        xs = [e["messages"] for e in by[name]]
        ax.plot(xs, [e["p50_ms"] for e in by[name]], marker=marker, label=f"{name} p50")
        ax.plot(xs, [e["p99_ms"] for e in by[name]], marker=marker, linestyle="--", label=f"{name} p99")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("messages already in the session")
    ax.set_ylabel("ms to add one message durably")
    ax.set_title("One more message: naive array rewrite vs the log")
    ax.legend(fontsize=8)
    return fig, "append_vs_session_size"


def _gateway(plt: Any, r: dict[str, Any]) -> tuple[Any, str]:
    sizes = r["bench_gateway"]["sizes"]
    xs = [int(k) for k in sizes]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    series = [("gateway overhead", "overhead_ms")]
    for name in ("passthrough", "litellm"):
        if all(name in s.get("proxies", {}) for s in sizes.values()):
            series.append((f"{name} overhead", f"proxies.{name}.overhead_ms"))
    for label, path in series:
        for q, style in (("p50", "-"), ("p99", "--")):
            a1.plot(xs, [get(s, f"{path}.{q}") for s in sizes.values()], marker="o", linestyle=style,
                    label=f"{label} {q}")  # fmt: skip
    a1.set_title("Time to first byte over a direct call, ms")
    a1.set_yscale("symlog", linthresh=1.0)  # LiteLLM's hundreds of ms beside the gateway's few; some p99s are < 0
    a2.plot(xs, [s["decode_ms"] for s in sizes.values()], marker="o", label="one msgspec decode of the request")
    a2.plot(xs, [s["check_only_ms"]["p99"] for s in sizes.values()], marker="o", label="gateway check p99")
    a2.plot(xs, [s["check_next_request_ms"]["p99"] for s in sizes.values()], marker="o", label="next request check p99")
    derive = get(r, "bench_projections.derive") or {}
    if derive:
        dx = [int(k) for k in derive]
        a2.plot(dx, [d["page0"]["p99_ms"] for d in derive.values()], marker="s", label="cached derive p99 (page 0)")
    a2.set_title("Work against message count, ms")
    for ax in (a1, a2):
        ax.set_xscale("log")
        ax.set_xlabel("messages in the request")
        ax.legend(fontsize=7)
    a2.set_yscale("log")
    return fig, "gateway_and_derive"


def _rebuild(plt: Any, r: dict[str, Any]) -> tuple[Any, str]:
    rb = r["bench_projections"]["rebuild"]
    items = [("raw read (records only)", rb["raw_read_events_per_s"]),
             ("floor: raw read + decode", rb["floor_raw_read_plus_decode_events_per_s"])]  # fmt: skip
    items += [(f"rebuild: {name}", x["events_per_s"]) for name, x in rb["every_projection"].items()]
    items.append(("SQLite: read back in order", r["bench_stores"]["sqlite_read_100k"]["events_per_s"]))
    items.append(("session read, 100k events", r["bench_log"]["read_100k"]["reader_events_per_s"]))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    _bars(ax, [a for a, _ in items], [b for _, b in items], unit="events/s")
    ax.set_title("Reading and rebuilding from offset 0")
    return fig, "rebuild_and_read"


def _fleet_lag(plt: Any, r: dict[str, Any]) -> tuple[Any, str]:
    fleet = r["bench_fleet"]
    wheres = [w for w in ("single", "cluster") if "timeline" in fleet.get(w, {})]
    fig, axes = plt.subplots(len(wheres), 1, figsize=(9, 3.0 * len(wheres)), squeeze=False)
    for ax, where in zip([a[0] for a in axes], wheres, strict=True):
        f = fleet[where]
        for projection in fleet["projections"]:
            ts = [s["t"] for s in f["timeline"]]
            lag = [max((x for x in s["lag_s"][projection] if x is not None), default=0.0) for s in f["timeline"]]
            ax.plot(ts, lag, label=projection, linewidth=1)
        for name, t in f["events"].items():
            ax.axvline(t, color="red" if name == "kill" else "green", linestyle=":")
            ax.text(t, ax.get_ylim()[1] * 0.9, f" {name}", color="red" if name == "kill" else "green")
        title = "one server" if where == "single" else "3-node cluster, R3"
        ax.set_title(f"Projection lag (oldest unapplied record), {f['sessions']:,} sessions, {title}")
        ax.set_xlabel("s")
        ax.set_ylabel("lag s")
        ax.legend(fontsize=7)
    return fig, "fleet_lag"


def _memory(plt: Any, r: dict[str, Any]) -> tuple[Any, str]:
    fleet = r["bench_fleet"]
    labels, values = [], []
    for where in ("single", "cluster"):
        for p, mib in (get(fleet, f"{where}.mib_per_1000_sessions") or {}).items():
            labels.append(f"{p} ({where})")
            values.append(mib)
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(labels) + 1.2))
    _bars(ax, labels, values, unit="MiB per 1,000 resident sessions (RSS growth / sessions held)")
    ax.set_title("Projection memory per resident session")
    return fig, "memory_per_session"


def markdown(r: dict[str, Any]) -> str:
    """The goals table as Markdown, with the machine and its load, for docs/performance.md."""
    before, after = r.get("machine_before", {}), r.get("machine_after", {})
    lines = [
        f"Run of {before.get('time_utc')}: {before.get('cores')} cores, {before.get('memory_gib')} GiB, "
        f"Python {before.get('python')}, {before.get('nats_server')}; load average (1/5/15 min) before "
        f"{_load(before)}, after {_load(after)}.",
        "",
        "| goal | target | figure | met | detail |",
        "|---|---|---|---|---|",
    ]
    for row in r.get("goals", []):
        met = {True: "met", False: "**not met**", None: ""}[row["met"]]
        lines.append(f"| {row['goal']} | {row['target']} | {_fmt(row['figure'])} | {met} | {row['note']} |")
    return "\n".join(lines) + "\n"
