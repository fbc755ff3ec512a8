"""Routes of the request classes (``lrs.shed.classes``) in the rendered bootstrap.

A request whose header ``classes.header`` (``x-sentinel-priority``) is ``sheddable`` goes to the
Envoy cluster ``<cluster>~sheddable``, one that says ``critical`` to ``<cluster>~critical``; every
other request (``standard``, no header, any other value) stays on ``<cluster>``. The control
plane publishes the class clusters over CDS and EDS with the parent's endpoints and health and
its own drop each (:mod:`xds_server.xds.class_clusters`), so a shed class gets 429 + Retry-After while
the others pass.
"""
from __future__ import annotations

import copy
from typing import Any

from xds_server.config import ShedClassesConfig

__all__ = ["class_routes"]


def class_routes(route: dict[str, Any], cluster: str, classes: ShedClassesConfig | None) -> list[dict[str, Any]]:
    """Copies of ``route`` for the non-standard classes of ``cluster``, each matching its header
    value exactly (to go before the route itself); [] with classes None or off."""
    if classes is None or not classes.enabled:
        return []
    out = []
    for klass, name, _ in classes.lower_first(cluster):
        if name == cluster:
            continue
        r = copy.deepcopy(route)
        headers = [*r["match"].get("headers", ()), {"name": classes.header, "string_match": {"exact": klass}}]
        r["match"] = {**r["match"], "headers": headers}
        r["route"]["cluster"] = name
        out.append(r)
    return out
