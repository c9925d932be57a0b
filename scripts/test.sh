#!/usr/bin/env bash
# Install (if needed), lint, build the documentation site, and run every test: unit tests, then
# integration tests against real NATS, Postgres and DeepSpeed ranks. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# the documentation site: a broken link, anchor or nav entry fails here (output in build/site, ignored)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
exec .venv/bin/python -m pytest "$@"
