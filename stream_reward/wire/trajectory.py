"""The two records that travel through Redis: a finished trajectory and its score."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["ok", "failed"]

__all__ = ["Trajectory", "ScoreResult", "ResultRecord", "Status", "default_uid", "trajectory_from_json"]

# A result's fields but ``extra``, in ScoreResult's order, as a plain tuple: with its
# extra, ``ScoreResult.from_record(record, extra)`` is the result again. What a batch
# keeps while it fills and after collect (see trainer.rewards.BatchRewards): a tuple
# of atoms stops being tracked by the garbage collector after one pass; a ScoreResult
# never does, nor a tuple that holds a dict (even an empty one).
ResultRecord = tuple[Any, ...]


def default_uid(batch_id: str, index: int) -> str:
    """The uid a sample gets when its producer gives none: unique within a namespace."""
    return f"{batch_id}/{index}"


@dataclass(slots=True)
class Trajectory:
    """One finished rollout, as a rollout producer pushes it.

    ``valid_response_length`` counts the response tokens that are not padding; the
    reward lands at index ``valid_response_length - 1`` of the batch's rm_scores
    row. When the producer has no token count it may leave it ``None``; the
    aggregator then uses the length of ``response_ids`` if given, else puts the
    score on the last column of the row.
    """

    batch_id: str
    index: int
    data_source: str
    response: str = ""
    ground_truth: Any = None
    uid: str = ""
    prompt: str | None = None
    response_ids: list[int] | None = None
    valid_response_length: int | None = None
    max_response_length: int | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    group: str | None = None
    # A score already computed upstream (verl's rm_scores path). Managers use it as
    # the task score instead of calling the scorer; shaping (dapo) still applies.
    rm_score: float | None = None

    def __post_init__(self) -> None:
        if not self.uid:
            self.uid = default_uid(self.batch_id, self.index)

    @property
    def response_length(self) -> int | None:
        """Valid response tokens, from the explicit count or the token ids."""
        if self.valid_response_length is not None:
            return self.valid_response_length
        if self.response_ids is not None:
            return len(self.response_ids)
        return None


@dataclass(slots=True)
class ScoreResult:
    """The one result record of a sample, written once per uid.

    ``status == "failed"`` means the sample could not be scored (``reason`` is a
    stable code, ``error`` the human message); its ``score`` is then meaningless
    and the batch's failure policy decides what the trainer sees.
    """

    uid: str
    batch_id: str
    index: int
    score: float
    status: Status = "ok"
    extra: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    error: str | None = None
    attempts: int = 1
    valid_response_length: int | None = None
    data_source: str | None = None
    group: str | None = None
    scored_at: float = 0.0  # server-side wall clock, seconds; set by the worker

    @classmethod
    def failed(
        cls,
        uid: str,
        batch_id: str,
        index: int,
        *,
        reason: str,
        error: str,
        attempts: int = 1,
        traj: Trajectory | None = None,
        **fields: Any,
    ) -> ScoreResult:
        """A `failed` result: no score (0.0 is a placeholder the policy replaces), a reason code and a message.

        With ``traj`` its length, data source and group are carried along.
        """
        if traj is not None:
            fields.setdefault("valid_response_length", traj.response_length)
            fields.setdefault("data_source", traj.data_source)
            fields.setdefault("group", traj.group)
        return cls(uid, batch_id, index, 0.0, "failed", reason=reason, error=error, attempts=attempts, **fields)

    @classmethod
    def from_record(cls, record: ResultRecord, extra: dict[str, Any]) -> ScoreResult:
        """The result of ``record`` and its ``extra`` (see ResultRecord)."""
        uid, batch_id, index, score, status, reason, error, attempts, length, source, group, at = record
        # Positional: 0.35 us against 0.93 with keywords, per result on the trainer.
        return cls(uid, batch_id, index, score, status, extra, reason, error, attempts, length, source, group, at)

    def record(self) -> ResultRecord:
        """The result's fields but ``extra`` (see ResultRecord)."""
        return (
            self.uid,
            self.batch_id,
            self.index,
            self.score,
            self.status,
            self.reason,
            self.error,
            self.attempts,
            self.valid_response_length,
            self.data_source,
            self.group,
            self.scored_at,
        )


_JSON_FIELDS: dict[str, tuple[type, ...]] = {
    "response": (str,),
    "data_source": (str,),
    "uid": (str,),
    "prompt": (str,),
    "response_ids": (list,),
    "valid_response_length": (int,),
    "max_response_length": (int,),
    "extra_info": (dict,),
    "group": (str, int),
    "rm_score": (int, float),
}


def trajectory_from_json(obj: Any, batch_id: str, index: int) -> Trajectory:
    """A trajectory from one JSONL rollout record; unknown fields are ignored.

    Raises ValueError naming the offending field.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    for name in ("response", "data_source"):
        if name not in obj:
            raise ValueError(f"missing required field {name!r}")
    if not isinstance(obj["response"], str):  # null too: a missing response is bad input, never an empty answer
        raise ValueError(f"field 'response' must be a string, got {type(obj['response']).__name__}")
    for name, types in _JSON_FIELDS.items():
        value = obj.get(name)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise ValueError(
                f"field {name!r} must be {' or '.join(t.__name__ for t in types)}, got {type(value).__name__}"
            )
    ids = obj.get("response_ids")
    if ids is not None and not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("field 'response_ids' must be a list of integers")
    group = obj.get("group")
    return Trajectory(
        batch_id=batch_id,
        index=index,
        data_source=obj["data_source"],
        response=obj["response"],
        ground_truth=obj.get("ground_truth"),
        uid=obj.get("uid") or "",
        prompt=obj.get("prompt"),
        response_ids=ids,
        valid_response_length=obj.get("valid_response_length"),
        max_response_length=obj.get("max_response_length"),
        extra_info=obj.get("extra_info") or {},
        group=str(group) if group is not None else None,
        rm_score=obj.get("rm_score"),
    )
