"""compose.yaml, the Dockerfile and deploy/: the files are valid, agree with the settings, and the NATS permissions
hold against real nats-server processes.

The permission tests run deploy/nats/single.conf and the cluster configs themselves (a copy whose only changes are
a temporary store folder and loopback addresses), connect as each role's user, and check both sides of every
boundary: what a role needs works, what it must not do is refused by the server (a permissions violation in the
server's log, and the stream unchanged). Real services (context-deriver, repairer) and the shared projection
runner run under their own users, so a permission the code needs and the config lacks shows up here.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import nats
import nats.errors
import pytest
import pytest_asyncio
import yaml
from nats.aio.client import Client
from sessiongen import closed_turn, user_message_data

from services.gateway.derivation import StreamSource
from services.stack import SERVICES, Stack
from sessionlog.embedded import Cluster, EmbeddedServer, find_server_binary, free_port
from sessionlog.events import encode_new_event
from sessionlog.log import SessionLog
from sessionlog.micro import call
from sessionlog.record import encode_payload, in_subject, record_headers
from sessionlog.services import RunOptions
from sessionlog.settings import ENV_PREFIX, Settings

pytestmark = pytest.mark.timeout(120)
on_module_loop = pytest.mark.asyncio(loop_scope="module")

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
NATS_DIR = DEPLOY / "nats"
SETTING_NAMES = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
WAIT_S = 10.0


def _load_make_accounts() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_accounts", NATS_DIR / "make_accounts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_accounts"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


accounts = _load_make_accounts()
ROLES: tuple[str, ...] = accounts.ROLES
PASSWORDS = {role: f"{role}-test-{uuid.uuid4().hex[:8]}" for role in (*ROLES, "sys")}
SERVER_ENV = {accounts.password_env(role): pw for role, pw in PASSWORDS.items()} | {"POD_NAME": "nats-0"}
PROJECTION_ROLES = ("context-deriver", "ui-replayer", "token-auditor")


def nats_server() -> Path:
    return find_server_binary()


def settings_names_in(env: dict[str, Any]) -> set[str]:
    return {key for key in env if key.startswith(ENV_PREFIX)}


# ================================================================================================ nats configs


def all_configs() -> list[Path]:
    return sorted(DEPLOY.rglob("*.conf"))


@pytest.mark.parametrize("config", all_configs(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_nats_server_accepts_every_config_in_deploy(config: Path) -> None:
    done = subprocess.run(
        [str(nats_server()), "-t", "-c", str(config)],
        env={**os.environ, **SERVER_ENV},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_config_without_a_password_in_the_environment_is_refused() -> None:
    env = {**os.environ, **SERVER_ENV}
    del env[accounts.password_env("writer")]
    done = subprocess.run(
        [str(nats_server()), "-t", "-c", str(NATS_DIR / "single.conf")], env=env, capture_output=True, text=True
    )
    assert done.returncode != 0
    assert accounts.password_env("writer") in done.stdout + done.stderr


def test_make_accounts_writes_one_account_per_tenant_that_nats_server_accepts(tmp_path: Path) -> None:
    config = shutil.copytree(NATS_DIR, tmp_path / "nats")
    (config / "accounts.conf").write_text(accounts.render(accounts.PARTITION_COUNT, ("acme", "globex")))
    env = {**os.environ, "NATS_SYS_PASSWORD": "sys"}
    env |= {accounts.password_env(r, t): f"{t}-{r}" for t in ("acme", "globex") for r in ROLES}
    done = subprocess.run([str(nats_server()), "-t", "-c", str(config / "single.conf")], env=env,
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    text = (config / "accounts.conf").read_text()
    assert "SESSIONLOG_ACME {" in text and "SESSIONLOG_GLOBEX {" in text and "  SESSIONLOG {" not in text
    users = re.findall(r"\{ user: ([\w-]+), password: \$(\w+)", text)
    assert ("acme-writer", "NATS_ACME_WRITER_PASSWORD") in users
    assert ("globex-admin", "NATS_GLOBEX_ADMIN_PASSWORD") in users
    for bad in (("Acme",), ("a.b",), ("acme", "acme"), ("",)):
        with pytest.raises(ValueError):
            accounts.render(accounts.PARTITION_COUNT, bad)


def test_accounts_conf_is_what_make_accounts_writes() -> None:
    partitions = int(re.search(r"--partitions (\d+)", (NATS_DIR / "accounts.conf").read_text()).group(1))
    assert partitions == accounts.PARTITION_COUNT
    assert (NATS_DIR / "accounts.conf").read_text() == accounts.render(partitions), (
        "deploy/nats/accounts.conf is stale: run `python deploy/nats/make_accounts.py`"
    )


def test_make_accounts_uses_the_names_of_the_settings_and_the_services() -> None:
    from services.context_deriver.service import SERVICE as CONTEXT_SERVICE
    from services.context_deriver.service import ContextDeriver
    from services.gateway.record import RELEASE_PREFIX
    from services.repairer.service import SERVICE as REPAIR_SERVICE
    from services.repairer.service import Repairer
    from services.token_auditor.service import SERVICE as AUDIT_SERVICE
    from services.token_auditor.service import TokenAuditor
    from services.ui_replayer.service import UIReplayer
    from sessionlog.log import PURGED_PREFIX

    defaults = Settings(_env_file=None)
    assert defaults.stream == accounts.STREAM
    assert defaults.raw_stream == accounts.RAW_STREAM
    assert defaults.kv_sessions == accounts.KV_SESSIONS
    assert defaults.kv_leases == accounts.KV_LEASES
    assert defaults.kv_checkpoints == accounts.KV_CHECKPOINTS
    assert defaults.object_store == accounts.OBJECT_STORE
    assert defaults.partition_count == accounts.PARTITION_COUNT
    assert ContextDeriver.name in accounts.PROJECTIONS and Repairer.name in accounts.PROJECTIONS
    assert accounts.MICRO["context-deriver"][0] == CONTEXT_SERVICE
    assert accounts.MICRO["repairer"][0] == REPAIR_SERVICE
    assert accounts.MICRO["token-auditor"][0] == AUDIT_SERVICE
    assert accounts.PURGED == PURGED_PREFIX
    assert accounts.RELEASE == RELEASE_PREFIX
    assert UIReplayer.name in accounts.PROJECTIONS and TokenAuditor.name in accounts.PROJECTIONS
    # Every service is a role with a user of its own, and so are the agents and the operator.
    assert set(SERVICES) | {"writer", "admin"} == set(ROLES)
    users = re.findall(r"\{ user: ([\w-]+), password: \$(\w+)", (NATS_DIR / "accounts.conf").read_text())
    assert {user: env for user, env in users} == {role: accounts.password_env(role) for role in (*ROLES, "sys")}


def test_every_server_config_fsyncs_every_write_and_the_readme_says_why() -> None:
    for config in ("single.conf", "cluster/cluster.conf", "k8s.conf"):
        text = (NATS_DIR / config).read_text()
        assert re.search(r"^\s*sync_interval:\s*always\s*$", text, re.M), config
    readme = (DEPLOY / "README.md").read_text()
    for words in ("sync_interval", "always", "R3", "2 minutes", "OS crash", "power loss", "TLS", "verify_and_map"):
        assert words in readme, words


# ================================================================================================ compose


def compose() -> dict[str, Any]:
    loaded = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


NATS_NODES = ("nats-1", "nats-2", "nats-3")
ONE_SHOTS = ("provision", "demo")


def test_compose_has_a_3_node_jetstream_cluster_of_the_official_image() -> None:
    services = compose()["services"]
    routes = re.findall(r"nats-route://([\w-]+):6222", (NATS_DIR / "cluster" / "cluster.conf").read_text())
    assert sorted(routes) == list(NATS_NODES), "the routes name the compose services"
    for i, name in enumerate(NATS_NODES, start=1):
        node = services[name]
        image, _, tag = node["image"].partition(":")
        assert image == "nats"
        assert tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", tag).groups()) >= (2, 11), tag
        command = node["command"]
        assert "-js" in command
        config = command[command.index("-c") + 1]
        assert config == f"/etc/nats/cluster/n{i}.conf"
        assert f"server_name: n{i}" in (NATS_DIR / "cluster" / f"n{i}.conf").read_text()
        assert "./deploy/nats:/etc/nats:ro" in node["volumes"]
        assert any(v.endswith(":/data") for v in node["volumes"]), "JetStream keeps its store on a volume"
        env = compose_env(node)
        assert {accounts.password_env(role) for role in (*ROLES, "sys")} <= set(env)


def test_compose_runs_the_five_services_the_provider_and_the_demo_from_one_image() -> None:
    services = compose()["services"]
    for name in SERVICES:
        assert services[name]["command"] == ["serve", name]
    assert services["demo"]["command"] == ["demo"]
    assert services["scripted-provider"]["entrypoint"] == ["python", "-m", "services.gateway.scripted"]
    ours = [s for n, s in services.items() if n not in NATS_NODES]
    assert {s["image"] for s in ours} == {"sessionlog:local"}
    assert all(s["build"] == {"context": ".", "dockerfile": "Dockerfile"} for s in ours)
    for name in ONE_SHOTS:
        assert services[name]["restart"] == "no"


def test_the_scripted_provider_command_is_what_its_entry_point_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.gateway.scripted as scripted
    import sessionlog.asgi as asgi

    service = compose()["services"]["scripted-provider"]
    mounts = dict(reversed(v.split(":")[:2]) for v in service["volumes"])  # container folder -> host folder
    argv = [
        str(REPO / mounts[str(Path(arg).parent)] / Path(arg).name) if str(Path(arg).parent) in mounts else arg
        for arg in service["command"]
    ]
    served: dict[str, Any] = {}

    async def fake_serve(app: Any, host: str, port: int, **options: Any) -> None:
        served.update(app=app, host=host, port=port)

    monkeypatch.setattr(asgi, "serve_until_cancelled", fake_serve)
    assert scripted.main(argv) == 0  # the script file loads, the arguments parse
    assert served["host"] == "0.0.0.0"
    gateway_env = compose_env(compose()["services"]["gateway"])
    assert gateway_env["SESSIONLOG_PROVIDER_BASE_URL"] == f"http://scripted-provider:{served['port']}"
    assert f"127.0.0.1:{served['port']}/healthz" in " ".join(service["healthcheck"]["test"])


def test_every_compose_service_has_a_healthcheck_on_its_own_port() -> None:
    services = compose()["services"]
    for name, service in services.items():
        if name in ONE_SHOTS:
            assert "healthcheck" not in service, f"{name} is a one-shot: others wait for it to complete"
            continue
        check = " ".join(service["healthcheck"]["test"])
        assert service["healthcheck"]["test"][0] == "CMD"
        if name in SERVICES:
            port = compose_env(service)["SESSIONLOG_METRICS_PORT"]
            assert f"127.0.0.1:{port}/readyz" in check, name
        elif name in NATS_NODES:
            assert "127.0.0.1:8222/healthz" in check
        else:
            assert "/healthz" in check
    demo_waits_for = services["demo"]["depends_on"]
    assert {name: dep["condition"] for name, dep in demo_waits_for.items()} == {
        name: "service_healthy" for name in SERVICES
    }
    for name in SERVICES:
        assert services[name]["depends_on"]["provision"]["condition"] == "service_completed_successfully"


def test_compose_environment_names_are_settings_and_the_stream_is_r3() -> None:
    doc = compose()
    seen: set[str] = set()
    for name, service in doc["services"].items():
        env = compose_env(service)
        seen |= settings_names_in(env)
        if name in NATS_NODES or name == "scripted-provider":
            continue
        assert env["SESSIONLOG_REPLICAS"] == "3", name
        assert env["SESSIONLOG_PARTITION_COUNT"] == str(accounts.PARTITION_COUNT), name
        assert env["SESSIONLOG_NATS_URL"] == ",".join(f"nats://{n}:4222" for n in NATS_NODES)
        user = env["SESSIONLOG_NATS_USER"]
        expected = {"provision": "admin", "demo": "writer"}.get(name, name)
        assert user == expected, f"{name} connects as {user}"
        assert env["SESSIONLOG_NATS_PASSWORD"].startswith(f"${{{accounts.password_env(user)}:-")
        Settings(_env_file=None, **{k[len(ENV_PREFIX) :].lower(): v for k, v in env.items() if "${" not in v})
    for block in ("x-sessionlog-env",):
        seen |= settings_names_in(doc[block])
    unknown = seen - SETTING_NAMES
    assert not unknown, f"not settings: {sorted(unknown)}"
    assert "SESSIONLOG_NATS_URL" in seen


def test_dockerfile_builds_the_package_and_runs_the_cli_unprivileged() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.1[1-9]", text, re.M)
    assert re.search(r"^RUN pip install \.", text, re.M)
    assert re.search(r"^USER (?!root|0\b)\S+", text, re.M)
    assert 'ENTRYPOINT ["sessionlog"]' in text
    env_names = set(re.findall(r"\b(SESSIONLOG_[A-Z_]+)=", text))
    assert env_names and env_names <= SETTING_NAMES
    for copied in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in copied.split():
            assert (REPO / path).exists(), path
    ignored = (REPO / ".dockerignore").read_text().split()
    for needed in ("pyproject.toml", "README.md", "shared", "services"):
        assert needed not in ignored
    assert "**/.env" in ignored and ".venv" in ignored


# ================================================================================================ kubernetes


def k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def k8s_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in k8s_docs() if d["kind"] == kind}


def test_k8s_manifests_parse_and_kustomize_names_files_that_exist() -> None:
    docs = k8s_docs()
    assert all({"apiVersion", "kind", "metadata"} <= set(d) for d in docs)
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (DEPLOY / resource).is_file(), resource
    files = [f for gen in kustomization["configMapGenerator"] for f in gen["files"]]
    for file in files:
        assert (DEPLOY / file).is_file(), file
    nats = k8s_kind("StatefulSet")["nats"]
    container = nats["spec"]["template"]["spec"]["containers"][0]
    config = container["args"][container["args"].index("-c") + 1]
    assert Path(config).name in {Path(f).name for f in files}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert Path(config).parent == Path(mounts["config"])
    volumes = {v["name"]: v for v in nats["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == kustomization["configMapGenerator"][0]["name"]


def test_k8s_nats_is_a_3_node_statefulset_with_storage_and_every_password() -> None:
    nats_set = k8s_kind("StatefulSet")["nats"]
    assert nats_set["spec"]["replicas"] == 3
    headless = k8s_kind("Service")[nats_set["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    routes = re.findall(r"nats-route://(nats-\d)\.([\w-]+):6222", (NATS_DIR / "k8s.conf").read_text())
    assert sorted(routes) == [(f"nats-{i}", nats_set["spec"]["serviceName"]) for i in range(3)]
    container = nats_set["spec"]["template"]["spec"]["containers"][0]
    image, _, tag = container["image"].partition(":")
    assert image == "nats" and tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", tag).groups()) >= (2, 11)
    env = {e["name"] for e in container["env"]}
    assert {accounts.password_env(role) for role in (*ROLES, "sys")} | {"POD_NAME"} <= env
    assert nats_set["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "monitor"}
    assert k8s_kind("PodDisruptionBudget")["nats"]["spec"]["maxUnavailable"] == 1


def test_k8s_deployments_run_the_image_with_probes_on_the_metrics_port_and_settings_env() -> None:
    config_maps = k8s_kind("ConfigMap")
    deployments = k8s_kind("Deployment")
    assert set(deployments) == set(SERVICES)
    images = set()
    secrets = k8s_kind("Secret")["sessionlog-nats-users"]["stringData"]
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        images.add(container["image"])
        assert container["args"] == ["serve", name]
        env: dict[str, Any] = {}
        for source in container.get("envFrom", []):
            env |= config_maps[source["configMapRef"]["name"]]["data"]
        env |= {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
        unknown = settings_names_in(env) - SETTING_NAMES
        assert not unknown, f"{name}: not settings: {sorted(unknown)}"
        assert env["SESSIONLOG_REPLICAS"] == "3"
        assert env["SESSIONLOG_PARTITION_COUNT"] == str(accounts.PARTITION_COUNT)
        assert env["SESSIONLOG_NATS_USER"] == name
        secret = env["SESSIONLOG_NATS_PASSWORD"]["secretKeyRef"]
        assert secret == {"name": "sessionlog-nats-users", "key": f"{name}-password"} and secret["key"] in secrets
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == int(env["SESSIONLOG_METRICS_PORT"])
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
            assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, (name, probe)
        assert pod["securityContext"]["runAsNonRoot"] is True
    job = k8s_kind("Job")["sessionlog-provision"]["spec"]["template"]["spec"]["containers"][0]
    images.add(job["image"])
    assert {e["name"]: e.get("value") for e in job["env"]}["SESSIONLOG_NATS_USER"] == "admin"
    assert len(images) == 1 and images.pop().startswith("sessionlog:")
    assert k8s_kind("Service")["gateway"]["spec"]["ports"][0]["port"] == int(
        config_maps["sessionlog-env"]["data"]["SESSIONLOG_GATEWAY_PORT"]
    )


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_the_manifests() -> None:
    done = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(done.stdout) if d]
    assert kinds.count("Deployment") == 5 and "StatefulSet" in kinds and "ConfigMap" in kinds


# ================================================================================================ live: helpers


def deploy_copy(dst: Path) -> Path:
    """deploy/nats as it is, except that JetStream stores in the folder `-sd` names and nothing binds beyond
    loopback. Flags override the rest (`-p`, `-m`, `--cluster`, `--routes`)."""
    shutil.copytree(NATS_DIR, dst)
    for conf in dst.rglob("*.conf"):
        text = conf.read_text()
        stores = text.count("  store_dir: /data/jetstream\n")
        assert stores <= 1
        conf.write_text(text.replace("  store_dir: /data/jetstream\n", "").replace("0.0.0.0", "127.0.0.1"))
    return dst


@contextlib.contextmanager
def server_env() -> Iterator[None]:
    """SERVER_ENV in the environment: a nats-server process reads the passwords when it starts."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in SERVER_ENV.items():
            mp.setenv(key, value)
        yield


def start_with_env(server: EmbeddedServer, wait: str = "ready") -> EmbeddedServer:
    with server_env():
        return server.start(wait=wait)  # type: ignore[arg-type]


VIOLATION = re.compile(
    r'"SESSIONLOG/user:(?P<user>[\w-]+)" - (?P<kind>Publish|Subscription) Violation - .*?Subject "(?P<subject>[^"]+)"'
)


def log_mark(server: EmbeddedServer) -> int:
    """Where the server's log ends now: `violations(since=...)` looks only at what comes after."""
    return server.log_path.stat().st_size


def violations(server: EmbeddedServer, user: str | None = None, *, since: int = 0) -> list[tuple[str, str, str]]:
    with open(server.log_path, "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    found = [(m["user"], m["kind"], m["subject"]) for m in VIOLATION.finditer(text)]
    return [v for v in found if user is None or v[0] == user]


async def wait_for_violation(server: EmbeddedServer, user: str, kind: str, subject: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while (user, kind, subject) not in violations(server, user):
        assert time.monotonic() < deadline, f"no {kind} violation of {user} on {subject}: {violations(server)}"
        await asyncio.sleep(0.02)


def role_settings(url: str, role: str, **overrides: Any) -> Settings:
    options: dict[str, Any] = {
        "nats_url": url,
        "nats_user": role,
        "nats_password": PASSWORDS[role],
        "lease_ttl_s": 1.0,
        "request_timeout_s": 2.0,
        "repair_grace_s": 0.2,
        "metrics_port": 0,
        **overrides,
    }
    return Settings(_env_file=None, **options)


async def connect_as(url: str, role: str) -> tuple[Client, list[str]]:
    errors: list[str] = []

    async def on_error(err: Exception) -> None:
        errors.append(str(err).lower())

    nc = await nats.connect(
        url, user=role, password=PASSWORDS[role], error_cb=on_error, connect_timeout=5, max_reconnect_attempts=0
    )
    return nc, errors


def new_id(prefix: str = "d") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def first_record(session_id: str) -> tuple[bytes, dict[str, str]]:
    """A valid first record of a session (a closed, empty turn), as the writer would publish it."""
    events = [
        encode_new_event("turn/start", {"turn": 1}, seq=0, time=1),
        encode_new_event("turn/end", {"turn": 1, "reason": {"kind": "completed"}}, seq=1, time=2),
    ]
    payload = encode_payload(events)
    headers = record_headers(
        session_id=session_id, first_seq=0, count=2, epoch=0, payload=payload, expected_last=0, open_turn=0
    )
    return payload, headers


async def publish_record(nc: Client, session_id: str, *, timeout: float = 5.0) -> Any:
    payload, headers = first_record(session_id)
    return await nc.jetstream(timeout=timeout).publish(in_subject(session_id), payload, headers=headers)


def kv_value(subject: str) -> bytes:
    """A value the bucket's readers accept (a session header where one is expected)."""
    if subject.startswith("$KV.sessionlog-sessions."):
        sid = subject.rsplit(".", 1)[-1]
        return json.dumps({"type": "session", "version": 0, "id": sid, "createdAt": 1}).encode()
    return b"{}"


# ================================================================================================ live: fixtures


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """deploy/nats/single.conf (with accounts.conf) on free loopback ports."""
    base = tmp_path_factory.mktemp("single")
    config = deploy_copy(base / "config") / "single.conf"
    server = EmbeddedServer(base / "data", extra_args=["-c", str(config)], log_path=base / "nats-server.log")
    start_with_env(server)
    try:
        yield server
    finally:
        server.kill()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def admin(single: EmbeddedServer) -> AsyncIterator[SessionLog]:
    """The admin's log: it provisions the streams, buckets and object store, which no other role may."""
    log = await SessionLog.connect(role_settings(single.url, "admin"))
    try:
        yield log
    finally:
        await log.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def writer_log(single: EmbeddedServer, admin: SessionLog) -> AsyncIterator[SessionLog]:
    log = await SessionLog.connect(role_settings(single.url, "writer"))
    try:
        yield log
    finally:
        await log.close()


async def stream_messages(admin: SessionLog, stream: str = "SESSIONLOG") -> int:
    info = await admin.js.stream_info(stream)
    return int(info.state.messages)


async def written_session(writer_log: SessionLog, turns: int = 1) -> str:
    session_id = new_id()
    writer = await writer_log.create(session_id)
    for turn in range(turns):
        await closed_turn(writer, f"question {turn}")
    await writer.close()
    return session_id


# ============================================================================================ live: the event stream


@on_module_loop
async def test_single_conf_fsyncs_every_write(single: EmbeddedServer) -> None:
    assert single.monitor_url is not None
    with urllib.request.urlopen(f"{single.monitor_url}/varz", timeout=5) as reply:
        config = json.load(reply)["jetstream"]["config"]
    assert config["sync_always"] is True
    assert Path(config["store_dir"]).is_relative_to(single.data_dir)


@on_module_loop
async def test_a_writer_appends_and_jetstream_acknowledges(
    single: EmbeddedServer, admin: SessionLog, writer_log: SessionLog
) -> None:
    mark = log_mark(single)
    nc, errors = await connect_as(single.url, "writer")
    try:
        before = await stream_messages(admin)
        ack = await publish_record(nc, new_id())
        assert ack.stream == "SESSIONLOG" and ack.seq > 0
        assert await stream_messages(admin) == before + 1
    finally:
        await nc.close()
    # The whole writer API, as an agent uses it: create, append, flush, list, read, fork, blobs, live tail.
    session_id = await written_session(writer_log, turns=2)
    assert session_id in {info.id for info in await writer_log.sessions()}
    _, session, _ = await writer_log.load(session_id)
    assert len(session) == 12
    await writer_log.fork(session_id, new_id("fork"))
    blob = await writer_log.put_blob(b"x" * 200_000, media_type="text/plain")
    assert await writer_log.get_blob(blob["attachmentId"]) == b"x" * 200_000
    records = writer_log.reader.subscribe(session_id=session_id)
    first = await asyncio.wait_for(anext(records), WAIT_S)
    await records.aclose()
    assert first.first_seq == 0
    assert errors == []
    assert violations(single, "writer", since=mark) == []


@on_module_loop
@pytest.mark.parametrize("role", [*PROJECTION_ROLES, "gateway"])
async def test_a_projection_cannot_write_the_event_stream_and_the_gateway_only_appends(
    single: EmbeddedServer, admin: SessionLog, role: str
) -> None:
    nc, errors = await connect_as(single.url, role)
    try:
        before = await stream_messages(admin)
        session_id = new_id(role)
        if role == "gateway":  # record mode: the gateway writes sessions for its clients, by appending only
            assert (await publish_record(nc, session_id)).stream == "SESSIONLOG"
            before += 1
        else:
            with pytest.raises((nats.errors.TimeoutError, TimeoutError)):  # no ack: the server dropped the publish
                await publish_record(nc, session_id, timeout=1)
            await wait_for_violation(single, role, "Publish", in_subject(session_id))
            assert any("permissions violation" in e and in_subject(session_id) in e for e in errors)
        # Neither the stored subject nor the stream API's write operations get through.
        await nc.publish(f"sessionlog.events.0.{session_id}", b"[]")
        for operation in ("STREAM.PURGE", "STREAM.MSG.DELETE", "STREAM.UPDATE", "STREAM.DELETE"):
            await nc.publish(f"$JS.API.{operation}.SESSIONLOG", b"{}")
        await nc.flush()
        for operation in ("STREAM.PURGE", "STREAM.MSG.DELETE", "STREAM.UPDATE", "STREAM.DELETE"):
            await wait_for_violation(single, role, "Publish", f"$JS.API.{operation}.SESSIONLOG")
        assert await stream_messages(admin) == before
    finally:
        await nc.close()


@on_module_loop
async def test_the_repairer_may_append_to_the_event_stream(single: EmbeddedServer, admin: SessionLog) -> None:
    nc, errors = await connect_as(single.url, "repairer")
    try:
        before = await stream_messages(admin)
        ack = await publish_record(nc, new_id("rep"))
        assert ack.stream == "SESSIONLOG"
        assert await stream_messages(admin) == before + 1
        assert errors == []
    finally:
        await nc.close()


@on_module_loop
@pytest.mark.parametrize("role", ["gateway", "writer", "repairer", "token-auditor"])
async def test_only_the_gateway_writes_the_raw_audit_stream(
    single: EmbeddedServer, admin: SessionLog, role: str
) -> None:
    nc, _ = await connect_as(single.url, role)
    try:
        before = await stream_messages(admin, "SESSIONLOG_RAW")
        subject = f"sessionlog.raw.{new_id(role)}"
        if role == "gateway":
            ack = await nc.jetstream(timeout=5).publish(subject, b"{}", stream="SESSIONLOG_RAW")
            assert ack.stream == "SESSIONLOG_RAW"
            assert await stream_messages(admin, "SESSIONLOG_RAW") == before + 1
        else:
            with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
                await nc.jetstream(timeout=1).publish(subject, b"{}")
            await wait_for_violation(single, role, "Publish", subject)
            assert await stream_messages(admin, "SESSIONLOG_RAW") == before
    finally:
        await nc.close()


@on_module_loop
async def test_no_role_but_admin_creates_streams(single: EmbeddedServer) -> None:
    for role in ROLES:
        if role == "admin":
            continue
        nc, _ = await connect_as(single.url, role)
        try:
            config = {"name": f"EVIL_{role.upper().replace('-', '_')}", "subjects": [f"evil.{role}"]}
            with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
                await nc.request(f"$JS.API.STREAM.CREATE.{config['name']}", json.dumps(config).encode(), timeout=1)
            await wait_for_violation(single, role, "Publish", f"$JS.API.STREAM.CREATE.{config['name']}")
        finally:
            await nc.close()


# ======================================================================================== live: each role in its lane

# (role, subject, allowed): a JetStream publish, acknowledged when allowed, refused by the server otherwise.
WRITES = [
    ("context-deriver", "$KV.sessionlog-checkpoints.context-deriver.test", True),
    ("context-deriver", "$KV.sessionlog-checkpoints.repairer.test", False),
    ("ui-replayer", "$KV.sessionlog-leases.partition.ui-replayer.99", True),
    ("ui-replayer", "$KV.sessionlog-leases.partition.context-deriver.99", False),
    ("token-auditor", "$KV.sessionlog-checkpoints.token-auditor.test", True),
    ("token-auditor", "$KV.sessionlog-leases.{session}", False),
    ("writer", "$KV.sessionlog-leases.{session}", True),
    ("writer", "$KV.sessionlog-leases.partition.repairer.99", False),
    ("writer", "$KV.sessionlog-checkpoints.context-deriver.test", False),
    ("writer", "$KV.sessionlog-sessions.{session}", True),
    ("repairer", "$KV.sessionlog-leases.{session}", True),
    ("repairer", "$KV.sessionlog-sessions.{session}", False),
    ("gateway", "$KV.sessionlog-sessions.{session}", True),  # record mode creates sessions
    ("gateway", "$KV.sessionlog-leases.{session}", True),
    ("gateway", "$KV.sessionlog-leases.partition.repairer.99", False),
    ("gateway", "$KV.sessionlog-checkpoints.context-deriver.test", False),
    ("writer", "$O.sessionlog-blobs.C.{session}", True),
    ("ui-replayer", "$O.sessionlog-blobs.C.{session}", False),
]


@on_module_loop
@pytest.mark.parametrize(("role", "subject", "allowed"), WRITES, ids=[f"{r}:{s}:{a}" for r, s, a in WRITES])
async def test_each_role_writes_only_its_own_keys(
    single: EmbeddedServer, admin: SessionLog, role: str, subject: str, allowed: bool
) -> None:
    subject = subject.format(session=new_id("kv"))
    nc, _ = await connect_as(single.url, role)
    try:
        if allowed:
            ack = await nc.jetstream(timeout=5).publish(subject, kv_value(subject))
            assert ack.seq > 0
        else:
            with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
                await nc.jetstream(timeout=1).publish(subject, kv_value(subject))
            await wait_for_violation(single, role, "Publish", subject)
    finally:
        await nc.close()


@on_module_loop
async def test_a_writer_cannot_purge_a_sessions_header(
    single: EmbeddedServer, admin: SessionLog, writer_log: SessionLog
) -> None:
    """The writer must put headers into the bucket, and NATS permissions cannot tell a put from a delete or purge
    marker (all publish to `$KV.sessionlog-sessions.<id>`): the bucket itself refuses anything but the first."""
    session_id = await written_session(writer_log)
    events = await admin.reader.events(session_id)
    header = await admin.header(session_id)
    assert header is not None
    subject = f"$KV.{admin.settings.kv_sessions}.{session_id}"
    nc, _ = await connect_as(single.url, "writer")
    try:
        await nc.publish(subject, b"", headers={"KV-Operation": "PURGE", "Nats-Rollup": "sub"})
        await nc.flush()
        js = nc.jetstream(timeout=5)
        for what, body, headers in (
            ("a purge marker", b"", {"KV-Operation": "PURGE", "Nats-Rollup": "sub"}),
            ("a delete marker", b"", {"KV-Operation": "DEL"}),
            ("another header", kv_value(subject), None),
        ):
            with pytest.raises(nats.js.errors.APIError):
                await js.publish(subject, body, headers=headers)
                pytest.fail(f"{what} was accepted")
    finally:
        await nc.close()
    assert await admin.reader.events(session_id) == events
    assert await admin.header(session_id) == header, "the writer erased or replaced the session's header"


# (role, subject): subscriptions that would let a role answer in another service's name, or eavesdrop on it.
IMPERSONATIONS = [
    ("gateway", "sessionlog.context.derive"),
    ("writer", "sessionlog.context.derive"),
    ("ui-replayer", "sessionlog.repair.close"),
    ("context-deriver", "sessionlog.audit.report"),
    ("writer", "sessionlog.replicas.context-deriver"),
    ("token-auditor", "sessionlog.replicas.repairer"),
    ("gateway", "sessionlog.raw.>"),
]


@on_module_loop
@pytest.mark.parametrize(("role", "subject"), IMPERSONATIONS)
async def test_no_role_answers_in_another_services_name(single: EmbeddedServer, role: str, subject: str) -> None:
    nc, _ = await connect_as(single.url, role)
    try:
        await nc.subscribe(subject)
        await nc.flush()
        await wait_for_violation(single, role, "Subscription", subject)
    finally:
        await nc.close()


# (role, api subject): consumer operations on another role's durable consumers.
CONSUMER_THEFT = [
    ("context-deriver", "$JS.API.CONSUMER.DELETE.SESSIONLOG.repairer-p0"),
    ("ui-replayer", "$JS.API.CONSUMER.MSG.NEXT.SESSIONLOG.context-deriver-p0"),
    ("token-auditor", "$JS.API.CONSUMER.CREATE.SESSIONLOG.ui-replayer-p1.sessionlog.events.1.>"),
    ("writer", "$JS.API.CONSUMER.CREATE.SESSIONLOG.context-deriver-p0.sessionlog.events.0.>"),
    ("gateway", "$JS.API.CONSUMER.CREATE.SESSIONLOG"),
]


@on_module_loop
@pytest.mark.parametrize(("role", "subject"), CONSUMER_THEFT)
async def test_no_role_touches_another_roles_consumers(single: EmbeddedServer, role: str, subject: str) -> None:
    nc, _ = await connect_as(single.url, role)
    try:
        with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
            await nc.request(subject, b"{}", timeout=1)
        await wait_for_violation(single, role, "Publish", subject)
    finally:
        await nc.close()


@on_module_loop
async def test_the_ephemeral_consumer_grant_cannot_create_a_durable(single: EmbeddedServer, admin: SessionLog) -> None:
    nc, _ = await connect_as(single.url, "ui-replayer")
    try:
        request = {"stream_name": "SESSIONLOG", "config": {"durable_name": "context-deriver-p0", "ack_policy": "all"}}
        reply = await nc.request("$JS.API.CONSUMER.CREATE.SESSIONLOG", json.dumps(request).encode(), timeout=5)
        assert json.loads(reply.data)["error"]["err_code"] == 10020  # "expected to be ephemeral"
    finally:
        await nc.close()


# ================================================================================================ live: the services

# Each service runs exactly as `sessionlog serve NAME` runs it (services.stack.Stack: the connection that
# verifies the layout, the service, the health server), as its own NATS user, and then does its job for a client
# that connects as its own user too. A permission the code needs and accounts.conf lacks fails here.


@contextlib.asynccontextmanager
async def serving(url: str, name: str, **overrides: Any) -> AsyncIterator[tuple[Any, str]]:
    """`sessionlog serve NAME` under the role's user; yields the service and its /readyz once it answers 200."""
    settings = role_settings(url, name, metrics_port=free_port(), gateway_port=free_port(), ui_port=free_port(),
                             gateway_host="127.0.0.1", ui_host="127.0.0.1", **overrides)  # fmt: skip
    stack = await Stack.start([name], settings, RunOptions())
    try:
        assert stack.health is not None
        ready = f"http://127.0.0.1:{stack.health.port}/readyz"
        service = stack.handles[name]
        runner = getattr(service, "runner", None)
        if runner is not None:  # claimed partitions: one replica takes them all
            deadline = time.monotonic() + WAIT_S
            while len(runner.owned) < runner.partition_count:
                assert time.monotonic() < deadline, f"{name} owns only {runner.owned}"
                await asyncio.sleep(0.05)
        async with httpx.AsyncClient(timeout=5) as http:
            deadline = time.monotonic() + WAIT_S
            while (await http.get(ready)).status_code != 200:
                assert time.monotonic() < deadline, f"{name} is not ready: {(await http.get(ready)).text}"
                await asyncio.sleep(0.05)
        yield service, ready
    finally:
        await stack.stop()


async def checkpoints(admin: SessionLog, projection: str) -> list[str]:
    kv = await admin.js.key_value("sessionlog-checkpoints")
    return [k for k in await kv.keys() if k.startswith(f"{projection}.p")]


@on_module_loop
async def test_the_context_deriver_serves_derivations_under_its_own_user(
    single: EmbeddedServer, admin: SessionLog, writer_log: SessionLog
) -> None:
    mark = log_mark(single)
    session_id = await written_session(writer_log, turns=2)
    gateway_nc, _ = await connect_as(single.url, "gateway")
    try:
        async with serving(single.url, "context-deriver"):
            body = {"session": session_id, "min_seq": 11}
            reply = await call(gateway_nc, "sessionlog.context.derive", body, timeout=5)
            assert reply["seq"] == 11 and len(reply["messages"]) == 4
            stats = await call(gateway_nc, "sessionlog.context.stats", {}, timeout=5)
            assert stats["partitions"] == list(range(8))
            ping = await admin.nc.request("$SRV.PING.sessionlog-context", b"", timeout=5)
            assert json.loads(ping.data)["name"] == "sessionlog-context"
    finally:
        await gateway_nc.close()
    assert await checkpoints(admin, "context-deriver")
    assert violations(single, "context-deriver", since=mark) == [] and violations(single, "gateway", since=mark) == []


async def watched_or_read(source: StreamSource, session_id: str, seq: int) -> str:
    """How the source answered a request naming `seq`: "watched" (no read of the tail) or "stream" (read)."""
    derived = await source.derive(session_id, seq)
    assert derived.seq >= seq
    return derived.source


async def until_settled(source: StreamSource, session_id: str, seq: int) -> None:
    tails = source.tails
    assert tails is not None
    deadline = time.monotonic() + WAIT_S
    while not tails.settled(session_id, seq):
        assert time.monotonic() < deadline, "the gateway's watch of the session was not confirmed"
        await asyncio.sleep(0.02)


@on_module_loop
async def test_the_gateway_watches_the_sessions_it_checks_under_its_own_user(
    single: EmbeddedServer, admin: SessionLog, writer_log: SessionLog
) -> None:
    mark = log_mark(single)
    writer = await writer_log.create(new_id("watch"))
    gateway = await SessionLog.connect(role_settings(single.url, "gateway"))
    source = StreamSource(gateway, wait_s=2.0)
    try:
        await closed_turn(writer, "first")
        seq = await writer.flush()
        assert await watched_or_read(source, writer.session_id, seq) == "stream"
        await until_settled(source, writer.session_id, seq)
        assert await watched_or_read(source, writer.session_id, seq) == "watched"
        await closed_turn(writer, "second")
        seq = await writer.flush()  # announced to the gateway, read ahead
        await until_settled(source, writer.session_id, seq)
        assert await watched_or_read(source, writer.session_id, seq) == "watched"
    finally:
        await source.close()
        await gateway.close()
        await writer.close()
    assert violations(single, "gateway", since=mark) == []


@on_module_loop
async def test_a_user_that_may_not_subscribe_to_the_writers_subject_reads_the_tail_every_time(
    single: EmbeddedServer, admin: SessionLog, writer_log: SessionLog
) -> None:
    writer = await writer_log.create(new_id("nowatch"))
    reader = await SessionLog.connect(role_settings(single.url, "context-deriver"))  # reads the log, no such grant
    source = StreamSource(reader, wait_s=2.0)
    try:
        await closed_turn(writer, "first")
        seq = await writer.flush()
        assert await watched_or_read(source, writer.session_id, seq) == "stream"
        await wait_for_violation(single, "context-deriver", "Subscription", in_subject(writer.session_id))
        await asyncio.sleep(0.2)  # the confirming read is over
        assert source.tails is not None and not source.tails.enabled
        for _ in range(3):
            assert await watched_or_read(source, writer.session_id, seq) == "stream"
    finally:
        await source.close()
        await reader.close()
        await writer.close()


@on_module_loop
async def test_the_repairer_closes_a_dead_writers_turn_under_its_own_user(
    single: EmbeddedServer, admin: SessionLog, writer_log: SessionLog
) -> None:
    mark = log_mark(single)
    session_id = new_id("dead")
    writer = await writer_log.create(session_id)
    await writer.emit("turn/start", {"turn": 1})
    await writer.emit("user/message", user_message_data("Are you there?", "u1"), surface_op="append")
    await writer.flush()
    await writer.abandon()  # a crash: the lease is not released, it expires
    async with serving(single.url, "repairer") as (service, _):
        deadline = time.monotonic() + WAIT_S
        while (last := await admin.reader.last_record(session_id)) is None or last.open_turn:
            assert time.monotonic() < deadline, "the repairer did not close the turn"
            await asyncio.sleep(0.1)
        assert [n for s, n in service.repaired if s == session_id] == [1]  # the turn/end, by this replica
        # The CLI's `sessionlog repair-session`, as an agent runs it: nothing left to close.
        reply = await call(writer_log.nc, "sessionlog.repair.close", {"session": session_id}, timeout=5)
        assert reply == {"session": session_id, "closers": []}
    assert await checkpoints(admin, "repairer")
    assert violations(single, "repairer", since=mark) == []


@on_module_loop
async def test_the_ui_replayer_serves_transcripts_and_live_tails_under_its_own_user(
    single: EmbeddedServer, admin: SessionLog, writer_log: SessionLog
) -> None:
    mark = log_mark(single)
    session_id = await written_session(writer_log)
    async with serving(single.url, "ui-replayer") as (service, _), httpx.AsyncClient(base_url=service.url) as http:
        listing = await http.get("/api/sessions", timeout=5)
        assert listing.status_code == 200 and session_id in listing.text
        transcript = await http.get(f"/api/sessions/{session_id}/transcript", timeout=5)
        assert transcript.status_code == 200 and "answer 1" in transcript.text
        # every view, the fleet's health (other projections' checkpoints, partition leases) and the raw tee
        tabs = ("", "/context", "/audit", "/raw")
        for path in ("/", "/api/health", *(f"/sessions/{session_id}{tab}" for tab in tabs)):
            assert (await http.get(path, timeout=5)).status_code == 200, path
        async with http.stream("GET", f"/sessions/{session_id}/events", timeout=5) as tail:
            assert tail.status_code == 200
            first = await asyncio.wait_for(anext(tail.aiter_bytes()), WAIT_S)
            assert first
    assert await checkpoints(admin, "ui-replayer")
    assert violations(single, "ui-replayer", since=mark) == []


@on_module_loop
async def test_the_token_auditor_reports_under_its_own_user(
    single: EmbeddedServer, admin: SessionLog, writer_log: SessionLog
) -> None:
    mark = log_mark(single)
    session_id = await written_session(writer_log)
    async with serving(single.url, "token-auditor"):
        reply = await call(writer_log.nc, "sessionlog.audit.report", {"session": session_id}, timeout=5)
        assert reply["session"] == session_id and "ledger" in reply and "findings" in reply
    assert await checkpoints(admin, "token-auditor")
    assert violations(single, "token-auditor", since=mark) == []


HEADER: dict[str, Any] = {
    "config": {"provider": "scripted", "model": "scripted-model", "temperature": 0.2, "maxTokens": 64},
    "system": "You are terse.",
}


@on_module_loop
async def test_the_gateway_forwards_and_tees_under_its_own_user(
    single: EmbeddedServer, admin: SessionLog, writer_log: SessionLog
) -> None:
    mark = log_mark(single)
    from services.gateway import ScriptedProvider, ServerThread

    session_id = new_id("gw")
    writer = await writer_log.create(session_id)
    await writer.emit("turn/start", {"turn": 1})
    await writer.emit("user/message", user_message_data("Say hi.", "u1"), surface_op="append")
    await writer.emit("step/start", {"turn": 1, "step": 1})
    await writer.emit("request/header", {"header": HEADER, "reason": "initial"})
    seq = await writer.flush()
    provider = ScriptedProvider([{"text": "hi"}])
    try:
        with ServerThread(provider.app()) as upstream:
            async with serving(single.url, "gateway", provider_base_url=upstream.url) as (service, _):
                url = f"http://127.0.0.1:{service.config.port}/v1/sessions/{session_id}/completions"
                async with httpx.AsyncClient(timeout=10) as http:
                    response = await http.post(url, headers={"X-Session-Seq": str(seq)})
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["message"]["content"] == "hi"
                await service.gateway.tee.drain()
        raw = await admin.nc.request(
            "$JS.API.DIRECT.GET.SESSIONLOG_RAW", json.dumps({"last_by_subj": f"sessionlog.raw.{session_id}"}).encode()
        )
        assert raw.headers is not None and raw.headers.get("Sessionlog-Kind") == "response"
    finally:
        await writer.close()
    assert violations(single, "gateway", since=mark) == []


@on_module_loop
async def test_the_gateway_records_a_session_under_its_own_user(single: EmbeddedServer, admin: SessionLog) -> None:
    mark = log_mark(single)
    from services.gateway import ScriptedProvider, ServerThread

    session_id = new_id("rec")
    provider = ScriptedProvider([{"text": "", "tool_calls": [{"id": "c1", "name": "read", "arguments": "{}"}]},
                                 {"text": "done"}])  # fmt: skip
    with ServerThread(provider.app()) as upstream:
        async with serving(single.url, "gateway", provider_base_url=upstream.url) as (service, _):
            url = f"http://127.0.0.1:{service.config.port}/record/{session_id}/v1/chat/completions"
            messages: list[dict[str, object]] = [{"role": "user", "content": "read"}]
            async with httpx.AsyncClient(timeout=10) as http:
                first = await http.post(url, json={"model": "m", "messages": messages})
                assert first.status_code == 200, first.text
                messages += [first.json()["choices"][0]["message"], {"role": "tool", "tool_call_id": "c1",
                                                                     "content": "x"}]  # fmt: skip
                second = await http.post(url, json={"model": "m", "messages": messages, "stream": True})
                assert second.status_code == 200, second.text
            await service.gateway.tee.drain()
    _, session, _ = await admin.load(session_id)
    assert session.open_turn is None and [e.type for e in session][-1] == "turn/end"
    assert violations(single, "gateway", since=mark) == []


# ================================================================================================ live: the cluster


@on_module_loop
async def test_the_cluster_configs_form_a_cluster_that_keeps_r3_streams(tmp_path: Path) -> None:
    # Cluster picks the ports (and picks them again when one was taken before its node bound it); each node reads
    # its own config, n1.conf to n3.conf. The flags for ports, routes and server names override the config's.
    configs = [deploy_copy(tmp_path / f"config{i}") / "cluster" / f"n{i + 1}.conf" for i in range(len(NATS_NODES))]
    cluster = Cluster(tmp_path / "data", size=len(NATS_NODES), name="sessionlog",
                      extra_args=[["-c", str(config)] for config in configs])  # fmt: skip
    try:
        with server_env():
            cluster.start()
        url = cluster.url
        admin = await SessionLog.connect(role_settings(url, "admin", replicas=3))
        writer = await SessionLog.connect(role_settings(url, "writer", replicas=3))
        try:
            info = await admin.js.stream_info("SESSIONLOG")
            assert info.config.num_replicas == 3
            for node in cluster.servers:
                with urllib.request.urlopen(f"{node.monitor_url}/varz", timeout=5) as reply:
                    assert json.load(reply)["jetstream"]["config"]["sync_always"] is True
            await written_session(writer)
            written = await stream_messages(admin)
            assert written >= 1
            nc, _ = await connect_as(cluster[2].url, "context-deriver")
            try:
                with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
                    await publish_record(nc, new_id(), timeout=1)
            finally:
                await nc.close()
            info = await admin.js.stream_info("SESSIONLOG")
            assert info.state.messages == written
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        finally:
            await writer.close()
            await admin.close()
    finally:
        for node in cluster.servers:
            node.kill()
