"""Nodes found at run time: a targets file per cluster and Kubernetes pods, merged with the
config's static nodes and applied through the reload path (added COLD -> WARMING, removed
drained then dropped, a changed address removed and added again).

Pure parts (tested with hypothesis): :mod:`.nodeset` (merge, diff of node sets), :mod:`.targets`
(targets file text -> nodes), :mod:`.pods` (pod JSON -> node, watch events -> pod set). I/O at
the edge: :mod:`.file_source`, :mod:`.kube_source` (list + watch), :mod:`.manager` (the sources
of every cluster, following the config). Config: :mod:`xds_server.config.discovery`.
"""
from xds_server.discovery.file_source import FileTargets
from xds_server.discovery.kube_source import KubernetesPods, selector_string
from xds_server.discovery.manager import Discovery
from xds_server.discovery.nodeset import (
    NodeSetDiff,
    diff_node_sets,
    drop_readdressed,
    merge_discovered,
    node_map,
    without_nodes,
)
from xds_server.discovery.pods import PodState, pod_node, pods_to_nodes, resource_version_newer
from xds_server.discovery.targets import TargetsError, parse_targets

__all__ = [
    "Discovery",
    "FileTargets",
    "KubernetesPods",
    "NodeSetDiff",
    "PodState",
    "TargetsError",
    "diff_node_sets",
    "drop_readdressed",
    "merge_discovered",
    "node_map",
    "parse_targets",
    "pod_node",
    "pods_to_nodes",
    "resource_version_newer",
    "selector_string",
    "without_nodes",
]
