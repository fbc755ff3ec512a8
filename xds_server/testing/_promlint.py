"""The exposition rules ``promtool check metrics`` applies, as a function (for hosts without
promtool): :func:`lint_exposition` returns the problems found in a Prometheus text exposition.

Rules (after Prometheus's ``promlint``, the library behind ``promtool check metrics``): every
family has HELP text; a family is described once; names match ``[a-zA-Z_:][a-zA-Z0-9_:]*`` and
are snake_case; a counter's samples end in ``_total`` (``_created`` aside) and a non-counter's
name does not; no non-base units (``_ms``, ``_milliseconds``, ``_microseconds``, ``_minutes``,
``_hours``, ``_days``, ``_percent``, ``_kilobytes``, ``_megabytes``, ``_gigabytes``, ...);
``_count``/``_sum``/``_bucket`` only on histograms and summaries; ``_info`` only on info
families; labels snake_case and not reserved (``__`` prefix).
"""
from __future__ import annotations

import re

__all__ = ["lint_exposition"]

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_CAMEL = re.compile(r"[A-Z]")
_NON_BASE = ("ms", "milliseconds", "microseconds", "us", "nanoseconds", "ns", "minutes", "hours",
             "days", "weeks", "percent", "kilobytes", "megabytes", "gigabytes", "terabytes", "bits",
             "celsius_millidegrees", "millis")
_HELP = re.compile(r"^# HELP (\S+) (.+)$")
_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+\S+")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')


def lint_exposition(text: str) -> list[str]:
    """Problems (one line each, naming the metric) in ``text``, a text-format exposition."""
    problems: list[str] = []
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if m := _HELP.match(line):
            if m.group(1) in helps:
                problems.append(f"{m.group(1)}: HELP given twice (duplicate family)")
            helps[m.group(1)] = m.group(2)
        elif m := _TYPE.match(line):
            if m.group(1) in types:
                problems.append(f"{m.group(1)}: TYPE given twice (duplicate family)")
            types[m.group(1)] = m.group(2)
    for name, kind in types.items():
        if not helps.get(name, "").strip():
            problems.append(f"{name}: no help text")
        if not _NAME.match(name):
            problems.append(f"{name}: invalid metric name")
        if _CAMEL.search(name):
            problems.append(f"{name}: metric names should be written in snake_case")
        parts = name.split("_")
        for unit in _NON_BASE:
            if unit in parts[1:]:
                problems.append(f"{name}: use base units (seconds, bytes, ratio), not {unit!r}")
        if kind != "counter" and name.endswith("_total"):
            problems.append(f"{name}: non-counter metrics should not have '_total' suffix")
        if kind not in ("histogram", "summary") and name.endswith(("_count", "_sum", "_bucket")):
            problems.append(f"{name}: reserved suffix on a {kind}")
        if kind != "info" and name.endswith("_info") and kind != "gauge":
            problems.append(f"{name}: '_info' suffix on a {kind}")
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            problems.append(f"unparsable sample line: {line[:80]!r}")
            continue
        sample = m.group(1)
        family = next((f for f in (sample, sample.removesuffix("_total"), sample.removesuffix("_created"),
                                   sample.removesuffix("_bucket"), sample.removesuffix("_count"),
                                   sample.removesuffix("_sum")) if f in types), None)
        if family is None:
            problems.append(f"{sample}: sample without a TYPE line")
            continue
        if types[family] == "counter" and not (sample.endswith(("_total", "_created"))):
            problems.append(f"{sample}: counter metrics should have '_total' suffix")
        for label in _LABEL.findall(m.group(3) or ""):
            if label.startswith("__"):
                problems.append(f"{sample}: reserved label name {label!r}")
            if _CAMEL.search(label):
                problems.append(f"{sample}: label {label!r} should be snake_case")
    return sorted(set(problems))
