"""A shell block in the docs is something a reader runs as written, so each one is run by a test
or by CI: the README's two commands (CI runs the test command, ``.ci/run``; the demo runs in
tests/integration/test_demo_output.py) and the README's ``readme-run`` block
(tests/integration/test_readme_run.py). Any other command in README.md, CHANGELOG.md or docs/*.md
is shown as an illustration (a ``text`` block, or a config in a ``yaml`` block), never as ``sh``.
A new runnable block needs begin/end markers and a test that runs it, as ``readme-run`` has.

Also here: the README's minimal config is a valid config. Pure: reads files; no process, no
socket."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from xds_server.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"sh", "bash", "shell", "zsh", "console", "shell-session", "sh-session"}
_BLOCK = re.compile(r"^( {0,3})```([^\n`]*)\n(.*?)^ {0,3}```[ \t]*$", re.M | re.S)

#: The blocks run as written, and what runs them.
RUN = {
    "demo": ("python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]' && .venv/bin/xds-server demo\n",
             "tests/integration/test_demo_output.py (xds-server demo)"),
    "tests": ("python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]' && .venv/bin/pytest -q -n 3 "
              "--dist loadgroup\n", ".ci/run"),
}


def shell_blocks(text: str) -> list[tuple[int, str]]:
    """(offset, body) of every fenced block whose info string names a shell."""
    return [(m.start(), m.group(3)) for m in _BLOCK.finditer(text)
            if (m.group(2).strip().split() or [""])[0].lower() in SHELL]


def _between(text: str, begin: str, end: str) -> tuple[int, int]:
    a, b = text.index(begin), text.index(end)
    assert a < b, (begin, end)
    return a, b


def test_every_shell_block_is_run_by_a_test_or_ci():
    stray = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for offset, body in shell_blocks(text):
            if doc.name == "README.md":
                a, b = _between(text, "<!-- readme-run:begin -->", "<!-- readme-run:end -->")
                if a < offset < b or body in {cmd for cmd, _ in RUN.values()}:
                    continue
            line = text.count("\n", 0, offset) + 1
            stray.append(f"{doc.relative_to(ROOT)}:{line}: {body.splitlines()[0] if body else ''}")
    assert not stray, ("shell blocks no test runs (mark them as `text` illustrations, or add markers "
                       "and a test that runs them):\n" + "\n".join(stray))


def test_the_readme_keeps_its_run_blocks_where_ci_and_the_tests_read_them():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("\n## The two commands\n")
    section = text[start:text.index("\n## ", start + 1)]
    assert [body for _, body in shell_blocks(section)] == [RUN["demo"][0], RUN["tests"][0]]
    a, b = _between(text, "<!-- readme-run:begin -->", "<!-- readme-run:end -->")
    assert len(shell_blocks(text[a:b])) == 1
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    # the same install (CI's through uv: the same versions, ~8 s against pip's 60-70) and test command
    assert "python3 -m venv .venv && .venv/bin/pip install -q uv" in ci
    assert "uv pip install -q --python .venv/bin/python -e '.[dev]'" in ci
    assert ".venv/bin/pytest -q -n 3 --dist loadgroup" in ci


def test_the_readme_minimal_config_is_valid():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("\n## A minimal config\n")
    section = text[start:text.index("\n## ", start + 1)]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, "README.md lost its minimal config"
    cfg = parse_config(yaml.safe_load(block.group(1)))
    assert [c.name for c in cfg.clusters] == ["llm"] and len(cfg.clusters[0].nodes) == 2
