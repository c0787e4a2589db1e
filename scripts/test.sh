#!/usr/bin/env bash
# The test suite (the default run: no `slow` marker). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the browser and the Prometheus the users' views are tested with (tests/test_ray_dashboard.py,
# tests/test_orchestrator.py's dashboard queries): installed where this is a root shell with
# apt; else those tests skip, saying why
if ! command -v chromium >/dev/null || ! command -v prometheus >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium prometheus >/dev/null 2>&1 \
      || echo "presto-sd: could not install chromium / prometheus: their tests will skip" >&2
  fi
fi
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
