#!/usr/bin/env bash
# The main job: speculative decoding of a prompt with SmolLM2-135M-Instruct and the
# shipped drafter (embedded: one process, no gRPC, no Ray). Extra args go to `generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/presto-sd generate "${PROMPT:-Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?}" "$@"
