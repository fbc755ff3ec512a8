"""``xds-server shift`` against two real admin endpoints (replicas): one command starts the shift
on both with the same start time, so both publish the same assignment bytes and decide at the same
instants; status/pause/cancel; a refused request exits 3 naming the field."""
from __future__ import annotations

import asyncio
import json
import sys

from xds_server.cli import TOKEN_ENV
from xds_server.config import parse_config
from xds_server.probing.memory import InMemoryProbes
from xds_server.server import ControlPlane
from xds_server.xds.resources import CLA_TYPE_URL

TOKEN = "shift-cli-token"
CLI = [sys.executable, "-m", "xds_server.cli"]
CONFIG = {
    "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0},
    "admin": {"listen": "127.0.0.1:0", "token": TOKEN},
    "health": {"ramp_start_percent": 100},
    "clusters": [{"name": "llm", "nodes": [
        {"id": f"n{i}", "address": f"127.0.0.1:{8001 + i}", "probe_address": f"127.0.0.1:{9001 + i}",
         "priority": i // 2, "locality": {"region": "us" if i < 2 else "eu"}} for i in range(4)]}],
}


async def arun(*args: str, env: dict | None = None) -> tuple[int, str, str]:
    import os

    env = {**{k: v for k, v in os.environ.items() if k != TOKEN_ENV}, **(env or {})}
    p = await asyncio.create_subprocess_exec(*CLI, *args, stdout=asyncio.subprocess.PIPE,
                                             stderr=asyncio.subprocess.PIPE, env=env)
    out, err = await asyncio.wait_for(p.communicate(), 60)
    return p.returncode or 0, out.decode(), err.decode()


async def test_shift_commands_on_two_replicas():
    cps = [ControlPlane(parse_config(CONFIG), probe_sources=InMemoryProbes()) for _ in range(2)]
    for cp in cps:
        await cp.start()
    try:
        admins = [a for cp in cps for a in ("--admin", f"127.0.0.1:{cp.admin_port}")]
        rc, out, err = await arun("shift", "status", "llm", "--admin", f"127.0.0.1:{cps[0].admin_port}")
        assert (rc, out.strip()) == (0, "shift llm: none (the configured layout)"), err
        rc, out, err = await arun("shift", "llm", "--to", "eu", "--step", "20", "--every", "5m", *admins,
                                  env={TOKEN_ENV: TOKEN})
        assert rc == 0, err
        lines = out.strip().splitlines()
        assert len(lines) == 2 and all("stepping at 20 % to region eu (+20 % every 300 s)" in x for x in lines), out
        views = [cp.shifts.view("llm") for cp in cps]
        assert views[0]["anchor_wall_s"] == views[1]["anchor_wall_s"]  # one start time for both
        assert views[0]["next_decision_wall_s"] == views[1]["next_decision_wall_s"]
        await asyncio.sleep(0.1)  # the publish each asked for
        clas = [cp.cache.resources(CLA_TYPE_URL)["llm"] for cp in cps]
        assert clas[0].version == clas[1].version and clas[0].any.value == clas[1].any.value
        rc, out, _ = await arun("shift", "status", "llm", "--admin", f"127.0.0.1:{cps[0].admin_port}", "--json")
        weights = {w["locality"]["region"]: w["weight"] for w in json.loads(out)["layout"]["locality_weights"]}
        assert rc == 0 and weights == {"us": 8000, "eu": 2000}
        rc, out, err = await arun("status", "--admin", f"127.0.0.1:{cps[0].admin_port}")
        shift_rows = [x for x in out.splitlines() if x.startswith("SHIFT ")]
        assert rc == 0 and len(shift_rows) == 1 and shift_rows[0].startswith(
            "SHIFT llm: stepping at 20 % to region eu (+20 % every 300 s)"), (out, err)
        rc, out, err = await arun("shift", "pause", "llm", *admins, "--token", TOKEN)
        assert rc == 0 and out.count("paused at 20 %") == 2, (out, err)
        rc, _, err = await arun("shift", "llm", "--to", "eu", "--step", "0", *admins[:2], "--token", TOKEN)
        assert rc == 3 and "409" in err  # a shift is running: refused, and it stays paused
        rc, out, err = await arun("shift", "cancel", "llm", *admins, "--token", TOKEN)
        # one wording with the event: where it was when cancelled
        assert rc == 0 and out.count("shift llm: cancelled (to region eu) - cancelled by the operator at 20 %") == 2, (
            out, err)
        assert [e.reason for e in cps[0].core.events.recent(50) if e.kind == "shift_cancelled"] == [
            "cancelled at 20 %: the weights before the shift are back"]
        # a cluster without a shift: a normal answer
        rc, out, err = await arun("shift", "status", "llm", "--admin", f"127.0.0.1:{cps[0].admin_port}")
        assert rc == 0 and out.strip().endswith("shift llm: cancelled (to region eu) - cancelled by the operator at "
                                                "20 %: the weights before the shift are back"), (out, err)
        rc, out, err = await arun("shift", "status", "other", "--admin", f"127.0.0.1:{cps[0].admin_port}")
        assert rc == 3 and "404" in err  # an unknown cluster is still an error
        # a window shorter than two load-report intervals: refused with the reason
        rc, _, err = await arun("shift", "llm", "--to", "eu", "--every", "1s", *admins[:2], "--token", TOKEN)
        assert rc == 3 and "every_s: 1 s is shorter than two load-report intervals" in err, err
        rc, _, err = await arun("shift", "llm", "--to", "eu", "--step", "0", *admins[:2], "--token", TOKEN)
        assert rc == 3 and "step_percent" in err and "400" in err, err
        rc, _, err = await arun("shift", "llm", *admins[:2], "--token", TOKEN)
        assert rc == 2 and "--to" in err
        rc, _, err = await arun("shift", "pause", "llm", *admins[:2])
        assert rc == 2 and TOKEN_ENV in err
    finally:
        for cp in cps:
            await cp.stop()
