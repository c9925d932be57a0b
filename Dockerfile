# syntax=docker/dockerfile:1
# Vigil's images, one build per target:
#   control-plane  `vigil scheduler`, `vigil telemetry`, `vigil guardian`: no torch, no DeepSpeed
#                  docker build --target control-plane -t vigil:dev .
#   worker         `vigil worker` and its training ranks: torch and DeepSpeed, CPU build by default;
#                  for GPU nodes a CUDA torch:
#                  docker build --target worker --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t vigil-worker:dev-gpu .
# compose.yaml builds each service from its target (and the `gpu` profile's worker with a CUDA torch).
FROM scratch AS source
COPY pyproject.toml README.md /opt/vigil/
COPY sdk /opt/vigil/sdk
COPY libs /opt/vigil/libs
COPY services /opt/vigil/services
COPY trainer /opt/vigil/trainer
COPY cli /opt/vigil/cli
COPY bench /opt/vigil/bench

FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIGIL_DATA_DIR=/var/lib/vigil
RUN pip install "pip>=24" "setuptools>=69" wheel
# A non-root user owning the data directory; named volumes mounted there start with this ownership.
RUN useradd --create-home --uid 10001 --user-group vigil \
 && mkdir -p /var/lib/vigil/checkpoints \
 && chown -R vigil:vigil /var/lib/vigil
COPY --chmod=0755 deploy/healthcheck.py /usr/local/bin/vigil-healthcheck
WORKDIR /opt/vigil
ENTRYPOINT ["vigil"]
CMD ["--help"]

# Each target installs as root, then runs as `vigil` in the data directory. The sources come last,
# so a code change rebuilds only the final layers (not torch).
FROM base AS control-plane
COPY --from=source /opt/vigil /opt/vigil
RUN pip install ./sdk . \
 && rm -rf build ./*.egg-info sdk/build sdk/*.egg-info
USER vigil
WORKDIR /var/lib/vigil

FROM base AS worker
# torch comes first, from the index that decides CPU or CUDA, so that `pip install .[worker]` below
# finds it installed and never pulls the registry's default build (several GB of CUDA packages).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG DEEPSPEED_VERSION=0.19.8
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
# DeepSpeed's setup.py imports torch, so it is built against the torch above (no build isolation);
# DS_BUILD_OPS=0: no CUDA/C++ op is compiled (the trainer uses torch's AdamW), so no compiler is needed.
RUN DS_BUILD_OPS=0 pip install --no-build-isolation "deepspeed==${DEEPSPEED_VERSION}"
COPY --from=source /opt/vigil /opt/vigil
RUN pip install ./sdk ".[worker]" \
 && rm -rf build ./*.egg-info sdk/build sdk/*.egg-info
USER vigil
WORKDIR /var/lib/vigil
