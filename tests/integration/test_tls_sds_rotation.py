"""Envoy's ADS client certificate rotated through filesystem SDS, one real Envoy.

A fleet of real processes (one simulated engine, its agent, xds-server, Envoy): the control plane
serves ADS with ``tls.mode: mtls``, an allow-list for Envoy's SPIFFE id and
``xds.keepalive.max_connection_age`` (1 s here); Envoy's ``xds_cluster`` takes its client certificate
from SDS files in a watched directory. Under load the certificate is replaced by a new one (same
SPIFFE id, new key and serial) by moving a new SDS file into place: Envoy loads it (its
``/certs``), and at its next connection (the connection age closes the old one) the control
plane's TLS handshake sees the new certificate (``/xds/clients``: its SHA-256), the allow-list
admits it, and no request fails.

Measured while writing this: without a connection age Envoy loads the new certificate but keeps
its open ADS connection, opened with the old one (one upstream connection after 7 s).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import aiohttp
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from xds_server.envoy.tls import SDS_CERT_FILE, xds_tls_sds_secrets, xds_tls_transport_socket
from xds_server.testing import LoadGenerator, TestCA, parse_envoy_stats, wait_for

pytestmark = pytest.mark.envoy

ENVOY_ID = "spiffe://cluster.local/ns/llm/sa/envoy"
XDS_NAME = "xds.sentinel.test"
# Fast recovery, and a busy CI machine's late heartbeats and slow probes tolerated (3 misses of
# 500 ms, TTFT up to 700 ms healthy): the one node stays routed while the test looks at certificates.
HEALTH = {"heartbeat": {"grace": "400ms", "failure_detector": "count"},
          "probes": {"ttft_healthy": "700ms"},
          "probation": {"clean": "1s", "ramp_step_percent": 50, "ramp_step": "200ms"}}


def _cert(path: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(path).read_bytes())


def _write_sds(pki: Path, ca_cert: str, cert: str, key: str) -> None:
    """Move the SDS file naming ``cert``/``key`` into ``pki`` (written aside, then renamed)."""
    doc = xds_tls_sds_secrets(ca_cert, cert, key, XDS_NAME)[SDS_CERT_FILE]
    (pki / ".sds.tmp").write_text(yaml.safe_dump(doc))
    os.replace(pki / ".sds.tmp", pki / SDS_CERT_FILE)


async def test_envoy_presents_its_sds_rotated_client_certificate_at_its_next_connection(
        make_fleet, http, tmp_path: Path):
    pki = tmp_path / "pki"
    ca = TestCA(pki, "ca")
    xds = ca.issue("xds", dns=[XDS_NAME], ips=["127.0.0.1"])
    old = ca.issue("envoy", uris=[ENVOY_ID], client=True)
    for name, secret in xds_tls_sds_secrets(ca.cert, old.cert, old.key, XDS_NAME).items():
        (pki / name).write_text(yaml.safe_dump(secret))
    fleet = make_fleet(
        n_nodes=1, probe_interval_s=0.3, health=HEALTH, cluster_options={"outlier_detection": {"enabled": False}},
        xds_options={"max_connection_age_s": 1.0, "max_connection_age_grace_s": 0.2},
        config_options={"tls": {"mode": "mtls", "cert_file": xds.cert, "key_file": xds.key,
                                "client_ca_file": ca.cert,
                                "node_allow": [{"identity": ENVOY_ID, "node_ids": ["envoy-llm-*"]}]}},
        envoy_xds_tls=xds_tls_transport_socket(ca.cert, old.cert, old.key, XDS_NAME, sds_dir=str(pki)))
    await fleet.wait_all_routed(http)
    envoy_admin = f"http://127.0.0.1:{fleet.envoy_admin_port}"

    async def presenting(sha: str, after_stream: int = 0) -> int | None:
        """The id of an ADS stream of Envoy's later than ``after_stream`` presenting certificate
        ``sha`` (``/xds/clients``)."""
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(f"http://127.0.0.1:{fleet.admin_port}/xds/clients") as r:
                clients = (await r.json())["clients"]
            for c in clients:
                cert = c["client_certificate"]
                if (c["node_id"] == "envoy-llm-gw-1" and c["stream_id"] > after_stream and cert
                        and cert["sha256"] == sha and ENVOY_ID in cert["names"]):
                    return c["stream_id"]
        return None

    async def envoy_stats() -> dict[str, int]:
        async with http.get(f"{envoy_admin}/stats", params={"filter": (
                r"^cluster\.xds_cluster\.upstream_cx_total$|^cluster_manager\.cluster_modified$")}) as r:
            return parse_envoy_stats(await r.text())

    old_sha = _cert(old.cert).fingerprint(hashes.SHA256()).hex()
    await wait_for(lambda: presenting(old_sha), timeout_s=10, what="Envoy's stream with the first certificate")
    load = LoadGenerator(fleet.url, concurrency=2)
    await load.start()
    try:
        before = load.phase("old certificate")
        await wait_for(lambda: before.ok >= 5, timeout_s=10, what="requests through Envoy")
        new = ca.issue("envoy-2", uris=[ENVOY_ID], client=True)
        assert _cert(new.cert).serial_number != _cert(old.cert).serial_number
        new_sha = _cert(new.cert).fingerprint(hashes.SHA256()).hex()
        _write_sds(pki, ca.cert, new.cert, new.key)
        rotating = load.phase("rotating")

        async def envoy_loaded() -> bool:  # Envoy's own view of the certificate it presents
            async with http.get(f"{envoy_admin}/certs") as r:
                certs = await r.json(content_type=None)
            return any(int(c["serial_number"], 16) == _cert(new.cert).serial_number
                       for entry in certs["certificates"] for c in entry.get("cert_chain", ()))

        await wait_for(envoy_loaded, timeout_s=10, what="Envoy's /certs listing the new certificate")
        first = await wait_for(lambda: presenting(new_sha), timeout_s=10,
                               what="an ADS stream presenting the new certificate")
        after = load.phase("new certificate")
        # the next connection (the age closes this one) presents it too
        await wait_for(lambda: presenting(new_sha, first), timeout_s=10, what="a later stream with it")
    finally:
        await load.stop()
    total, stats = load.totals(), await envoy_stats()
    print(f"\nrequests ok {total.ok} failed {dict(total.failures)}; while rotating {rotating.ok}; "
          f"Envoy {stats}")
    assert total.failed == 0 and total.ok > 20, {k: (v.ok, dict(v.failures)) for k, v in load.phases.items()}
    assert before.ok >= 5 and after.ok > 0
    assert stats["cluster.xds_cluster.upstream_cx_total"] >= 2  # it reconnected (old and new certificate)
    assert stats["cluster_manager.cluster_modified"] == 0  # the reconnects changed no cluster
