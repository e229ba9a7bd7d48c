"""Small configuration dataclasses, grouped by concern, units in the names."""

from __future__ import annotations

import math
import os
import socket
import sys
import warnings
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any, Literal

from stream_reward.errors import ConfigDeprecationWarning, ConfigError

__all__ = [
    "ConsumerConfig",
    "ProducerConfig",
    "BatchPolicy",
    "FailurePolicy",
    "default_consumer_name",
    "check_namespace",
    "DEFAULT_NAMESPACE",
    "DEFAULT_GROUP",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ManagerConfig",
    "OverlongConfig",
    "QuotaConfig",
    "SandboxConfig",
]

DEFAULT_NAMESPACE = "sr"
DEFAULT_GROUP = "scorers"
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


def check_namespace(namespace: str, key: str = "namespace") -> str:
    """The one rule for namespace names, checked wherever a namespace enters."""
    # Braces would break the hash tag; '#' is reserved: a namespace "a#1.3" would
    # share a tag with partition 1 of "a".
    if not namespace or any(c in namespace for c in "{}#"):
        raise ConfigError(key, f"must be non-empty and contain no braces or '#', got {namespace!r}")
    return namespace


FailurePolicy = Literal["fallback", "mask", "drop"]


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(slots=True)
class ConsumerConfig:
    """How one worker process reads, scores and acknowledges."""

    namespace: str = DEFAULT_NAMESPACE
    group: str = DEFAULT_GROUP
    partitions: int = 1
    consumer: str = field(default_factory=default_consumer_name)
    concurrency: int = 256  # samples in flight per process
    read_count: int = 256  # entries per XREADGROUP
    block_ms: int = 200  # also bounds how fast a stop request is noticed
    reclaim_idle_ms: int = 30_000  # a pending entry idle this long belongs to a dead consumer
    reclaim_interval_s: float = 5.0
    # An entry delivered more than this often (its consumers died with it in
    # flight) is scored alone, so a crash can be pinned on the right sample.
    quarantine_after_deliveries: int = 2
    max_deliveries: int = 10  # backstop: past this, dead-letter without another try
    drain_timeout_s: float = 10.0
    heartbeat_interval_s: float = 2.0
    trim_interval_s: float = 2.0
    result_ttl_s: int = 7 * 24 * 3600  # results of batches never collected
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # A server whose maxmemory-policy may evict keys is refused (wire/eviction.py) unless this is set.
    allow_eviction: bool = False

    def __post_init__(self) -> None:
        for name in ("concurrency", "read_count", "max_deliveries", "partitions"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("block_ms", "reclaim_idle_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")


# Samples one stream entry holds at most, unless a producer says otherwise; a worker's
# first guess of what an entry holds, before it has read one.
SAMPLES_PER_ENTRY = 16


@dataclass(slots=True)
class ProducerConfig:
    namespace: str = DEFAULT_NAMESPACE
    partitions: int = 1
    group: str = DEFAULT_GROUP
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Backpressure: samples not yet read by the group, above which push() waits
    # (or raises BackpressureError with on_backlog="raise"). 0 disables the check.
    max_backlog: int = 100_000
    on_backlog: Literal["wait", "raise"] = "wait"
    backlog_poll_s: float = 0.05
    result_ttl_s: int = 7 * 24 * 3600
    # Coalescing: concurrent pushes of one event-loop turn go in one round trip. While
    # pushes come faster than coalesce_delay_s (a group's first push came less than that
    # after the push before it), a flush waits that long for more (up to the max); a
    # push after a quiet spell goes at once. 0: never wait. Groups of at most
    # coalesce_max_entries, up to coalesce_in_flight at once: a wave of agent loops
    # resuming together then reaches several workers, not one.
    coalesce_max_entries: int = 128
    coalesce_delay_s: float = 0.001
    coalesce_in_flight: int = 2
    # Samples one stream entry holds at most (consecutive samples of one push call or
    # coalesced group, one partition): a stream entry costs the server and the clients
    # more than a sample's bytes do. 1: an entry per sample.
    samples_per_entry: int = SAMPLES_PER_ENTRY
    # A server whose maxmemory-policy may evict keys is refused (wire/eviction.py) unless this is set.
    allow_eviction: bool = False

    def __post_init__(self) -> None:
        if self.on_backlog not in ("wait", "raise"):
            raise ConfigError("on_backlog", f"must be 'wait' or 'raise', got {self.on_backlog!r}")
        if self.max_backlog < 0:
            raise ConfigError("max_backlog", f"must be >= 0, got {self.max_backlog}")
        if not 1 <= self.samples_per_entry <= 1024:
            raise ConfigError("samples_per_entry", f"must be between 1 and 1024, got {self.samples_per_entry}")
        if self.coalesce_max_entries < 1:
            raise ConfigError("coalesce_max_entries", f"must be >= 1, got {self.coalesce_max_entries}")
        if self.coalesce_in_flight < 1:
            raise ConfigError("coalesce_in_flight", f"must be >= 1, got {self.coalesce_in_flight}")
        if not 0 <= self.coalesce_delay_s <= 1:
            raise ConfigError("coalesce_delay_s", f"must be between 0 and 1 s, got {self.coalesce_delay_s}")


@dataclass(slots=True)
class BatchPolicy:
    """What the aggregator does with samples that failed or missed the deadline."""

    on_failure: FailurePolicy = "mask"
    fallback_score: float = 0.0
    deadline_s: float | None = None  # after open_batch; unfinished samples resolve as failed

    def __post_init__(self) -> None:
        if self.on_failure not in ("fallback", "mask", "drop"):
            raise ConfigError("on_failure", f"must be fallback, mask or drop, got {self.on_failure!r}")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ConfigError("deadline_s", f"must be > 0, got {self.deadline_s}")


@dataclass(slots=True)
class ManagerConfig:
    """Manager options, with verl's key names where verl has them."""

    manager: str = "naive"
    scorer: str = "rules"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    timeout: float = 30.0  # per sample, seconds (verl's key name); per call for `batch`
    num_processes: int | None = None  # scorer processes; default: cores
    # dapo
    overlong_buffer_cfg: dict[str, Any] = field(default_factory=dict)
    max_resp_len: int | None = None
    # batch
    batch_size: int = 128
    batch_wait_ms: float = 20.0
    # rate_limited (and remote verifiers)
    max_concurrent: int | None = None
    max_rpm: float | None = None
    max_tpm: float | None = None
    estimated_tokens_per_request: int = 2000
    quota_key: str | None = None
    retries: int = 5  # attempts after the first, for infrastructure faults
    redis_url: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    # the `sandbox` scorer: keyword arguments of scorers.sandbox.SandboxConfig
    sandbox: dict[str, Any] = field(default_factory=dict)
    # [[reward.components]]: several scorers, weighted (stream_reward.scoring.composite);
    # when given, they are the reward and `scorer` is not used
    components: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class OverlongConfig:
    """verl's ``overlong_buffer_cfg``: ``{enable, len, penalty_factor, log}``."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None, max_resp_len: int | None) -> OverlongConfig:
        """Validated only when enabled, as verl does (a disabled block may hold anything)."""
        cfg = dict(cfg or {})
        if not cfg.get("enable"):
            return cls()
        unknown = sorted(set(cfg) - {"enable", "len", "penalty_factor", "log"})
        if unknown:
            raise ConfigError(
                f"overlong_buffer_cfg.{unknown[0]}", "unknown key; known: enable, len, penalty_factor, log"
            )
        buffer_len = cfg.get("len")
        if isinstance(buffer_len, bool) or not isinstance(buffer_len, int) or buffer_len <= 0:
            raise ConfigError(
                "overlong_buffer_cfg.len",
                f"must be an integer > 0 when the overlong penalty is enabled, got {buffer_len!r}",
            )
        factor = cfg.get("penalty_factor", 1.0)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 0:
            raise ConfigError("overlong_buffer_cfg.penalty_factor", f"must be a number >= 0, got {factor!r}")
        if max_resp_len is not None:
            if isinstance(max_resp_len, bool) or not isinstance(max_resp_len, int):
                raise ConfigError("max_resp_len", f"must be an integer, got {max_resp_len!r}")
            if max_resp_len < buffer_len:
                raise ConfigError(
                    "max_resp_len", f"must be >= overlong_buffer_cfg.len ({buffer_len}), got {max_resp_len}"
                )
        return cls(True, buffer_len, float(factor), bool(cfg.get("log", False)))


@dataclass
class QuotaConfig:
    """One verifier's global limits. ``None`` disables a limit.

    ``name`` keys the quota in Redis: every limiter with the same name and
    namespace shares it (use the API key's identity when the provider meters per
    key). ``estimated_tokens_per_request`` is charged against TPM up front when
    the caller gives no count. ``lease_ttl_s``: an in-flight lease not renewed
    for this long (its worker died) stops counting.

    Beyond the core fields: ``burst`` — requests allowed back to back after an
    idle spell (GCRA tolerance; TPM's is ``burst`` x the token estimate);
    ``adaptive`` — lower the rate after repeated 429s, by ``rate_decrease`` per
    repeat down to ``min_rate_factor``, and recover to the full rate over
    ``recovery_s``; ``repeat_window_s`` — two 429s this close are "repeated".
    """

    name: str
    max_rpm: float | None = None
    max_tpm: float | None = None
    max_concurrent: int | None = None  # requests in flight (verl's name; `max_inflight` before 0.2)
    estimated_tokens_per_request: int = 2000
    lease_ttl_s: float = 60.0
    burst: float = 1.0
    adaptive: bool = False
    rate_decrease: float = 0.7
    min_rate_factor: float = 0.1
    recovery_s: float = 60.0
    repeat_window_s: float = 60.0
    # The keyword of 0.1, still accepted with a ConfigDeprecationWarning.
    max_inflight: InitVar[int | None] = None

    def __post_init__(self, max_inflight: int | None = None) -> None:
        if max_inflight is not None:
            warnings.warn(
                "QuotaConfig(max_inflight=...) is deprecated; use max_concurrent",
                ConfigDeprecationWarning,
                stacklevel=3,
            )
            if self.max_concurrent is not None and self.max_concurrent != max_inflight:
                raise ConfigError("max_inflight", "is the old name of max_concurrent: give one of them")
            self.max_concurrent = max_inflight
        if not self.name or any(c in self.name for c in "{}"):
            raise ConfigError("quota_key", f"{self.name!r} must be non-empty and contain no braces")
        for key in ("max_rpm", "max_tpm", "max_concurrent"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(key, f"must be > 0 (or unset), got {value}")
        if self.estimated_tokens_per_request < 0:
            raise ConfigError("estimated_tokens_per_request", f"must be >= 0, got {self.estimated_tokens_per_request}")
        if self.lease_ttl_s <= 0:
            raise ConfigError("lease_ttl_s", f"must be > 0, got {self.lease_ttl_s}")
        if self.burst < 1:
            raise ConfigError("burst", f"must be >= 1, got {self.burst}")
        if not 0 < self.rate_decrease < 1:
            raise ConfigError("rate_decrease", f"must be in (0, 1), got {self.rate_decrease}")
        if not 0 < self.min_rate_factor <= 1:
            raise ConfigError("min_rate_factor", f"must be in (0, 1], got {self.min_rate_factor}")
        if self.recovery_s <= 0:
            raise ConfigError("recovery_s", f"must be > 0, got {self.recovery_s}")


def _old_max_inflight(self: QuotaConfig) -> int | None:
    warnings.warn("QuotaConfig.max_inflight is deprecated; use max_concurrent", ConfigDeprecationWarning, stacklevel=2)
    return self.max_concurrent


# Reading the old attribute still works (set after the dataclass is built, which took the
# InitVar's default already).
setattr(QuotaConfig, "max_inflight", property(_old_max_inflight))  # noqa: B010 - mypy would reject the assignment


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """Limits are per test case unless named otherwise; ``concurrency`` is the
    number of sandbox slots (each a persistent sandbox running one sample at a
    time). ``memory_mb`` and ``max_procs`` bound a slot's cgroups (all processes
    of a case together) when ``cgroups`` allows, and each process's RLIMIT_AS.
    ``sample_timeout_s`` bounds a sample's cases together; ``stop_on_timeout``
    ends a sample at its first timed-out case. ``cgroups``: "auto" (use them
    when this host lets us), "required" (refuse to start without), "off".

    ``tmp_mb`` sizes each of the sandbox's private /tmp and /dev/shm.
    ``extra_ro_binds`` are host paths shown read-only at the same place (not
    under /tmp, which is the sandbox's own). ``backend="none"`` or a host with no
    usable backend is refused unless ``unsafe_no_isolation``. Case processes run
    as uids leased from ``uid_base .. uid_base + uid_count - 1`` (when root).
    """

    timeout_s: float = 5.0
    cpu_s: float = 5.0
    memory_mb: int = 1024
    max_output_bytes: int = 4 * 1024 * 1024
    max_file_mb: int = 16
    max_procs: int = 32
    tmp_mb: int = 64
    concurrency: int = os.cpu_count() or 1
    all_or_nothing: bool = False
    unsafe_no_isolation: bool = False
    backend: str = "auto"  # auto | bwrap | unshare | none
    bwrap_path: str = "bwrap"
    unshare_path: str = "unshare"
    # The real interpreter, not a venv's symlink to it: a venv may live under /tmp,
    # which inside the sandbox is a fresh tmpfs. The harness needs no site-packages.
    python: str = os.path.realpath(sys.executable)
    site_packages: bool = True  # put the host's site-packages on sys.path (no .pth processing)
    extra_ro_binds: tuple[str, ...] = ()
    uid_base: int = 60000
    uid_count: int = 1000
    sample_timeout_s: float = 60.0
    stop_on_timeout: bool = True
    cgroups: str = "auto"  # auto | required | off
    seccomp: bool = True
    # Languages other than Python (docs/sandbox.md): where their compilers and
    # runtimes are looked up (None: the worker's PATH plus ~/.cargo/bin), a
    # compile's wall clock (and CPU), and the host's compile cache (None: a
    # temporary directory of the scorer's own) with its size bound.
    toolchain_path: str | None = None
    compile_timeout_s: float = 20.0
    compile_cache_dir: str | None = None
    compile_cache_mb: int = 512

    def __post_init__(self) -> None:
        for key in (
            "compile_timeout_s",
            "compile_cache_mb",
            "timeout_s",
            "cpu_s",
            "memory_mb",
            "max_output_bytes",
            "max_file_mb",
            "max_procs",
            "tmp_mb",
            "concurrency",
            "uid_count",
            "sample_timeout_s",
        ):
            if not getattr(self, key) > 0:
                raise ConfigError(key, "must be > 0")
        if self.backend not in ("auto", "bwrap", "unshare", "none"):
            raise ConfigError("backend", f"{self.backend!r} is not auto, bwrap, unshare or none")
        if self.cgroups not in ("auto", "required", "off"):
            raise ConfigError("cgroups", f"{self.cgroups!r} is not auto, required or off")
        if self.uid_base < 1000:
            raise ConfigError("uid_base", "must be >= 1000 (an unprivileged uid range)")
