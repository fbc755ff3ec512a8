"""Durations in the configuration: written with their unit, read in either.

A duration key takes a string with a unit, as Envoy, Kubernetes and Prometheus write them:
``"100ms"``, ``"1.5s"``, ``"5m"``, ``"1h"`` (``0`` alone is allowed). A bare number other than 0
is refused with the field's name: ``interval: 100`` could mean 100 ms or 100 s, and a heartbeat
100 s long is a different product. The code reads a :class:`Duration` as ``.s`` or ``.ms``
(plain attributes, both set at construction), so no call site converts units by hand.

Shape::

    class M(_Model):
        interval: PositiveDuration = Field(Duration.parse("100ms"))
    M(interval="0.1s").interval.ms   # 100.0
    str(Duration.parse("1500ms"))    # "1.5s"
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import AfterValidator, PlainSerializer, PlainValidator, WithJsonSchema

__all__ = ["Duration", "NonNegativeDuration", "PositiveDuration", "at_least", "at_most"]

_FORM = re.compile(r"^\s*(-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*(ms|s|m|h)\s*$")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True, slots=True)
class Duration:
    """A length of time: ``s`` seconds, ``ms`` the same in milliseconds."""

    s: float
    ms: float = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ms", self.s * 1000.0)

    @classmethod
    def parse(cls, value: object) -> Duration:
        """A Duration from ``"100ms"``, ``"1.5s"``, ``"5m"``, ``"1h"``, ``0`` or a Duration.
        ValueError saying what was given and the form expected."""
        if isinstance(value, Duration):
            return value
        if isinstance(value, str) and value.strip() in ("0", "0.0"):
            return cls(0.0)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value == 0:
                return cls(0.0)
            raise ValueError(f"{value!r} has no unit: write it with one, e.g. {value:g}ms or {value:g}s")
        if isinstance(value, str) and (m := _FORM.match(value)):
            s = float(m[1]) * _SECONDS[m[2]]
            if math.isfinite(s):
                return cls(s)
        raise ValueError(f"{str(value)[:40]!r} is not a duration (e.g. 100ms, 1.5s, 5m, 1h)")

    def __str__(self) -> str:
        """The shortest exact form: ``"80ms"``, ``"1.5s"``, ``"5m"``, ``"0"``."""
        if self.s == 0:
            return "0"
        if self.s < 0:
            return f"-{Duration(-self.s)}"
        for unit, scale in (("h", 3600.0), ("m", 60.0), ("s", 1.0)):
            if self.s >= scale and (self.s / scale) == round(self.s / scale, 3):
                return f"{self.s / scale:.15g}{unit}"
        return f"{self.ms:.15g}ms"


def _positive(value: Any) -> Duration:
    d = Duration.parse(value)
    if d.s <= 0:
        raise ValueError(f"{d} must be longer than 0")
    return d


def _non_negative(value: Any) -> Duration:
    d = Duration.parse(value)
    if d.s < 0:
        raise ValueError(f"{d} must not be negative")
    return d


_SCHEMA = WithJsonSchema({"type": "string", "pattern": _FORM.pattern})
_AS_TEXT = PlainSerializer(str, return_type=str)
#: A duration longer than 0.
PositiveDuration = Annotated[Duration, PlainValidator(_positive), _AS_TEXT, _SCHEMA]
#: A duration, 0 allowed.
NonNegativeDuration = Annotated[Duration, PlainValidator(_non_negative), _AS_TEXT, _SCHEMA]


def _bound(limit: str, low: bool) -> AfterValidator:
    """An AfterValidator refusing a duration under (``low``) or over ``limit``; None passes."""
    edge = Duration.parse(limit)

    def check(d: Duration | None) -> Duration | None:
        if d is not None and (d.s < edge.s if low else d.s > edge.s):
            raise ValueError(f"{d} is {'shorter' if low else 'longer'} than {edge}")
        return d
    return AfterValidator(check)


def at_most(limit: str) -> AfterValidator:
    """A field's upper bound, for ``Annotated[PositiveDuration, at_most("1s")]`` (None passes)."""
    return _bound(limit, low=False)


def at_least(limit: str) -> AfterValidator:
    """A field's lower bound, for ``Annotated[PositiveDuration, at_least("100ms")]`` (None passes)."""
    return _bound(limit, low=True)
