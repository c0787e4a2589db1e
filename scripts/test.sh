#!/usr/bin/env bash
# The test suite (the default run: no `slow` marker). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
