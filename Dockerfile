# syntax=docker/dockerfile:1
# Container images of xds-sentinel, one build target per program (build from the repository root):
#
#   docker build --target xds-server -t xds-sentinel/xds-server:0.1.0 .
#   docker build --target node-probe -t xds-sentinel/node-probe:0.1.0 .
#
# Both targets install the same wheel into a slim Python image and run one console script as a
# non-root user (uid/gid 10001, numeric so Kubernetes' runAsNonRoot can check it). Each has a
# HEALTHCHECK on its own /healthz: the URL is SENTINEL_HEALTHCHECK_URL, set per target below;
# change it when the config moves the port. The simulated engine runs from the node-probe image
# (`node-probe sim-engine`, see compose.yaml). Not built or run on the project's CI machine (it
# cannot run containers); tests/deploy/ checks what can be checked without a container runtime.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY xds_server ./xds_server
COPY node_probe ./node_probe
COPY sentinel_relay ./sentinel_relay
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS runtime
# Optional extras installed with the wheel: "kubernetes" brings the client that pod discovery
# (the config's discovery.kubernetes) uses; "uvloop" the event loop that `serve --loop uvloop`
# (and the relay) can run on; pip warns and goes on where a build lacks an extra.
ARG EXTRAS=kubernetes,uvloop
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/xds_sentinel-*.whl)[${EXTRAS}]" \
    && rm -rf /wheels \
    && groupadd --system --gid 10001 sentinel \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/xds-sentinel \
       --shell /usr/sbin/nologin sentinel \
    && install -d -o 10001 -g 10001 /var/lib/xds-sentinel
WORKDIR /var/lib/xds-sentinel
USER 10001:10001
# Exit 0 when the URL answers 2xx within 2 s; any other answer or no answer: exit 1 (urlopen raises).
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['SENTINEL_HEALTHCHECK_URL'], timeout=2)"]

# The control plane: ADS on 18000, admin (/healthz, /readyz, /metrics, dashboard) on 19000, as
# the config mounted at /etc/xds-sentinel/xds.yaml says (deploy/compose/xds.yaml,
# deploy/kubernetes/10-xds-server.yaml). The state file (state.path) goes under the WORKDIR.
FROM runtime AS xds-server
ENV SENTINEL_HEALTHCHECK_URL=http://127.0.0.1:19000/healthz
EXPOSE 18000 19000
ENTRYPOINT ["xds-server"]
CMD ["--log-format", "json", "serve", "/etc/xds-sentinel/xds.yaml"]

# The agent beside one engine: NodeProbe gRPC on 50051, its own /metrics and /healthz on 9464.
# The default engine URL is the engine in the same network namespace (a Kubernetes sidecar, or
# compose's network_mode "service:ENGINE"); the node id defaults to the host (pod) name.
# Plaintext is said explicitly (a non-loopback --listen refuses it otherwise); for mTLS replace the
# command's --plaintext with --tls-cert, --tls-key and --tls-client-ca (docs/tls.md).
FROM runtime AS node-probe
ENV SENTINEL_HEALTHCHECK_URL=http://127.0.0.1:9464/healthz
EXPOSE 50051 9464
ENTRYPOINT ["node-probe"]
CMD ["--engine-url", "http://127.0.0.1:8000", "--listen", "0.0.0.0:50051", "--plaintext", "--metrics-listen", "0.0.0.0:9464"]
