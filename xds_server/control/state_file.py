"""File I/O at the edge of the control plane: the routing-state file and the config file's
signature. The state document itself is built and read by :mod:`xds_server.control.state`.

- :func:`read_json` / :func:`write_json_atomic`: the state file (temp file, fsync, rename, so a
  crash never leaves a half-written file).
- :func:`load_kept_state` / :func:`save_state`: the same with the state document's meaning,
  logging instead of raising (a state file must never stop a start or a stop).
- :func:`file_signature`: ``(mtime, sha256)`` of a file, for the config-file watch.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from xds_server.config import StateConfig
from xds_server.control.core import ControlCore
from xds_server.control.state import restore, snapshot, usable_until_s, with_unclaimed
from xds_server.health import model as hm

__all__ = ["file_signature", "load_kept_state", "read_json", "save_core_state", "save_state", "write_json_atomic"]

log = logging.getLogger(__name__)


def load_kept_state(sc: StateConfig, node_ids: Iterable[str] | None, now_s: float,
                    wall_s: float) -> tuple[dict[str, hm.NodeHealth], float]:
    """The kept state of ``node_ids`` (None: every node in the file) from ``sc.path``, and the
    monotonic time (s) until which it may still be given to a node that appears later
    (:func:`~xds_server.control.state.usable_until_s`); ``({}, -inf)`` when there is no path or
    file, the file is older than ``sc.max_age_s``, or it cannot be read (logged)."""
    if not sc.path:
        return {}, float("-inf")
    try:
        doc = read_json(sc.path)
        kept = restore(doc, now_s, wall_s, sc.max_age.s, node_ids)
        until = usable_until_s(doc, now_s, wall_s, sc.max_age.s) if kept else float("-inf")
    except FileNotFoundError:
        return {}, float("-inf")
    except (OSError, ValueError) as e:
        log.warning("state file %s not used: %s", sc.path, e)
        return {}, float("-inf")
    log.info("state file %s: resuming %d node(s) at their first heartbeat", sc.path, len(kept))
    return kept, until


def save_state(path: str | None, health: Mapping[str, hm.NodeHealth], now_s: float, wall_s: float,
               unclaimed: Mapping[str, hm.NodeHealth] | None = None) -> bool:
    """Write the state document of ``health`` to ``path`` atomically, with the kept states not
    resumed yet (``unclaimed``, :func:`~xds_server.control.state.with_unclaimed`); False
    (logged) on failure or without a path."""
    if not path:
        return False
    try:
        write_json_atomic(path, snapshot(with_unclaimed(health, unclaimed or {}), now_s, wall_s))
    except (OSError, ValueError) as e:
        log.warning("cannot write state file %s: %s", path, e)
        return False
    return True


def read_json(path: str) -> Any:
    """The JSON document at ``path``. Raises FileNotFoundError, OSError, or ValueError (not JSON)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_json_atomic(path: str, doc: Any) -> None:
    """Write ``doc`` (strict JSON: no NaN) to ``path`` atomically. Raises OSError or ValueError;
    the temp file is removed then."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, ValueError):
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def file_signature(path: str | None) -> tuple[float, str] | None:
    """``(mtime, sha256 hex)`` of the file at ``path``; None when there is no path or it cannot be read."""
    if not path:
        return None
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            return st.st_mtime, hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def save_core_state(path: str | None, core: ControlCore) -> bool:
    """:func:`save_state` of the core's node health at its clock's time. Kept states not claimed
    yet are written again only while they may still be claimed (``state.max_age`` from the
    file's time), so a node that never comes back ages out."""
    now = core.clock.now()
    unclaimed = core.restored if now <= core.restored_until_s else None
    return save_state(path, core.health, now, core.clock.wall(), unclaimed)
