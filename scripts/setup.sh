#!/usr/bin/env bash
# Create .venv with the CPU torch on this machine's disk and presto-sd (editable) in it.
# Idempotent: re-runs only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ]; then
  echo "presto-sd: setting up .venv (first run only) ..." >&2
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  # torch first and pinned: the CPU build that lies on disk, never a multi-GB CUDA download
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[dev]'
  touch .venv/.installed
fi
