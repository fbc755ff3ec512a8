"""``shift:`` section: gated traffic shifts between priorities or regions.

Defaults come from seed 002, the regional-failover article: a soft shift sends 10 % to the standby
region, advances 10 % every 5 minutes while the target's error rate stays below 0.5 % and its
latency rises less than 15 %. The minimum-sample and consecutive-failure rules answer the faults
users report in Flagger and Argo Rollouts (no data judged as failure, one bad sample rolls back).
"""
from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from xds_server.config.duration import Duration, PositiveDuration, at_most
from xds_server.config.renames import Moves, _Renaming

__all__ = ["ShiftConfig"]



class ShiftConfig(_Renaming):
    """Gates and defaults of ``POST /clusters/{name}/shift`` and ``xds-server shift``."""

    WHERE: ClassVar[str] = "shift"
    MOVED: ClassVar[Moves] = {
        "default_every_s": ("default_every", "s"),
    }

    default_step_percent: float = Field(
        10.0, gt=0, le=100, description="share moved per step, % (seed 002: 10 %)")
    default_every: Annotated[PositiveDuration, at_most("24h")] = Field(
        Duration.parse("5m"), description="length of a step's gate window, s (seed 002: 5 minutes)")
    max_error_ratio: float = Field(
        0.005, gt=0, lt=1,
        description="the target's real-traffic error ratio (LRS, 0..1) must stay below this "
        "(seed 002: < 0.5 %)")
    max_latency_increase: float = Field(
        0.15, gt=0, le=10,
        description="the target's probe TTFT over the source's, minus 1 (ratio), must stay below "
        "this (seed 002: latency rises < 15 %)")
    min_requests: int = Field(
        50, ge=1,
        description="fewest completed target requests in a window for the error gate to judge; "
        "fewer holds the step (Kayenta asks >= 50 data points per metric)")
    wilson_z: float = Field(
        1.96, gt=0, le=10,
        description="z of the Wilson score interval on the error ratio (1.96: 95 %); the gate "
        "passes when the upper bound is below max_error_ratio, fails when the lower bound is "
        "above it, and holds in between (the sample cannot tell)")
    fail_windows: int = Field(
        2, ge=1, le=100,
        description="consecutive failed windows that roll a step back (Argo's consecutiveErrorLimit "
        "idea; 1 would let a single bad window roll back)")
    max_rollbacks: int = Field(
        3, ge=1, le=100,
        description="rollbacks of one shift before it pauses for the operator")
    state_path: str | None = Field(
        None,
        description="JSON file the running shifts are kept in (atomic writes), so a restart resumes "
        "at the same step; None: next to state.path as <state.path>.shifts.json, or not kept")
