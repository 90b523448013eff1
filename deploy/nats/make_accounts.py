"""Write deploy/nats/accounts.conf: the sessionlog account, one user per role, and each role's permissions.

    python deploy/nats/make_accounts.py                   # rewrite accounts.conf for 8 partitions
    python deploy/nats/make_accounts.py --partitions 16   # a stream created with SESSIONLOG_PARTITION_COUNT=16
    python deploy/nats/make_accounts.py --tenant acme --tenant globex -o tenants.conf   # one account per tenant

Why generated: NATS permissions match whole subject tokens only (`context-deriver-p*` is not a wildcard), so
"a projection may use its own durable consumers and no other's" means listing `<projection>-p<N>` for every
partition N. The partition count is fixed when the stream is created, so the list is written once per deployment.
tests/test_deploy.py checks that the committed file is what this script writes, and that the names below are
the defaults of `sessionlog.settings.Settings`.

The model, per role (details next to each list):
- only `writer` (agents), `repairer` and `gateway` (record mode) may publish to the event stream
  (`sessionlog.in.*`); only `gateway` to the raw audit stream (`sessionlog.raw.*`); only `admin` may create,
  change, purge or delete streams;
- a projection reads the log (direct get, its own durable consumers), keeps its own checkpoints
  (`$KV.sessionlog-checkpoints.<projection>.>`) and partition leases (`$KV.sessionlog-leases.partition.<projection>.>`),
  answers presence on `sessionlog.replicas.<projection>` and serves its own micro endpoints;
- everyone receives replies on `_INBOX.>`; a service answers requests through `allow_responses` (only to the
  reply subject of a request it received), never by publishing to `_INBOX.>` at will.

Tenants (`--tenant NAME`, repeated): each tenant is an account of its own, `SESSIONLOG_<NAME>`, with the same
roles as users `<name>-<role>` (passwords in `NATS_<NAME>_<ROLE>_PASSWORD`) and the same permissions. A JetStream
account has its own streams and subjects, so a tenant's `sessionlog.in.<id>` can only reach that tenant's stream:
no user of one tenant can publish to, read or even name another tenant's sessions, and the wire format (subjects,
session ids, headers) is the same as with one account. Each tenant runs its own services under its own users.

Standard library only, so it runs without the project installed.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

# The defaults of sessionlog.settings.Settings (a test keeps these in step).
STREAM = "SESSIONLOG"
RAW_STREAM = "SESSIONLOG_RAW"
KV_SESSIONS = "sessionlog-sessions"
KV_LEASES = "sessionlog-leases"
KV_CHECKPOINTS = "sessionlog-checkpoints"
OBJECT_STORE = "sessionlog-blobs"
PARTITION_COUNT = 8

ACCOUNT = "SESSIONLOG"
SYSTEM_ACCOUNT = "SYS"
PROJECTIONS = ("context-deriver", "repairer", "ui-replayer", "token-auditor")
# Micro service name -> the endpoint group it serves.
MICRO = {
    "context-deriver": ("sessionlog-context", "sessionlog.context"),
    "repairer": ("sessionlog-repair", "sessionlog.repair"),
    "token-auditor": ("sessionlog-audit", "sessionlog.audit"),
}
ROLES = ("admin", "writer", "repairer", "context-deriver", "ui-replayer", "token-auditor", "gateway")

OUT = Path(__file__).with_name("accounts.conf")


# A tenant's name becomes part of an account name, user names and environment variables.
TENANT_RE = re.compile(r"^[a-z][a-z0-9]{0,31}$")


def password_env(role: str, tenant: str | None = None) -> str:
    """The environment variable of the nats-server process holding the role's password (or bcrypt hash)."""
    name = role if tenant is None else f"{tenant}_{role}"
    return f"NATS_{name.upper().replace('-', '_')}_PASSWORD"


def user_name(role: str, tenant: str | None = None) -> str:
    """The NATS user of a role: the role itself, or `<tenant>-<role>` in a tenant's account."""
    return role if tenant is None else f"{tenant}-{role}"


def account_name(tenant: str | None = None) -> str:
    """The account holding one log: `SESSIONLOG`, or `SESSIONLOG_<TENANT>`."""
    return ACCOUNT if tenant is None else f"{ACCOUNT}_{tenant.upper()}"


@dataclass
class Permissions:
    pub: list[tuple[str, list[str]]] = field(default_factory=list)  # (comment, subjects)
    sub: list[tuple[str, list[str]]] = field(default_factory=list)
    deny_pub: list[str] = field(default_factory=list)
    deny_sub: list[str] = field(default_factory=list)
    responses: bool = False

    def publish(self, comment: str, *subjects: str) -> None:
        self.pub.append((comment, list(subjects)))

    def subscribe(self, comment: str, *subjects: str) -> None:
        self.sub.append((comment, list(subjects)))


API = "$JS.API"
ALL_STREAMS = (
    STREAM,
    RAW_STREAM,
    f"KV_{KV_SESSIONS}",
    f"KV_{KV_LEASES}",
    f"KV_{KV_CHECKPOINTS}",
    f"OBJ_{OBJECT_STORE}",
)

# Writers of the event stream and of the raw stream; a projection role must never hold these (also denied
# explicitly, so widening an allow list later cannot grant them by accident).
EVENT_WRITES = ("sessionlog.in.>", "sessionlog.events.>")
PURGED = "sessionlog.admin.purged."  # sessionlog.log.PURGED_PREFIX: only the admin announces an erasure
RAW_WRITES = ("sessionlog.raw.>",)
RELEASE = "sessionlog.gateway.release."  # services.gateway.record.RELEASE_PREFIX


def connect_and_verify(p: Permissions) -> None:
    # Every process provisions-or-verifies at start (`SessionLog.connect`): stream info of each stream and
    # bucket; creating them is the admin's job.
    p.publish("verify the layout at start (stream info only; creating is admin's)",
              *(f"{API}.STREAM.INFO.{name}" for name in ALL_STREAMS))  # fmt: skip
    p.publish("session headers: read (KV direct get; a miss is asked of the bucket's leader)",
              f"{API}.DIRECT.GET.KV_{KV_SESSIONS}.>", f"{API}.STREAM.MSG.GET.KV_{KV_SESSIONS}")  # fmt: skip
    p.subscribe("replies: JetStream API answers, acks, direct-get batches, consumer deliveries", "_INBOX.>")


def read_log(p: Permissions) -> None:
    p.publish("read sessions: batch direct get, and the leader when a follower is behind",
              f"{API}.DIRECT.GET.{STREAM}", f"{API}.STREAM.MSG.GET.{STREAM}")  # fmt: skip


def list_sessions(p: Permissions) -> None:
    p.publish("list sessions (batch direct gets of the header bucket: any replica answers, quorum or not)",
              f"{API}.DIRECT.GET.KV_{KV_SESSIONS}")  # fmt: skip
    p.publish("follow the session list (a KV watcher: an ordered consumer on the header bucket, and its info)",
              f"{API}.CONSUMER.CREATE.KV_{KV_SESSIONS}", f"{API}.CONSUMER.INFO.KV_{KV_SESSIONS}.*",
              f"$JS.FC.KV_{KV_SESSIONS}.>")  # fmt: skip


def live_tail(p: Permissions) -> None:
    # `$JS.API.CONSUMER.CREATE.<stream>` without a name creates ephemeral consumers only: the server refuses
    # a durable name there (10020), so this grants no durable consumer.
    p.publish("follow sessions live (ephemeral ordered consumers)",
              f"{API}.CONSUMER.CREATE.{STREAM}", f"$JS.FC.{STREAM}.>")  # fmt: skip


def read_blobs(p: Permissions) -> None:
    p.publish("read attachments (object store: meta by direct get, chunks by an ordered consumer)",
              f"{API}.DIRECT.GET.OBJ_{OBJECT_STORE}.>", f"{API}.STREAM.MSG.GET.OBJ_{OBJECT_STORE}",
              f"{API}.STREAM.NAMES", f"{API}.CONSUMER.CREATE.OBJ_{OBJECT_STORE}",
              f"$JS.FC.OBJ_{OBJECT_STORE}.>")  # fmt: skip


def session_leases(p: Permissions) -> None:
    # A session id is one token, so `*` covers writer leases and not the projections' `partition.<p>.<N>`.
    p.publish("writer leases of sessions (compare-and-set writes; reads from the stream leader)",
              f"$KV.{KV_LEASES}.*", f"{API}.STREAM.MSG.GET.KV_{KV_LEASES}")  # fmt: skip


def projection(p: Permissions, name: str, partitions: int) -> None:
    read_log(p)
    consumers: list[str] = []
    for n in range(partitions):
        durable = f"{name}-p{n}"
        consumers += [
            f"{API}.CONSUMER.INFO.{STREAM}.{durable}",
            f"{API}.CONSUMER.CREATE.{STREAM}.{durable}",
            f"{API}.CONSUMER.CREATE.{STREAM}.{durable}.>",
            f"{API}.CONSUMER.DURABLE.CREATE.{STREAM}.{durable}",
            f"{API}.CONSUMER.DELETE.{STREAM}.{durable}",
            f"{API}.CONSUMER.MSG.NEXT.{STREAM}.{durable}",
            f"$JS.ACK.{STREAM}.{durable}.>",
        ]
    p.publish(f"its own durable consumers {name}-p0..p{partitions - 1}: create, info, delete, fetch, ack", *consumers)
    own_keys = f"$KV.{KV_CHECKPOINTS}.{name}.>"
    own_reads = f"{API}.DIRECT.GET.KV_{KV_CHECKPOINTS}.{own_keys}"
    p.publish("its own checkpoints and quarantine entries", own_keys, own_reads)
    p.publish("list quarantine entries at start (batch direct get on the checkpoints bucket, read only)",
              f"{API}.DIRECT.GET.KV_{KV_CHECKPOINTS}")  # fmt: skip
    p.publish("its own partition leases", f"$KV.{KV_LEASES}.partition.{name}.>", f"{API}.STREAM.MSG.GET.KV_{KV_LEASES}")
    p.publish("presence requests to its own replicas", f"sessionlog.replicas.{name}")
    p.subscribe("presence: answer its own replicas", f"sessionlog.replicas.{name}")
    p.subscribe("erasure notices from the admin (`sessionlog purge`): forget the session", f"{PURGED}*")
    p.responses = True


def micro(p: Permissions, role: str) -> None:
    service, group = MICRO[role]
    p.subscribe(f"micro service {service}: endpoints and discovery ($SRV.PING|INFO|STATS[.name[.id]])",
                f"{group}.*", "$SRV.*", f"$SRV.*.{service}", f"$SRV.*.{service}.*")  # fmt: skip
    p.responses = True


def role_permissions(role: str, partitions: int) -> Permissions | None:
    """The permissions of one role; None for admin (everything in the account)."""
    if role == "admin":
        return None
    p = Permissions()
    connect_and_verify(p)
    if role == "writer":
        # Agents, the SDK and the CLI: write their sessions, read any session of the account.
        read_log(p)
        p.publish("append records to the event stream", "sessionlog.in.*")
        p.publish("make sessions visible (KV create of the header)", f"$KV.{KV_SESSIONS}.*")
        session_leases(p)
        list_sessions(p)
        live_tail(p)
        read_blobs(p)
        p.publish("store attachments (chunks, then the meta entry)", f"$O.{OBJECT_STORE}.C.>", f"$O.{OBJECT_STORE}.M.>")
        p.publish("call the services (what the CLI does: derive, repair-session, audit)",
                  "sessionlog.context.*", "sessionlog.repair.*", "sessionlog.audit.*")  # fmt: skip
        p.deny_pub += [*RAW_WRITES, "sessionlog.events.>", f"$KV.{KV_CHECKPOINTS}.>"]
    elif role == "repairer":
        projection(p, role, partitions)
        list_sessions(p)  # at start it reads every session's last record header
        p.publish("append closers to the event stream", "sessionlog.in.*")
        session_leases(p)
        micro(p, role)
        p.deny_pub += [*RAW_WRITES, "sessionlog.events.>", f"$KV.{KV_SESSIONS}.>"]
    elif role in ("context-deriver", "ui-replayer", "token-auditor"):
        projection(p, role, partitions)
        if role == "context-deriver":
            micro(p, role)
        if role == "ui-replayer":
            list_sessions(p)
            live_tail(p)
            read_blobs(p)
            p.publish("the fleet's health: every projection's checkpoints and quarantine entries (keys by an ordered "
                      "consumer, values by direct get) and the info of its partition consumers, all read only",
                      f"{API}.DIRECT.GET.KV_{KV_CHECKPOINTS}.>", f"{API}.CONSUMER.CREATE.KV_{KV_CHECKPOINTS}",
                      f"{API}.CONSUMER.INFO.KV_{KV_CHECKPOINTS}.*", f"$JS.FC.KV_{KV_CHECKPOINTS}.>",
                      f"{API}.CONSUMER.INFO.{STREAM}.*")  # fmt: skip
            p.publish("a session's raw exchanges (the raw audit stream, read only)", f"{API}.DIRECT.GET.{RAW_STREAM}")
        if role == "token-auditor":
            micro(p, role)
            list_sessions(p)
            p.publish("read the raw audit stream (direct get, and consumers of its own choosing on that stream)",
                      f"{API}.DIRECT.GET.{RAW_STREAM}", f"{API}.STREAM.MSG.GET.{RAW_STREAM}",
                      f"{API}.CONSUMER.*.{RAW_STREAM}", f"{API}.CONSUMER.*.{RAW_STREAM}.>",
                      f"{API}.CONSUMER.MSG.NEXT.{RAW_STREAM}.*", f"$JS.ACK.{RAW_STREAM}.>",
                      f"$JS.FC.{RAW_STREAM}.>")  # fmt: skip
        p.deny_pub += [*EVENT_WRITES, *RAW_WRITES, f"$KV.{KV_SESSIONS}.>", f"$KV.{KV_LEASES}.*"]
    elif role == "gateway":
        read_log(p)
        read_blobs(p)
        p.publish("ask the context-deriver for derivations", "sessionlog.context.*")
        p.publish("tee request and response bytes to the raw audit stream", "sessionlog.raw.*")
        # Record mode: the gateway writes sessions for clients that cannot (appends only, as a writer does).
        p.publish("record mode: append records to the event stream", "sessionlog.in.*")
        p.publish("record mode: make sessions visible (KV create of the header)", f"$KV.{KV_SESSIONS}.*")
        session_leases(p)
        p.publish("record mode: ask the replica holding a session to let go of it", f"{RELEASE}*")
        p.subscribe("record mode: another replica asks for a session this one holds", f"{RELEASE}*")
        p.subscribe("check mode: hear of records appended to the sessions it checks, to read their tails ahead",
                    "sessionlog.in.*")  # fmt: skip
        p.subscribe("erasure notices from the admin (`sessionlog purge`): forget the session", f"{PURGED}*")
        p.deny_pub += ["sessionlog.events.>", f"$KV.{KV_CHECKPOINTS}.>"]
    else:
        raise ValueError(f"unknown role {role!r}")
    # Nobody but admin touches a stream's configuration or its stored messages, or announces an erasure.
    p.deny_pub += ["sessionlog.admin.>", f"{API}.STREAM.CREATE.>", f"{API}.STREAM.UPDATE.>", f"{API}.STREAM.DELETE.>",
                   f"{API}.STREAM.PURGE.>", f"{API}.STREAM.MSG.DELETE.>"]  # fmt: skip
    # Only the role serving an endpoint may subscribe to it (no one else can answer in its name).
    p.deny_sub += [f"{group}.>" for r, (_, group) in MICRO.items() if r != role]
    return p


def _variable(role: str) -> str:
    return f"{role.upper().replace('-', '_')}_PERMISSIONS"


def _render_list(key: str, groups: list[tuple[str, list[str]]], indent: str) -> list[str]:
    lines = [f"{indent}{key}: ["]
    seen: set[str] = set()
    for comment, subjects in groups:
        fresh = [s for s in subjects if s not in seen]
        if not fresh:
            continue
        lines.append(f"{indent}  # {comment}")
        for subject in fresh:
            seen.add(subject)
            lines.append(f'{indent}  "{subject}"')
    lines.append(f"{indent}]")
    return lines


def render_permissions(role: str, p: Permissions) -> list[str]:
    lines = [f"{_variable(role)} = {{", "  publish: {"]
    lines += _render_list("allow", p.pub, "    ")
    never = "never: explicit, so a wider allow added later cannot grant it"
    lines += _render_list("deny", [(never, sorted(set(p.deny_pub)))], "    ")
    lines += ["  }", "  subscribe: {"]
    lines += _render_list("allow", p.sub, "    ")
    if p.deny_sub:
        lines += _render_list("deny", [("endpoints of other services", sorted(set(p.deny_sub)))], "    ")
    lines.append("  }")
    if p.responses:
        lines.append("  # answer requests it received (micro endpoints, presence): one reply each, within 5 minutes")
        lines.append('  allow_responses: { max: 1, expires: "5m" }')
    lines.append("}")
    return lines


def render(partitions: int = PARTITION_COUNT, tenants: tuple[str, ...] = ()) -> str:
    """accounts.conf: the one account `SESSIONLOG`, or with `tenants` one account per tenant (and no other)."""
    if not 1 <= partitions <= 1024:
        raise ValueError(f"partitions must be 1..1024, got {partitions}")
    for tenant in tenants:
        if not TENANT_RE.match(tenant):
            raise ValueError(f"a tenant name is a lowercase letter then up to 31 letters or digits, got {tenant!r}")
    if len(set(tenants)) != len(tenants):
        raise ValueError(f"a tenant is named twice in {list(tenants)}")
    flags = f"--partitions {partitions}" + "".join(f" --tenant {t}" for t in tenants)
    logs = (
        f"Account {ACCOUNT} (one tenant's log) with one user per role"
        if not tenants
        else f"One account per tenant ({', '.join(account_name(t) for t in tenants)}), one user per role in each"
    )
    out = [
        f"# GENERATED by deploy/nats/make_accounts.py {flags}: edit the script, not this file.",
        "#",
        f"# {logs}, and the system account {SYSTEM_ACCOUNT}.",
        "# Included by single.conf, cluster/*.conf and k8s.conf. Passwords are read from the nats-server's",
        "# environment (a missing one fails the start); a value that is a bcrypt hash ($2a$...) is compared as one,",
        "# so the server need not know the plain password. deploy/README.md explains each role.",
        "",
    ]
    # Every account's users have the same permissions: the subjects are the account's own.
    granted: dict[str, str] = {}  # role -> ", permissions: $VARIABLE" (nothing for admin)
    for role in ROLES:
        p = role_permissions(role, partitions)
        granted[role] = ""
        if p is not None:
            out += render_permissions(role, p)
            out.append("")
            granted[role] = f", permissions: ${_variable(role)}"
    out.append("accounts {")
    for tenant in tenants or (None,):
        out += [f"  {account_name(tenant)} {{", "    jetstream: enabled", "    users: ["]
        for role in ROLES:
            user, env = user_name(role, tenant), password_env(role, tenant)
            out.append(f"      {{ user: {user}, password: ${env}{granted[role]} }}")
        out += ["    ]", "  }"]
    out += [
        f"  {SYSTEM_ACCOUNT} {{",
        "    # monitoring and `nats server ...` commands only",
        f"    users: [ {{ user: sys, password: ${password_env('sys')} }} ]",
        "  }",
        "}",
        f"system_account: {SYSTEM_ACCOUNT}",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, default=PARTITION_COUNT, help="SESSIONLOG_PARTITION_COUNT")
    parser.add_argument("--tenant", action="append", default=[], help="an account of its own per tenant (repeat)")
    parser.add_argument("-o", "--out", type=Path, default=OUT, help="where to write (- for stdout)")
    args = parser.parse_args(argv)
    try:
        text = render(args.partitions, tuple(args.tenant))
    except ValueError as err:
        parser.error(str(err))
    if str(args.out) == "-":
        sys.stdout.write(text)
    else:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
