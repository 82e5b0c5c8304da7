#!/usr/bin/env bash
# Install what zkq needs on a fresh Debian machine, skipping what is already there:
#   - Debian's zookeeper package (and a JRE) for the local servers the demo and tests start;
#   - a virtualenv in .venv with torch installed first (a pinned CPU build unless ZKQ_TORCH says
#     otherwise: a bare torch requirement would pull a multi-GB CUDA build), then zkq with its
#     worker, serve and test extras.
set -euo pipefail
cd "$(dirname "$0")/.."

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

if [ ! -x /usr/share/zookeeper/bin/zkServer.sh ] || ! command -v java >/dev/null; then
  echo "setup: installing ZooKeeper (Debian package)" >&2
  sudo_if_needed apt-get update -qq
  DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get install -y -qq zookeeper >/dev/null
fi

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PYTHON" >&2
  "$PYTHON" -m venv .venv
fi

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing ${ZKQ_TORCH:-torch==2.13.0}" >&2
  .venv/bin/pip install -q --disable-pip-version-check "${ZKQ_TORCH:-torch==2.13.0}"
fi

stamp=".venv/.zkq-setup-$(cat setup.cfg pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "setup: installing zkq and its extras" >&2
  .venv/bin/pip install -q --disable-pip-version-check -e '.[cli,worker,serve,test]'
  rm -f .venv/.zkq-setup-* && touch "$stamp"
fi
