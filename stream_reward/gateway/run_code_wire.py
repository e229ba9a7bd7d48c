"""SandboxFusion's ``/run_code`` wire format: reading a request, writing a reply.

The shapes are SandboxFusion's own (``sandbox/server/sandbox_api.py``,
``sandbox/runners/types.py``): a request
``{code, language, stdin, compile_timeout, run_timeout, memory_limit_MB, files,
fetch_files}``, a reply ``{status, message, compile_result, run_result,
executor_pod_name, files}`` whose results are ``{status, execution_time,
return_code, stdout, stderr}``.

A request SandboxFusion's pydantic model would refuse (a missing ``code``, a
wrong type, a language not in its list) is refused the same way: HTTP 422 with
``detail`` a list of ``{type, loc, msg, input}``; we add ``error``, the same
reason on one line. A language SandboxFusion knows but this sandbox cannot run
is refused exactly like an unknown one — the list in the message is what runs
here — never run as something else, never answered with a made-up result.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
from dataclasses import dataclass
from typing import Any

from stream_reward.errors import BadInputError

__all__ = ["RunCodeRequest", "parse_request", "invalid", "reply_from_report", "sandbox_error", "LANGUAGES"]

# The languages this sandbox runs. SandboxFusion's own list is longer; a request for
# one of the others is refused (see the module docstring).
LANGUAGES = ("python",)

# A program killed by SIGKILL: SandboxFusion reports asyncio's negative return code.
_KILLED = -9


@dataclass(frozen=True, slots=True)
class RunCodeRequest:
    code: str
    language: str
    stdin: str | None
    run_timeout_s: float
    memory_limit_mb: int | None  # None: SandboxFusion's -1, no limit of the request's own
    files: list[tuple[str, bytes]]
    fetch_files: list[str]


def invalid(loc: str, kind: str, msg: str, value: Any) -> BadInputError:
    """A refusal in SandboxFusion's (pydantic's) shape; ``detail`` is the 422 body's list."""
    exc = BadInputError(f"{loc}: {msg}")
    exc.detail = [{"type": kind, "loc": ["body", loc], "msg": msg, "input": _short(value)}]  # type: ignore[attr-defined]
    return exc


def _short(value: Any) -> Any:
    if isinstance(value, str) and len(value) > 200:
        return value[:200] + "..."
    return value if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__


def _number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(key, "float_type", "Input should be a valid number", value)
    if not math.isfinite(value):
        raise invalid(key, "finite_number", "Input should be a finite number", value)
    return float(value)


def _check_path(loc: str, name: str) -> None:
    # SandboxFusion joins the name to its temporary directory, so an absolute name or
    # ".." writes outside it; here a name must stay inside the program's own directory.
    parts = name.split("/")
    if not name or name.startswith("/") or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise invalid(loc, "path", "file paths must be relative, without '.', '..' or empty parts", name)


def _files(files: Any, limit: int) -> list[tuple[str, bytes]]:
    if not isinstance(files, dict) or not all(isinstance(v, (str, type(None))) for v in files.values()):
        raise invalid("files", "dict_type", "Input should be a dictionary of base64 strings or null", files)
    out, total = [], 0
    for name, content in files.items():
        if content is None or "IGNORE_THIS_FILE" in name:  # skipped, as SandboxFusion skips them
            continue
        _check_path("files", name)
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise invalid("files", "base64", f"{name}: not base64", name) from None
        total += len(data)
        if total > limit:
            raise invalid("files", "too_large", f"files over {limit} bytes in all", name)
        out.append((name, data))
    return out


def parse_request(body: Any, *, default_run_timeout_s: float, max_files_bytes: int) -> RunCodeRequest:
    """Validates a decoded JSON body; raises ``BadInputError`` (see ``invalid``)."""
    if not isinstance(body, dict):
        raise invalid("", "dict_type", "Input should be a valid dictionary", body)
    code = body.get("code")
    if not isinstance(code, str):
        kind, msg = ("missing", "Field required") if "code" not in body else ("string_type", "Input should be a string")
        raise invalid("code", kind, msg, code)
    language = body.get("language")
    if "language" not in body:
        raise invalid("language", "missing", "Field required", None)
    if language not in LANGUAGES:
        allowed = " or ".join(repr(name) for name in LANGUAGES)
        raise invalid("language", "literal_error", f"Input should be {allowed}", language)
    stdin = body.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise invalid("stdin", "string_type", "Input should be a valid string", stdin)
    _number(body, "compile_timeout", 10.0)  # checked like SandboxFusion; Python compiles nothing
    run_timeout = _number(body, "run_timeout", default_run_timeout_s)
    if run_timeout <= 0:
        raise invalid("run_timeout", "greater_than", "Input should be greater than 0", run_timeout)
    memory = body.get("memory_limit_MB", -1)
    if isinstance(memory, float) and memory.is_integer():
        memory = int(memory)
    if isinstance(memory, bool) or not isinstance(memory, int):
        raise invalid("memory_limit_MB", "int_type", "Input should be a valid integer", memory)
    files = _files(body.get("files", {}), max_files_bytes)
    fetch = body.get("fetch_files", [])
    if not isinstance(fetch, list) or not all(isinstance(v, str) for v in fetch):
        raise invalid("fetch_files", "list_type", "Input should be a list of file paths", fetch)
    for name in fetch:
        _check_path("fetch_files", name)
    return RunCodeRequest(
        code=code,
        language=language,
        stdin=stdin,
        run_timeout_s=run_timeout,
        memory_limit_mb=memory if memory > 0 else None,
        files=files,
        fetch_files=list(dict.fromkeys(fetch)),
    )


def _text(value: Any) -> str:
    # The harness hands output over as surrogate-escaped text; clients get valid UTF-8.
    return str(value or "").encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _pod() -> str | None:
    return os.environ.get("MY_POD_NAME")  # SandboxFusion's field, from the same variable


def reply_from_report(report: dict[str, Any]) -> dict[str, Any]:
    """SandboxFusion's reply for the sandbox's report of one run (``run_program``)."""
    limit = report.get("status")
    result: dict[str, Any] = {
        "status": "Finished",
        "execution_time": round(float(report.get("elapsed_s", 0.0)), 6),
        "return_code": None,
        "stdout": _text(report.get("stdout")),
        "stderr": _text(report.get("err")),
    }
    message = ""
    if limit == "timeout":
        result["status"] = "TimeLimitExceeded"
    elif limit in ("memory", "output_limit"):
        # Killed by the kernel's OOM killer (the slot's cgroup) or by us for its output:
        # SandboxFusion would report a finished process with a negative return code.
        result["return_code"] = _KILLED
        message = "memory limit exceeded" if limit == "memory" else "output limit exceeded"
    elif "signal" in report:
        result["return_code"] = -int(report["signal"])
    else:
        result["return_code"] = int(report.get("exit", 1))
    ok = result["status"] == "Finished" and result["return_code"] == 0
    return {
        "status": "Success" if ok else "Failed",
        "message": message,
        "compile_result": None,
        "run_result": result,
        "executor_pod_name": _pod(),
        "files": {name: base64.b64encode(data).decode() for name, data in (report.get("files") or {}).items()},
    }


def sandbox_error(message: str) -> dict[str, Any]:
    """Our fault, not the program's: SandboxFusion's ``SandboxError`` (HTTP 200)."""
    return {
        "status": "SandboxError",
        "message": message,
        "compile_result": None,
        "run_result": None,
        "executor_pod_name": _pod(),
        "files": {},
    }
