"""A cluster's nodes from Kubernetes pods: list, then watch from the list's resourceVersion (I/O
around :mod:`.pods`), through ``kubernetes-asyncio`` (the optional extra ``kubernetes``).

Loop: list the namespace's pods matching ``label_selector`` (the PodList's resourceVersion);
watch from it (``allowWatchBookmarks``, ``timeoutSeconds`` = ``watch_timeout``), applying each
event; when the watch ends (the server's timeout, a dropped connection) watch again from the last
resourceVersion seen (events or bookmarks), so nothing is replayed or missed; on 410 Gone (that
resourceVersion is older than the server keeps) list again. Any other failure waits
``retry_backoff`` and retries the same step. Each change of the node set calls ``on_change``.

Client configuration: ``kubeconfig`` when set; else the in-cluster service account when
``KUBERNETES_SERVICE_HOST`` is set; else $KUBECONFIG or ~/.kube/config. RBAC: pods get, list, watch
in the namespace; nodes get (cluster-wide) for ``locality_from: node``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from xds_server.config import KubernetesDiscoveryConfig, NodeConfig
from xds_server.discovery.pods import PodState, pods_to_nodes

if TYPE_CHECKING:
    import aiohttp
    from kubernetes_asyncio.client import CoreV1Api

__all__ = ["KubernetesPods", "selector_string"]

log = logging.getLogger("xds_server.discovery")


def selector_string(selector: dict[str, str]) -> str:
    """``{"app": "vllm", "pool": "a"}`` -> ``"app=vllm,pool=a"`` (keys sorted)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


_LIST_TIMEOUT_S = 30.0
"""Client-side bound on a list request, s, and the slack after a watch's timeoutSeconds (ours)."""


class _Gone(Exception):
    """410: the resourceVersion asked for is older than the API server keeps."""


class KubernetesPods:
    """Nodes of one cluster from the pods a label selector picks. Readable: ``nodes``, ``skipped``
    (pod name -> why not a node), ``state`` (:class:`~xds_server.discovery.pods.PodState`),
    ``error`` (the last failure, None after a success), and counts ``lists``, ``watches``
    (watch requests), ``gone`` (410 answers), ``errors``."""

    kind = "kubernetes"

    def __init__(self, cluster: str, spec: KubernetesDiscoveryConfig, on_change: Callable[[], None]) -> None:
        self.cluster, self.spec, self.on_change = cluster, spec, on_change
        self.nodes: tuple[NodeConfig, ...] = ()
        self.skipped: dict[str, str] = {}
        self.state = PodState()
        self.node_labels: dict[str, dict[str, str]] = {}  # Kubernetes node name -> labels (locality_from: node)
        self._api: CoreV1Api | None = None  # set once the client is up, before any list
        self.error: str | None = None
        self.lists = self.watches = self.gone = self.errors = 0

    def check(self) -> bool:
        """Nothing to read synchronously: pods arrive once the watch loop runs."""
        return False

    def start(self) -> asyncio.Task:
        return asyncio.create_task(self._run(), name=f"discovery kubernetes {self.cluster}")

    async def _client(self):
        from kubernetes_asyncio import client, config  # the optional extra "kubernetes"
        cfg = client.Configuration()
        if self.spec.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=cfg)
        else:
            await config.load_kube_config(config_file=self.spec.kubeconfig, context=self.spec.context,
                                          client_configuration=cfg, persist_config=False)
        return client.ApiClient(configuration=cfg)

    async def _run(self) -> None:
        try:
            from kubernetes_asyncio import client
        except ImportError:
            self._fail("kubernetes-asyncio is not installed (pip install 'xds-sentinel[kubernetes]')")
            return
        api_client = None
        try:
            while api_client is None:
                try:
                    api_client = await self._client()
                except Exception as e:  # a bad kubeconfig is reported, then retried
                    self._fail(f"cannot load the Kubernetes client configuration: {e}")
                    await asyncio.sleep(self.spec.retry_backoff.s)
            api = self._api = client.CoreV1Api(api_client)
            while True:
                try:
                    if self.state.resource_version is None:
                        await self._list(api)
                    await self._watch(api)
                except _Gone as e:
                    self.gone += 1
                    log.info("cluster %s: watch from resourceVersion %s expired (%s); listing again",
                             self.cluster, self.state.resource_version, e)
                    self.state = PodState(self.state.pods, None, self.state.applied, self.state.stale)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the API server may be away; retry
                    self._fail(f"{type(e).__name__}: {e}")
                    await asyncio.sleep(self.spec.retry_backoff.s)
        finally:
            if api_client is not None:
                await api_client.close()

    def _fail(self, error: str) -> None:
        error = error if len(error) <= 300 else error[:297] + "..."
        self.errors += 1
        if error != self.error:
            log.error("cluster %s: kubernetes discovery (namespace %s, selector %s): %s; keeping the last "
                      "%d node(s)", self.cluster, self.spec.namespace, selector_string(self.spec.label_selector),
                      error, len(self.nodes))
        self.error = error

    async def _list(self, api) -> None:
        resp = await api.list_namespaced_pod(self.spec.namespace,
                                             label_selector=selector_string(self.spec.label_selector),
                                             _preload_content=False, _request_timeout=_LIST_TIMEOUT_S)
        try:
            body = await resp.read()
            if resp.status == 410:
                raise _Gone(body.decode("utf-8", "replace")[:200])
            if resp.status != 200:
                raise RuntimeError(f"list pods answered HTTP {resp.status}: {body.decode('utf-8', 'replace')[:200]}")
        finally:
            resp.release()
        self.lists += 1
        self.state = PodState.listed(json.loads(body), self.state)
        self.error = None
        await self._update()

    async def _watch(self, api) -> None:
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException
        self.watches += 1
        w = watch.Watch(return_type="object")  # raw JSON objects, as PodState takes them
        try:
            # timeout_seconds set: the library ends the stream at the server's timeout instead of
            # reconnecting (and retrying a 410 itself); this loop owns resume and relist.
            async for ev in w.stream(api.list_namespaced_pod, self.spec.namespace,
                                     label_selector=selector_string(self.spec.label_selector),
                                     resource_version=self.state.resource_version, allow_watch_bookmarks=True,
                                     timeout_seconds=round(self.spec.watch_timeout.s),
                                     # a silent connection (a partition) ends too, a little after
                                     # the server would have ended the watch
                                     _request_timeout=self.spec.watch_timeout.s + _LIST_TIMEOUT_S):
                await self._event(ev["type"], ev["raw_object"])
        except ApiException as e:
            if e.status == 410:
                raise _Gone(str(e.reason)) from None
            raise
        finally:
            await w.close()

    async def _event(self, etype: str, obj: dict[str, Any]) -> None:
        self.state = self.state.apply(etype, obj)
        self.error = None
        await self._update()

    async def _update(self) -> None:
        if self.spec.locality_from == "node":
            await self._read_nodes()
        nodes, self.skipped = pods_to_nodes(self.state.pods, self.spec, self.node_labels)
        if nodes != self.nodes:
            self.nodes = nodes
            self.on_change()

    async def _read_nodes(self) -> None:
        """Read the labels of each Kubernetes node a pod runs on that was not read yet (once: a
        node's topology labels do not change). A failure (e.g. no RBAC get on nodes) is logged
        and counted; that node then has no locality."""
        names = {n for p in self.state.pods.values() if (n := (p.get("spec") or {}).get("nodeName"))}
        for name in sorted(names - self.node_labels.keys()):
            try:
                assert self._api is not None, "nodes are read once the client is up (after a list)"
                # _preload_content=False: the raw aiohttp response, not the V1Node the stubs say
                resp = cast("aiohttp.ClientResponse", await self._api.read_node(
                    name, _preload_content=False, _request_timeout=_LIST_TIMEOUT_S))
                try:
                    body = await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {body.decode('utf-8', 'replace')[:200]}")
                finally:
                    resp.release()
                self.node_labels[name] = dict((json.loads(body).get("metadata") or {}).get("labels") or {})
            except Exception as e:  # no locality is better than no node
                self.node_labels[name] = {}
                self._fail(f"cannot read Kubernetes node {name!r} for its locality: {e}")

    def status(self) -> dict:
        return {"source": "kubernetes", "namespace": self.spec.namespace,
                "selector": selector_string(self.spec.label_selector), "nodes": [n.id for n in self.nodes],
                "skipped": dict(self.skipped), "resource_version": self.state.resource_version,
                "error": self.error, "errors": self.errors, "lists": self.lists, "watches": self.watches,
                "gone": self.gone, "events_applied": self.state.applied, "events_stale": self.state.stale}
