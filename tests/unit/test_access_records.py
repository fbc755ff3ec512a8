"""Who gets in, the pure and in-process parts: certificate validity read from DER, the certificate watch
(expiry metrics, /readyz reasons, warnings) on a fake clock, a rotated-in expired certificate
refused, refusals counted and rate-limited per identity (not globally)."""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xds_server.process.certs import pem_not_after, refuse_expired, validity
from xds_server.process.certwatch import CertWatch
from xds_server.process.refusals import Refusals
from xds_server.process.tls import ServerCertFiles
from xds_server.testing import TestCA


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return TestCA(tmp_path_factory.mktemp("pki"), "ca")


def test_validity_matches_what_cryptography_reads(ca, tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    for i, (start, length) in enumerate([(-3600, 90000), (-7200, 3600), (60, 86400 * 400)]):
        pair = ca.issue(f"c{i}", dns=["a"], valid_from_s=start, valid_for_s=length, directory=tmp_path)
        pem = Path(pair.cert).read_bytes()
        cert = x509.load_pem_x509_certificate(pem)
        nb, na = validity(cert.public_bytes(serialization.Encoding.DER))
        assert nb == cert.not_valid_before_utc.timestamp() and na == cert.not_valid_after_utc.timestamp()
        assert pem_not_after(pem + Path(ca.cert).read_bytes()) == min(na, x509.load_pem_x509_certificate(
            Path(ca.cert).read_bytes()).not_valid_after_utc.timestamp())  # a bundle ends with its first member


@given(st.binary(max_size=200))
def test_validity_of_garbage_is_a_value_error_never_a_crash(data):
    try:
        validity(data)
    except ValueError:
        pass


def test_refuse_expired_names_the_field_and_date(ca, tmp_path):
    old = ca.issue("old", valid_from_s=-7200, valid_for_s=3600, directory=tmp_path)
    with pytest.raises(ValueError, match=r"tls.cert_file: certificate .*old.pem expired at 20\d\d-.*Z; renew it"):
        refuse_expired(old.cert, time.time(), "tls.cert_file")
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ValueError, match="no PEM certificate found"):
        refuse_expired(str(bad), time.time(), "x")


def test_a_rotated_in_expired_certificate_is_refused_and_the_old_one_stays(ca, tmp_path):
    live = ca.issue("live", dns=["a"], directory=tmp_path)
    files = ServerCertFiles(live.cert, live.key)
    old = ca.issue("old", dns=["a"], valid_from_s=-7200, valid_for_s=3600, directory=tmp_path / "o")
    shutil.copy(old.key, live.key)
    shutil.copy(old.cert, live.cert)
    assert files.fetch() is None and files.reload_errors == 1 and "expired at" in files.last_error
    assert files.handshakes == 1  # every fetch is one connection's handshake
    with pytest.raises(OSError, match="expired at"):
        ServerCertFiles(live.cert, live.key)  # and at start


def test_cert_watch_metrics_reasons_and_warnings_follow_the_clock(ca, tmp_path, caplog):
    pair = ca.issue("w", directory=tmp_path)
    end = pem_not_after(Path(pair.cert).read_bytes())
    now = [end - 10 * 86400]
    mono = [0.0]
    w = CertWatch(7 * 86400, clock=lambda: now[0], monotonic=lambda: mono[0])
    w.add("xds_server", pair.cert)
    w.add("unused", None)
    assert w.reasons() == []  # 10 days left, window 7
    (secs, days) = list(w.metric_families())
    assert [s.value for s in secs.samples] == [10 * 86400] and [s.value for s in days.samples] == [10.0]
    now[0] = end - 3 * 86400
    with caplog.at_level(logging.WARNING, "xds_server.process.certwatch"):
        (why,) = w.reasons()
        assert w.reasons() == [why]  # still named, but one warning line per hour
        mono[0] = 3600.0
        w.reasons()
    assert why.startswith(f"certificate {pair.cert} (xds_server) expires in 3.0 days")
    assert [r.getMessage() for r in caplog.records].count(f"TLS: {why}: renew it (warning window 7.0 days)") == 2
    now[0] = end + 5
    (gone,) = w.reasons()
    assert " expired at " in gone  # /readyz turns 503 on this one
    assert next(iter(w.metric_families())).samples[0].value == -5


def test_refusals_are_counted_and_rate_limited_per_identity_not_globally(caplog):
    t = [0.0]
    r = Refusals(logging.getLogger("test.refusals"), clock=lambda: t[0])
    with caplog.at_level(logging.WARNING, "test.refusals"):
        r.refuse("xds", "node_allow", "ipv4:127.0.0.1:1", "cn:a", "no")
        r.refuse("xds", "node_allow", "ipv4:127.0.0.1:2", "dns:b", "no")     # another identity at once: named
        for _ in range(5):
            r.refuse("xds", "node_allow", "ipv4:127.0.0.1:3", "cn:a", "no")  # the same one in a loop: quiet
        r.refuse("admin", "token_wrong", "10.0.0.1", "", "POST /reload")
        r.refuse("admin", "token_wrong", "10.0.0.2", "", "POST /reload")     # per peer host without identity
        t[0] = 10.0
        r.refuse("xds", "node_allow", "ipv4:127.0.0.1:4", "cn:a", "no")
    lines = [rec.getMessage() for rec in caplog.records]
    assert len(lines) == 5, lines
    assert "identity dns:b" in lines[1] and "peer 10.0.0.2" in lines[3]
    assert lines[4].endswith("(5 similar suppressed)")
    (fam,) = r.metric_families()
    got = {(s.labels["port"], s.labels["reason"]): s.value for s in fam.samples}
    assert got == {("xds", "node_allow"): 8, ("xds", "feed_allow"): 0, ("admin", "token_wrong"): 2,
                   ("admin", "token_missing"): 0, ("xds", "lrs_peer"): 0, ("xds", "lrs_plaintext"): 0,
                   ("xds", "agent_identity"): 0, ("xds", "agent_claim"): 0}
