"""The relay's configuration: CLI flags or a small YAML file -> one validated pydantic model.

Every field has its default and the reason for it. Errors: :func:`load_relay_config` raises
:class:`RelayConfigError` naming each bad field (``stall_gap_s: ...``).
"""
from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from xds_server.process.tls import ClientTls, is_loopback

__all__ = ["RelayConfig", "RelayConfigError", "load_relay_config"]


class RelayConfigError(ValueError):
    """The relay's config file or flags are invalid; the message names the field and reason."""


def _hostport(v: str) -> str:
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {v!r}")
    return v


class RelayConfig(BaseModel):
    """Fields (units in the name: ``_s`` seconds):

    - ``listen``: where clients connect (HOST:PORT).
    - ``upstream``: Envoy's listener URL; every attempt goes there and Envoy picks the node.
    - ``routing_feed``: the control plane's gRPC address serving ``sentinel.routing.v1``, or its
      replicas' (a list, or HOST:PORT,HOST:PORT): each reconnect dials the next, as Envoy's
      xds_cluster moves its stream (None: no health signal; the relay still rescues on its own
      evidence).
    - ``admin_listen``: Prometheus ``/metrics`` (worker *i* listens on port + *i*); None: off.
    - ``workers``: processes sharing ``listen`` with SO_REUSEPORT (one per core to scale).
    - ``max_rescues``: continuation attempts after the first (default 2: a second node failing
      during one request is rare; a third points at the request itself, e.g. a crash it causes).
    - ``max_resume_tokens``: most generated tokens re-sent as context (8192: re-prefill of 8k
      tokens takes ~100-400 ms on one H100-class GPU, within the pause goal of 500 ms).
    - ``stall_gap_s``: silence within a stream, after its first chunk, that counts as a stall
      (2.0 s: 10x a slow decode step of a busy engine (~200 ms TPOT); the health signal usually
      acts first, at ~200 ms).
    - ``first_chunk_timeout_s``: silence before an attempt's first chunk (covers prefill of a
      long prompt: 30 s).
    - ``ping_interval_s``: ``: ping`` comment lines while a rescue is prefilling (0.3 s: keeps
      SDK and proxy read timeouts quiet and shows the client the stream is alive).
    - ``upstream_host_header``: Envoy's response header naming the node (%UPSTREAM_HOST%).
    - ``hedge_unary_on_ejection``: a non-streaming request in flight when a node is ejected is
      re-issued at once, pinned to another node, if it runs there (each attempt is pinned to a
      routable node from the feed; one started before the feed listed any is re-issued on every
      ejection); the first answer wins, the other is cancelled.
    - ``feed_reconnect_max_s``: longest wait between routing feed reconnects (backoff from 0.1 s).
    - ``feed_keepalive_s``: HTTP/2 PING interval on the feed's connection, and how long an
      answer may take before the connection is dropped and redialled (1.0 s: a frozen or cut-off
      control plane, which sends no FIN or RST, is noticed within ~2 s, as Envoy's xds_cluster
      keepalive does; the control plane accepts pings 0.5 s apart).
    - ``feed_tls_ca_file``: dial the routing feed over TLS, verifying the control plane's
      certificate against this CA bundle (PEM); ``feed_tls_cert_file`` + ``feed_tls_key_file``:
      the relay's client certificate (mutual TLS, ``tls.mode: mtls`` on the control plane);
      ``feed_tls_server_name``: the name the control plane's certificate must carry (default the
      feed's host). Files are re-read at each reconnect when they changed.
    - ``feed_plaintext``: dial a non-loopback routing feed in plaintext (must be said; refused
      otherwise).
    - ``header_timeout_s``: a client's request head (request line and headers) must be whole
      within this of its first byte (of the connection, for the first request), else the
      connection is closed (10.0 s: a head is one packet, a slow mobile link takes well under a
      second; Apache's mod_reqtimeout allows 20-40 s with a minimum rate, nginx 60 s. Measured:
      2,000 slowloris connections held the relay's fds for as long as they dripped).
    - ``body_timeout_s``: the request body must be whole within this of the head, else 408 and
      the connection closed (30.0 s: 1 MiB, the most the relay accepts (413 above), at 35 KB/s;
      a prompt is kilobytes. Measured: bodies dripping 1 byte/s were never timed out).
    - ``keepalive_timeout_s``: an idle kept-alive connection is closed after this (60.0 s:
      under the common 75 s of nginx, over the 15-60 s idle pools of HTTP clients, so a client
      rarely sends on a connection the relay is closing).
    - ``max_connections``: client connections open at once; one more evicts the connection idle
      longest (between requests or still sending its head), or is answered 503 when every one
      has a request in flight. None (default): half the process's open-file limit
      (RLIMIT_NOFILE soft), since each client connection may hold one upstream connection to
      Envoy; a common 1,024 limit gives 512.
    - ``listen_backlog``: connections the kernel queues before the relay accepts them (1024,
      capped by net.core.somaxconn; aiohttp's 128 made a burst of 2,000 connections wait for SYN
      retries, 11 s in all, where 1,024 took 0.4 s).
    - ``sample_prompts``: ratio (0..1) of forwarded requests whose prompt is sampled for the
      control plane's switch-back validation (``RoutingFeed/SubmitPrompts``; the control plane
      takes them with ``health.validation.live_prompts.enabled``). 0 (default): off, nothing is
      parsed or kept; ``--sample-prompts`` without a value: 0.05 (seed 002: 5 %). Needs
      ``routing_feed`` (sent over its connection, its TLS). A prompt is a ``/v1/completions``
      string ``prompt`` or a chat request's last ``user`` message (text only), of a request
      answered 200; it is never logged.
    - ``sample_max_chars``: a longer prompt is not sampled (2,000 characters: the control
      plane's default ``max_chars``; counted as dropped, reason too_long).
    - ``sample_buffer``: sampled prompts waiting to be sent; one more drops the oldest (32, at
      most 64: one SubmitPrompts call carries at most 64).
    - ``sample_interval_s``: how often the waiting prompts are sent, in one call (5.0 s; a
      call fails after the same time, its prompts dropped: counted, never retried).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    listen: str = "127.0.0.1:8080"
    upstream: str = "http://127.0.0.1:10000"
    routing_feed: list[str] | None = None
    admin_listen: str | None = "127.0.0.1:9470"
    workers: int = Field(1, ge=1, le=256)
    max_rescues: int = Field(2, ge=0, le=10)
    max_resume_tokens: int = Field(8192, ge=0)
    stall_gap_s: float = Field(2.0, gt=0)
    first_chunk_timeout_s: float = Field(30.0, gt=0)
    ping_interval_s: float = Field(0.3, gt=0)
    upstream_host_header: str = "x-sentinel-upstream-host"
    hedge_unary_on_ejection: bool = True
    feed_reconnect_max_s: float = Field(2.0, gt=0)
    feed_keepalive_s: float = Field(1.0, ge=0.1, le=3600)
    feed_tls_ca_file: str | None = None
    feed_tls_cert_file: str | None = None
    feed_tls_key_file: str | None = None
    feed_tls_server_name: str | None = None
    feed_plaintext: bool = False
    header_timeout_s: float = Field(10.0, gt=0, le=3600)
    body_timeout_s: float = Field(30.0, gt=0, le=3600)
    keepalive_timeout_s: float = Field(60.0, gt=0, le=86_400)
    max_connections: int | None = Field(None, ge=1, le=10_000_000)
    listen_backlog: int = Field(1024, ge=16, le=65_535)
    sample_prompts: float = Field(0.0, ge=0, le=1)
    sample_max_chars: int = Field(2000, ge=1, le=100_000)
    sample_buffer: int = Field(32, ge=1, le=64)
    sample_interval_s: float = Field(5.0, gt=0, le=3600)

    @model_validator(mode="after")
    def _feed_tls(self) -> RelayConfig:
        if (self.feed_tls_cert_file is None) != (self.feed_tls_key_file is None):
            raise ValueError("feed_tls_cert_file and feed_tls_key_file go together")
        if self.feed_tls_ca_file is None and (self.feed_tls_cert_file or self.feed_tls_server_name):
            raise ValueError("feed_tls_cert_file/feed_tls_server_name need feed_tls_ca_file")
        if self.feed_tls_ca_file is not None and self.feed_plaintext:
            raise ValueError("feed_plaintext and feed_tls_ca_file exclude each other")
        if self.feed_tls_ca_file is None and not self.feed_plaintext:
            for target in self.routing_feed or ():
                if not is_loopback(target.rpartition(":")[0]):
                    raise ValueError(f"routing_feed {target} is not a loopback address: set feed_tls_ca_file "
                                     "(--feed-tls-ca) or feed_plaintext (--feed-plaintext)")
        if self.sample_prompts > 0 and not self.routing_feed:
            raise ValueError("sample_prompts needs routing_feed (--routing-feed): sampled prompts are sent over it")
        return self

    def connection_cap(self) -> int:
        """``max_connections``, or half the soft open-file limit when it is None."""
        if self.max_connections is not None:
            return self.max_connections
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(16, (soft if soft != resource.RLIM_INFINITY else 1 << 20) // 2)

    def feed_tls(self) -> ClientTls | None:
        """How to dial the routing feed: None for plaintext."""
        if self.feed_tls_ca_file is None:
            return None
        return ClientTls(self.feed_tls_ca_file, self.feed_tls_cert_file, self.feed_tls_key_file,
                         self.feed_tls_server_name)

    @field_validator("listen", "admin_listen")
    @classmethod
    def _check_hostport(cls, v: str | None) -> str | None:
        return None if v is None else _hostport(v)

    @field_validator("routing_feed", mode="before")
    @classmethod
    def _feed_targets(cls, v: Any) -> list[str] | None:
        """One HOST:PORT, several comma-separated, or a list of them (each may hold commas)."""
        if v is None:
            return None
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
            raise ValueError("expected HOST:PORT, HOST:PORT,HOST:PORT or a list of HOST:PORT")
        targets = [_hostport(t.strip()) for x in items for t in x.split(",") if t.strip()]
        if not targets:
            raise ValueError("no HOST:PORT given")
        return targets

    @field_validator("upstream")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"expected an http(s):// URL, got {v!r}")
        return v.rstrip("/")


def load_relay_config(path: str | Path | None = None, **overrides: Any) -> RelayConfig:
    """Read a YAML mapping (optional) and apply ``overrides`` (flags; None values ignored)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise RelayConfigError(f"{path}: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise RelayConfigError(f"{path}: expected a mapping at the top level")
        data.update(loaded or {})
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return RelayConfig(**data)
    except ValidationError as e:
        msgs = [f"{'.'.join(str(x) for x in err['loc']) or '(top)'}: {err['msg'].removeprefix('Value error, ')}"
                for err in e.errors()]
        raise RelayConfigError("; ".join(msgs)) from None
