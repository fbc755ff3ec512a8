"""The simulated engine's SSE bytes for one request, without HTTP: the same job parsing,
decoders and chunk encoding as ``node_probe.sim.app`` (its generation loop, minus the pacing
and faults), so the relay's pure core can be checked against the deterministic simulator with
its byte-level tokenizer at any cut, for thousands of cases."""
from __future__ import annotations

import json
import re

from node_probe.sim.app import _Exchange
from node_probe.sim.engine import SimConfig
from node_probe.sim.protocol import parse_job

CFG = SimConfig(port=1, token_interval_ms=0, byte_token_rate=0.15)
_ID = re.compile(rb'"id":"[^"]*"')
_CREATED = re.compile(rb'"created":[0-9]+')


def sim_sse(kind: str, body: dict, cfg: SimConfig = CFG) -> bytes:
    """What the engine streams for ``body`` on the ``kind`` path ("completions" or "chat")."""
    job = parse_job(json.dumps(body).encode(), kind == "chat", served_model=cfg.model,
                    default_max_tokens=cfg.default_max_tokens, max_model_len=cfg.max_model_len)
    ex = _Exchange(job, cfg)
    parts = [ex.opening()]
    while not all(d.finished for d in ex.decoders):
        for i, d in enumerate(ex.decoders):
            if not d.finished:
                out = d.step()
                parts.append(ex.chunk(i, out.text, out.token_id, out.finish_reason, out.stop_reason).encode())
    if job.include_usage:
        parts.append(ex.usage_chunk())
    return b"".join(parts) + b"data: [DONE]\n\n"


def same_but_identity(raw: bytes) -> bytes:
    """Client bytes with the response id and created time (which differ per request) blanked,
    and the relay's ``: ping`` lines dropped."""
    return _CREATED.sub(b'"created":0', _ID.sub(b'"id":"x"', raw.replace(b": ping\n\n", b"")))
