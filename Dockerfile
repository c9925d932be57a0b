# Vigil's images, one build per target:
#   control-plane  `vigil scheduler`, `vigil telemetry`, `vigil guardian`: no torch, no DeepSpeed
#                  docker build --target control-plane -t vigil:dev .
#   worker         `vigil worker` and its training ranks: torch and DeepSpeed, CPU build by default;
#                  for GPU nodes a CUDA torch:
#                  docker build --target worker --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t vigil-worker:dev-gpu .
# compose.yaml builds each service from its target (and the `gpu` profile's worker with a CUDA torch).
#
# Where images come from a mirror, PYTHON_IMAGE names its Python 3.11 (python:3.11-slim or one like it:
# `python` and `pip` on PATH, Debian's useradd):
#   docker build --build-arg PYTHON_IMAGE=registry.example.com/python:3.11-slim ...
# Where the torch index cannot be reached, WHEELS_IMAGE names an image holding wheels (*.whl) at its root
# (FROM scratch + COPY *.whl /): the worker's torch and DeepSpeed are taken from it first, their
# dependencies from TORCH_INDEX_URL (then a PyPI-like index):
#   docker build --target worker --build-arg WHEELS_IMAGE=site/wheels:1 --build-arg TORCH_INDEX_URL=https://pypi.org/simple ...
# No `# syntax=` line: the Dockerfile frontend built into the engine builds this file, so no
# docker/dockerfile image is pulled (an air-gapped builder has none to pull).
ARG PYTHON_IMAGE=python:3.11-slim
ARG WHEELS_IMAGE=scratch

FROM scratch AS source
COPY pyproject.toml README.md /opt/vigil/
COPY sdk /opt/vigil/sdk
COPY libs /opt/vigil/libs
COPY services /opt/vigil/services
COPY trainer /opt/vigil/trainer
COPY cli /opt/vigil/cli
COPY bench /opt/vigil/bench

# The two projects' manifests alone: the dependencies' layers are rebuilt when these change, not with
# every change of the code.
FROM scratch AS manifests
COPY pyproject.toml /opt/vigil/
COPY sdk/pyproject.toml /opt/vigil/sdk/

FROM ${WHEELS_IMAGE} AS wheels

FROM ${PYTHON_IMAGE} AS base
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
COPY --chmod=0755 deploy/requirements.py /usr/local/bin/vigil-requirements
WORKDIR /opt/vigil
ENTRYPOINT ["vigil"]
CMD ["--help"]

# Each target installs as root, then runs as `vigil` in the data directory. The third-party
# dependencies come from the manifests first and the sources last, so a code change rebuilds only the
# final layers (not torch, not the dependencies).
FROM base AS control-plane
RUN --mount=type=bind,from=manifests,source=/opt/vigil,target=/tmp/manifests \
    vigil-requirements /tmp/manifests > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
COPY --from=source /opt/vigil /opt/vigil
RUN pip install --no-build-isolation ./sdk . \
 && rm -rf build ./*.egg-info sdk/build sdk/*.egg-info
USER vigil
WORKDIR /var/lib/vigil

FROM base AS worker
# torch comes first, from the index that decides CPU or CUDA, so that `pip install .[worker]` below
# finds it installed and never pulls the registry's default build (several GB of CUDA packages).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG DEEPSPEED_VERSION=0.19.8
RUN --mount=type=bind,from=wheels,target=/wheels \
    pip install --find-links /wheels --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
# DeepSpeed's setup.py imports torch, so it is built against the torch above (no build isolation);
# DS_BUILD_OPS=0: no CUDA/C++ op is compiled (the trainer uses torch's AdamW), so no compiler is needed.
RUN --mount=type=bind,from=wheels,target=/wheels \
    DS_BUILD_OPS=0 pip install --find-links /wheels --no-build-isolation "deepspeed==${DEEPSPEED_VERSION}"
RUN --mount=type=bind,from=manifests,source=/opt/vigil,target=/tmp/manifests \
    vigil-requirements /tmp/manifests worker > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
COPY --from=source /opt/vigil /opt/vigil
RUN pip install --no-build-isolation ./sdk ".[worker]" \
 && rm -rf build ./*.egg-info sdk/build sdk/*.egg-info
USER vigil
WORKDIR /var/lib/vigil
