"""The shifts' state document (JSON) and back, pure: what the shift state file holds.

Shape (version 1)::

    {"version": 1, "written_wall_s": 1.7e9,
     "shifts": {"llm": {"spec": {...}, "phase": "stepping", "steps": 3, "anchor_s": ..., ...}},
     "base": {"llm": {"gpu-a": 1, "gpu-b": 0}}}

Times are wall-clock seconds, so a restarted control plane finds the same step and the same
decision grid. :func:`from_doc` raises ValueError naming the entry on anything malformed.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xds_server.policy.shift_machine import Phase, ShiftSpec, ShiftState

__all__ = ["VERSION", "from_doc", "to_doc"]

VERSION = 1


def _state_doc(st: ShiftState) -> dict[str, Any]:
    s = st.spec
    return {"spec": {"cluster": s.cluster, "to_kind": s.to_kind, "to": s.to, "step_percent": s.step_percent,
                     "every_s": s.every_s, "hard": s.hard},
            "phase": st.phase.value, "steps": st.steps, "anchor_s": st.anchor_s, "decisions": st.decisions,
            "window_start_s": st.window_start_s, "failures": st.failures, "rollbacks": st.rollbacks,
            "paused_from": st.paused_from.value if st.paused_from else None, "reason": st.reason}


def to_doc(shifts: Mapping[str, ShiftState], base: Mapping[str, Mapping[str, int]], wall_s: float) -> dict[str, Any]:
    """The document of every shift and every cluster's base layout (node id -> priority)."""
    return {"version": VERSION, "written_wall_s": wall_s,
            "shifts": {name: _state_doc(st) for name, st in shifts.items()},
            "base": {name: dict(b) for name, b in base.items()}}


def _num(d: Mapping[str, Any], k: str, where: str) -> float:
    v = d.get(k)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where}.{k}: expected a number, got {type(v).__name__}")
    return float(v)


def from_doc(doc: Any) -> tuple[dict[str, ShiftState], dict[str, dict[str, int]]]:
    """(shifts by cluster, base layouts by cluster) from a document. ValueError when malformed."""
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"not a version {VERSION} shift document")
    shifts: dict[str, ShiftState] = {}
    for name, d in (doc.get("shifts") or {}).items():
        where = f"shifts.{name}"
        if not isinstance(d, dict) or not isinstance(d.get("spec"), dict):
            raise ValueError(f"{where}: expected an object with a spec")
        sp = d["spec"]
        try:
            spec = ShiftSpec(str(sp["cluster"]), str(sp["to_kind"]), str(sp["to"]),
                             _num(sp, "step_percent", where), _num(sp, "every_s", where), bool(sp.get("hard")))
            phase = Phase(d["phase"])
            paused = Phase(d["paused_from"]) if d.get("paused_from") else None
        except (KeyError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
        shifts[name] = ShiftState(spec, phase, int(_num(d, "steps", where)), _num(d, "anchor_s", where),
                                  int(_num(d, "decisions", where)), _num(d, "window_start_s", where),
                                  int(_num(d, "failures", where)), int(_num(d, "rollbacks", where)), paused,
                                  None, str(d.get("reason", "")))
    base: dict[str, dict[str, int]] = {}
    for name, b in (doc.get("base") or {}).items():
        if not isinstance(b, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in b.values()):
            raise ValueError(f"base.{name}: expected node id -> priority")
        base[name] = {str(k): int(v) for k, v in b.items()}
    return shifts, base
