"""The JetStream layout of sessionlog, and the one step that creates or verifies it.

This module owns the stream side of the wire format (`sessionlog.in.*` in, stored as `sessionlog.events.<p>.<id>`
by a subject transform; `sessionlog.raw.>`), the partition function, and the exact stream configurations of
the event stream, the raw audit stream, the three KV buckets and the object store. `provision(js, settings)`
creates what is missing and verifies what exists; an existing stream that differs in a field that matters is
reported with `StreamMismatch` listing every difference, and nothing is changed: JetStream would accept some of
those updates (even a new partition count, which silently re-homes new sessions), so the only safe default is
to refuse.

Configurations are sent as raw JSON to `$JS.API.STREAM.CREATE.<name>`, through the JetStream context's connection
and API prefix (so a JetStream domain is honoured). The same dicts are what the server echoes back, which keeps
the comparison exact, and they can be dumped for `nats stream add --config` in deploy files.

Decisions (2026-12):
- Subjects are fixed, not a setting: stream subjects may not overlap within an account, so one account holds one
  log (tenants are accounts). Tests that need a fresh layout start their own server.
- Subjects are `sessionlog.in.*`, not `sessionlog.in.>`: a stream subject transform only rewrites subjects that
  match its source, so with `>` a multi-token subject like `sessionlog.in.a.b` is stored untransformed, outside
  every partition. With `*` such a publish finds no stream and fails. Publishing straight to
  `sessionlog.events.<p>.<id>` also finds no stream, so a writer cannot pick its own partition.
- `deny_delete` is always on. `deny_purge` follows `allow_purge` (default off): it blocks every purge API call,
  filtered ones too, so the admin erasure `sessionlog purge ID` needs streams created with `allow_purge`. JetStream
  lets an update turn `deny_purge` on but never off, so this is decided when the stream is created; turning it on
  later is an operator's `nats stream edit`. A KV bucket or object store cannot deny purge: roll-ups (KV purge,
  object metadata) need the purge permission.
- The headers bucket is write-once (2026-12-03): `discard_new_per_subject` with one message per key, and no
  roll-ups, so no writer can overwrite, delete or purge another session's header (a writer role must be able to put
  headers, and NATS permissions cannot tell a put from a delete or purge marker). `sessionlog purge` erases a header
  with a filtered purge of the bucket's stream. An older bucket is reported as a mismatch (`nats stream edit` fixes
  it: docs/operations.md).
- Leases: per-message TTL (`allow_msg_ttl`) plus subject delete markers, so a lease that expires leaves a marker
  (`Nats-Marker-Reason: MaxAge`) that watchers see and a takeover can name as the expected last sequence.
  Markers live LEASE_MARKER_TTL_S and then vanish; an empty subject is as free as a marker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from sessionlog.errors import (
    JS_STREAM_NAME_IN_USE,
    JS_STREAM_NOT_FOUND,
    LogUnavailable,
    ProvisionFailed,
    StreamMismatch,
)
from sessionlog.settings import Settings

NANOS = 1_000_000_000

# The stream's side of the wire format; record.py holds the writers' and readers' side (`in_subject`,
# `events_filter`, `partition_filter`), and a test publishes and reads through those against this config.
EVENTS_IN = "sessionlog.in.*"
EVENTS = "sessionlog.events"
RAW_ALL = "sessionlog.raw.>"

# How long a subject delete marker in the lease bucket stays visible. Long enough for a watcher that reconnects
# to still see it; short so that a bucket of finished sessions empties itself. At least 1 s (server minimum).
LEASE_MARKER_TTL_S = 60

# JetStream API error codes this module acts on.


@dataclass(frozen=True)
class FieldDifference:
    """One field of an existing stream that is not what the settings call for."""

    field: str
    expected: Any
    actual: Any

    def __str__(self) -> str:
        return f"{self.field}: expected {self.expected!r}, found {self.actual!r}"


@dataclass(frozen=True)
class ProvisionReport:
    """What `provision` did: each resource named like "stream SESSIONLOG" or "kv sessionlog-leases"."""

    created: list[str] = field(default_factory=list)
    verified: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # only when called with create=False

    def __str__(self) -> str:
        parts = [f"created: {', '.join(self.created) or '-'}", f"verified: {', '.join(self.verified) or '-'}"]
        if self.missing:
            parts.append(f"missing: {', '.join(self.missing)}")
        return "; ".join(parts)


# --- subjects and partitions ---------------------------------------------------------------------------------


def partition_of(session_id: str, partition_count: int) -> int:
    """The partition the server's `partition(N,1)` mapping puts a session in: FNV-1a 32 of the token, mod N.

    Lets a reader compute the stored subject without a lookup; a test checks it against a real server.
    """
    h = 0x811C9DC5
    for byte in session_id.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h % partition_count


def stored_subject(session_id: str, partition_count: int) -> str:
    """The subject a record of the session is stored under (`sessionlog.events.<p>.<id>`)."""
    return f"{EVENTS}.{partition_of(session_id, partition_count)}.{session_id}"


def partition_transform(partition_count: int) -> dict[str, str]:
    """The stream subject transform that stores `sessionlog.in.<id>` under its partition."""
    return {"src": EVENTS_IN, "dest": f"{EVENTS}.{{{{partition({partition_count},1)}}}}.{{{{wildcard(1)}}}}"}


def _partition_count_of(transform: Any) -> int | None:
    if not isinstance(transform, dict):
        return None
    m = re.search(r"\{\{\s*partition\(\s*(\d+)\s*,", str(transform.get("dest", "")), re.IGNORECASE)
    return int(m.group(1)) if m else None


# --- configurations ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resource:
    """One stream to provision: its kind and display name, the config to create, the fields to verify."""

    kind: str  # "stream", "kv" or "object store"
    name: str  # the stream name, or the bucket name for kv / object store
    stream: str
    config: dict[str, Any]
    checked: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.kind} {self.name}"


# Values the server leaves out of a config (or defaults) that must compare equal to our explicit ones.
_ABSENT_MEANS: dict[str, Any] = {
    "subject_transform": None,
    "subject_delete_marker_ttl": 0,
    "mirror": None,
    "deny_delete": False,
    "deny_purge": False,
    "allow_direct": False,
    "allow_rollup_hdrs": False,
    "allow_msg_ttl": False,
    "sealed": False,
    "max_age": 0,
    "max_msgs_per_subject": -1,
    "num_replicas": 1,
    "retention": "limits",
    "discard": "old",
}


def _limits(settings: Settings) -> dict[str, Any]:
    # Unlimited by default: capacity is an operator's decision (max_bytes plus discard new refuses writes
    # rather than dropping history); provisioning does not check these, so an operator may set them.
    return {
        "retention": "limits",
        "max_consumers": -1,
        "max_msgs": -1,
        "max_bytes": -1,
        "max_age": 0,
        "max_msg_size": -1,
        "storage": settings.storage,
        "num_replicas": settings.replicas,
    }


def event_stream_config(settings: Settings) -> dict[str, Any]:
    """The SESSIONLOG stream: one subject per session, partitioned by a stored-subject transform."""
    return {
        "name": settings.stream,
        "description": "sessionlog events: one record (a batch of one session's events) per message",
        "subjects": [EVENTS_IN],
        "subject_transform": partition_transform(settings.partition_count),
        **_limits(settings),
        "max_msgs_per_subject": -1,
        "discard": "new",
        "duplicate_window": int(settings.duplicate_window_s * NANOS),
        "deny_delete": True,
        "deny_purge": not settings.allow_purge,
        "allow_rollup_hdrs": False,  # a roll-up would let one publish erase a session's history
        "allow_direct": True,
        "allow_msg_ttl": False,  # the log only grows: no event may carry its own expiry
    }


_EVENT_CHECKED = (
    "subjects",
    "subject_transform",
    "storage",
    "num_replicas",
    "retention",
    "discard",
    "max_age",
    "max_msgs_per_subject",
    "duplicate_window",
    "deny_delete",
    "deny_purge",
    "allow_rollup_hdrs",
    "allow_direct",
    "allow_msg_ttl",
    "sealed",
    "mirror",
)


def raw_stream_config(settings: Settings) -> dict[str, Any]:
    """The SESSIONLOG_RAW audit stream: exact gateway request bytes and provider responses, per session."""
    return {
        "name": settings.raw_stream,
        "description": "sessionlog raw audit: gateway request bytes and raw provider responses",
        "subjects": [RAW_ALL],
        **_limits(settings),
        "max_msgs_per_subject": -1,
        "discard": "new",
        "duplicate_window": int(settings.duplicate_window_s * NANOS),
        "deny_delete": True,
        "deny_purge": not settings.allow_purge,  # erasure of a session covers its raw bytes too
        "allow_rollup_hdrs": False,
        "allow_direct": True,
        "allow_msg_ttl": False,
    }


_RAW_CHECKED = (
    "subjects",
    "storage",
    "num_replicas",
    "retention",
    "discard",
    "max_age",
    "deny_delete",
    "deny_purge",
    "allow_rollup_hdrs",
    "sealed",
    "mirror",
)


def kv_stream_config(settings: Settings, bucket: str, *, history: int = 1, ttl_markers: bool = False) -> dict[str, Any]:
    """The stream behind a KV bucket, laid out as every NATS client expects (`KV_<bucket>`, `$KV.<bucket>.>`)."""
    config: dict[str, Any] = {
        "name": f"KV_{bucket}",
        "subjects": [f"$KV.{bucket}.>"],
        **_limits(settings),
        "max_msgs_per_subject": history,
        "discard": "new",
        "duplicate_window": 120 * NANOS,
        "deny_delete": True,
        "deny_purge": False,
        "allow_rollup_hdrs": True,
        "allow_direct": True,
        "allow_msg_ttl": ttl_markers,
    }
    if ttl_markers:
        config["subject_delete_marker_ttl"] = LEASE_MARKER_TTL_S * NANOS
    return config


_KV_CHECKED = ("subjects", "storage", "num_replicas", "max_msgs_per_subject", "max_age", "sealed", "mirror")
_LEASE_CHECKED = (*_KV_CHECKED, "allow_msg_ttl", "subject_delete_marker_ttl")
_WRITE_ONCE_FIELDS = ("discard_new_per_subject", "allow_rollup_hdrs")
_HEADERS_CHECKED = (*_KV_CHECKED, "discard", *_WRITE_ONCE_FIELDS)


def headers_stream_config(settings: Settings) -> dict[str, Any]:
    """The session headers bucket: write-once keys. A writer must put headers, and a put, a delete marker and a
    purge marker all publish to `$KV.<bucket>.<id>`, which permissions cannot tell apart; so the stream refuses a
    second message on a key (`discard_new_per_subject`) and every roll-up. Erasure purges the stream (admin)."""
    return {
        **kv_stream_config(settings, settings.kv_sessions),
        "discard_new_per_subject": True,
        "allow_rollup_hdrs": False,
    }


def object_store_stream_config(settings: Settings, bucket: str) -> dict[str, Any]:
    """The stream behind an object store (`OBJ_<bucket>`, chunk and metadata subjects), as clients expect."""
    return {
        "name": f"OBJ_{bucket}",
        "subjects": [f"$O.{bucket}.C.>", f"$O.{bucket}.M.>"],
        **_limits(settings),
        "discard": "new",
        "allow_rollup_hdrs": True,
        "allow_direct": True,
    }


_OBJ_CHECKED = ("subjects", "storage", "num_replicas", "max_age", "allow_rollup_hdrs", "sealed", "mirror")


def resources(settings: Settings) -> list[Resource]:
    """Everything `provision` creates or verifies, in creation order."""
    return [
        Resource("stream", settings.stream, settings.stream, event_stream_config(settings), _EVENT_CHECKED),
        Resource("stream", settings.raw_stream, settings.raw_stream, raw_stream_config(settings), _RAW_CHECKED),
        Resource(
            "kv",
            settings.kv_sessions,
            f"KV_{settings.kv_sessions}",
            headers_stream_config(settings),
            _HEADERS_CHECKED,
        ),
        Resource(
            "kv",
            settings.kv_leases,
            f"KV_{settings.kv_leases}",
            kv_stream_config(settings, settings.kv_leases, ttl_markers=True),
            _LEASE_CHECKED,
        ),
        Resource(
            "kv",
            settings.kv_checkpoints,
            f"KV_{settings.kv_checkpoints}",
            kv_stream_config(settings, settings.kv_checkpoints),
            _KV_CHECKED,
        ),
        Resource(
            "object store",
            settings.object_store,
            f"OBJ_{settings.object_store}",
            object_store_stream_config(settings, settings.object_store),
            _OBJ_CHECKED,
        ),
    ]


def _normalized(name: str, value: Any) -> Any:
    if value is None and name in _ABSENT_MEANS:
        value = _ABSENT_MEANS[name]
    if name == "subjects" and isinstance(value, list):
        return sorted(value)
    if name == "subject_transform" and isinstance(value, dict) and not value.get("src") and not value.get("dest"):
        return None
    return value


def compare_config(resource: Resource, actual: dict[str, Any]) -> list[FieldDifference]:
    """Every checked field where the existing stream's config differs from the resource's."""
    differences: list[FieldDifference] = []
    for name in resource.checked:
        expected = _normalized(name, resource.config.get(name))
        found = _normalized(name, actual.get(name))
        if expected != found:
            differences.append(FieldDifference(name, expected, found))
            if name == "subject_transform":
                want, have = _partition_count_of(expected), _partition_count_of(found)
                if want != have:
                    differences.append(FieldDifference("partition_count", want, have))
    return differences


def mismatch_error(mismatches: dict[str, list[FieldDifference]]) -> StreamMismatch:
    lines = [
        f"{label} exists with a different configuration: " + "; ".join(str(d) for d in diffs)
        for label, diffs in mismatches.items()
    ]
    advice = (
        "Provisioning changed nothing. Make the settings match the existing streams, or migrate: a new "
        "partition count, storage or replica layout means a new stream sourced from the old one."
    )
    if any(d.field in _WRITE_ONCE_FIELDS for diffs in mismatches.values() for d in diffs):
        advice += (
            " A session headers bucket from before write-once headers takes discard_new_per_subject=true and "
            "allow_rollup_hdrs=false as an update in place (docs/operations.md, 'Write-once session headers')."
        )
    return StreamMismatch(" | ".join(lines) + ". " + advice, differences=mismatches)


# --- the JetStream API ---------------------------------------------------------------------------------------


async def _api(js: JetStreamContext, operation: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
    """One JetStream API request (`$JS.API.<operation>`) answered as a dict; the `error` key is left in."""
    # nats-py keeps the connection and the API prefix (which honours a JetStream domain) on the context.
    prefix: str = js._prefix
    nc = js._nc
    payload = json.dumps(body).encode() if body is not None else b""
    try:
        msg = await nc.request(f"{prefix}.{operation}", payload, timeout=timeout)
    except nats.errors.NoRespondersError as exc:
        raise LogUnavailable(f"JetStream did not answer {operation}: no responders (is JetStream enabled?)") from exc
    except nats.errors.TimeoutError as exc:
        raise LogUnavailable(f"JetStream did not answer {operation} within {timeout}s") from exc
    answer = json.loads(msg.data)
    if not isinstance(answer, dict):
        raise ProvisionFailed(f"JetStream answered {operation} with {answer!r}")
    error = answer.get("error")
    if isinstance(error, dict) and error.get("code") == 503:  # no leader or no quorum yet: not a refusal
        raise LogUnavailable(f"JetStream answered {operation} with 503: {error.get('description')}")
    return answer


async def stream_config(js: JetStreamContext, stream: str, timeout: float = 5.0) -> dict[str, Any] | None:
    """The existing stream's config as the server reports it, or None when there is no such stream."""
    answer = await _api(js, f"STREAM.INFO.{stream}", None, timeout)
    error = answer.get("error")
    if error:
        if error.get("err_code") == JS_STREAM_NOT_FOUND:
            return None
        raise ProvisionFailed(f"stream info of {stream}: {error.get('description')} (err_code {error.get('err_code')})")
    config = answer.get("config")
    return config if isinstance(config, dict) else {}


async def provision(js: JetStreamContext, settings: Settings, *, create: bool = True) -> ProvisionReport:
    """Create what is missing and verify what exists; refuse (StreamMismatch) before creating anything.

    Idempotent: a second run verifies everything and creates nothing. With `create=False` it only verifies and
    lists what is missing (a service that must not provision can check the layout at start).
    """
    timeout = settings.request_timeout_s
    wanted = resources(settings)
    existing: dict[str, dict[str, Any] | None] = {}
    mismatches: dict[str, list[FieldDifference]] = {}
    # Plan first, then commit: a mismatch anywhere leaves every stream as it was.
    for resource in wanted:
        actual = await stream_config(js, resource.stream, timeout)
        existing[resource.stream] = actual
        if actual is not None:
            diffs = compare_config(resource, actual)
            if diffs:
                mismatches[resource.label] = diffs
    if mismatches:
        raise mismatch_error(mismatches)

    report = ProvisionReport()
    for resource in wanted:
        if existing[resource.stream] is not None:
            report.verified.append(resource.label)
            continue
        if not create:
            report.missing.append(resource.label)
            continue
        answer = await _api(js, f"STREAM.CREATE.{resource.stream}", resource.config, timeout)
        error = answer.get("error")
        if not error:
            report.created.append(resource.label)
            continue
        if error.get("err_code") == JS_STREAM_NAME_IN_USE:
            # Another provisioner created it in between, with a different config (an identical one succeeds).
            actual = await stream_config(js, resource.stream, timeout)
            diffs = compare_config(resource, actual or {})
            if diffs:
                raise mismatch_error({resource.label: diffs})
            report.verified.append(resource.label)
            continue
        raise ProvisionFailed(
            f"creating {resource.label} failed: {error.get('description')} (err_code {error.get('err_code')})"
        )
    return report


async def wait_until_served(nc: Client, js: JetStreamContext, settings: Settings, timeout: float = 30.0) -> None:
    """Until every stream and bucket of the layout has a leader that answers (direct gets too, where allowed).

    On a cluster, provisioning returns when the replicated streams exist, not when each has elected a leader and
    answers direct gets; a write or read in between fails with no responders. Raises LogUnavailable after
    `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    for resource in resources(settings):
        while True:
            with contextlib.suppress(Exception):
                info = await js.stream_info(resource.stream)
                if info.cluster is None or info.cluster.leader:
                    if not resource.config.get("allow_direct"):
                        break
                    # Any answer (a message or a 404 status) shows a direct get responder; none raises.
                    await nc.request(f"$JS.API.DIRECT.GET.{resource.stream}", b'{"seq":1}', timeout=1.0)
                    break
            if time.monotonic() > deadline:
                raise LogUnavailable(f"{resource.label} has no leader answering after {timeout}s")
            await asyncio.sleep(0.05)
