#!/usr/bin/env bash
# The SmolLM2 draft recipe on one GPU, inside a fixed time budget: grow the self-distilled data with make_data.py,
# compute the target features once, then train EAGLE-2, HASS and PosS-1/2/3 side by side (one process each) on
# the same features with the same recipe (recipe.yaml plus larger batches and more epochs).
#
#   bash examples/smollm2_drafts/train_drafts_gpu.sh                # defaults below; override with VAR=value
#   BUDGET_SECONDS=0 KINDS="hass poss1 poss2 poss3" bash examples/smollm2_drafts/train_drafts_gpu.sh   # equal epochs
#
# Every training run stops at the budget's end and saves what it has (training.max_train_minutes); the drafts land
# in runs/smollm2-gpu-KIND/final. Benchmark them on the CPU with train_drafts.sh --bench-only (edit the paths).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
PROMPTS=${PROMPTS:-5200}            # distinct prompts in total (each gets one answer)
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-384}
GEN_BATCH=${GEN_BATCH:-1024}        # answers generated together
DATA_MINUTES=${DATA_MINUTES:-3.5}   # cap on the data stage
EPOCHS=${EPOCHS:-8}
BATCH=${BATCH:-32}
BUDGET_SECONDS=${BUDGET_SECONDS:-480}   # whole script, data to saved drafts; 0: no limit (every draft runs EPOCHS)
KINDS=(${KINDS:-eagle2 hass poss1 poss2 poss3})
EXTRA=(${EXTRA:-})                  # more --set overrides for every training run (e.g. training.max_steps=2)
RECIPE=examples/smollm2_drafts/recipe.yaml
START=$(date +%s)
declare -A SHAPE=([eagle2]="1 1" [hass]="1 6" [poss1]="6 1" [poss2]="3 2" [poss3]="2 3")
mkdir -p runs/logs

echo "== data ($(date -u +%T))"
$PY examples/smollm2_drafts/make_data.py --device "$DEVICE" --prompts "$PROMPTS" --max-new-tokens "$MAX_NEW_TOKENS" \
  --batch-size "$GEN_BATCH" --prompt-batch-size "$GEN_BATCH" --chunk "$GEN_BATCH" --minutes "$DATA_MINUTES"

echo "== features ($(date -u +%T))"
$PY -m transformers_poss train --config "$RECIPE" --stage features --set device="$DEVICE" \
  --set features_batch_size=64 --set output_dir=runs/smollm2-gpu-features

if [ "$BUDGET_SECONDS" -gt 0 ]; then
  left=$(( BUDGET_SECONDS - ($(date +%s) - START) - 60 ))   # 60 s for start-up, evaluation and saving
  minutes=$(awk -v s="$left" 'BEGIN { m = s / 60; if (m < 0.5) m = 0.5; printf "%.2f", m }')
else
  minutes=null   # equal epochs for every draft
fi
echo "== training ${KINDS[*]} side by side, $EPOCHS epochs, time limit: $minutes minutes ($(date -u +%T))"
pids=()
export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1   # TF32 matmuls for training only; data and features stay exact fp32
for kind in "${KINDS[@]}"; do
  read -r S N <<<"${SHAPE[$kind]}"
  $PY -m transformers_poss train --config "$RECIPE" --set device="$DEVICE" --set output_dir="runs/smollm2-gpu-$kind" \
    --set draft.num_specialists="$S" --set draft.positions_per_specialist="$N" \
    --set training.num_train_epochs="$EPOCHS" --set training.per_device_train_batch_size="$BATCH" \
    --set training.max_train_minutes="$minutes" --set training.logging_steps=50 --set training.save_steps=100000 \
    --set training.dataloader_num_workers=2 "${EXTRA[@]/#/--set=}" >"runs/logs/$kind.log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then echo "!! ${KINDS[$i]} failed:"; tail -20 "runs/logs/${KINDS[$i]}.log"; status=1; fi
done
echo "== done in $(( $(date +%s) - START )) s"
exit $status
