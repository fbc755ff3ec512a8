"""The health rules read records, never the state (xds_server.health.rules' contract): what a
signal does in each state is the transition table's business alone. The WARMING
rule (a good probe does not promote a node whose agent is not heard) was a state check inside
``_r_probe``; it is now the table's PROBE_UNHEARD row."""
from __future__ import annotations

import ast
from pathlib import Path

import xds_server.health.rules as rules
import xds_server.health.time_rules as time_rules
from xds_server.health.model import TABLE, NodeState, Signal


def test_no_rule_reads_the_nodes_state():
    for mod in (rules, time_rules):
        tree = ast.parse(Path(mod.__file__).read_text())
        reads = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "state"
                 and isinstance(n.value, ast.Name) and n.value.id == "nh"]
        assert reads == [], f"{mod.__name__} reads nh.state at lines {reads}"


def test_an_answer_while_the_agent_is_unheard_promotes_nothing_in_any_state():
    for st in NodeState:
        if st is NodeState.DRAINING:
            continue
        t = TABLE[(st, Signal.PROBE_UNHEARD)]
        assert t.next is st, st
