"""The ``reward_extra_info`` columns of verl's reward loop, fixed before the first sample.

verl 0.9.1's ``RewardLoopManager.compute_rm_score`` gathers the samples of its
``reward.num_workers`` ``RewardLoopWorker`` actors and takes the columns from the first
sample's keys: a key another sample lacks is a ``KeyError``, a key the first lacks is
dropped, and between validation batches a column that comes and goes breaks verl's
length check. The actors never see each other's samples, so no actor can discover the
columns; they are declared instead, and every sample of every actor carries exactly:

* ``score``, ``acc``, ``reward_failed``, ``reward_status`` (the loop's own);
* ``overlong_reward``, ``overlong`` with dapo's logged overlong penalty;
* a composite's columns (``composite_columns``: each component's ``<name>``,
  ``<name>_status``, ``<name>_latency_ms`` and its declared ``<name>/<key>``), or the
  single scorer's keys: a built-in's defaults plus ``extra_keys`` (a custom function's).

A declared key a sample lacks (a failed sample, a skipped component) is None: verl's
validation metrics drop None before they average (``process_validation_metrics``), where
NaN would turn the mean into NaN. A key a scorer returns that was not declared is dropped,
with one warning per key naming the option that declares it. A list or dict value is
sent as its JSON text: verl stacks each column with ``np.array``, which fails on lists of
unequal length.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from stream_reward.config import ManagerConfig, OverlongConfig
from stream_reward.scoring.columns import default_columns

__all__ = ["LOOP_COLUMNS", "VerlColumns", "declared_columns"]

log = logging.getLogger(__name__)

LOOP_COLUMNS = ("score", "acc", "reward_failed", "reward_status")


def declared_columns(manager: ManagerConfig, extra_keys: Sequence[str] = ()) -> list[str]:
    """Every column a sample of ``manager`` carries in verl's reward loop, in order."""
    from stream_reward.scoring.composite import composite_columns, parse_components

    out = list(LOOP_COLUMNS)
    if manager.manager == "dapo":
        overlong = OverlongConfig.from_config(manager.overlong_buffer_cfg, manager.max_resp_len)
        if overlong.enable and overlong.log:
            out += ["overlong_reward", "overlong"]
    if manager.components:
        out += composite_columns(parse_components(manager.components))
    else:
        out += default_columns(manager.scorer, manager.reward_kwargs)
    out += extra_keys
    return list(dict.fromkeys(out))


class VerlColumns:
    """Conform each sample's extra info to the declared columns (see the module docstring)."""

    def __init__(self, columns: Sequence[str], *, composite: bool) -> None:
        self.columns = tuple(columns)
        self._composite = composite
        self._warned: set[str] = set()

    def conform(self, extra: Mapping[str, Any]) -> dict[str, Any]:
        for key in extra:
            if key not in self._warned and key not in self.columns:
                self._warned.add(key)
                log.warning(
                    "reward_extra_info key %r was not declared and is left out of verl's columns; declare it in %s",
                    key,
                    self._option_for(key),
                )
        return {key: _cell(extra.get(key)) for key in self.columns}

    def _option_for(self, key: str) -> str:
        name, sep, _ = key.partition("/")
        if self._composite and sep:
            return f"reward.components.{name}.columns"
        return "reward.reward_kwargs.extra_keys"


def _cell(value: Any) -> Any:
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=repr, sort_keys=True)
    return value
