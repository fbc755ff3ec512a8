"""The switch-back validator's edges without agents: the prompts file, the optional
embedding cosine through an operator's /v1/embeddings, and the config's refusals."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from aiohttp import web

from xds_server.config import ConfigError, parse_config
from xds_server.config.validation import DEFAULT_PROMPTS, ValidationConfig
from xds_server.policy.replay_judge import Answer, PromptAnswers
from xds_server.probing.switchback import SwitchbackValidator, load_prompts
from xds_server.testing import free_port


def test_prompts_come_from_the_file_or_the_built_in_set(tmp_path):
    assert load_prompts(ValidationConfig()) == DEFAULT_PROMPTS and len(DEFAULT_PROMPTS) == 8
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "one"}\n\n{"prompt": "two", "note": "x"}\n')
    assert load_prompts(ValidationConfig(prompts_file=str(f))) == ("one", "two")
    f.write_text('{"prompt": "one"}\nnot json\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not JSON"):
        load_prompts(ValidationConfig(prompts_file=str(f)))
    f.write_text('{"text": "one"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: expected an object with a non-empty 'prompt' string"):
        load_prompts(ValidationConfig(prompts_file=str(f)))
    with pytest.raises(OSError):
        load_prompts(ValidationConfig(prompts_file=str(tmp_path / "missing.jsonl")))


def _cfg(**validation) -> dict:
    node = {"id": "a", "address": "127.0.0.1:1", "probe_address": "127.0.0.1:2"}
    return {"health": {"validation": validation}, "clusters": [{"name": "c", "nodes": [node]}]}


def test_the_config_names_what_it_refuses():
    with pytest.raises(ConfigError, match=r"health\.validation\.embeddings_url"):
        parse_config(_cfg(embeddings_url="ftp://x"))
    with pytest.raises(ConfigError, match=r"health\.validation\.sample"):
        parse_config(_cfg(sample=0))
    with pytest.raises(ConfigError, match=r"health\.validation\.enabled needs probe\.workers: 0"):
        parse_config({**_cfg(enabled=True), "probe": {"workers": 2}})
    assert parse_config(_cfg(enabled=True)).health.validation.enabled


async def test_embedding_cosines_are_added_and_a_failing_endpoint_changes_nothing():
    seen: list[dict] = []

    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if body.get("model") == "broken":
            return web.Response(status=500)
        # one axis per distinct text: equal texts have cosine 1, different ones 0
        axes = {t: i for i, t in enumerate(dict.fromkeys(body["input"]))}
        data = [{"index": i, "embedding": [1.0 if axes[t] == k else 0.0 for k in range(len(axes))]}
                for i, t in enumerate(body["input"])]
        return web.json_response({"data": list(reversed(data))})

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        v = SwitchbackValidator(lambda: None, SimpleNamespace(), lambda *a: None, lambda n: None)
        same, other = Answer("a b c", (1, 2, 3)), Answer("x y z", (7, 8, 9))
        pas = [PromptAnswers(other, same, same), PromptAnswers(same, same, same)]
        url = f"http://127.0.0.1:{port}/v1/embeddings"
        out = await v._with_cosines(ValidationConfig(embeddings_url=url, embeddings_model="e5"), pas)
        assert [pa.cosines for pa in out] == [(0.0, 0.0, 1.0), (1.0, 1.0, 1.0)]
        assert seen[0]["model"] == "e5" and len(seen[0]["input"]) == 6
        kept = await v._with_cosines(ValidationConfig(embeddings_url=url, embeddings_model="broken"), pas)
        assert kept == pas
    finally:
        await runner.cleanup()
    assert json.dumps(seen)  # what was sent is plain JSON
