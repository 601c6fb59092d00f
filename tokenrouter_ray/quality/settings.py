"""The live-quality sections of the app config: ``quality_monitor`` (which answers the top
model scores, quality/live.py) and ``tuner.quality_target`` (the operating point requests
without ``routing`` get from those scores, quality/target.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class QualityTargetSpec(_Strict):
    """``tuner.quality_target``: the routing operating point of requests that ask for no
    ``routing`` follows live quality (tokenrouter_ray/quality/target.py): the cheapest rung
    of ``ladder`` whose live agreement with the top model meets ``target``, the top model
    alone (bypass) when none does. Each ingress replica holds it from the answers it scores
    (``quality_monitor``); it does not need the tuner deployment."""

    target: float = Field(
        gt=0, le=1, description="The agreement to hold, in (0, 1] (see ``metric``)."
    )
    metric: Literal["answer", "position"] = Field(
        "answer",
        description="answer: share of scored answers the top model would have written "
        "token for token (greedy); position: share of answer positions where its greedy "
        "token is the committed one.",
    )
    ladder: list[str] = Field(
        min_length=1,
        description="policy.presets names, cheapest first (lowest large-model share); the "
        "top model alone is the rung above the last unless ``bypass`` is false.",
    )
    bypass: bool = Field(
        True, description="The top model alone as the last rung (always meets any target)."
    )
    start: str | None = Field(
        None, description="The rung to start on (a ladder name, or alone); null: alone."
    )
    min_samples: int = Field(30, ge=2, description="Scored answers on a rung before it is judged.")
    confidence: float = Field(
        0.9,
        gt=0.5,
        lt=1,
        description="One-sided confidence of each judgement: a rung is left upwards when "
        "agreement's upper bound is under the target, downwards when its lower bound is "
        "at least target + margin.",
    )
    margin: float = Field(
        0.02, ge=0, lt=1, description="Hysteresis: how far above the target to step down."
    )
    retry_after: int = Field(
        200,
        ge=1,
        description="Scored answers before a rung that failed is tried again (a prompt mix "
        "that shifts back is found again).",
    )
    window: int = Field(
        100, ge=2, description="Recent scored answers per rung its judgement reads."
    )


class QualityMonitorSpec(_Strict):
    """The ``quality_monitor`` section: a sample of finished answers scored live by the top
    model of the chain by teacher forcing (tokenrouter_ray/quality/live.py)."""

    sample_rate: float = Field(
        0.02,
        ge=0,
        le=1,
        description="Share of finished answers scored (0: off). Each is one prefill of prompt "
        "and answer on a replica of the top model, run between two of its steps.",
    )
    max_share: float = Field(
        0.05,
        gt=0,
        le=1,
        description="Most of a top-model replica's time that scoring may take, over the last "
        "minute; a sampled answer past it is skipped (counted as reason=budget).",
    )
    max_pending: int = Field(
        4, ge=1, description="Scorings in flight per ingress replica; more are skipped."
    )
    window: int = Field(
        200, ge=1, description="Scored answers per operating point the status route averages."
    )
    timeout_s: float = Field(60.0, gt=0, description="Longest wait for one scoring.")


class SpeedBypassSpec(_Strict):
    """``tuner.speed_bypass``: requests that ask for no ``routing`` are served by the top
    model alone at the load levels where that is measured faster than routing
    (tokenrouter_ray/quality/speed.py). Each ingress replica measures it from the requests it
    serves; it does not need the tuner deployment."""

    explore_every: int = Field(
        20,
        ge=0,
        description="Every this many requests at a load level, one is served in the slower "
        "mode, so a change is seen (0: never; its cost is at most 1/explore_every of the gap).",
    )
    min_samples: int = Field(
        4, ge=1, description="Requests measured in each mode at a load level before it decides."
    )
    margin: float = Field(
        0.05, ge=0, lt=1, description="Hysteresis: how much faster the other mode must be."
    )
    window: int = Field(
        32, ge=1, description="Recent requests per mode and load level the means read."
    )
    min_tokens: int = Field(
        4, ge=1, description="Shorter answers are not measured (their time is mostly prefill)."
    )
    start: Literal["routed", "alone"] = Field(
        "alone", description="The mode a load level's first request gets while it learns."
    )
