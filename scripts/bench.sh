#!/usr/bin/env bash
# The benchmark: install what is missing (./scripts/setup.sh, the bench extra with matplotlib,
# redis and pyinstrument, and Debian's redis-server for the baseline), then run
# `python -m scripts.bench` with the arguments given. Examples:
#   ./scripts/bench.sh --quick                 # under 2 minutes, results in bench-results/
#   ./scripts/bench.sh --out docs/bench        # the full run quoted in BENCHMARKS.md
set -euo pipefail
cd "$(dirname "$0")/.."

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

./scripts/setup.sh

if ! .venv/bin/python -c "import matplotlib, redis, pyinstrument" 2>/dev/null; then
  echo "bench: installing the bench extra" >&2
  .venv/bin/pip install -q --disable-pip-version-check -e '.[bench]'
fi

if ! command -v redis-server >/dev/null; then
  echo "bench: installing redis-server (Debian package)" >&2
  sudo_if_needed apt-get update -qq
  DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get install -y -qq redis-server >/dev/null
fi

exec .venv/bin/python -m scripts.bench "$@"
