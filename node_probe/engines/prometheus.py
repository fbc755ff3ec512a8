"""Prometheus text parsing for engine load: :func:`parse_with_spec` reads the samples a
:class:`MetricSpec` names from a ``/metrics`` page into an :class:`EngineLoadReading`.

Only the lines of the wanted metric names are parsed (a prefix pick, then a strict parse of
those lines): a vLLM page is ~57 KB and 92 families, a full parse would cost milliseconds of
event-loop time at every scrape, this one ~0.1 ms.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["EngineLoadReading", "GroupLoad", "MetricSpec", "Sel", "parse_with_spec", "sel"]


@dataclass(frozen=True)
class GroupLoad:
    """Load of one engine instance behind the endpoint (one value of the adapter's group label,
    e.g. vLLM's ``engine`` label under data parallelism; ``""`` when there is no such label).

    Attributes:
        running: requests being processed by this instance (``None``: unknown).
        waiting: requests queued at this instance (``None``: unknown).
        progress: a counter that advances with every engine step (vLLM generated + prompt
            tokens, TGI successful batch forwards, TensorRT-LLM iterations); ``None`` when the
            engine exposes none, which disables stall detection for this instance.
        kv: this instance's KV-cache usage, ratio 0..1 (max over its series); a second
            progress signal: it grows during a chunked prefill while vLLM's token counters stay
            frozen (vLLM v1 counts prompt tokens only when a prefill completes). ``None``: unknown.
    """

    running: float | None = None
    waiting: float | None = None
    progress: float | None = None
    kv: float | None = None


@dataclass(frozen=True)
class EngineLoadReading:
    """Engine load read from one ``/metrics`` scrape. ``None`` means unknown (never 0).

    Attributes:
        requests_waiting: requests queued in the engine (summed over instances).
        requests_running: requests being decoded (summed over instances).
        kv_cache_usage_ratio: KV-cache usage, 0..1 (max over instances).
        prefix_cache_hit_ratio: prefix-cache hits / queries since engine start, 0..1; ``None``
            while there were no queries or the engine does not expose them.
        generation_tokens_total: cumulative generated tokens (counter).
        requests_finished_total: requests finished since the engine started (counter, summed
            over every series: finish reasons, instances).
        kv_cache_metric: name of the metric the KV value came from, ``""`` if none.
        groups: per-instance running/waiting/progress, keyed by the group label's value.
        progress_metric: name(s) of the metric(s) ``GroupLoad.progress`` comes from, ``""``
            when the engine exposes no per-step progress counter.
    """

    requests_waiting: float | None = None
    requests_running: float | None = None
    kv_cache_usage_ratio: float | None = None
    prefix_cache_hit_ratio: float | None = None
    generation_tokens_total: float | None = None
    requests_finished_total: float | None = None
    kv_cache_metric: str = ""
    groups: Mapping[str, GroupLoad] = field(default_factory=dict, compare=False)
    progress_metric: str = field(default="", compare=False)

    @property
    def stall_capable(self) -> bool:
        """True if at least one instance exposes a progress counter (stall detection works)."""
        return any(g.progress is not None for g in self.groups.values())


@dataclass(frozen=True)
class Sel:
    """Selects the samples of metric ``name`` whose labels include every ``labels`` pair."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """True if ``labels`` hold every pair of this selector."""
        return all(labels.get(k) == v for k, v in self.labels)

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        inner = ",".join(f'{k}="{v}"' for k, v in self.labels)
        return f"{self.name}{{{inner}}}"


def sel(name: str, **labels: str) -> Sel:
    """``Sel(name, labels)`` with the labels given as keywords (sorted, so equal selectors compare equal)."""
    return Sel(name, tuple(sorted(labels.items())))


@dataclass(frozen=True)
class MetricSpec:
    """Where an engine family keeps its load signals in ``/metrics``.

    Each field is a tuple of alternatives in order of preference: the first alternative that has
    samples wins and the others are never added to it (so a metric renamed between versions and
    exposed under both names counts once).

    Attributes:
        running, waiting: gauges; per instance the max over duplicate series (e.g. one per
            tensor-parallel rank), then summed over instances.
        kv_usage: ratio gauges 0..1 (max over all series).
        kv_used_total: ``(used, total)`` gauge pairs giving the ratio when no ratio gauge exists.
        prefix_pairs: ``(queries, hits)`` counter pairs (summed) giving the hit ratio.
        prefix_gauges: hit-ratio gauges 0..1, used when no counter pair exists.
        generation_tokens: generated-token counters (summed).
        finished: finished-request counters (summed over every series).
        progress: alternatives for the per-step progress counter; each alternative is a tuple of
            selectors whose samples are all summed (e.g. generated + prompt tokens).
        group_label: label whose values identify engine instances (``None``: one instance).
    """

    running: tuple[Sel, ...] = ()
    waiting: tuple[Sel, ...] = ()
    kv_usage: tuple[Sel, ...] = ()
    kv_used_total: tuple[tuple[Sel, Sel], ...] = ()
    prefix_pairs: tuple[tuple[Sel, Sel], ...] = ()
    prefix_gauges: tuple[Sel, ...] = ()
    generation_tokens: tuple[Sel, ...] = ()
    finished: tuple[Sel, ...] = ()
    progress: tuple[tuple[Sel, ...], ...] = ()
    group_label: str | None = None

    def names(self) -> frozenset[str]:
        """Every metric name the spec selects (the only lines parsed from a page)."""
        sels: list[Sel] = [*self.running, *self.waiting, *self.kv_usage, *self.prefix_gauges,
                           *self.generation_tokens, *self.finished]
        for pair in (*self.kv_used_total, *self.prefix_pairs):
            sels.extend(pair)
        for alt in self.progress:
            sels.extend(alt)
        return frozenset(s.name for s in sels)


@dataclass(frozen=True)
class _Sample:
    name: str
    labels: Mapping[str, str]
    value: float


_SAMPLE_RE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+-?\d+)?[ \t]*")
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_wanted_prefixes: dict[frozenset[str], tuple[str, ...]] = {}


def _prefixes(wanted: frozenset[str]) -> tuple[str, ...]:
    found = _wanted_prefixes.get(wanted)
    if found is None:
        found = tuple(n + sep for n in sorted(wanted) for sep in ("{", " ", "\t"))
        _wanted_prefixes[wanted] = found
    return found


def _parse_labels(inner: str, line: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    inner = inner.rstrip()
    while pos < len(inner):
        m = _LABEL_RE.match(inner, pos)
        if m is None:
            raise ValueError(f"invalid labels in metric line: {line!r}")
        value = m.group(2)
        if "\\" in value:
            value = re.sub(r"\\[\\\"n]", lambda x: _UNESCAPE[x.group(0)], value)
        labels[m.group(1)] = value
        pos = m.end()
    return labels


def _samples(text: str, wanted: frozenset[str]) -> dict[str, list[_Sample]]:
    """Samples of the ``wanted`` metric names only, by name (see the module docstring for why
    only those lines are parsed). Raises ValueError for an invalid wanted line."""
    out: dict[str, list[_Sample]] = {}
    prefixes = _prefixes(wanted)
    for line in text.splitlines():
        if not line.startswith(prefixes):
            continue
        sm = _SAMPLE_RE.fullmatch(line)
        if sm is None:
            raise ValueError(f"invalid metric line: {line!r}")
        name, inner, raw = sm.group(1), sm.group(2), sm.group(3)
        if name not in wanted:
            continue
        value = float(raw)  # ValueError for garbage; "NaN", "+Inf" parse and are dropped below
        if not math.isfinite(value):
            continue
        labels = _parse_labels(inner, line) if inner else {}
        out.setdefault(name, []).append(_Sample(name, labels, value))
    return out


def _select(samples: dict[str, list[_Sample]], sel_: Sel) -> list[_Sample]:
    return [s for s in samples.get(sel_.name, ()) if sel_.matches(s.labels)]


def _first(samples: dict[str, list[_Sample]], alts: Iterable[Sel]) -> tuple[Sel, list[_Sample]] | None:
    for alt in alts:
        found = _select(samples, alt)
        if found:
            return alt, found
    return None


def parse_with_spec(text: str, spec: MetricSpec) -> EngineLoadReading:
    """Parse Prometheus exposition text into a reading, following ``spec``.

    NaN/Inf samples are ignored; missing metrics give ``None``. Only the lines of the metrics
    named in ``spec`` are parsed (the rest of the page is skipped for speed, not validated).

    Raises:
        ValueError: the selected lines are not valid Prometheus exposition format.
    """
    samples = _samples(text, spec.names())
    glabel = spec.group_label

    def group_of(s: _Sample) -> str:
        return s.labels.get(glabel, "") if glabel else ""

    def per_group_max(alts: tuple[Sel, ...]) -> dict[str, float] | None:
        found = _first(samples, alts)
        if found is None:
            return None
        out: dict[str, float] = {}
        for s in found[1]:
            g = group_of(s)
            out[g] = max(out.get(g, s.value), s.value)
        return out

    running = per_group_max(spec.running)
    waiting = per_group_max(spec.waiting)

    progress: dict[str, float] | None = None
    progress_metric = ""
    for alt in spec.progress:
        found_any = False
        acc: dict[str, float] = {}
        for sel_ in alt:
            for s in _select(samples, sel_):
                found_any = True
                g = group_of(s)
                acc[g] = acc.get(g, 0.0) + s.value
        if found_any:
            progress = acc
            progress_metric = "+".join(str(s) for s in alt if _select(samples, s))
            break

    kv_by_group = per_group_max(spec.kv_usage)
    if kv_by_group is None:
        for used_sel, _total_sel in spec.kv_used_total:
            used = _select(samples, used_sel)
            if used:  # the used-block count alone moves exactly when the ratio does
                kv_by_group = {}
                for s in used:
                    g = group_of(s)
                    kv_by_group[g] = kv_by_group.get(g, 0.0) + s.value
                break

    groups: dict[str, GroupLoad] = {}
    for g in set(running or ()) | set(waiting or ()) | set(progress or ()):
        groups[g] = GroupLoad(
            running=None if running is None else running.get(g),
            waiting=None if waiting is None else waiting.get(g),
            progress=None if progress is None else progress.get(g),
            kv=None if kv_by_group is None else kv_by_group.get(g),
        )

    kv_ratio: float | None = None
    kv_name = ""
    found = _first(samples, spec.kv_usage)
    if found is not None:
        kv_name = str(found[0])
        kv_ratio = min(1.0, max(0.0, max(s.value for s in found[1])))
    else:
        for used_sel, total_sel in spec.kv_used_total:
            used = _select(samples, used_sel)
            total = _select(samples, total_sel)
            if used and total:
                tot = sum(s.value for s in total)
                if tot > 0:
                    kv_ratio = min(1.0, max(0.0, sum(s.value for s in used) / tot))
                    kv_name = f"{used_sel}/{total_sel}"
                break

    prefix_ratio: float | None = None
    for queries_sel, hits_sel in spec.prefix_pairs:
        queries = _select(samples, queries_sel)
        if queries:
            q = sum(s.value for s in queries)
            hits = _select(samples, hits_sel)
            if q > 0 and hits:
                prefix_ratio = min(1.0, max(0.0, sum(s.value for s in hits) / q))
            break
    else:
        gauge = _first(samples, spec.prefix_gauges)
        if gauge is not None:
            vals = [s.value for s in gauge[1]]
            prefix_ratio = min(1.0, max(0.0, sum(vals) / len(vals)))

    gen = _first(samples, spec.generation_tokens)
    fin = _first(samples, spec.finished)
    return EngineLoadReading(
        requests_waiting=None if waiting is None else float(sum(waiting.values())),
        requests_running=None if running is None else float(sum(running.values())),
        kv_cache_usage_ratio=kv_ratio,
        prefix_cache_hit_ratio=prefix_ratio,
        generation_tokens_total=None if gen is None else float(sum(s.value for s in gen[1])),
        requests_finished_total=None if fin is None else float(sum(s.value for s in fin[1])),
        kv_cache_metric=kv_name,
        groups=groups,
        progress_metric=progress_metric,
    )
