#!/usr/bin/env bash
# The test command: install what is missing, then lint, type-check and run the tests against
# real ZooKeeper servers the fixtures start. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check zkqueue workers gateway tests scripts
.venv/bin/ruff format --check zkqueue workers gateway tests scripts
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
