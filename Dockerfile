# pd-proxy container image: small (python slim), non-root, health-checked.
#   docker build -t pd-proxy:0.1.0 .
#   docker run --rm -p 127.0.0.1:8000:8000 -e PD_PROXY_API_KEY pd-proxy:0.1.0 \
#       --prefill http://P:8100 --decode http://D:8200
# The entrypoint listens on 0.0.0.0:8000 with --workers auto: one process per CPU the container may
# use (its CPU set, capped by a CPU limit: `docker run --cpus 2` gives 2 processes; with no limit,
# one per host core). Limits such as --max-inflight hold per process. Arguments are appended, so a
# later --port or --workers N wins (set PD_PROXY_PORT to the same port for the health check). The
# client API key comes from the environment (PD_PROXY_API_KEY; never bake it into the image): without
# it pd-proxy logs a WARNING.
# Only the runtime dependencies are installed, plus the k8s extra (pool membership from EndpointSlices),
# otlp (pd-proxy --otel exporting over OTLP/HTTP) and bench (pd-bench runs in the image:
#   docker run --rm --network host --entrypoint pd-bench pd-proxy:0.1.0 run --url http://127.0.0.1:8000 ...);
# no dev extras. The build stage keeps pip's and setuptools' leftovers out of the final image.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/pd-proxy
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY proxy ./proxy
COPY kv_transfer ./kv_transfer
COPY workers ./workers
COPY benchmarks ./benchmarks
RUN /opt/pd-proxy/bin/pip install --no-cache-dir ".[k8s,otlp,bench]" \
    && /opt/pd-proxy/bin/pip uninstall --yes pip setuptools wheel

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pd-proxy" \
      org.opencontainers.image.description="Proxy for disaggregated prefill/decode vLLM pools" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 pdproxy \
    && useradd --system --uid 10001 --gid pdproxy --no-create-home --shell /usr/sbin/nologin pdproxy
COPY --from=build /opt/pd-proxy /opt/pd-proxy
ENV PATH=/opt/pd-proxy/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PD_PROXY_PORT=8000
USER 10001:10001
EXPOSE 8000
# /livez answers 200 while the process serves, whatever the workers do (/health is 503 while a pool
# has no worker: vLLM loading, an outage); python is used because the slim image has no curl.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('PD_PROXY_PORT', '8000') + '/livez', timeout=2)"]
ENTRYPOINT ["pd-proxy", "--host", "0.0.0.0", "--port", "8000", "--workers", "auto"]
