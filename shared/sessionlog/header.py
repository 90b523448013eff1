"""The session header (SPEC section 9): the one shape every header is read as and built through.

A header is the first line of a JSONL file and the value of the session's key in the headers bucket. Reading
validates it into `SessionHeader` (unknown keys are kept in the original bytes, never dropped from them);
building one (a new session, a fork's child, an import under another id) goes through `SessionHeader` too, so
the key order of SPEC section 9 and the rules about `origin` and `delegationDepth` are written once.

Decisions:
- `delegationDepth` is always written (dsh writes it); every other optional key only when it holds a value.
- `origin`, `agentPreset` and `tenant` decode as any JSON: files and logs keep whatever a header holds.
- `tenant` (2026-12-03) is the gateway's record mode's owner of a session; written after SPEC's keys.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from .errors import EventTooDeep, InvalidEvent, UnsupportedVersion

NonNegInt = Annotated[int, Meta(ge=0)]

SUPPORTED_VERSION: Final = 0


class SessionHeader(Struct, frozen=True, kw_only=True, rename="camel", tag="session", tag_field="type"):
    """The header line. `type` is the tag ("session"), so it is checked on decode and always encoded; fields
    left UNSET are not written, `delegationDepth` always is (in the key order of SPEC section 9)."""

    version: int
    id: str
    created_at: int
    cwd: str | UnsetType = UNSET
    parent_session: str | UnsetType = UNSET
    seed_length: NonNegInt | UnsetType = UNSET
    origin: Any = UNSET
    delegation_depth: NonNegInt = 0
    agent_preset: Any = UNSET
    tenant: Any = UNSET

    @property
    def type(self) -> str:
        return "session"

    @classmethod
    def new(
        cls,
        session_id: str,
        *,
        created_at: int,
        cwd: str | None = None,
        origin: str | None = None,
        delegation_depth: int = 0,
        tenant: str | None = None,
    ) -> SessionHeader:
        """A new session's header. `origin` is absent or "subagent", the only value dsh reads (any other makes dsh
        refuse the whole file)."""
        if origin is not None and origin != "subagent":
            raise InvalidEvent(f'session header origin must be "subagent" or absent, got {origin!r}')
        return cls(
            version=SUPPORTED_VERSION,
            id=session_id,
            created_at=created_at,
            cwd=UNSET if cwd is None else cwd,
            origin=UNSET if origin is None else origin,
            delegation_depth=delegation_depth,
            tenant=UNSET if tenant is None else tenant,
        )

    def child(self, child_id: str, *, seed_length: int, created_at: int) -> SessionHeader:
        """A fork's child: lineage from this parent (`id`, `cwd`) and the seed length, as dsh's own fork writes it.
        No `origin` (dsh reads only "subagent" there and refuses the file otherwise) and `delegationDepth` 0: a
        fork is not a delegation, whatever the parent's depth (2026-12-03)."""
        return SessionHeader(
            version=SUPPORTED_VERSION,
            id=child_id,
            created_at=created_at,
            cwd=self.cwd,
            parent_session=self.id,
            seed_length=seed_length,
        )

    def encode(self) -> bytes:
        """The bytes of a new header line (no newline)."""
        return _encoder.encode(self)


def encode_header(header: SessionHeader) -> bytes:
    """The bytes of a new header line (no newline), in the key order of SPEC section 9."""
    return header.encode()


def with_id(header_raw: bytes, session_id: str) -> bytes:
    """A header's bytes under another session id, every other key kept as it was (an import under a new id keeps
    whatever the file's header holds, keys this build does not know included)."""
    fields: dict[str, Any] = msgspec.json.decode(header_raw)
    fields["id"] = session_id
    return _encoder.encode(fields)


class _HeaderProbe(Struct, gc=False):
    type: Any = UNSET
    version: Any = UNSET


_encoder: Final = msgspec.json.Encoder()
_header_probe_decoder: Final = msgspec.json.Decoder(_HeaderProbe)
_header_decoder: Final = msgspec.json.Decoder(SessionHeader)


def _preview(line: bytes, limit: int = 60) -> str:
    if not line:
        return "an empty line"
    text = line[:limit].decode("utf-8", "replace")
    return repr(text + ("..." if len(line) > limit else ""))


def decode_header(line: bytes) -> SessionHeader:
    """Validate a header line. Raises `InvalidEvent` (seq None; bytes that are not UTF-8 too), `EventTooDeep`
    (nested past the recursion limit) or `UnsupportedVersion`."""
    if not line.isascii():
        try:
            line.decode()
        except UnicodeDecodeError as exc:
            raise InvalidEvent(f"line 1: the session header is not valid UTF-8 (byte {exc.start})") from None
    try:
        probe = _header_probe_decoder.decode(line)
    except msgspec.DecodeError:
        raise InvalidEvent(
            f'line 1: expected a session header {{"type":"session","version":0,...}}, got {_preview(line)}'
        ) from None
    except RecursionError:  # no header field nests; only a hostile file gets this far
        raise EventTooDeep("line 1: the session header nests deeper than a reader can follow") from None
    if probe.type != "session":
        got = "no type" if probe.type is UNSET else f"type {probe.type!r}"
        raise InvalidEvent(f'line 1: expected a session header (type "session"), got {got}')
    if type(probe.version) is not int:
        raise InvalidEvent(f"line 1: session header version must be an integer, got {probe.version!r}")
    if probe.version != SUPPORTED_VERSION:
        raise UnsupportedVersion(
            f"line 1: session header version {probe.version}; this build reads version {SUPPORTED_VERSION}"
        )
    try:
        return _header_decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise InvalidEvent(f"line 1: session header: {exc}") from None
    except msgspec.DecodeError as exc:  # invalid UTF-8 in a string the probe skipped
        raise InvalidEvent(f"line 1: session header: {exc}") from None
    except RecursionError:
        raise EventTooDeep("line 1: the session header nests deeper than a reader can follow") from None
