"""`sessionlog up` killed with -9 leaves its embedded nats-server running; the next one takes it on and stops it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sessionlog.connection import OrphanedServer, adopt_orphaned_embedded, owner_file
from sessionlog.embedded import free_port, port_open
from sessionlog.settings import Settings

OWNER = (
    "import time\n"
    "from sessionlog.connection import ensure_embedded\n"
    "from sessionlog.settings import Settings\n"
    "print(ensure_embedded(Settings(_env_file=None)), flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc to tell a process's command line")
def test_an_embedded_server_whose_owner_was_killed_is_taken_on_and_stopped(tmp_path: Path) -> None:
    """Found probing record mode, 2026-12-05: the orphan served every later `sessionlog up`, none of which stopped
    it, though the README says Ctrl-C stops the server too."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "SESSIONLOG_NATS_URL"}
    env |= {"SESSIONLOG_DATA_DIR": str(tmp_path), "SESSIONLOG_EMBEDDED_PORT": str(port)}
    owner = subprocess.Popen([sys.executable, "-c", OWNER], env=env, stdout=subprocess.PIPE)
    orphan: OrphanedServer | None = None
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == f"nats://127.0.0.1:{port}".encode()
        record = json.loads(owner_file(Settings(_env_file=None, data_dir=tmp_path)).read_text())
        assert record["owner"] == owner.pid and record["port"] == port
        owner.kill()
        owner.wait(10)
        server = OrphanedServer(record["pid"])
        assert server.running and port_open("127.0.0.1", port)  # the orphan
        settings = Settings(_env_file=None, data_dir=tmp_path, embedded_port=port)
        orphan = adopt_orphaned_embedded(settings)
        assert orphan is not None and orphan.pid == record["pid"]
        assert json.loads(owner_file(settings).read_text())["owner"] == os.getpid()
        assert adopt_orphaned_embedded(settings) is None  # its owner (this process) is alive now
        orphan.stop()
        assert not server.running and not port_open("127.0.0.1", port)
    finally:
        if owner.poll() is None:
            owner.kill()
        if orphan is not None:
            orphan.stop()
        elif (tmp_path / "nats-server.owner.json").exists():
            OrphanedServer(json.loads((tmp_path / "nats-server.owner.json").read_text())["pid"]).stop()


def test_a_pid_that_is_not_this_folders_nats_server_is_never_taken_on(tmp_path: Path) -> None:
    """An owner file whose owner is gone, naming a pid that some other process has now: left alone."""
    settings = Settings(_env_file=None, data_dir=tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    owner_file(settings).write_text(json.dumps({"pid": os.getpid(), "owner": gone.pid, "port": 4222}))
    assert adopt_orphaned_embedded(settings) is None
    owner_file(settings).write_text("not json")
    assert adopt_orphaned_embedded(settings) is None


def test_a_taken_on_server_whose_pid_went_to_another_process_is_never_signalled() -> None:
    """Found reviewing, 2026-12-05: the pid was checked once, when taken on; a server that exited later and whose
    pid was reused would have had the other process killed at Ctrl-C. The process's start time tells them apart."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        server = OrphanedServer(other.pid)
        assert server.running
        server.started = "1"  # as if the server that had this pid had started at another time
        assert not server.running
        server.stop()
        assert other.poll() is None  # left alone
    finally:
        other.kill()
        other.wait(10)
