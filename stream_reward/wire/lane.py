"""A connection of its own for the hot round trips: RESP on a bare asyncio protocol.

On the per-sample path the trainer makes a round trip per coalesced push and per
page of results. Through redis-py's asyncio client each one cost ~200 us of CPU
on the 2-core VM this was measured on (2026-12-01), where the same PING on an
``asyncio.Protocol`` with a hiredis reader cost ~36 us: the pool's checkout and
return (~40 us), a task and a timer per send (``wait_for`` around the write), a
timeout context per read, the retry wrapper. At a paced 5,000 samples a second
that was a sixth of the trainer's CPU.

A lane is one connection, owned by one user (the producer's pushes, a listener's
reader, a worker's read loop, a worker's result flushes), that pipelines: each call
writes its commands at once and its replies come back in order, matched to the calls
by a queue. A caller that gives up leaves its place in the queue, so the replies it no
longer wants are read and dropped and the connection stays in step (redis-py must drop
such a connection). A lost connection fails every call in flight with redis-py's
ConnectionError, what the callers already handle, and the next call connects again.

Only for what redis-py would send the same way: a single node over TCP or a
unix socket, with at most a username, a password, a database and a client name
(``Lane.for_client`` says None for the rest: TLS, a credential provider, a
cluster, a client pinned to one connection), speaking RESP2 as ``connect`` does.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import hiredis
from redis._parsers.base import BaseParser
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from stream_reward.wire.connection import is_cluster
from stream_reward.wire.packed import pack_command

__all__ = ["Lane"]

_CONNECT_TIMEOUT_S = 5.0


class _Call:
    """One caller's commands in flight: its future and the replies read so far."""

    __slots__ = ("fut", "n", "replies", "sent", "allow")

    def __init__(self, fut: asyncio.Future[list[Any]], n: int, sent: float = 0.0, allow: float | None = None) -> None:
        self.fut = fut
        self.n = n
        self.replies: list[Any] = []
        self.sent = sent  # loop time of the write
        self.allow = allow  # seconds its first reply byte may take (None: no deadline)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader()
        self.calls: deque[_Call] = deque()
        self.lost: BaseException | None = None
        # Liveness: the oldest call in flight must see the server's bytes within its
        # allowance, counted from its write or the last bytes read, whichever is later
        # (a long queue of big replies is progress, not a stall). One watch timer per
        # connection while calls are in flight, not one per call.
        self.last_read = 0.0
        self.watch: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        calls = self.calls
        if self.watch is not None:
            self.last_read = self.loop.time()
        reader.feed(data)
        while calls:
            try:
                reply = reader.gets()
            except hiredis.ProtocolError as exc:  # out of step: nothing after this can be trusted
                self._fail(RedisConnectionError(f"Redis protocol error: {exc}"))
                if self.transport is not None:
                    self.transport.close()
                return
            if reply is False:
                return
            call = calls[0]
            call.replies.append(_error(reply) if isinstance(reply, hiredis.ReplyError) else reply)
            if len(call.replies) == call.n:
                calls.popleft()
                if not call.fut.done():  # (its caller may have given up: the replies are dropped)
                    call.fut.set_result(call.replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"Connection closed by server ({type(exc).__name__ if exc else 'EOF'})"))

    def _fail(self, error: BaseException) -> None:
        self.lost = error
        while self.calls:
            call = self.calls.popleft()
            if not call.fut.done():
                call.fut.set_exception(error)
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None

    def arm(self, loop: asyncio.AbstractEventLoop, allow: float) -> None:
        if self.watch is None and self.lost is None:
            self.watch = loop.call_later(allow, self.check, loop)

    def check(self, loop: asyncio.AbstractEventLoop) -> None:
        """The watch: expire the connection if its oldest call stalled, else look again
        when it would have."""
        self.watch = None
        if not self.calls or self.lost is not None:
            return
        head = self.calls[0]
        if head.allow is None:  # blocks for ever on the server: nothing to judge
            return
        due = max(self.last_read, head.sent) + head.allow
        now = loop.time()
        if now >= due:
            self.expire(head.allow)
        else:
            self.watch = loop.call_later(due - now, self.check, loop)

    def expire(self, timeout_s: float) -> None:
        """A call's reply did not come in time: the server is stopped or the path drops
        packets. The connection is given up (its replies could only arrive out of step
        with the calls now), every call on it fails, and the next call connects again."""
        self._fail(RedisTimeoutError(f"no reply from Redis within {timeout_s:g}s"))
        if self.transport is not None:
            self.transport.abort()


def _error(reply: hiredis.ReplyError) -> BaseException:
    """An error reply as redis-py raises it (NOSCRIPT as NoScriptError, ...)."""
    error = BaseParser.parse_error(str(reply))
    return error if isinstance(error, BaseException) else ResponseError(str(reply))


class Lane:
    """One pipelined connection to the node ``for_client`` found (see module doc)."""

    def __init__(self, address: dict[str, Any]) -> None:
        self._address = address
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self._closed = False

    @staticmethod
    def for_client(client: Any) -> Lane | None:
        """A lane to ``client``'s node, or None where only redis-py's own path is right."""
        if (
            is_cluster(client)
            or getattr(client, "connection", None) is not None
            or getattr(client, "single_connection_client", False)
        ):
            return None
        pool = getattr(client, "connection_pool", None)
        if pool is None or pool.connection_class not in (Connection, UnixDomainSocketConnection):
            return None
        kwargs = pool.connection_kwargs
        if kwargs.get("credential_provider") is not None or kwargs.get("protocol", 2) not in (2, "2", None):
            return None
        address = {k: kwargs.get(k) for k in ("host", "port", "path", "db", "username", "password", "client_name")}
        address["connect_timeout"] = kwargs.get("socket_connect_timeout") or _CONNECT_TIMEOUT_S
        address["reply_timeout"] = kwargs.get("socket_timeout")  # connect's timeout_s; None: wait
        return Lane(address)

    async def call(self, commands: list[bytes], block_s: float | None = 0.0) -> list[Any]:
        """Send packed ``commands`` in one write; their replies in order, an error reply as
        its exception (not raised). Raises redis-py's ConnectionError if the connection is
        lost before all replies came, and its TimeoutError if they did not come within the
        lane's reply timeout (plus ``block_s``, for a command that blocks on the server;
        None: one that may block for ever); the commands may or may not have run."""
        if not commands:  # no reply would ever complete it, and every later call would queue behind
            return []
        protocol = self._protocol
        if protocol is None or protocol.lost is not None:
            protocol = await self._connect()
            if protocol.lost is not None:  # lost again while this call waited to go on
                protocol = await self._connect()
                if protocol.lost is not None:
                    raise protocol.lost
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Any]] = loop.create_future()
        timeout = self._address.get("reply_timeout")
        if timeout:
            allow = None if block_s is None else timeout + block_s
            protocol.calls.append(_Call(fut, len(commands), loop.time(), allow))
            if allow is not None:
                protocol.arm(loop, allow)
        else:
            protocol.calls.append(_Call(fut, len(commands)))
        transport = protocol.transport
        assert transport is not None
        transport.writelines(commands)
        return await fut

    async def _connect(self) -> _Protocol:
        if self._closed:
            raise RedisConnectionError("lane closed")
        # One connection attempt for every call that finds none (a second would be left
        # open behind the first): shielded, so a caller that gives up does not cancel it
        # under the others. The attempt itself makes its connection the lane's.
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(_retrieve)  # its error is its callers', if any are left
        return await asyncio.shield(self._connecting)

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        a = self._address
        try:
            opening = (
                loop.create_unix_connection(_Protocol, a["path"])
                if a["path"]
                else loop.create_connection(_Protocol, a["host"], a["port"])
            )
            transport, protocol = await asyncio.wait_for(opening, a["connect_timeout"])
        except (OSError, asyncio.TimeoutError) as exc:
            raise RedisConnectionError(f"Error connecting to Redis: {type(exc).__name__}") from exc
        try:
            # What redis-py's handshake sends for the options for_client lets through.
            setup = []
            if a["username"] or a["password"]:  # as redis-py: nothing for empty ones, no user for ""
                user = (a["username"],) if a["username"] else ()
                setup.append(pack_command("AUTH", *user, a["password"] or ""))
            if a["db"]:
                setup.append(pack_command("SELECT", int(a["db"])))
            if a["client_name"]:
                setup.append(pack_command("CLIENT", "SETNAME", a["client_name"]))
            if setup:
                fut: asyncio.Future[list[Any]] = loop.create_future()
                protocol.calls.append(_Call(fut, len(setup)))
                transport.writelines(setup)
                try:  # the handshake has the reply deadline every call has
                    replies = await asyncio.wait_for(fut, a["reply_timeout"])
                except asyncio.TimeoutError:
                    raise RedisTimeoutError(f"no reply from Redis within {a['reply_timeout']:g}s") from None
                for reply in replies:
                    if isinstance(reply, BaseException):
                        raise reply
            if self._closed:
                raise RedisConnectionError("lane closed")
        except BaseException:
            transport.close()
            raise
        self._protocol = protocol
        return protocol

    def close(self) -> None:
        """Close the connection; calls in flight fail with ConnectionError."""
        self._closed = True
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
            protocol._fail(RedisConnectionError("lane closed"))


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
