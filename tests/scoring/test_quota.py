"""The global quota: GCRA reservations on the server's clock, TPM settling, leases in
flight, the shared 429 pause, adaptive rate, and two processes sharing one quota.

Spacing is checked on the reserved start times the script hands out (Redis
``TIME``), not on wall-clock sleeps, so the assertions are exact without being
flaky; wall-clock bounds, where any, are generous.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import wait_until

from stream_reward.config import QuotaConfig
from stream_reward.errors import ConfigDeprecationWarning, ConfigError
from stream_reward.scoring.quota import QuotaLimiter
from stream_reward.wire.keys import Keys

pytestmark = pytest.mark.anyio

EPS = 2e-6  # start times are whole microseconds, rounded up


def spacing(starts: list[float]) -> list[float]:
    starts = sorted(starts)
    return [b - a for a, b in zip(starts, starts[1:])]


async def test_rpm_reservations_are_spaced_by_the_interval(redis_url: str, namespace: str) -> None:
    limiter = QuotaLimiter(redis_url, QuotaConfig("v", max_rpm=6000), namespace=namespace)  # one per 10 ms
    starts = []

    async def one() -> None:
        async with limiter.lease() as lease:
            starts.append(lease.start_at)

    began = time.monotonic()
    await asyncio.gather(*(one() for _ in range(30)))
    elapsed = time.monotonic() - began
    await limiter.aclose()
    assert len(starts) == 30
    assert min(spacing(starts)) >= 0.010 - EPS
    assert elapsed >= 0.25  # 29 intervals of 10 ms had to pass
    assert elapsed < 5


async def test_burst_lets_the_first_requests_through_together(redis_url: str, namespace: str) -> None:
    limiter = QuotaLimiter(redis_url, QuotaConfig("v", max_rpm=600, burst=4), namespace=namespace)  # 100 ms apart
    leases = [await limiter.acquire() for _ in range(5)]
    for lease in leases:
        await limiter.release(lease)
    await limiter.aclose()
    first = leases[0].start_at
    assert all(lease.start_at - first < 0.05 for lease in leases[:4])
    assert leases[4].start_at - first >= 0.1 - 0.05  # the fifth waits for the budget


async def test_tpm_charges_the_estimate_then_settles(redis_url: str, namespace: str) -> None:
    # 1,000 tokens/s: the estimate (1000 tokens, also the burst) books 1 s ahead, 10 tokens 10 ms.
    # The booking is read back a round trip later on the server's clock, so the check on it
    # leaves half the second for that round trip on a loaded machine.
    cfg = QuotaConfig("v", max_tpm=60_000, estimated_tokens_per_request=1000)
    limiter = QuotaLimiter(redis_url, cfg, namespace=namespace)
    async with limiter.lease() as lease:
        charged = await limiter.state()
        lease.settle(10)  # without await
    assert charged["tokens"] == 1000
    assert charged["tpm_reserved_ahead_s"] > 0.5
    state = await limiter.state()
    assert state["tokens"] == 10
    assert state["tpm_reserved_ahead_s"] <= 0.01 + EPS  # settled: 10 ms booked from the start, less since
    async with limiter.lease(tokens=1500) as big:  # 1.5 s of budget, past the 1 s burst
        await big.settle(1500)  # with await, too
    async with limiter.lease(tokens=10) as after:
        pass
    await limiter.aclose()
    # A request larger than the burst goes at once and is paid for afterwards:
    # the next one waits for its cost less the burst (1500 + 10 - 1000 ms).
    assert after.start_at - big.start_at >= 0.5 - EPS
    assert state["requests"] == 1


async def test_settle_after_the_lease_ended(redis_url: str, namespace: str) -> None:
    limiter = QuotaLimiter(
        redis_url, QuotaConfig("v", max_tpm=600_000, estimated_tokens_per_request=50), namespace=namespace
    )
    async with limiter.lease() as lease:
        pass
    lease.settle(75)
    await limiter.aclose()  # waits for the correction
    check = QuotaLimiter(redis_url, QuotaConfig("v"), namespace=namespace)
    assert (await check.state())["tokens"] == 75
    await check.aclose()


async def test_max_concurrent_holds_the_next_request_until_a_release(redis_url: str, namespace: str) -> None:
    limiter = QuotaLimiter(redis_url, QuotaConfig("v", max_concurrent=2), namespace=namespace)
    a = await limiter.acquire()
    b = await limiter.acquire()
    assert (await limiter.state())["in_flight"] == 2
    third = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0.2)
    assert not third.done()
    await limiter.release(a)
    c = await asyncio.wait_for(third, 5)
    assert (await limiter.state())["in_flight"] == 2
    await limiter.release(b)
    await limiter.release(c)
    assert (await limiter.state())["in_flight"] == 0
    await limiter.aclose()


async def test_lease_of_a_dead_worker_expires(redis_url: str, namespace: str) -> None:
    cfg = QuotaConfig("v", max_concurrent=1, lease_ttl_s=0.3)
    dead = QuotaLimiter(redis_url, cfg, namespace=namespace)
    await dead.acquire()  # never released, never renewed: its worker "died"
    live = QuotaLimiter(redis_url, cfg, namespace=namespace)
    began = time.monotonic()
    lease = await asyncio.wait_for(live.acquire(), 10)
    assert time.monotonic() - began >= 0.2
    await live.release(lease)
    await live.aclose()
    await dead.aclose()


async def test_live_leases_are_renewed(redis_url: str, namespace: str) -> None:
    cfg = QuotaConfig("v", max_concurrent=1, lease_ttl_s=0.3)
    limiter = QuotaLimiter(redis_url, cfg, namespace=namespace)
    other = QuotaLimiter(redis_url, cfg, namespace=namespace)
    async with limiter.lease():
        waiting = asyncio.create_task(other.acquire())
        await asyncio.sleep(0.8)  # well past the TTL: a renewed lease still counts
        assert not waiting.done()
    lease = await asyncio.wait_for(waiting, 5)
    await other.release(lease)
    await other.aclose()
    await limiter.aclose()


async def test_cancelled_waiter_gives_its_lease_back(redis_url: str, namespace: str) -> None:
    limiter = QuotaLimiter(redis_url, QuotaConfig("v", max_rpm=60, max_concurrent=5), namespace=namespace)
    async with limiter.lease():
        pass
    waiter = asyncio.create_task(limiter.acquire())  # reserved ~1 s ahead, sleeping
    await asyncio.sleep(0.1)
    assert (await limiter.state())["in_flight"] == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await limiter.aclose()
    check = QuotaLimiter(redis_url, QuotaConfig("v"), namespace=namespace)
    assert (await check.state())["in_flight"] == 0
    await check.aclose()


async def test_block_for_pauses_every_limiter_of_the_quota(redis_url: str, namespace: str) -> None:
    cfg = QuotaConfig("v", max_rpm=60_000)
    a = QuotaLimiter(redis_url, cfg, namespace=namespace)
    b = QuotaLimiter(redis_url, cfg, namespace=namespace)
    await a.block_for(0.4)
    state = await b.state()
    assert state["http_429"] == 1
    assert 0 < state["blocked_for_s"] <= 0.4
    blocked_until = state["blocked_until"]
    await a.block_for(0.05)  # a shorter pause never shortens a longer one
    assert (await b.state())["blocked_until"] == blocked_until
    lease = await asyncio.wait_for(b.acquire(), 5)
    assert lease.start_at >= blocked_until
    assert lease.waited_s >= 0.2
    await b.release(lease)
    await a.aclose()
    await b.aclose()


async def test_reservation_inside_a_later_pause_is_given_up(redis_url: str, namespace: str) -> None:
    cfg = QuotaConfig("v", max_rpm=120)  # one every 500 ms
    a = QuotaLimiter(redis_url, cfg, namespace=namespace)
    b = QuotaLimiter(redis_url, cfg, namespace=namespace)
    first = await a.acquire()
    second = asyncio.create_task(a.acquire())  # reserved for +0.5 s
    await asyncio.sleep(0.1)
    await b.block_for(1.0)  # another worker got a 429 meanwhile
    until = (await b.state())["blocked_until"]
    lease = await asyncio.wait_for(second, 10)
    assert lease.start_at >= until
    assert lease.start_at - first.start_at >= 1.0
    await a.aclose()
    await b.aclose()


async def test_adaptive_rate_drops_after_repeated_429s_and_recovers(redis_url: str, namespace: str) -> None:
    # The server's clock runs on between any two calls, by a round trip on a quiet machine and
    # by much more beside a loaded one: each check below leaves a good part of a second for it.
    cfg = QuotaConfig("v", max_rpm=6000, adaptive=True, rate_decrease=0.5, recovery_s=2.0, repeat_window_s=30)
    limiter = QuotaLimiter(redis_url, cfg, namespace=namespace)

    async def pause_over() -> bool:
        return (await limiter.state())["blocked_for_s"] == 0

    await limiter.block_for(0.6)
    assert (await limiter.state())["rate_factor"] == 1.0  # one 429 is a pause, not a trend
    await limiter.block_for(0.02)  # a straggler inside the pause changes nothing
    assert (await limiter.state())["rate_factor"] == 1.0
    await wait_until(pause_over, timeout_s=10, every_s=0.02)
    await limiter.block_for(0.02)  # the pause did not help: slow down
    state = await limiter.state()
    assert 0.5 <= state["rate_factor"] < 0.75  # back to full over 2 s: 0.5 s of slack
    assert state["effective_rpm"] == pytest.approx(6000 * state["rate_factor"])
    await wait_until(pause_over, timeout_s=10, every_s=0.02)
    a = await limiter.acquire()
    b = await limiter.acquire()
    # The interval grew with the lower rate (the factor recovers as time passes: read it off the leases).
    assert max(a.rate_factor, b.rate_factor) < 1.0
    assert b.start_at - a.start_at >= 0.010 / max(a.rate_factor, b.rate_factor) - EPS

    async def recovered() -> bool:
        return (await limiter.state())["rate_factor"] == 1.0

    await wait_until(recovered, timeout_s=10)
    await limiter.aclose()


async def test_keys_share_one_cluster_slot(redis_url: str, namespace: str) -> None:
    limiter = QuotaLimiter(redis_url, QuotaConfig("api-key-1", max_rpm=600, max_concurrent=3), namespace=namespace)
    prefix = Keys(namespace).quota("api-key-1")
    assert all(key.startswith(prefix) for key in limiter.keys)
    async with limiter.lease():
        found = sorted(k.decode() for k in await limiter.client.keys(f"{prefix}*"))
    assert found == sorted(limiter.keys)
    await limiter.aclose()


def test_limiter_binds_no_loop_in_init(redis_url: str) -> None:
    # Built outside any running loop, then used inside two successive ones.
    limiter = QuotaLimiter(redis_url, QuotaConfig("v"), namespace="noloop")

    async def use() -> None:
        async with limiter.lease():
            pass
        await limiter.aclose()

    asyncio.run(use())
    asyncio.run(use())


def test_bad_quota_config_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="quota_key"):
        QuotaConfig("a{b}")
    with pytest.raises(ConfigError, match="max_rpm"):
        QuotaConfig("a", max_rpm=0)
    with pytest.raises(ConfigError, match="max_concurrent"):
        QuotaConfig("a", max_concurrent=-1)
    with pytest.raises(ConfigError, match="burst"):
        QuotaConfig("a", burst=0.5)


_CHILD = textwrap.dedent("""
    import asyncio, json, sys
    from stream_reward.scoring.quota import QuotaConfig, QuotaLimiter

    async def main(url, ns, n):
        limiter = QuotaLimiter(url, QuotaConfig("shared", max_rpm=1200), namespace=ns)
        starts = []
        async def one():
            async with limiter.lease() as lease:
                starts.append(lease.start_at)
        await asyncio.gather(*(one() for _ in range(n)))
        await limiter.aclose()
        print(json.dumps(starts))

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
""")


def test_two_processes_share_one_schedule(redis_url: str, namespace: str) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHILD, redis_url, namespace, "15"], stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=30)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    per_process = [json.loads(out) for out in outputs]
    merged = [s for starts in per_process for s in starts]
    assert len(merged) == 30
    # One schedule for both: 50 ms between any two requests, whoever made them.
    assert min(spacing(merged)) >= 0.050 - EPS
    assert max(merged) - min(merged) >= 29 * 0.050 - EPS


def test_the_old_max_inflight_keyword_still_works_with_a_warning() -> None:
    with pytest.warns(ConfigDeprecationWarning, match="max_inflight.*max_concurrent"):
        cfg = QuotaConfig("v", max_inflight=3)
    assert cfg.max_concurrent == 3
    with pytest.warns(ConfigDeprecationWarning):
        assert cfg.max_inflight == 3
    with pytest.warns(ConfigDeprecationWarning), pytest.raises(ConfigError, match="old name of max_concurrent"):
        QuotaConfig("v", max_concurrent=2, max_inflight=3)
