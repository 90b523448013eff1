"""The transcript tab: a session as the user saw it, entry by entry (`render_entry`, which the script mirrors with
`textContent` for live entries), paged back from the newest."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from sessionlog.transcript import (
    CompactionEntry,
    Entry,
    MessageEntry,
    NoteEntry,
    SeedEntry,
    ShownBlock,
    StreamEntry,
    Transcript,
    TurnEndEntry,
    TurnStartEntry,
    compaction_label,
)

from .frame import SYNTHETIC_TEXT, SessionContext, esc, html_page, session_bottom, session_href, session_top

STREAM_STATE_TEXT: Final = {
    "streaming": "streaming…",
    "finished": "response complete",
    "failed": "response failed",
    "retried": "response failed, retried",
    "cut": "response cut off (no message was written)",
}
OUTCOME_TEXT: Final = {
    "completed": "completed",
    "aborted": "aborted",
    "blocked": "blocked",
    "error": "ended with an error",
    "max-tokens": "stopped at the token limit",
    "interrupted": "interrupted by a crash",
}


# ---------------------------------------------------------------------------------------------- entries


def render_block(block: ShownBlock, index: int | None = None) -> str:
    at = f' data-index="{index}"' if index is not None else ""
    kind = block.type
    if kind == "text":
        return f'<div class="block text"{at}><div class="body">{esc(block.text)}</div></div>'
    if kind == "reasoning":
        return (
            f'<details class="block reasoning"{at}><summary>thinking</summary>'
            f'<div class="body">{esc(block.text)}</div></details>'
        )
    if kind == "tool-call":
        return (
            f'<div class="block tool-call"{at}><div class="tool-head">tool call '
            f'<b class="tool-name">{esc(block.name or "")}</b> <code class="call-id">{esc(block.id or "")}</code></div>'
            f'<pre class="body args">{esc(block.text)}</pre></div>'
        )
    if kind == "tool-result":
        error = " error" if block.is_error else ""
        flag = ' <span class="badge error">error</span>' if block.is_error else ""
        return (
            f'<div class="block tool-result{error}"{at}><div class="tool-head">result of '
            f'<code class="call-id">{esc(block.tool_call_id or "")}</code>{flag}</div>'
            f'<pre class="body">{esc(block.text)}</pre></div>'
        )
    if kind == "image":
        return f'<div class="block image"{at}><div class="body">[image {esc(block.attachment or "?")}]</div></div>'
    return f'<div class="block other"{at}><div class="body">{esc(block.text)}</div></div>'


def _blocks(blocks: Sequence[ShownBlock], *, indexed: bool = False) -> str:
    return "".join(render_block(b, i if indexed else None) for i, b in enumerate(blocks))


def _open(entry: Entry, classes: str, tag: str = "div") -> str:
    return f'<{tag} class="entry {classes}" id="{esc(entry.key)}" data-key="{esc(entry.key)}" data-seq="{entry.seq}">'


def _who(entry: MessageEntry) -> str:
    if entry.event_type == "tool/result":
        return "tool"
    if entry.source == "plugin":
        return f"context from {entry.plugin or 'a plugin'}"
    if entry.role == "assistant" and entry.model:
        return f"assistant · {entry.model}"
    return entry.role


def render_entry(entry: Entry) -> str:
    if isinstance(entry, TurnStartEntry):
        return _open(entry, "turn-start") + f"Turn {entry.turn}</div>"
    if isinstance(entry, TurnEndEntry):
        detail = f' <span class="detail">— {esc(entry.detail)}</span>' if entry.detail else ""
        outcome = OUTCOME_TEXT.get(entry.outcome, entry.outcome)
        head = _open(entry, f"turn-end outcome-{esc(entry.outcome)}")
        return head + f"Turn {entry.turn} {esc(outcome)}{detail}</div>"
    if isinstance(entry, SeedEntry):
        return _open(entry, "seed") + f"inherited history ends here (events 0-{entry.seq - 1} came from before)</div>"
    if isinstance(entry, NoteEntry):
        return _open(entry, "note") + f"{esc(entry.text)}</div>"
    if isinstance(entry, CompactionEntry):
        return (
            _open(entry, "compaction")
            + f'<span class="marker">{esc(compaction_label(entry))}</span>'
            + '<details class="summary"><summary>what the model sees instead</summary>'
            + f"{_blocks(entry.summary)}</details>"
            + "</div>"
        )
    if isinstance(entry, StreamEntry):
        state = STREAM_STATE_TEXT.get(entry.state, entry.state)
        error = f' <span class="error-text">{esc(entry.error)}</span>' if entry.error else ""
        return (
            _open(entry, f"msg role-assistant stream state-{esc(entry.state)}", "article")
            + f'<div class="meta"><span class="who">assistant</span> <span class="state">{esc(state)}</span>{error}'
            + f'<span class="seq">#{entry.seq}</span></div>'
            + f'<div class="blocks">{_blocks(entry.blocks, indexed=True)}</div></article>'
        )
    badges = ""
    if entry.interrupted:
        badges += ' <span class="badge interrupted">interrupted: partial response</span>'
    if entry.synthetic:
        badges += f' <span class="badge synthetic">{esc(SYNTHETIC_TEXT.get(entry.synthetic, entry.synthetic))}</span>'
    elif entry.error:
        badges += f' <span class="badge error">{esc(entry.error)}</span>'
    classes = f"msg role-{esc(entry.role)} src-{esc(entry.source)}" + (" synthetic" if entry.synthetic else "")
    seq = f'<span class="seq">#{entry.seq}</span>'
    meta = f'<div class="meta"><span class="who">{esc(_who(entry))}</span>{badges}{seq}</div>'
    body = f'<div class="blocks">{_blocks(entry.blocks)}</div>'
    if entry.source == "plugin":
        body = f"<details><summary>show</summary>{body}</details>"
    return _open(entry, classes, "article") + meta + body + "</article>"


PAGE_ENTRIES: Final = 400  # transcript entries on one page of the timeline


def render_transcript_page(
    transcript: Transcript, ctx: SessionContext, *, live: bool = True, before: int | None = None
) -> str:
    sid = transcript.session
    title = transcript.title or sid
    fork = ""
    if transcript.fork is not None:
        seed = (
            f" at event {transcript.fork.seed_length - 1} (the first {transcript.fork.seed_length} events are "
            "inherited)"
            if transcript.fork.seed_length
            else ""
        )
        parent = transcript.fork.parent
        fork = (
            f'<div class="banner fork">forked from <a class="parent" href="{session_href(parent)}">{esc(parent)}</a>'
            f"{seed}</div>"
        )
    parts = [session_top(ctx, fork_banner=fork)]
    if ctx.at is not None:
        parts.append(
            f'<div class="banner replay">replay up to event {ctx.at} · <a href="{session_href(sid)}">latest</a></div>'
        )
    entries = transcript.entries
    if before is not None:
        entries = tuple(e for e in entries if e.seq < before)
    shown = entries[-PAGE_ENTRIES:]
    if len(shown) < len(entries):
        parts.append(
            f'<div class="pager"><a class="earlier" href="{session_href(sid)}?before={shown[0].seq}">'
            f"← earlier ({len(entries) - len(shown):,} entries)</a>"
            f'<span class="muted">showing entries from event {shown[0].seq}</span></div>'
        )
    if before is not None:
        parts.append(f'<div class="pager"><a href="{session_href(sid)}">latest →</a></div>')
    parts.append('<main id="transcript">')
    parts.extend(render_entry(e) for e in shown)
    parts.append("</main>")
    parts.append(session_bottom(ctx))
    attrs = f' data-session="{esc(sid)}" data-next-seq="{transcript.next_seq}" data-live="{"1" if live else "0"}"'
    return html_page(title, "".join(parts), body_attrs=attrs, wide=True)
