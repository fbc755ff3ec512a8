"""sentinel-relay: an optional HTTP relay in front of Envoy that rescues requests and SSE streams
in flight on a failing node by continuing them on a healthy one (Envoy still routes).

Pure core (no I/O): :mod:`.sse` (event framing), :mod:`.plan` (refusals, continuation request),
:mod:`.stream` (what the client has received, what it must receive next). I/O shell:
:mod:`.server` (the HTTP relay), :mod:`.feed` (the control plane's routing feed),
:mod:`.prompts` (opt-in live prompt sampling for switch-back validation; pure part
:mod:`.sampling`), :mod:`.metrics`, :mod:`.config`, :mod:`.cli`.
"""
from .plan import Plan, Received, Refused, continuation_body, plan_request
from .sse import SSESplitter, event_data
from .stream import DONE, PING, St, StreamBook, error_event

__all__ = [
    "DONE",
    "PING",
    "Plan",
    "Received",
    "Refused",
    "SSESplitter",
    "St",
    "StreamBook",
    "continuation_body",
    "error_event",
    "event_data",
    "plan_request",
]
