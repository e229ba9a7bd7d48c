"""A worker of another protocol version refuses to join a namespace (exit 2, no traceback),
and so does a producer.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
from helpers import WIDTH

from stream_reward import RolloutProducer
from stream_reward.config import ProducerConfig
from stream_reward.wire.codec import PROTOCOL_VERSION
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("processes", ["1", "2"])
async def test_a_worker_of_another_protocol_version_refuses_to_join(
    redis_url: str, namespace: str, processes: str
) -> None:
    client = connect(redis_url)
    try:
        await client.hset(Keys(namespace).namespace_info(), mapping={"protocol": PROTOCOL_VERSION + 1, "epoch": "e"})
    finally:
        await client.aclose()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "workers",
        "--redis",
        redis_url,
        "--namespace",
        namespace,
        "--processes",
        processes,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:  # a supervisor restarting refused children forever
            proc.terminate()
            await proc.wait()
    assert proc.returncode == 2
    assert b"protocol" in err and b"Traceback" not in err
    with pytest.raises(Exception, match="protocol"):
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("z", 1, WIDTH)
