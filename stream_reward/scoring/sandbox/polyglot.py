"""A sample in a language other than Python: its toolchain, one compile per distinct
program (``compiled.CompileCache``), then its stdin cases on the compiled artifact.

The scorer hands such a sample here after choosing its code block
(``languages.choose_program``); the slot, the per-case limits and the comparison
(``judge.same_output``) are the scorer's, as for Python.
"""

from __future__ import annotations

import dataclasses
import marshal
import time
from typing import TYPE_CHECKING, Any

from stream_reward.config import SandboxConfig
from stream_reward.errors import VerifierError
from stream_reward.scoring.sandbox.compiled import (
    Artifact,
    Build,
    artifact_from,
    build_for,
    compile_job,
    compile_limits,
    run_job,
)
from stream_reward.scoring.sandbox.forms import tally
from stream_reward.scoring.sandbox.languages import TOOLS, Toolchain, default_toolchain_path, find_toolchain
from stream_reward.scoring.scorer import Scored

if TYPE_CHECKING:
    from stream_reward.scoring.sandbox.slot import Slot

# The SandboxScorer that drives the sample, typed loosely: it imports this module.
SandboxScorer = Any

__all__ = ["find_toolchains", "score_other", "toolchain_of"]


def find_toolchains(config: SandboxConfig) -> tuple[SandboxConfig, dict[str, Toolchain | VerifierError]]:
    """Each language's toolchain, or why it is missing (raised when a sample needs it),
    and ``config`` with the directories they live in bound read-only into the sandbox."""
    search = config.toolchain_path if config.toolchain_path is not None else default_toolchain_path()
    found: dict[str, Toolchain | VerifierError] = {}
    for language in TOOLS:
        try:
            found[language] = find_toolchain(language, search)
        except VerifierError as exc:
            found[language] = exc
    binds = sorted({b for t in found.values() if isinstance(t, Toolchain) for b in t.binds})
    binds = [b for b in binds if b not in config.extra_ro_binds]
    if binds:
        config = dataclasses.replace(config, extra_ro_binds=(*config.extra_ro_binds, *binds))
    return config, found


def toolchain_of(found: dict[str, Toolchain | VerifierError], language: str) -> Toolchain:
    """``language``'s toolchain; VerifierError(reason="toolchain_missing") naming the
    missing program when this host lacks it (a fresh error each time: it is raised)."""
    tool = found[language]
    if isinstance(tool, VerifierError):
        raise VerifierError(str(tool), reason=tool.reason)
    return tool


async def score_other(
    scorer: SandboxScorer, language: str, program: str, form: str, cases: list[dict[str, Any]]
) -> Scored:
    aon = scorer.config.all_or_nothing
    if form != "stdin":
        return _with(
            tally([("failed", f"{language} runs only in the stdin form")] * len(cases), all_or_nothing=aon),
            language=language,
        )
    toolchain = scorer.toolchain(language)
    build = build_for(toolchain, program, scorer.config.memory_mb)
    info: dict[str, Any] = {"language": language}
    async with scorer._slot() as slot:
        artifact: Artifact | None = None
        if build.steps:
            start = time.monotonic()
            artifact, cached = await scorer.compile_cache.lookup(
                build.key(toolchain, program), lambda: _compile(scorer, slot, build, program)
            )
            info.update(compile="cached" if cached else "compiled", compile_s=round(time.monotonic() - start, 3))
            if not artifact.ok:
                # The policy's program does not compile: it loses (0, status ok), never a failed sample.
                results = [("failed", f"compile error: {artifact.message[-300:]}")] * len(cases)
                info.update(reason="compile_error", compile_error=artifact.message[-2000:])
                return _with(tally(results, all_or_nothing=aon), **info)
        job = run_job(build, program, artifact)
        job.update(
            address_space=build.address_space,
            address_space_mb=build.address_space_mb,
            key=build.key(toolchain, program),
        )
        results = await scorer._run_cases(slot, program, form, cases, None, job=job)
    return _with(tally(results, all_or_nothing=aon), **info)


async def _compile(scorer: SandboxScorer, slot: Slot, build: Build, program: str) -> Artifact:
    """Compile in the sandbox: one ``exec`` case with the compile's limits."""
    cfg = scorer.config
    assert slot.h is not None
    msg = scorer._case_msg("exec", "", b"", cfg.compile_timeout_s, exec=compile_job(build, program))
    msg["limits"] = compile_limits(msg["limits"], build, cfg.compile_timeout_s)
    slot.h.send(marshal.dumps(msg, 4))
    done = await scorer._done(slot, cfg.compile_timeout_s)
    return artifact_from(done, build.language, cfg.compile_timeout_s)


def _with(scored: Scored, **extra: Any) -> Scored:
    scored.extra.update(extra)
    return scored
