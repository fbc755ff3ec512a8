"""Request-class clusters on the wire (``lrs.shed.classes``): each configured cluster's sheddable
and critical classes are Envoy clusters of their own, ``<cluster>~<class>``
(:data:`~xds_server.config.load.CLASS_SEPARATOR`), with the parent's settings (CDS) and its
endpoints, weights and health (EDS), each with its own overload drop. With classes off these add
nothing.
"""
from __future__ import annotations

from collections.abc import Callable

from google.protobuf.message import Message

from xds_server.config import ClusterConfig, SentinelConfig, class_clusters

__all__ = ["class_cds", "class_clas"]


def class_cds(config: SentinelConfig, build: Callable[[ClusterConfig], Message]) -> dict[str, Message]:
    """Envoy cluster name -> Cluster: ``build(c)`` for each configured cluster, and for each of its
    class clusters the same message renamed (its EDS name is the cluster name)."""
    out: dict[str, Message] = {}
    for c in config.clusters:
        out[c.name] = parent = build(c)
        for name in class_clusters([c], config.lrs.shed.classes):
            if name != c.name:
                out[name] = copy = type(parent)()
                copy.CopyFrom(parent)
                copy.name = name  # type: ignore[attr-defined]  # a Cluster
    return out


def class_clas(c: ClusterConfig, config: SentinelConfig,
               build: Callable[[ClusterConfig], Message]) -> dict[str, Message]:
    """Class cluster name -> ``build(copy)`` for each class cluster of ``c`` (the copy is ``c``
    renamed; not ``c`` itself); empty with classes off."""
    return {name: build(cc) for name, cc in class_clusters([c], config.lrs.shed.classes).items() if name != c.name}
