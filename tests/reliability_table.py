"""The figures of the reliability suite as the table of docs/reliability.md.

    python tests/reliability_table.py [--figures FILE] [--mode full|default] [--write docs/reliability.md]

Reads the JSON lines the suite's tests append (tests/reliability.py, `record_figures`), keeps the latest line of each
test in the given mode, and prints a Markdown table; with `--write`, replaces the table between the
`reliability-figures` markers of that file (under `## The suite`) and leaves the rest of the page as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability import figures_path

START = "<!-- reliability-figures:start -->"
END = "<!-- reliability-figures:end -->"
MAIN = ("events_written", "faults_injected", "events_lost", "worst_recovery_s")
SKIP = {"test", "mode", "at", "fault", *MAIN}


def latest(lines: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """The last line of each test in `mode`, in the order the tests first appear."""
    out: dict[str, dict[str, Any]] = {}
    for line in lines:
        if line.get("mode") == mode:
            out[line["test"]] = line
    return list(out.values())


def cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, dict):
        return ", ".join(f"{k} {cell(v)}" for k, v in value.items())
    return str(value).replace("|", "\\|")


def table(rows: list[dict[str, Any]], mode: str) -> str:
    if not rows:
        return f"(no figures of a `{mode}` run yet)\n"
    head = "| test | fault | events written | faults injected | events lost | worst time to recover (s) | more |\n"
    head += "|---|---|---|---|---|---|---|\n"
    body = ""
    for row in rows:
        more = "; ".join(f"{k.replace('_', ' ')}: {cell(v)}" for k, v in row.items() if k not in SKIP)
        main = " | ".join(cell(row.get(k)) for k in MAIN)
        body += f"| {cell(row['test'])} | {cell(row.get('fault'))} | {main} | {more} |\n"
    stamp = max(row["at"] for row in rows)
    return f"Figures of a `{mode}` run, {len(rows)} tests, last written {stamp}:\n\n" + head + body


def write(page: Path, text: str) -> None:
    content = page.read_text(encoding="utf-8")
    if START not in content or END not in content:
        raise SystemExit(f"{page}: no {START} ... {END} markers to put the table between")
    before, rest = content.split(START, 1)
    _, after = rest.split(END, 1)
    page.write_text(f"{before}{START}\n{text}{END}{after}", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--figures", type=Path, default=figures_path())
    parser.add_argument("--mode", default="full", choices=["full", "default"])
    parser.add_argument("--write", type=Path, default=None)
    args = parser.parse_args()
    lines = [json.loads(x) for x in args.figures.read_text(encoding="utf-8").splitlines() if x.strip()]
    text = table(latest(lines, args.mode), args.mode)
    if args.write is None:
        sys.stdout.write(text)
    else:
        write(args.write, text)


if __name__ == "__main__":
    main()
