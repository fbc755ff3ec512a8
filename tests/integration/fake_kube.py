"""A local fake of the Kubernetes API server's pod list and watch (aiohttp, 127.0.0.1, free port).

It serves what the kube discovery reads, as the real API server does:

- ``GET /api/v1/nodes/{name}`` -> a Node with the labels in ``nodes`` (404 for another name);
- ``GET /api/v1/namespaces/{ns}/pods?labelSelector=k=v,...`` -> a PodList whose
  ``metadata.resourceVersion`` is the current one;
- ``...&watch=true&resourceVersion=N[&allowWatchBookmarks=true][&timeoutSeconds=S]`` -> newline-
  delimited watch events (ADDED / MODIFIED / DELETED / BOOKMARK) after N, then live ones, until
  ``timeoutSeconds``, :meth:`FakeKube.end_watches` or the server stops; an N older than the
  retained history (see :meth:`FakeKube.expire`) gets one ``ERROR`` event carrying a Status with
  code 410, reason Expired, and the stream ends (as etcd compaction does). A pod that stops
  matching the selector is sent as DELETED, one that starts matching as ADDED.

Test controls: :meth:`add_pod`, :meth:`set_ready`, :meth:`mark_deleting`, :meth:`delete_pod`,
:meth:`end_watches`, :meth:`expire`, :meth:`bookmark`, :meth:`hold_watches`; ``requests`` records each list and watch
(with the resourceVersion asked for) and ``sent`` every event written to a watch.
"""
from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

from aiohttp import web

__all__ = ["FakeKube", "parse_selector"]


def parse_selector(text: str) -> list[tuple[str, str, str]]:
    """``"a=b,c!=d"`` -> ``[("a", "=", "b"), ("c", "!=", "d")]`` (equality-based selectors)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        for op in ("!=", "==", "="):
            if op in part:
                k, _, v = part.partition(op)
                out.append((k.strip(), "=" if op == "==" else op, v.strip()))
                break
        else:
            raise ValueError(f"unsupported selector term {part!r}")
    return out


def _matches(pod: dict | None, selector: list[tuple[str, str, str]]) -> bool:
    if pod is None:
        return False
    labels = pod["metadata"].get("labels") or {}
    return all((labels.get(k) == v) == (op == "=") for k, op, v in selector)


def _flag(v: str | None) -> bool:
    """A boolean query parameter as the API server parses it (Go's strconv.ParseBool)."""
    return (v or "").lower() in ("1", "t", "true")


class FakeKube:
    """Pods by (namespace, name), a history of changes by resourceVersion, and the open watches."""

    def __init__(self) -> None:
        self.rv = 1000
        self.pods: dict[tuple[str, str], dict] = {}
        self.history: list[tuple[int, str, dict | None, dict | None]] = []  # (rv, ns, before, after)
        self.oldest = 0  # a watch from a resourceVersion below this gets 410 Gone
        self.requests: list[tuple[str, str, str | None]] = []  # (kind "list"/"watch", namespace, resourceVersion)
        self.sent: list[dict] = []
        self.nodes: dict[str, dict[str, str]] = {}  # Kubernetes node name -> labels (GET /api/v1/nodes/{name})
        self.node_reads: list[str] = []
        self._watches: set[asyncio.Queue] = set()
        self._open = asyncio.Event()  # cleared by hold_watches(): new watch requests wait
        self._open.set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_get("/api/v1/nodes/{name}", self._node)
        self._runner = web.AppRunner(app, shutdown_timeout=0.2, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]:d}"
        return self.url

    async def stop(self) -> None:
        self.end_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, path: Path) -> str:
        """Write a kubeconfig pointing at this server (token auth, which it ignores); its path."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }))
        return str(path)

    # -- controls ----------------------------------------------------------------------------

    def _commit(self, ns: str, name: str, after: dict | None) -> None:
        """Store a change at the next resourceVersion and hand it to every open watch."""
        self.rv += 1
        before = copy.deepcopy(self.pods.get((ns, name)))
        if after is None:
            self.pods.pop((ns, name), None)
            if before is not None:  # DELETED carries the last state at the deletion's version
                before["metadata"]["resourceVersion"] = str(self.rv)
        else:
            after["metadata"]["resourceVersion"] = str(self.rv)
            self.pods[(ns, name)] = after
        entry = (self.rv, ns, before, copy.deepcopy(after))
        self.history.append(entry)
        for q in self._watches:
            q.put_nowait(entry)

    def add_pod(self, name: str, *, ns: str = "default", labels: dict[str, str] | None = None,
                ip: str | None = None, ready: bool = False, ports: dict[str, int] | None = None,
                extra_labels: dict[str, str] | None = None, node: str = "worker-1") -> None:
        """A pod (Pending without ``ip``; Running with it), container ports by name."""
        ports = ports if ports is not None else {"http": 8000, "probe": 9100}
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}-{self.rv}",
                            "labels": {**(labels or {"app": "vllm"}), **(extra_labels or {})},
                            "creationTimestamp": "2026-12-01T08:00:00Z"},
               "spec": {"nodeName": node, "containers": [
                   {"name": "vllm", "image": "vllm/vllm-openai",
                    "ports": [{"name": k, "containerPort": v, "protocol": "TCP"} for k, v in ports.items()]}]},
               "status": {"phase": "Pending", "conditions": []}}
        self._commit(ns, name, self._with_status(pod, ip, ready))

    @staticmethod
    def _with_status(pod: dict, ip: str | None, ready: bool) -> dict:
        pod["status"] = {"phase": "Running" if ip else "Pending",
                         "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        if ip:
            pod["status"]["podIP"] = ip
            pod["status"]["podIPs"] = [{"ip": ip}]
        return pod

    def set_ready(self, name: str, ready: bool = True, *, ns: str = "default", ip: str | None = None) -> None:
        pod = copy.deepcopy(self.pods[(ns, name)])
        self._commit(ns, name, self._with_status(pod, ip or pod["status"].get("podIP"), ready))

    def mark_deleting(self, name: str, *, ns: str = "default") -> None:
        """``kubectl delete`` with a grace period: deletionTimestamp set (MODIFIED), pod kept."""
        pod = copy.deepcopy(self.pods[(ns, name)])
        pod["metadata"]["deletionTimestamp"] = "2026-12-01T08:05:00Z"
        pod["metadata"]["deletionGracePeriodSeconds"] = 30
        self._commit(ns, name, pod)

    def delete_pod(self, name: str, *, ns: str = "default") -> None:
        self._commit(ns, name, None)

    def end_watches(self) -> None:
        """Close every open watch (as an API server restart or the watch's timeout does)."""
        for q in self._watches:
            q.put_nowait(None)

    def expire(self) -> None:
        """Compact history (as etcd does, here after one more write elsewhere): a watch from any
        resourceVersion a client holds now gets 410; a new list answers the first one kept."""
        self.rv += 1
        self.oldest = self.rv
        self.history.clear()

    def hold_watches(self) -> None:
        """New watch requests wait (the API server unreachable) until :meth:`release_watches`."""
        self._open.clear()

    def release_watches(self) -> None:
        self._open.set()

    def bookmark(self) -> None:
        """A BOOKMARK at the current resourceVersion to every watch that allowed them."""
        for q in self._watches:
            q.put_nowait(("BOOKMARK", self.rv))

    # -- HTTP --------------------------------------------------------------------------------

    async def _node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.node_reads.append(name)
        if name not in self.nodes:
            return web.json_response(self._status(404, "NotFound", f'nodes "{name}" not found'), status=404)
        return web.json_response({"kind": "Node", "apiVersion": "v1",
                                  "metadata": {"name": name, "labels": self.nodes[name], "resourceVersion": "1"}})

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        ns = request.match_info["ns"]
        q = request.query
        try:
            selector = parse_selector(q.get("labelSelector", ""))
        except ValueError as e:
            return web.json_response(self._status(400, "BadRequest", str(e)), status=400)
        rv = q.get("resourceVersion")
        if not _flag(q.get("watch")):
            self.requests.append(("list", ns, rv))
            items = [p for (pns, _), p in sorted(self.pods.items()) if pns == ns and _matches(p, selector)]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.rv)}, "items": items})
        await self._open.wait()
        self.requests.append(("watch", ns, rv))
        return await self._watch(request, ns, selector, rv)

    @staticmethod
    def _status(code: int, reason: str, message: str) -> dict:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": message, "reason": reason, "code": code}

    async def _watch(self, request: web.Request, ns: str, selector, rv: str | None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        bookmarks = _flag(request.query.get("allowWatchBookmarks"))
        timeout = float(request.query.get("timeoutSeconds", "1800"))
        queue: asyncio.Queue = asyncio.Queue()
        self._watches.add(queue)
        try:
            start = int(rv) if rv and rv != "0" else None
            if start is not None and start < self.oldest:
                await self._send(resp, "ERROR", self._status(
                    410, "Expired", f"too old resource version: {start} ({self.oldest})"))
                return resp
            if start is None:  # no resourceVersion: the current pods as ADDED, then changes
                for (pns, _), p in sorted(self.pods.items()):
                    if pns == ns and _matches(p, selector):
                        await self._send(resp, "ADDED", p)
            else:
                for entry in [e for e in self.history if e[0] > start]:
                    await self._event(resp, ns, selector, entry)
            loop = asyncio.get_running_loop()
            end = loop.time() + timeout
            while True:
                try:
                    entry = await asyncio.wait_for(queue.get(), max(0.0, end - loop.time()))
                except TimeoutError:
                    break
                if entry is None:
                    break
                if entry[0] == "BOOKMARK":
                    if bookmarks:
                        await self._send(resp, "BOOKMARK", {"kind": "Pod", "apiVersion": "v1",
                                                            "metadata": {"resourceVersion": str(entry[1])}})
                    continue
                await self._event(resp, ns, selector, entry)
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):  # the client went away
            pass
        finally:
            self._watches.discard(queue)
        return resp

    async def _event(self, resp, ns: str, selector, entry) -> None:
        _rv, ens, before, after = entry
        if ens != ns:
            return
        was, now = _matches(before, selector), _matches(after, selector)
        if after is None:
            if was:
                await self._send(resp, "DELETED", before)
        elif was and now:
            await self._send(resp, "MODIFIED", after)
        elif now:
            await self._send(resp, "ADDED", after)
        elif was:
            await self._send(resp, "DELETED", after)

    async def _send(self, resp: web.StreamResponse, etype: str, obj: dict[str, Any]) -> None:
        ev = {"type": etype, "object": obj}
        self.sent.append(ev)
        await resp.write(json.dumps(ev).encode() + b"\n")
