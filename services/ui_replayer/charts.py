"""Inline SVG charts rendered on the server: bars (stacked series), lines with markers, and the session's timeline
strip. Every label is escaped; numbers are formatted here, so a chart is a pure function of its series. Each chart
on a page sits beside a table (or a JSON endpoint) holding the same numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import Final, NamedTuple

PALETTE: Final = ("#2f6fde", "#e0892b", "#2aa876", "#c0417c", "#7a5cd6", "#8a8f98", "#d1b02b", "#2bb0c8")
W: Final = 720  # a chart's viewBox (it scales to the page's width)
H: Final = 180


class _Plot(NamedTuple):
    """Where the data is drawn inside the viewBox; the margins around it hold the ticks and labels."""

    left: int
    top: int
    right: int
    bottom: int

    @property
    def width(self) -> int:
        return self.right - self.left

    @property
    def height(self) -> int:
        return self.bottom - self.top


PLOT: Final = _Plot(left=52, top=12, right=W - 12, bottom=H - 28)
MAX_BARS: Final = 160
MAX_TICKS: Final = 400


def _e(text: object) -> str:
    return escape(str(text), quote=True)


def compact(value: float) -> str:
    """12345 -> 12.3k; small values as they are."""
    if abs(value) >= 1_000_000:
        return f"{value / 1_000_000:.1f}M"
    if abs(value) >= 10_000:
        return f"{value / 1000:.0f}k"
    if abs(value) >= 1000:
        return f"{value / 1000:.1f}k"
    if value != int(value):
        return f"{value:.3g}" if abs(value) >= 1 else (f"{value:.6f}".rstrip("0") or "0")
    return str(int(value))


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    magnitude = 10.0 ** math.floor(math.log10(value))
    for step in (1.0, 2.0, 2.5, 5.0, 10.0):
        if value <= step * magnitude:
            return step * magnitude
    return float(value)


def _frame(title: str, top: float, body: str, legend: Sequence[tuple[str, str]], css: str) -> str:
    """Axes, grid and legend around a chart body; legend swatches are CSS classes (the CSP forbids inline
    styles), `c0`..`c7` in palette order."""
    grid = []
    for i in range(5):
        y = PLOT.top + PLOT.height * i / 4
        value = top * (4 - i) / 4
        grid.append(
            f'<line x1="{PLOT.left}" y1="{y:.1f}" x2="{PLOT.right}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{PLOT.left - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{_e(compact(value))}</text>'
        )
    keys = "".join(f'<span class="key"><i class="sw {swatch}"></i>{_e(name)}</span>' for name, swatch in legend)
    return (
        f'<figure class="chart {css}"><figcaption>{_e(title)}<span class="legend">{keys}</span></figcaption>'
        f'<svg viewBox="0 0 {W} {H}" width="100%" role="img" aria-label="{_e(title)}" preserveAspectRatio="none">'
        f"{''.join(grid)}{body}</svg></figure>"
    )


def bar_chart(
    title: str, labels: Sequence[str], series: Sequence[tuple[str, Sequence[float]]], *, css: str = ""
) -> str:
    """Stacked bars, one per label; `series` is (name, values) with one value per label. More than `MAX_BARS`
    labels are summed in runs of consecutive labels (a bar then reads "first–last")."""
    if len(labels) > MAX_BARS:
        size = -(-len(labels) // MAX_BARS)
        runs = range(0, len(labels), size)
        labels = [f"{labels[i]}–{labels[min(i + size, len(labels)) - 1]}" for i in runs]
        series = [(name, [sum(values[i : i + size]) for i in runs]) for name, values in series]
    n = max(1, len(labels))
    totals = [sum(values[i] for _, values in series) for i in range(len(labels))]
    top = _nice_max(max(totals, default=0))
    slot = PLOT.width / n
    bar = max(1.0, min(28.0, slot * 0.7))
    parts = []
    label_every = max(1, n // 12)
    for i, label in enumerate(labels):
        x = PLOT.left + slot * i + (slot - bar) / 2
        base: float = PLOT.bottom
        tip = []
        for k, (name, values) in enumerate(series):
            h = PLOT.height * values[i] / top
            base -= h
            tip.append(f"{name} {compact(values[i])}")
            parts.append(
                f'<rect x="{x:.1f}" y="{base:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                f'fill="{PALETTE[k % len(PALETTE)]}"><title>{_e(label)}: {_e(", ".join(tip))}</title></rect>'
            )
        if i % label_every == 0:
            parts.append(
                f'<text x="{x + bar / 2:.1f}" y="{H - 10}" class="tick" text-anchor="middle">{_e(label)}</text>'
            )
    legend = [(name, f"c{k % len(PALETTE)}") for k, (name, _) in enumerate(series)]
    return _frame(title, top, "".join(parts), legend, css)


def line_chart(
    title: str,
    xs: Sequence[float],
    series: Sequence[tuple[str, Sequence[float | None]]],
    *,
    marks: Sequence[tuple[float, str]] = (),
    x_label: str = "seq",
    css: str = "",
) -> str:
    """Lines over a numeric x axis (a point per x; None leaves a gap), with vertical marks (x, label) such as
    compactions."""
    values = [v for _, ys in series for v in ys if v is not None]
    top = _nice_max(max(values, default=0))
    lo = min(xs, default=0)
    hi = max(xs, default=1)
    span = (hi - lo) or 1

    def px(x: float) -> float:
        return PLOT.left + PLOT.width * (x - lo) / span

    def py(y: float) -> float:
        return PLOT.top + PLOT.height * (1 - y / top)

    parts = []
    for x, label in marks:
        parts.append(
            f'<line x1="{px(x):.1f}" y1="{PLOT.top}" x2="{px(x):.1f}" y2="{PLOT.bottom}" class="mark">'
            f"<title>{_e(label)}</title></line>"
        )
    for k, (name, ys) in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        path: list[str] = []
        pen = "M"
        for x, y in zip(xs, ys, strict=True):
            if y is None:
                pen = "M"
                continue
            path.append(f"{pen}{px(x):.1f},{py(y):.1f}")
            pen = "L"
        if path:
            parts.append(f'<path d="{" ".join(path)}" fill="none" stroke="{color}" stroke-width="2"/>')
        if len(xs) <= 200:
            for x, y in zip(xs, ys, strict=True):
                if y is not None:
                    parts.append(
                        f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}">'
                        f"<title>{_e(name)} at {_e(x_label)} {_e(compact(x))}: {_e(compact(y))}</title></circle>"
                    )
    parts.append(f'<text x="{PLOT.right}" y="{H - 8}" class="tick" text-anchor="end">{_e(x_label)}</text>')
    parts.append(f'<text x="{PLOT.left}" y="{H - 8}" class="tick">{_e(compact(lo))}</text>')
    parts.append(f'<text x="{PLOT.right - 30}" y="{H - 8}" class="tick" text-anchor="end">{_e(compact(hi))}</text>')
    legend = [(name, f"c{k % len(PALETTE)}") for k, (name, _) in enumerate(series)]
    if marks:
        legend.append(("compaction", "cm"))
    return _frame(title, top, "".join(parts), legend, css)


def timeline_strip(
    length: int,
    requests: Sequence[tuple[int, str, str]],
    compactions: Sequence[tuple[int, str]],
    *,
    headers: Sequence[tuple[int, str, str]] = (),
    current: int | None = None,
) -> str:
    """The session's seq axis: a tick per request (at, label, link; at most `MAX_TICKS`, evenly picked) and a mark
    per compaction (seq, label); the request the page shows is highlighted."""
    width = 1000
    height = 40
    span = max(1, length - 1)

    def px(seq: int) -> float:
        return 8 + (width - 16) * seq / span

    parts = [f'<line x1="8" y1="20" x2="{width - 8}" y2="20" class="axis"/>']
    for seq, label in compactions:
        parts.append(
            f'<rect x="{px(seq) - 2:.1f}" y="6" width="4" height="24" class="compaction-mark">'
            f"<title>{_e(label)}</title></rect>"
        )
    for seq, label, href in headers[:MAX_TICKS]:
        x = px(seq)
        parts.append(
            f'<a href="{_e(href)}"><path d="M{x:.1f},27 l4,5 l-4,5 l-4,-5 z" class="hdr"><title>{_e(label)}</title>'
            "</path></a>"
        )
    step = max(1, -(-len(requests) // MAX_TICKS))  # a long session: every k-th request, and the current one
    for index, (at, label, href) in enumerate(requests):
        if index % step and at != current:
            continue
        cls = "req current" if at == current else "req"
        parts.append(
            f'<a href="{_e(href)}"><circle cx="{px(at):.1f}" cy="20" r="{6 if at == current else 4}" class="{cls}">'
            f"<title>{_e(label)}</title></circle></a>"
        )
    return (
        f'<svg class="timeline" viewBox="0 0 {width} {height}" width="100%" height="{height}" '
        f'preserveAspectRatio="none" role="img" aria-label="timeline: requests and compactions">'
        f"{''.join(parts)}</svg>"
    )
