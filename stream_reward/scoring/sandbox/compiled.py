"""Compiled and non-Python languages in the sandbox: the fixed compile command and
run command per language, and the host's compile cache.

A program is compiled once per distinct (language, toolchain version, flags,
source): GRPO groups answer one prompt n times, often identically. The compile
itself runs inside the sandbox (the compiler parses untrusted input) as one
``exec`` case of the harness, with its own wall and a larger output cap (its
artifacts come back as a reply); each test case then runs the artifact as
another ``exec`` case with the sample's per-case limits, written afresh into the
case's fresh /tmp (from the harness's kept copy: ``run_job``'s ``key`` lets the
scorer send the files to a slot once).

The cache is a directory of entries ``<key>/`` (artifacts plus ``meta.json``),
written under a temporary name and renamed into place, least recently used
evicted past ``compile_cache_mb``. Compile errors are cached too: the same bad
program fails the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
from typing import Any

from stream_reward.errors import VerifierError
from stream_reward.scoring.sandbox.languages import Toolchain
from stream_reward.scoring.sandbox.wire import WireError, loads

__all__ = [
    "Artifact",
    "Build",
    "CompileCache",
    "artifact_from",
    "build_for",
    "compile_job",
    "compile_limits",
    "java_class",
    "java_unpackaged",
    "run_job",
    "COMPILE_OUTPUT_BYTES",
]

COMPILE_OUTPUT_BYTES = 64 << 20  # a compile's reply carries its artifacts (a Go binary is ~1.5 MB)
_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclasses.dataclass(frozen=True)
class Build:
    """How one program is compiled (``steps`` empty: nothing to compile) and run."""

    language: str
    source_name: str
    steps: list[list[str]]
    env: dict[str, str]
    run_argv: list[str]
    run_env: dict[str, str]
    # The JVM reserves far more address space than it uses: RLIMIT_AS stops it from
    # starting at all. Java runs without it; the slot's memory cgroup (and -Xmx)
    # bound what it really uses.
    address_space: bool = True
    # Node (V8's reservations) and Go (its heap arenas) reserve ~700 MiB of address
    # space before main runs: under a smaller RLIMIT_AS every program of theirs dies
    # at start, a 0 that is ours. Their RLIMIT_AS is at least this; the slot's
    # memory cgroup bounds what they use.
    address_space_mb: int = 0

    def key(self, toolchain: Toolchain, source: str) -> str:
        h = hashlib.sha256()
        for part in (self.language, toolchain.version, json.dumps([self.steps, self.env]), source):
            h.update(part.encode("utf-8", "surrogateescape") + b"\0")
        return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A compile's outcome: the files to run, or the compiler's complaint."""

    ok: bool
    files: dict[str, bytes]
    message: str = ""
    keep: bool = True  # cached; a compile timeout may be the host's load: the next one retries


# Comments and string or char literals, which may spell ``public class X`` too.
_JAVA_NOT_CODE = re.compile(r'//[^\n]*|/\*.*?\*/|""".*?"""|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
_JAVA_CLASS = re.compile(r"\b((?:(?:public|final|abstract|static|strictfp)\s+)*)class\s+(\w+)")
_JAVA_MAIN = re.compile(r"\bstatic\s+void\s+main\s*\(")


def java_class(source: str) -> str:
    """The class to run: the single public top-level class the source declares, else
    the top-level class that declares main, else ``Main``. Nested classes (a
    ``public static class FastReader``), comments and literals do not count."""
    code = _JAVA_NOT_CODE.sub(" ", source)
    top, depth, last = [], 0, 0  # (position, name, public) of the top-level classes
    for m in _JAVA_CLASS.finditer(code):
        depth += code.count("{", last, m.start()) - code.count("}", last, m.start())
        last = m.start()
        if depth == 0:
            top.append((m.start(), m.group(2), "public" in m.group(1).split()))
    public = {name for _, name, is_public in top if is_public}
    if len(public) == 1:
        return public.pop()
    if "Main" not in public:
        for m in _JAVA_MAIN.finditer(code):
            owners = [name for pos, name, _ in top if pos < m.start()]
            if owners:
                return owners[-1]
    return "Main"


# The package declaration: the first statement, after comments only.
_JAVA_PACKAGE = re.compile(r"\A((?:\s|//[^\n]*\n|/\*.*?\*/)*)package\s+[\w.\s]+;", re.S)


def java_unpackaged(source: str) -> str:
    """``source`` in the unnamed package: ``java -cp . <Class>`` finds only a class
    whose package matches its directory, and a lone file is its own program. The
    declaration becomes blanks, so the compiler's line numbers stay right."""
    return _JAVA_PACKAGE.sub(lambda m: m.group(1) + " " * (len(m.group(0)) - len(m.group(1))), source, count=1)


RUNTIME_RESERVE_MB = 2048


def build_for(toolchain: Toolchain, source: str, memory_mb: int) -> Build:
    """The fixed commands of ``toolchain``'s language for ``source``."""
    t = toolchain.tools
    env = {"PATH": _PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
    lang = toolchain.language
    if lang == "cpp":
        return Build(
            lang, "main.cpp", [[t["g++"], "-O2", "-std=c++17", "-o", "out/main", "main.cpp"]], env, ["./main"], env
        )
    if lang == "c":
        return Build(
            lang, "main.c", [[t["gcc"], "-O2", "-std=c11", "-o", "out/main", "main.c", "-lm"]], env, ["./main"], env
        )
    if lang == "rust":
        # The linker by its real path: /usr/bin/cc is a link through /etc/alternatives.
        flags = ["-O", "--edition", "2021", "-C", "strip=symbols", "-C", f"linker={t['cc']}"]
        steps = [[t["rustc"], *flags, "-o", "out/main", "main.rs"]]
        return Build(lang, "main.rs", steps, env, ["./main"], env)
    if lang == "go":
        # GOPATH mode, no cgo, no network, a private build cache in the compile's /tmp.
        genv = {**env, "GOCACHE": "/tmp/gocache", "GOPATH": "/tmp/gopath", "GO111MODULE": "off"}
        genv.update({"CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOFLAGS": "", "GOMAXPROCS": "2"})
        # No -trimpath: it changes the standard library's build IDs, so a fresh cache
        # would rebuild all of it (seconds) instead of using the installed packages.
        steps = [[t["go"], "build", "-ldflags=-s -w", "-o", "out/main", "main.go"]]
        return Build(
            lang, "main.go", steps, genv, ["./main"], {**env, "GOMAXPROCS": "2"}, address_space_mb=RUNTIME_RESERVE_MB
        )
    if lang == "java":
        name = java_class(source)
        heap = max(64, memory_mb // 2)
        jvm = ["-XX:+UseSerialGC", "-XX:-UsePerfData"]
        javac = [t["javac"], f"-J-Xmx{heap}m", *(f"-J{o}" for o in jvm), "-J-XX:TieredStopAtLevel=1"]
        steps = [[*javac, "-encoding", "UTF-8", "-d", "out", f"{name}.java"]]
        run = [t["java"], f"-Xmx{heap}m", "-Xss64m", *jvm, "-cp", ".", name]
        return Build(lang, f"{name}.java", steps, env, run, env, address_space=False)
    if lang == "javascript":
        return Build(lang, "main.js", [], env, [t["node"], "main.js"], env, address_space_mb=RUNTIME_RESERVE_MB)
    raise ValueError(f"no build for {lang!r}")


def compile_job(build: Build, source: str) -> dict[str, Any]:
    if build.language == "java":
        source = java_unpackaged(source)
    return {
        "files": [(build.source_name, source.encode("utf-8", "surrogateescape"), 0o644)],
        "dirs": ["out"],
        "steps": build.steps,
        "env": build.env,
        "collect": "out",
    }


def compile_limits(limits: dict[str, Any], build: Build, timeout_s: float) -> dict[str, Any]:
    """A compile's limits: wall and CPU ``timeout_s``, RLIMIT_AS of at least 2 GiB
    (compilers reserve more than they touch; the slot's memory cgroup bounds what
    they use), room for the artifacts in the output cap and /tmp."""
    return {
        **limits,
        "cpu_s": timeout_s,
        "memory_mb": max(limits["memory_mb"], 2048),
        "max_output_bytes": COMPILE_OUTPUT_BYTES,
        "max_file_mb": max(limits["max_file_mb"], 64),
        "address_space": build.address_space,
    }


def artifact_from(done: dict[str, Any], language: str, timeout_s: float) -> Artifact:
    """A compile case's report as an Artifact. A tool the sandbox cannot execute is
    the host's fault: VerifierError(reason="toolchain_missing")."""
    replies = []
    for raw in done.get("replies") or []:
        try:
            replies.append(loads(str(raw).encode("utf-8", "surrogateescape")))
        except WireError:
            continue
    for reply in replies:
        if type(reply) is tuple and len(reply) == 2 and reply[0] == "missing":
            raise VerifierError(
                f"{language} toolchain: {reply[1]} cannot run inside the sandbox", reason="toolchain_missing"
            )
    err = str(done.get("err", "")).strip()
    status = done.get("status")
    if status == "timeout":
        return Artifact(False, {}, f"the compile ran past {timeout_s:g} s", keep=False)
    if status:
        return Artifact(False, {}, f"the compile hit a limit: {status}")
    if "signal" in done or done.get("exit") != 0:
        return Artifact(False, {}, err or f"the compiler failed ({done.get('signal') or done.get('exit')})")
    files = next((r[1] for r in replies if type(r) is tuple and len(r) == 2 and r[0] == "files"), None)
    if not isinstance(files, dict) or not files:
        return Artifact(False, {}, err or "the compiler produced nothing")
    return Artifact(True, {str(k): v for k, v in files.items() if type(v) is bytes})


def run_job(build: Build, source: str, artifact: Artifact | None) -> dict[str, Any]:
    if artifact is None:  # an interpreted language: the source is the program
        files = [(build.source_name, source.encode("utf-8", "surrogateescape"), 0o644)]
    else:
        files = [(name, data, 0o755) for name, data in artifact.files.items()]
    return {"files": files, "steps": [build.run_argv], "env": build.run_env}


class CompileCache:
    """Compiled programs on the host, by key; ``root`` None: a temporary directory
    of this cache's own, removed by ``close``."""

    def __init__(self, root: str | None, max_mb: int) -> None:
        self._own = root is None
        self.root = tempfile.mkdtemp(prefix="stream-reward-compiled-") if root is None else root
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self.max_bytes = max_mb << 20
        self.compiles = 0  # compiler runs (a hit runs none)
        self.hits = 0
        self._inflight: dict[str, asyncio.Future[Artifact]] = {}

    def get(self, key: str) -> Artifact | None:
        entry = os.path.join(self.root, key)
        try:
            with open(os.path.join(entry, "meta.json"), encoding="utf-8") as f:
                meta = json.load(f)
            files = {}
            for name in meta["files"]:
                with open(os.path.join(entry, "files", name), "rb") as f:
                    files[name] = f.read()
            os.utime(os.path.join(entry, "meta.json"))  # the LRU's clock
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return Artifact(bool(meta["ok"]), files, str(meta.get("message", "")))

    def put(self, key: str, artifact: Artifact) -> None:
        tmp = tempfile.mkdtemp(prefix=".new-", dir=self.root)
        try:
            os.mkdir(os.path.join(tmp, "files"))
            for name, data in artifact.files.items():
                with open(os.path.join(tmp, "files", os.path.basename(name)), "wb") as f:
                    f.write(data)
            meta = {"ok": artifact.ok, "message": artifact.message, "files": sorted(artifact.files)}
            with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
                json.dump(meta, f)
            os.rename(tmp, os.path.join(self.root, key))
        except OSError:
            pass  # another process stored it first, or the disk is full: the cache is an optimisation
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._evict()

    def _evict(self) -> None:
        entries = []
        total = 0
        for name in os.listdir(self.root):
            if name.startswith("."):
                continue
            path = os.path.join(self.root, name)
            try:
                size = sum(e.stat().st_size for e in os.scandir(os.path.join(path, "files")))
                used = os.stat(os.path.join(path, "meta.json")).st_mtime
            except OSError:
                continue
            entries.append((used, size, path))
            total += size
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            shutil.rmtree(path, ignore_errors=True)
            total -= size

    async def lookup(self, key: str, compile_: Any) -> tuple[Artifact, bool]:
        """The artifact for ``key`` and whether it came from the cache; ``compile_()``
        runs at most once per key at a time (concurrent samples of one program wait
        for the first one's compile)."""
        found = self.get(key)
        if found is not None:
            self.hits += 1
            return found, True
        loop = asyncio.get_running_loop()
        pending = self._inflight.get(key)
        if pending is not None and pending.get_loop() is loop:
            artifact = await asyncio.shield(pending)
            self.hits += 1
            return artifact, True
        future: asyncio.Future[Artifact] = loop.create_future()
        self._inflight[key] = future
        try:
            self.compiles += 1
            artifact = await compile_()
            if artifact.keep:
                self.put(key, artifact)
            future.set_result(artifact)
            return artifact, False
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: nobody may be waiting
            raise
        finally:
            if self._inflight.get(key) is future:
                del self._inflight[key]

    def close(self) -> None:
        if self._own:
            shutil.rmtree(self.root, ignore_errors=True)
