"""What a namespace is doing right now, read from Redis (``stream-reward status``),
and the trainer-side batch metrics (``record_batch``).

Everything comes from keys the pipeline already keeps: XINFO of the trajectory
streams (length, lag, pending per group and consumer), the workers' heartbeat
hash, the dead-letter streams, the open-batch sorted set with each batch's meta
hash and result ledgers, and the quota keys. Nothing here writes to Redis.

A worker is *alive* when its heartbeat was seen within 3 heartbeat intervals,
*stale* when it has a heartbeat record but an older one (crashed, or cut off
from Redis), and *gone* when the group still lists it as a consumer (possibly
holding pending entries) but it left no heartbeat at all.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import msgpack
from redis.exceptions import ResponseError

from stream_reward.config import DEFAULT_GROUP, DEFAULT_NAMESPACE
from stream_reward.wire.batch_meta import BatchMeta
from stream_reward.wire.connection import connect, mask_url
from stream_reward.wire.deadletter import decode_dead_letter
from stream_reward.wire.entries import group_state
from stream_reward.wire.heartbeat import parse_heartbeats, server_time
from stream_reward.wire.heartbeat import text as _s
from stream_reward.wire.keys import Keys
from stream_reward.wire.lag import read_partition_lags

__all__ = ["read_status", "read_heartbeats", "render_status", "record_batch"]


async def read_heartbeats(
    client: Any, keys: Keys, *, interval_s: float = 2.0, now: float | None = None
) -> dict[str, dict[str, Any]]:
    """Consumer name -> its heartbeat record, with ``age_s`` and ``alive`` added; ages on
    the server's clock unless ``now`` is given."""
    now = await server_time(client) if now is None else now
    return parse_heartbeats(await client.hgetall(keys.workers()), interval_s=interval_s, now=now)


async def _stream_info(client: Any, keys: Keys, partition: int) -> dict[str, Any]:
    name = keys.stream(partition)
    out: dict[str, Any] = {
        "partition": partition,
        "stream": name,
        "exists": True,
        "length": 0,
        "entries_added": 0,
        "samples_pushed": 0,
        "last_id": None,
        "groups": [],
    }
    out["samples_pushed"] = int(await client.hget(keys.pushed(partition), "samples") or 0)
    try:
        info = await client.xinfo_stream(name)
    except ResponseError:  # no such key: nothing was ever pushed to this partition
        out["exists"] = False
        return out
    out.update(
        length=int(info.get("length", 0)),
        entries_added=int(info.get("entries-added", 0) or 0),
        last_id=_s(info.get("last-generated-id")),
    )
    lags = {g.group: g for g in await read_partition_lags(client, keys, partition)}
    for group in map(group_state, await client.xinfo_groups(name)):
        lag = lags.get(group["name"])
        consumers = []
        for consumer in await client.xinfo_consumers(name, group["name"]):
            consumers.append(
                {
                    "name": _s(consumer["name"]),
                    "pending": int(consumer.get("pending", 0)),
                    "idle_ms": int(consumer.get("idle", 0)),
                    "inactive_ms": int(consumer["inactive"]) if consumer.get("inactive") is not None else None,
                }
            )
        out["groups"].append(
            {
                "group": group["name"],
                "consumers": group["consumers"],
                "pending": group["pending"],
                "lag": group["lag"],
                # The lag in samples (wire/lag.py); None for a group that came after the reading.
                "lag_samples": lag.lag_samples if lag else None,
                "lag_samples_exact": lag.exact if lag else None,
                "entries_read": group["entries_read"],
                "last_delivered_id": group["last_delivered_id"],
                "consumer_list": consumers,
            }
        )
    return out


async def _batches(client: Any, keys: Keys, limit: int, now: float) -> tuple[int, list[dict[str, Any]]]:
    total = await client.zcard(keys.batches())
    ids = await client.zrange(keys.batches(), -limit, -1, withscores=True) if limit > 0 else []
    batches = []
    for raw_id, created in reversed(ids):  # newest first
        batch_id = _s(raw_id)
        raw = await client.hgetall(keys.batch_meta(batch_id))
        try:
            meta: BatchMeta | None = BatchMeta.decode(raw)
        except (KeyError, ValueError):
            meta = None  # expired meanwhile, or not a batch's record: listed with what is known
        parts = meta.partitions if meta else 1
        bkeys = Keys(keys.namespace, parts)
        done = 0
        for p in range(parts):
            done += int(await client.hlen(bkeys.results(batch_id, p, meta.group if meta else DEFAULT_GROUP)))
        size = meta.size if meta else None
        deadline = meta.deadline if meta else 0.0
        batches.append(
            {
                "batch": batch_id,
                "size": size,
                "done": done,
                "complete": round(done / size, 4) if size else (1.0 if size == 0 else None),
                "created": meta.created if meta and meta.created else float(created),
                "age_s": round(now - float(created), 3),
                "deadline_in_s": round(deadline - now, 3) if deadline else None,
                "on_failure": meta.policy.on_failure if meta else None,
                "response_len": meta.response_len if meta else None,
                "partitions": parts,
                "meta": meta is not None,
            }
        )
    return int(total), batches


async def _dead_letters(client: Any, keys: Keys, recent: int) -> dict[str, Any]:
    per_partition = [int(await client.xlen(keys.dead_letters(p))) for p in range(keys.partitions)]
    latest: list[dict[str, Any]] = []
    for p in range(keys.partitions):
        if not per_partition[p] or recent <= 0:
            continue
        for entry_id, fields in await client.xrevrange(keys.dead_letters(p), count=recent):
            try:
                letter = decode_dead_letter(p, entry_id, fields).summary()
            except (KeyError, ValueError, TypeError, msgpack.UnpackException):
                letter = dict.fromkeys(("reason", "batch", "index", "uid", "consumer", "deliveries", "at"))
            error = str(letter.get("error") or "")
            letter.pop("payload_bytes", None)
            letter.update(id=_s(entry_id), partition=p, error=error[:200] + ("..." if len(error) > 200 else ""))
            latest.append(letter)
    latest.sort(key=lambda d: d.get("at") or 0, reverse=True)
    return {"total": sum(per_partition), "partitions": per_partition, "recent": latest[:recent]}


async def _quota(client: Any, namespace: str, limits: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Each verifier's shared quota: ``QuotaLimiter.state()`` (counters, in flight, pause,
    how far ahead the schedule is booked), else the raw keys under its prefix.

    Names are found by scanning for the quota hash tags. ``limits`` (name ->
    QuotaConfig fields, from the config) fills in the configured limits, which
    live in the workers' settings rather than in Redis.
    """
    prefix = "{" + namespace + ":quota:"
    keys_by_name: dict[str, list[str]] = {}
    async for raw in client.scan_iter(match=prefix.replace("[", "\\[") + "*", count=500):
        key = _s(raw)
        name = key[len(prefix) :].split("}", 1)[0]
        keys_by_name.setdefault(name, []).append(key)
    out = []
    for name in sorted(keys_by_name):
        entry: dict[str, Any] = {"name": name}
        try:
            entry["state"] = await _quota_state(client, namespace, name, (limits or {}).get(name, {}))
        except Exception as exc:  # status must show the rest even if one quota cannot be read
            entry["state_error"] = f"{type(exc).__name__}: {exc}"
        if entry.get("state") is None:
            entry["keys"] = {
                key.split("}", 1)[1].lstrip(":") or key: await _key_value(client, key)
                for key in sorted(keys_by_name[name])
            }
        out.append(entry)
    return out


async def _quota_state(client: Any, namespace: str, name: str, limits: dict[str, Any]) -> dict[str, Any] | None:
    if importlib.util.find_spec("stream_reward.scoring.quota") is None:
        return None
    from stream_reward.config import QuotaConfig
    from stream_reward.scoring.quota import QuotaLimiter

    fields = QuotaConfig.__dataclass_fields__
    limiter = QuotaLimiter(
        client,
        QuotaConfig(name=name, **{k: v for k, v in limits.items() if k in fields and k != "name"}),
        namespace=namespace,
    )
    try:
        return dict(await limiter.state())
    finally:
        await limiter.aclose()


async def _key_value(client: Any, key: str) -> dict[str, Any]:
    kind = _s(await client.type(key))
    value: Any
    if kind == "string":
        value = _s(await client.get(key))
    elif kind == "hash":
        value = {_s(k): _s(v) for k, v in (await client.hgetall(key)).items()}
    elif kind == "zset":
        value = {"card": int(await client.zcard(key))}
    elif kind == "list":
        value = {"len": int(await client.llen(key))}
    elif kind == "stream":
        value = {"len": int(await client.xlen(key))}
    else:
        value = None
    ttl = int(await client.pttl(key))
    return {"type": kind, "value": value, "ttl_ms": ttl if ttl >= 0 else None}


def _consumers(streams: list[dict[str, Any]], beats: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for stream in streams:
        for group in stream["groups"]:
            for c in group["consumer_list"]:
                row = merged.setdefault(
                    c["name"], {"name": c["name"], "group": group["group"], "pending": 0, "idle_ms": None}
                )
                row["pending"] += c["pending"]
                row["idle_ms"] = c["idle_ms"] if row["idle_ms"] is None else min(row["idle_ms"], c["idle_ms"])
    for name, beat in beats.items():
        row = merged.setdefault(name, {"name": name, "group": beat.get("group"), "pending": 0, "idle_ms": None})
        for key in (
            "host",
            "pid",
            "started",
            "seen",
            "age_s",
            "scorer",
            "scored",
            "failed",
            "dead_letters",
            "reclaimed",
            "duplicates",
            "in_flight",
        ):
            if key in beat:
                row[key] = beat[key]
        row["group"] = row.get("group") or beat.get("group")
    for name, row in merged.items():
        heartbeat = beats.get(name)
        row["state"] = "gone" if heartbeat is None else ("alive" if heartbeat["alive"] else "stale")
    return sorted(merged.values(), key=lambda r: ({"alive": 0, "stale": 1, "gone": 2}[r["state"]], r["name"]))


async def read_status(
    redis_url: str,
    namespace: str = DEFAULT_NAMESPACE,
    *,
    partitions: int | None = None,
    heartbeat_interval_s: float = 2.0,
    window_s: float = 0.0,
    batch_limit: int = 20,
    recent_dead_letters: int = 5,
    quota_limits: dict[str, dict[str, Any]] | None = None,
    client: Any = None,
) -> dict[str, Any]:
    """A JSON-able snapshot of the namespace (see docs/operations.md for the fields).

    ``window_s > 0`` reads the heartbeat counters and stream counters twice,
    that far apart, for the throughput figures; 0 leaves ``throughput`` None.
    """
    own = client is None
    client = client or connect(redis_url)
    try:
        now = await server_time(client)  # the clock batch stamps and heartbeats are on
        bkeys = Keys(namespace)
        metas = await client.zrange(bkeys.batches(), -batch_limit, -1) if batch_limit > 0 else []
        declared = []
        for raw in metas:
            value = await client.hget(bkeys.batch_meta(_s(raw)), "partitions")
            if value is not None:
                declared.append(int(value))
        beats = await read_heartbeats(client, bkeys, interval_s=heartbeat_interval_s)
        # Partition tags depend on P, so P cannot be probed from key names: take
        # what open batches and live workers declare.
        declared += [int(beat.get("partitions", 1) or 1) for beat in beats.values()]
        parts = partitions or max([1, *declared])
        keys = Keys(namespace, parts)
        streams = [await _stream_info(client, keys, p) for p in range(parts)]
        throughput = None
        if window_s > 0:
            throughput = await _throughput(client, keys, streams, beats, window_s, heartbeat_interval_s)
        # Workers that keep their own one-minute rate in the heartbeat need no sampling.
        rates = [b["settled_per_s_1m"] for b in beats.values() if b["alive"] and "settled_per_s_1m" in b]
        groups: dict[str, dict[str, Any]] = {}
        for stream in streams:
            for g in stream["groups"]:
                agg = groups.setdefault(g["group"], {"pending": 0, "lag": 0, "lag_samples": 0, "consumers": 0})
                agg["pending"] += g["pending"]
                agg["lag_samples"] = (
                    None
                    if agg["lag_samples"] is None or g["lag_samples"] is None
                    else agg["lag_samples"] + g["lag_samples"]
                )
                agg["consumers"] = max(agg["consumers"], g["consumers"])
                agg["lag"] = None if agg["lag"] is None or g["lag"] is None else agg["lag"] + g["lag"]
        consumers = _consumers(streams, beats)
        open_batches, batches = await _batches(client, keys, batch_limit, now)
        return {
            "redis": mask_url(redis_url),
            "namespace": namespace,
            "time": now,
            "partitions": parts,
            "heartbeat_interval_s": heartbeat_interval_s,
            "streams": [
                {**s, "groups": [{k: v for k, v in g.items() if k != "consumer_list"} for g in s["groups"]]}
                for s in streams
            ],
            "groups": groups,
            "workers": {
                state: sum(1 for c in consumers if c["state"] == state) for state in ("alive", "stale", "gone")
            },
            "consumers": consumers,
            "throughput": throughput,
            "settled_per_s_1m": round(sum(rates), 2) if rates else None,
            "dead_letters": await _dead_letters(client, keys, recent_dead_letters),
            "quota": await _quota(client, namespace, quota_limits),
            "open_batches": open_batches,
            "batches": batches,
        }
    finally:
        if own:
            await client.aclose()


async def _throughput(
    client: Any,
    keys: Keys,
    streams: list[dict[str, Any]],
    beats: dict[str, dict[str, Any]],
    window_s: float,
    interval_s: float,
) -> dict[str, Any]:
    """Rates from two readings ``window_s`` apart: heartbeat counters (scored, failed) and
    the streams' samples pushed (an entry holds several). A worker's rate uses its own
    heartbeat times."""
    await asyncio.sleep(window_s)
    later_streams = [await _stream_info(client, keys, p) for p in range(keys.partitions)]
    later = await read_heartbeats(client, keys, interval_s=interval_s)
    scored = failed = 0.0
    for name, beat in later.items():
        first = beats.get(name)
        if first is None:
            continue
        dt = float(beat.get("seen", 0)) - float(first.get("seen", 0))
        if dt <= 0:
            continue  # no new heartbeat in the window: no reading for this worker
        scored += (int(beat.get("scored", 0)) - int(first.get("scored", 0))) / dt
        failed += (int(beat.get("failed", 0)) - int(first.get("failed", 0))) / dt
    pushed = sum(b["samples_pushed"] - a["samples_pushed"] for a, b in zip(streams, later_streams)) / window_s
    return {
        "window_s": window_s,
        "scored_per_s": round(scored, 2),
        "failed_per_s": round(failed, 2),
        "pushed_per_s": round(pushed, 2),
    }


# ---------------------------------------------------------------------- rendering
def render_status(status: dict[str, Any], console: Any = None) -> None:
    """The snapshot as rich tables (for a terminal; ``--json`` prints the dict instead)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    w = status["workers"]
    console.print(
        f"[bold]stream-reward[/] namespace [cyan]{status['namespace']}[/] on {status['redis']}  "
        f"partitions {status['partitions']}  workers: [green]{w['alive']} alive[/], "
        f"{'[yellow]' if w['stale'] else ''}{w['stale']} stale{'[/]' if w['stale'] else ''}, {w['gone']} gone"
    )
    if status.get("settled_per_s_1m") is not None:
        console.print(f"throughput (workers' last minute): {status['settled_per_s_1m']:,.1f} settled/s")
    t = status.get("throughput")
    if t:
        console.print(
            f"throughput ({t['window_s']:g}s): {t['scored_per_s']:,.1f} scored/s, "
            f"{t['failed_per_s']:,.1f} failed/s, {t['pushed_per_s']:,.1f} pushed/s"
        )

    # Redis counts a stream's length, lag and pending in entries, and an entry holds up to
    # samples_per_entry samples: the title says so, and the samples pushed and the lag in
    # samples (~: an estimate, see wire/lag.py) stand next to them.
    table = Table(
        title="streams (entries, added, lag, pending: stream entries, of several samples each; "
        "samples, lag samples: samples)",
        title_justify="left",
    )
    for col in ("stream", "entries", "added", "samples", "group", "consumers", "lag", "lag samples", "pending"):
        table.add_column(col, justify="left" if col in ("stream", "group") else "right")
    for s in status["streams"]:
        counts = (f"{s['length']:,}", f"{s['entries_added']:,}", f"{s.get('samples_pushed', 0):,}")
        if not s["groups"]:
            table.add_row(s["stream"], *counts, "-", "-", "-", "-", "-")
        for g in s["groups"]:
            lag = "?" if g["lag"] is None else f"{g['lag']:,}"
            behind = g.get("lag_samples")
            lag_samples = "?" if behind is None else ("" if g.get("lag_samples_exact") else "~") + f"{behind:,}"
            table.add_row(
                s["stream"],
                *counts,
                g["group"],
                str(g["consumers"]),
                lag,
                lag_samples,
                f"{g['pending']:,}",
            )
    console.print(table)

    if status["consumers"]:
        table = Table(title="consumers (pending: stream entries; in flight, scored...: samples)", title_justify="left")
        for col in ("name", "state", "host:pid", "beat", "idle", "pending", "in flight", "scored", "failed", "dead"):
            table.add_column(
                col,
                justify="left" if col in ("name", "state", "host:pid") else "right",
                no_wrap=col != "host:pid",
                overflow="fold",
            )
        colour = {"alive": "green", "stale": "yellow", "gone": "red"}
        for c in status["consumers"]:
            where = f"{c['host']}:{c.get('pid', '?')}" if c.get("host") else "-"
            table.add_row(
                c["name"],
                f"[{colour[c['state']]}]{c['state']}[/]",
                where,
                f"{c['age_s']:.1f}s" if "age_s" in c else "-",
                f"{c['idle_ms'] / 1000:.1f}s" if c.get("idle_ms") is not None else "-",
                str(c["pending"]),
                *(str(c.get(k, "-")) for k in ("in_flight", "scored", "failed", "dead_letters")),
            )
        console.print(table)

    if status["batches"]:
        table = Table(title=f"open batches ({status['open_batches']}, newest first)", title_justify="left")
        for col in ("batch", "done", "size", "complete", "age", "deadline in", "policy"):
            table.add_column(col, justify="left" if col in ("batch", "policy") else "right")
        for b in status["batches"]:
            table.add_row(
                b["batch"],
                f"{b['done']:,}",
                f"{b['size']:,}" if b["size"] is not None else "?",
                f"{b['complete'] * 100:.1f}%" if b["complete"] is not None else "?",
                f"{b['age_s']:.1f}s",
                f"{b['deadline_in_s']:.1f}s" if b["deadline_in_s"] is not None else "-",
                str(b.get("on_failure") or "-"),
            )
        console.print(table)
    else:
        console.print("open batches: none")

    dl = status["dead_letters"]
    console.print(
        f"dead letters: {'[red]' if dl['total'] else ''}{dl['total']:,}{'[/]' if dl['total'] else ''}"
        + (f"  (per partition {dl['partitions']})" if len(dl["partitions"]) > 1 else "")
    )
    for d in dl["recent"]:
        console.print(
            f"  {d['id']}  {d['reason']}  batch={d['batch']} index={d['index']}  {d['error']}",
            markup=False,
            highlight=False,
        )
    for q in status["quota"]:
        state = q.get("state")
        if state:
            pause = f", paused {state['blocked_for_s']:.1f}s more" if state.get("blocked_for_s") else ""
            limits = ", ".join(f"{k}={state[k]:g}" for k in ("max_rpm", "max_tpm", "max_concurrent") if state.get(k))
            console.print(
                f"quota {q['name']}: {state.get('requests', 0):,} requests, {state.get('http_429', 0):,} x 429, "
                f"{state.get('in_flight', 0)} in flight, rate x{state.get('rate_factor', 1.0):.2f}, "
                f"booked {state.get('rpm_reserved_ahead_s', 0.0):.1f}s ahead{pause}"
                + (f" ({limits})" if limits else ""),
                markup=False,
                highlight=False,
            )
        else:
            shown = q.get("state_error") or {k: v["value"] for k, v in (q.get("keys") or {}).items()}
            console.print(f"quota {q['name']}: {shown}", markup=False, highlight=False)


# ---------------------------------------------------------------------- trainer side
_TRAINER_METRICS: dict[int, Any] = {}


def _trainer_metrics(registry: Any) -> Any:
    from prometheus_client import Counter, Gauge, Histogram

    found = _TRAINER_METRICS.get(id(registry))
    if found is None:
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
        found = (
            Histogram(
                "stream_reward_batch_completion_seconds",
                "batch opened (or generation started) -> rewards ready",
                buckets=buckets,
                registry=registry,
            ),
            Histogram(
                "stream_reward_reward_tail_seconds",
                "last trajectory pushed -> rewards ready (the wait rewarding adds)",
                buckets=buckets,
                registry=registry,
            ),
            Counter("stream_reward_batch_samples", "collected samples by status", ["status"], registry=registry),
            Gauge(
                "stream_reward_batch_valid_ratio", "valid share (0..1) of the last collected batch", registry=registry
            ),
            Counter("stream_reward_batches", "collected batches", registry=registry),
        )
        _TRAINER_METRICS[id(registry)] = found
    return found


def record_batch(
    rewards: Any, *, completion_s: float | None = None, reward_tail_s: float | None = None, registry: Any = None
) -> None:
    """Record a collected batch in Prometheus metrics (the trainer's process exposes them).

    ``completion_s``: from opening the batch (or starting generation) to rewards
    ready; ``reward_tail_s``: from the last push to rewards ready. Either may be omitted.
    """
    from prometheus_client import REGISTRY

    completion, tail, samples, valid, batches = _trainer_metrics(registry or REGISTRY)
    if completion_s is not None:
        completion.observe(max(0.0, completion_s))
    if reward_tail_s is not None:
        tail.observe(max(0.0, reward_tail_s))
    for status, count in rewards.status_counts().items():
        samples.labels(status).inc(count)
    n = len(rewards.status)
    if n:
        valid.set(float(rewards.valid.float().mean()))
    batches.inc()
