"""The embedded server: a private child on a unix socket only (its dir 0700), that dies with
its owner and leaves nothing behind (the next server reclaims an orphan's dir); ``stream-reward
server`` prints its URL first and, with ``--dir --appendonly``, keeps its data across restarts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ops_support import _alive

from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.wire.connection import connect

ROOT = Path(__file__).resolve().parents[2]


OWNER = """
import sys, time
from stream_reward.ops.embedded import EmbeddedServer
server = EmbeddedServer().start()
print(server.pid, server.socket_path, flush=True)
time.sleep(600)
"""


def test_server_dies_with_a_sigkilled_owner_and_its_dir_is_reclaimed():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    pid_text, socket_path = owner.stdout.readline().split()
    server_pid = int(pid_text)
    assert _alive(server_pid) and os.path.exists(socket_path)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    owner.stdout.close()
    deadline = time.monotonic() + 5
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(server_pid)
    with EmbeddedServer():  # the next server removes the orphaned dir
        assert not os.path.exists(os.path.dirname(socket_path))


def test_server_is_unix_socket_only_and_cleans_up():
    with EmbeddedServer() as server:
        path = server.socket_path
        assert server.url.startswith("unix://")
        assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
        import redis

        client = redis.Redis(unix_socket_path=path)
        try:
            assert client.config_get("port") == {"port": "0"}  # no TCP listener at all
        finally:
            client.close()
    assert not os.path.exists(os.path.dirname(path))


def test_server_command_prints_its_url_first():
    proc = subprocess.Popen([sys.executable, "-m", "stream_reward.cli", "server"], stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("unix://") and url.endswith(".sock")
        assert os.path.exists(url.removeprefix("unix://"))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        proc.stdout.close()
    assert not os.path.exists(url.removeprefix("unix://"))


def test_server_dir_keeps_appendonly_data_across_restarts(tmp_path):
    data = tmp_path / "data"

    def run_server() -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stream_reward.cli", "server", "--appendonly", "--dir", str(data)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        return proc, proc.stdout.readline().strip()

    async def set_then_get(url: str, value: bytes | None) -> bytes | None:
        client = connect(url)
        try:
            if value is not None:
                await client.set("kept", value)
            return await client.get("kept")
        finally:
            await client.aclose()

    proc, url = run_server()
    assert asyncio.run(set_then_get(url, b"yes")) == b"yes"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    proc.stdout.close()
    proc, url = run_server()
    try:
        assert asyncio.run(set_then_get(url, None)) == b"yes"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        proc.stdout.close()
