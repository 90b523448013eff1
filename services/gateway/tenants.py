"""Gateway API keys and the tenants they name.

Keys are stored hashed: the settings hold the SHA-256 hex digest of each key and the tenant it belongs to
(`SESSIONLOG_GATEWAY_KEYS`, JSON, and/or `SESSIONLOG_GATEWAY_KEYS_FILE`, one `TENANT SHA256_HEX` per line). The single
`SESSIONLOG_GATEWAY_API_KEY` is the key of the tenant `default`. With no key configured at all, every request is the
tenant `default` and no key is asked for. A request presents its key as `Authorization: Bearer <key>` (what every
OpenAI client sends) or `x-api-key`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from sessionlog.errors import InvalidKeys, Unauthorized
from sessionlog.settings import Settings

DEFAULT_TENANT: Final = "default"
_HEX_RE: Final = re.compile(r"^[0-9a-f]{64}$")


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Tenants:
    """Key digests to tenants."""

    def __init__(self, digests: Mapping[str, str]) -> None:
        for digest, tenant in digests.items():
            if not _HEX_RE.match(digest) or not tenant:
                raise InvalidKeys(f"a gateway key must be a lowercase sha256 hex digest with a tenant, got {digest!r}")
        self._digests = dict(digests)

    @property
    def required(self) -> bool:
        return bool(self._digests)

    @classmethod
    def from_settings(cls, settings: Settings, api_key: str | None = None) -> Tenants:
        digests = dict(settings.gateway_keys)
        if settings.gateway_keys_file is not None:
            digests.update(read_keys_file(settings.gateway_keys_file))
        key = api_key if api_key is not None else settings.gateway_api_key
        if key:
            digests[key_digest(key)] = DEFAULT_TENANT
        return cls(digests)

    def tenant(self, headers: Mapping[str, str]) -> str:
        """The tenant whose key the request presents; `UNAUTHORIZED` when keys are configured and it presents none."""
        if not self._digests:
            return DEFAULT_TENANT
        given = headers.get("authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else headers.get("x-api-key", "")
        digest = key_digest(token)
        for known, tenant in self._digests.items():
            if hmac.compare_digest(known, digest):
                return tenant
        raise Unauthorized("missing or wrong gateway API key (send it as `Authorization: Bearer <key>`)")


def read_keys_file(path: Path) -> dict[str, str]:
    """`TENANT SHA256_HEX` per line; blank lines and `#` comments skipped."""
    out: dict[str, str] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidKeys(f"gateway keys file {path}: {exc}") from None
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not _HEX_RE.match(parts[1]):
            raise InvalidKeys(f"gateway keys file {path}, line {number}: expected `TENANT SHA256_HEX`")
        out[parts[1]] = parts[0]
    return out


__all__ = ["DEFAULT_TENANT", "InvalidKeys", "Tenants", "Unauthorized", "key_digest", "read_keys_file"]
