"""Test session fixtures: one real Redis-compatible server for the session, a fresh
namespace per test (instead of FLUSHALL), and factories that close what they open."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from stream_reward.ops.embedded import EmbeddedServer


@pytest.fixture(scope="session")
def server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer() as srv:
        yield srv


@pytest.fixture(scope="session")
def redis_url(server: EmbeddedServer) -> str:
    return server.url


@pytest.fixture
def own_url() -> Iterator[str]:
    """A server of the test's own, for a test that pauses or kills its clients (on the
    shared session server that would stall or cut the tests xdist runs beside it) or
    counts commands server-wide (theirs would count too)."""
    with EmbeddedServer() as srv:
        yield srv.url


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def spawn_workers(redis_url: str, namespace: str) -> Iterator:
    """``spawn_workers(n, *args, url=None)`` starts worker processes; all are stopped after the test."""
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(n: int = 1, *args: str, url: str | None = None, ns: str | None = None) -> list[subprocess.Popen[bytes]]:
        started = []
        for _ in range(n):
            argv = [
                sys.executable,
                "-m",
                "workers",
                "--redis",
                url or redis_url,
                "--namespace",
                ns or namespace,
                "--log-level",
                os.environ.get("STREAM_REWARD_TEST_LOG", "WARNING"),
                *args,
            ]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
            procs.append(proc)
            started.append(proc)
        return started

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No STREAM_REWARD_* setting from the outer environment leaks into a test."""
    for name in list(os.environ):
        if name.startswith("STREAM_REWARD_") and name not in ("STREAM_REWARD_SERVER_BIN", "STREAM_REWARD_TEST_LOG"):
            monkeypatch.delenv(name)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """The root logger's handlers and level as they were: ``main([...])`` configures logging."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
