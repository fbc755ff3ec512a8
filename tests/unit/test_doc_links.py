"""Every relative link in the README, the changelog and the pages under docs/ points at a file (or
folder) of this repository, and a link to a heading (``page.md#anchor``, ``#anchor``) at a
heading that page has; a test they cite (``tests/x/test_y.py::test_z``) exists under that name.
Pure: reads files; no process, no socket."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^ {0,3}```.*?^ {0,3}```[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`]*`")
_INLINE_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text outside fenced blocks and code spans (a link there is an example, not a link)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    prose = _prose(text)
    return _INLINE_LINK.findall(prose) + _REF_LINK.findall(prose)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than ``-``
    and ``_`` removed, each space a ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link in a heading: its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor, duplicates numbered as GitHub numbers them (``-1``, ``-2``)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        s = slug(heading)
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def _is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I))   # http:, https:, mailto:, ...


def test_the_slug_rules_match_githubs():
    assert slug("4. The health model (xds_server/health)") == "4-the-health-model-xds_serverhealth"
    assert slug("Load reports across replicas (`lrs.peers`)") == "load-reports-across-replicas-lrspeers"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}
    assert links("[x](a.md) `[y](b.md)` [z](https://e.example)\n```\n[w](c.md)\n```\n") == [
        "a.md", "https://e.example"]


def test_every_relative_link_in_the_docs_resolves():
    assert (ROOT / "CHANGELOG.md").exists() and len(DOCS) > 6, DOCS
    broken = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for target in links(text):
            if _is_external(target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                broken.append(f"{where}: no heading with that anchor in {dest.relative_to(ROOT)}")
            elif not dest.is_relative_to(ROOT):
                broken.append(f"{where}: outside the repository")
    assert not broken, "\n".join(broken)


def test_every_test_the_docs_cite_exists():
    missing = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for path, name in re.findall(r"\b(tests/[\w/]+\.py)::(\w+)", text):
            source = ROOT / path
            if not source.exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}: no such file")
            elif not re.search(rf"^\s*(?:async )?def {name}\(", source.read_text(encoding="utf-8"), re.M):
                missing.append(f"{doc.relative_to(ROOT)}: {path}::{name}: no such test")
    assert not missing, "\n".join(missing)


def test_the_simulators_fault_modes_are_all_named_in_the_running_page():
    from node_probe.sim.faults import FAULT_MODES

    text = (ROOT / "docs" / "running.md").read_text(encoding="utf-8")
    section = text[text.index("## The simulated engine"):]
    assert [m for m in FAULT_MODES if m not in section] == []


def test_the_health_pages_keys_column_names_real_health_fields():
    import re

    from xds_server.config import HealthConfig

    text = (ROOT / "docs" / "health-model.md").read_text(encoding="utf-8")
    rows = [r.split(" | ") for r in text.splitlines()
            if r.startswith("| ") and r.count(" | ") == 3 and not r.startswith("| signal |")]
    named = {k for r in rows for k in re.findall(r"`([a-z_.]+)`", r[2])}

    def real(path: str) -> bool:
        obj: object = HealthConfig()
        for part in path.split("."):
            if part not in getattr(type(obj), "model_fields", {}):
                return False
            obj = getattr(obj, part)
        return True

    assert len(rows) >= 15 and named and [k for k in named if not real(k)] == []
    assert any("." in k for k in named)  # the sections' names, not the flat ones of earlier releases
