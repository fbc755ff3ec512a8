"""Cluster-level decisions, pure: from every node's health and the fleet's load to what a
cluster's traffic does (routing policy, fleet-wide traffic ejection, overload drop and its
queueing model, request classes, gated shifts and their layout, the switch-back replay verdict).

Inputs and a time argument in, decisions out; no I/O, no clock reads. The control plane
(:mod:`xds_server.control`) and the load layer (:mod:`xds_server.load`) apply them.
"""
