#!/usr/bin/env bash
# The demo: install what is missing, then run scripts/demo.py (local ZooKeeper, a worker, jobs at
# three priorities, results and timings, clean-up).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
