"""Headless Chromium driven over the Chrome DevTools Protocol (a websocket, aiohttp's client):
start it, open a page, evaluate JavaScript, take screenshots. For the dashboard's browser test.

:func:`find_chromium` names the binary or None; :class:`HeadlessChromium` is an async context
manager that always kills the browser (its own process group) on exit.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0")


def find_chromium() -> str | None:
    """Debian's chromium (/usr/bin/chromium) or one on PATH; None when there is none."""
    for name in ("/usr/bin/chromium", "chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


class HeadlessChromium:
    """``async with HeadlessChromium(binary, width, height) as browser``: one page target."""

    def __init__(self, binary: str, width: int = 1400, height: int = 900) -> None:
        self.binary, self.width, self.height = binary, width, height
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.console: list[str] = []

    async def __aenter__(self) -> HeadlessChromium:
        self._dir = tempfile.TemporaryDirectory(prefix="sentinel-chromium-")
        self.proc = await asyncio.create_subprocess_exec(
            self.binary, *FLAGS, f"--user-data-dir={self._dir.name}",
            f"--window-size={self.width},{self.height}", "about:blank",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            ws_url = None
            async with asyncio.timeout(30):
                while ws_url is None:
                    line = await self.proc.stderr.readline()
                    if not line:
                        raise RuntimeError("chromium exited before its DevTools endpoint was up")
                    if m := re.search(rb"DevTools listening on (ws://\S+)", line):
                        ws_url = m.group(1).decode()
            self._stderr_task = asyncio.create_task(self._drain_stderr())
            port = int(re.search(r":(\d+)/", ws_url).group(1))
            self.session = aiohttp.ClientSession()
            async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
                targets = await r.json()
            page = next(t for t in targets if t["type"] == "page")
            self.ws = await self.session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=64 << 20)
            self._reader = asyncio.create_task(self._read())
            await self.call("Page.enable")
            await self.call("Runtime.enable")
            return self
        except BaseException:
            await self.__aexit__(None, None, None)
            raise

    async def __aexit__(self, *exc: object) -> None:
        for name in ("_reader", "_stderr_task"):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        if getattr(self, "ws", None) is not None:
            await self.ws.close()
        if getattr(self, "session", None) is not None:
            await self.session.close()
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()
        self._dir.cleanup()

    async def _drain_stderr(self) -> None:
        while await self.proc.stderr.readline():
            pass

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data and data["id"] in self._pending:
                fut = self._pending.pop(data["id"])
                if not fut.done():
                    fut.set_result(data)
            elif data.get("method") == "Runtime.consoleAPICalled":
                self.console.append(" ".join(str(a.get("value", a.get("description", "")))
                                             for a in data["params"]["args"]))
            elif data.get("method") == "Runtime.exceptionThrown":
                self.console.append("exception: " + json.dumps(data["params"]["exceptionDetails"])[:500])

    async def call(self, method: str, **params: Any) -> dict:
        """One CDP command; its ``result``. RuntimeError on a CDP error."""
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[i] = fut
        await self.ws.send_str(json.dumps({"id": i, "method": method, "params": params}))
        async with asyncio.timeout(30):
            data = await fut
        if "error" in data:
            raise RuntimeError(f"{method}: {data['error']}")
        return data["result"]

    async def navigate(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of ``expression`` in the page (awaited if it is a promise)."""
        r = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page raised: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def screenshot(self, path: Path) -> Path:
        r = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(r["data"]))
        return path
