"""The async compute_score ``bench verl_loop`` gives both verl and stream-reward:
one POST per sample to the reference verifier server (``stream_reward/bench/verifier_server.py``).

One aiohttp session per event loop: verl calls it on its worker's loop, stream-reward's
worker processes on theirs.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
from typing import Any

import aiohttp

_SESSIONS: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}


async def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, *, url: str, **_: Any
) -> float:
    loop = asyncio.get_running_loop()
    session = _SESSIONS.get(loop)
    if session is None or session.closed:
        session = _SESSIONS[loop] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    payload = {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth}
    async with session.post(url, json=payload) as resp:
        resp.raise_for_status()
        body = await resp.json()
    return float(body["score"])


@atexit.register
def _drop_sessions() -> None:
    # A worker process exits with this module's sessions open (nothing calls
    # close_sessions there): close their sockets quietly instead of letting each
    # session's finalizer log "Unclosed client session" at exit.
    for session in _SESSIONS.values():
        connector = session.connector
        session.detach()
        if connector is not None:
            with contextlib.suppress(Exception):
                connector._close()
    _SESSIONS.clear()


async def close_sessions() -> None:
    for session in list(_SESSIONS.values()):
        await session.close()
    _SESSIONS.clear()
