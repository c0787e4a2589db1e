#!/usr/bin/env bash
# The test suite (the default run: no `slow` marker). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the browser the Ray dashboard is tested in (tests/test_ray_dashboard.py): installed where
# this is a root shell with apt; else that test skips, saying why
if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
      || echo "presto-sd: could not install chromium: the dashboard test will skip" >&2
  fi
fi
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
