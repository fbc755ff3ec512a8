"""Envoy's ADS client certificate rotated through filesystem SDS (issue 14 item 3), one real Envoy.

A control plane with ``tls.mode: mtls``, an allow-list for Envoy's SPIFFE id and
``xds.max_connection_age_s`` (1 s here); one simulated engine and its agent; a real Envoy whose
``xds_cluster`` takes its client certificate from SDS files in a watched directory. Under load,
the certificate is replaced by a new one (same SPIFFE id, new key and serial) by moving a new SDS
file into place: Envoy loads it (its ``/certs``), and at its next connection (the connection age
closes the old one) the control plane's TLS handshake sees the new certificate (``/xds/clients``:
its SHA-256), the allow-list admits it, and no request fails.

Measured while writing this: without a connection age Envoy loads the new certificate but keeps
its open ADS connection, opened with the old one, indefinitely (one upstream connection in 7 s).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from node_probe.agent import AgentConfig, ProbeAgent
from node_probe.sim import SimConfig, build_app
from xds_server.config import parse_config
from xds_server.envoy_bootstrap import SDS_CERT_FILE, xds_tls_sds_secrets, xds_tls_transport_socket
from xds_server.server import ControlPlane
from xds_server.testing import LoadGenerator, StandaloneEnvoy, TestCA, free_port, wait_for

pytestmark = pytest.mark.envoy

ENVOY_ID = "spiffe://cluster.local/ns/llm/sa/envoy"
XDS_NAME = "xds.sentinel.test"


def _cert(path: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(path).read_bytes())


async def _client_certs(http: aiohttp.ClientSession, admin_port: int) -> dict[int, dict | None]:
    """Stream id -> the client certificate of each ADS stream of Envoy's node id (``/xds/clients``)."""
    async with http.get(f"http://127.0.0.1:{admin_port}/xds/clients") as r:
        data = await r.json()
    return {c["stream_id"]: c["client_certificate"] for c in data["clients"] if c["node_id"] == "envoy-llm-gw-1"}


async def test_envoy_presents_its_sds_rotated_client_certificate_at_its_next_connection(tmp_path: Path):
    pki = tmp_path / "pki"
    ca = TestCA(pki, "ca")
    xds = ca.issue("xds", dns=[XDS_NAME], ips=["127.0.0.1"])
    old = ca.issue("envoy", uris=[ENVOY_ID], client=True)
    cleanups = []
    cp = envoy = load = None
    try:
        port = free_port()
        runner = web.AppRunner(build_app(SimConfig(port=port, replica_id="n1", token_interval_ms=5)))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        cleanups.append(runner.cleanup)
        agent = ProbeAgent(AgentConfig(engine_url=f"http://127.0.0.1:{port}", listen="127.0.0.1:0",
                                       node_id="n1", probe_interval_s=0.2, gpu_interval_s=0))
        aport = await agent.start()
        cleanups.insert(0, agent.stop)
        cp = ControlPlane(parse_config({
            "xds": {"listen": "127.0.0.1:0", "max_connection_age_s": 1.0, "max_connection_age_grace_s": 0.2},
            "admin": {"listen": "127.0.0.1:0"},
            "health": {"ramp_step_percent": 50, "ramp_step_s": 0.2, "probation_clean_s": 1.0},
            "tls": {"mode": "mtls", "cert_file": xds.cert, "key_file": xds.key, "client_ca_file": ca.cert,
                    "node_allow": [{"identity": ENVOY_ID, "node_ids": ["envoy-llm-*"]}]},
            "clusters": [{"name": "llm", "outlier_detection": {"enabled": False}, "nodes": [
                {"id": "n1", "address": f"127.0.0.1:{port}", "probe_address": f"127.0.0.1:{aport}"}]}]}))
        await cp.start()
        for name, secret in xds_tls_sds_secrets(ca.cert, old.cert, old.key, XDS_NAME).items():
            (pki / name).write_text(yaml.safe_dump(secret))
        envoy = await StandaloneEnvoy(cp.xds_port, xds_tls=xds_tls_transport_socket(
            ca.cert, old.cert, old.key, XDS_NAME, sds_dir=str(pki))).start()

        async def routed() -> bool:
            hosts = await envoy.hosts()
            return [h["health"] for h in hosts.values()] == ["HEALTHY"]
        await wait_for(routed, timeout_s=20, what=lambda: f"n1 HEALTHY in Envoy; Envoy:\n{envoy.proc.output_tail()}")

        old_sha = _cert(old.cert).fingerprint(hashes.SHA256()).hex()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            async def presenting(sha: str, after_stream: int = 0) -> int | None:
                """The id of a stream later than ``after_stream`` presenting certificate ``sha``."""
                with contextlib.suppress(aiohttp.ClientError):
                    for sid, c in (await _client_certs(http, cp.admin_port)).items():
                        if sid > after_stream and c and c["sha256"] == sha and ENVOY_ID in c["names"]:
                            return sid
                return None

            await wait_for(lambda: presenting(old_sha), timeout_s=10, what="Envoy's stream with the first certificate")
            load = LoadGenerator(envoy.url, concurrency=2)
            await load.start()
            load.phase("old certificate")
            # Rotate: new files, then the SDS file naming them moved into the watched directory.
            new = ca.issue("envoy-2", uris=[ENVOY_ID], client=True)
            assert _cert(new.cert).serial_number != _cert(old.cert).serial_number
            new_sha = _cert(new.cert).fingerprint(hashes.SHA256()).hex()
            doc = xds_tls_sds_secrets(ca.cert, new.cert, new.key, XDS_NAME)[SDS_CERT_FILE]
            (pki / ".sds.tmp").write_text(yaml.safe_dump(doc))
            os.replace(pki / ".sds.tmp", pki / SDS_CERT_FILE)
            rotated = load.phase("rotated")

            async def envoy_loaded() -> bool:  # Envoy's own view of the certificate it presents
                certs = await envoy.admin_json("/certs")
                return any(int(c["serial_number"], 16) == _cert(new.cert).serial_number
                           for entry in certs["certificates"] for c in entry.get("cert_chain", ()))
            await wait_for(envoy_loaded, timeout_s=10, what="Envoy's /certs listing the new certificate")
            first = await wait_for(lambda: presenting(new_sha), timeout_s=10, what=lambda: (
                f"an ADS stream presenting the new certificate; Envoy:\n{envoy.proc.output_tail()}"))
            load.phase("new certificate")
            # the next connection (the age closes this one) presents it too
            await wait_for(lambda: presenting(new_sha, first), timeout_s=10, what="a later stream with it")
            await load.stop()
        total = load.totals()
        stats = await envoy.stats(r"^cluster\.xds_cluster\.upstream_cx_total$|^cluster_manager\.cluster_modified$")
        print(f"\nrequests ok {total.ok} failed {dict(total.failures)}; while rotating {rotated.ok}; "
              f"Envoy's connections to the control plane {stats}")
        assert total.failed == 0 and total.ok > 20, dict(total.failures)
        assert load.phases["new certificate"].ok > 0
        assert stats["cluster.xds_cluster.upstream_cx_total"] >= 2  # it reconnected
        assert stats["cluster_manager.cluster_modified"] == 0  # reconnects changed no cluster
        assert cp.ads.stats.rejected == {}  # the allow-list admitted every connection
    finally:
        if load is not None:
            await load.stop()
        if envoy is not None:
            envoy.stop()
        if cp is not None:
            await cp.stop()
        for c in cleanups:
            await c()
