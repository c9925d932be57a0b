#!/usr/bin/env bash
# Install (if needed) and run every test: unit tests, then integration tests against real
# NATS, Postgres and DeepSpeed ranks. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
