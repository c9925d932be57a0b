#!/usr/bin/env bash
# Install Vigil into ./.venv from scratch, in the order that keeps CUDA wheels off CPU machines:
# torch first (pinned), then DeepSpeed without build isolation (so its build sees that torch),
# then Vigil itself with its test tools.
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
# Debian programs some tests run for real: Slurm with munge (tests/integration/slurm) and Prometheus
# (tests/integration/telemetry/test_prometheus.py). Installed only when missing, and only as root
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

PIP=(.venv/bin/python -m pip --quiet)
"${PIP[@]}" install --upgrade "pip>=24" "setuptools>=69" wheel
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    "${PIP[@]}" install "$TORCH_REQ"
fi
if ! .venv/bin/python -c "import deepspeed" 2>/dev/null; then
    DS_BUILD_OPS=0 "${PIP[@]}" install --no-build-isolation "deepspeed>=0.16,<0.20"
fi
"${PIP[@]}" install -e ".[test]"
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
echo "install: done ($(.venv/bin/python -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)'))"
