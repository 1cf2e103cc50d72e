#!/usr/bin/env bash
# The SmolLM2 draft recipe on one GPU, inside a fixed time budget, following the paper: grow the self-distilled data
# with make_data.py (prompts by request category, some with follow-up turns), compute the target features once,
# train the EAGLE-2 draft to the end of its schedule, then start HASS, PosS-1/2/3 and a continued EAGLE-2 draft from
# it (every specialist and fc copied, its token map kept) and train them side by side (one process each) with
# schedules sized to the time left (training.train_budget_minutes), so every schedule runs to its end.
#
#   bash examples/smollm2_drafts/train_drafts_gpu.sh                # defaults below; override with VAR=value
#   BUDGET_SECONDS=0 KINDS="hass poss2" bash examples/smollm2_drafts/train_drafts_gpu.sh   # equal epochs instead
#   KINDS="eagle2c poss2 eagle3 poss2e3 eagle3c" bash examples/smollm2_drafts/train_drafts_gpu.sh   # EAGLE-3 style too
#
# The EAGLE-3-style kinds (as in train_drafts.sh) read target layers [2, 15, 27] from features of their own
# (runs/smollm2-gpu-features-e3): eagle3 starts from the EAGLE-2 draft (warm start), poss2e3 and eagle3c from the
# trained eagle3 draft, so they train in a second round after the first; with a budget the two rounds share the time
# left after stage 1 equally. eagle3pn and poss2e3pn read layers [2, 15, 30] (30: the post-norm feature) from the
# same features and start from the EAGLE-2 draft exactly (first round, lr 1e-4).
#
# The drafts land in runs/smollm2-gpu-KIND/final. Benchmark them on the CPU with train_drafts.sh --bench-only
# (RUNS=runs, edit the labels).
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
KINDS=(${KINDS:-eagle2c hass poss1 poss2 poss3})
FOLLOWUPS=${FOLLOWUPS:-0}           # answered conversations that get a follow-up turn
EXTRA=(${EXTRA:-})                  # more flags for every training run (e.g. "--max_steps 2")
RECIPE=examples/smollm2_drafts/recipe.yaml
START=$(date +%s)
declare -A SHAPE=([eagle2c]="1 1" [hass]="1 6" [poss1]="6 1" [poss2]="3 2" [poss3]="2 3" [eagle3]="1 6" [poss2e3]="3 2"
                  [eagle3c]="1 6" [eagle3pn]="1 6" [poss2e3pn]="3 2")
E3_RECIPE=examples/smollm2_drafts/recipe_eagle3.yaml
is_e3() { case "$1" in eagle3|poss2e3|eagle3c|eagle3pn|poss2e3pn) return 0 ;; *) return 1 ;; esac; }
after_e3() { case "$1" in poss2e3|eagle3c) return 0 ;; *) return 1 ;; esac; }
want_e3=""; round2=""
for kind in "${KINDS[@]}"; do
  [ -n "${SHAPE[$kind]:-}" ] || { echo "unknown kind $kind (${!SHAPE[*]})"; exit 2; }
  is_e3 "$kind" && want_e3=1
  after_e3 "$kind" && round2=1
done
mkdir -p runs/logs

echo "== data ($(date -u +%T))"
$PY examples/smollm2_drafts/make_data.py --device "$DEVICE" --prompts "$PROMPTS" --max-new-tokens "$MAX_NEW_TOKENS" \
  --batch-size "$GEN_BATCH" --prompt-batch-size "$GEN_BATCH" --chunk "$GEN_BATCH" --minutes "$DATA_MINUTES" \
  --followups "$FOLLOWUPS"
# every conversation once, in its two-turn form where make_data.py wrote a follow-up (derived: rebuilt each run)
rm -rf runs/smollm2-gpu-data
$PY examples/smollm2_drafts/split_data.py --out runs/smollm2-gpu-data --seen 0 --heldout 0
DATA_SET=(--train runs/smollm2-gpu-data/train.jsonl.gz)

echo "== features ($(date -u +%T))"
$PY -m transformers_poss train --config "$RECIPE" "${DATA_SET[@]}" --stage features --device "$DEVICE" \
  --features_batch_size 64 --output_dir runs/smollm2-gpu-features
if [ -n "$want_e3" ]; then
  $PY -m transformers_poss train --config "$E3_RECIPE" "${DATA_SET[@]}" --stage features --device "$DEVICE" \
    --features_batch_size 64 --features_dir runs/smollm2-gpu-features-e3 --init_from None \
    --output_dir runs/smollm2-gpu-features-e3-run
fi

echo "== stage 1: EAGLE-2 from random weights, $EPOCHS epochs ($(date -u +%T))"
export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1   # TF32 matmuls for training only; data and features stay exact fp32
$PY -m transformers_poss train --config "$RECIPE" "${DATA_SET[@]}" --device "$DEVICE" \
  --output_dir runs/smollm2-gpu-eagle2 --num_specialists 1 --positions_per_specialist 1 \
  --init_from None --learning_rate 1e-3 --warmup_steps 50 --fc_learning_rate_scale 1 --num_train_epochs "$EPOCHS" \
  --per_device_train_batch_size "$BATCH" --logging_steps 50 --save_steps 100000 \
  --dataloader_num_workers 2 "${EXTRA[@]}" >runs/logs/eagle2.log 2>&1

# one round of kinds side by side: run_round KIND ...
run_round() {
  local kinds=("$@") pids=() kind S N fc from recipe features extra
  if [ "$BUDGET_SECONDS" -gt 0 ]; then
    left=$(( BUDGET_SECONDS - ($(date +%s) - START) - 60 ))   # 60 s for start-up, evaluation and saving
    [ -n "$round2" ] && [ "$ROUND" = 1 ] && left=$(( left / 2 ))   # the second round gets the other half
    minutes=$(awk -v s="$left" 'BEGIN { m = s / 60; if (m < 0.5) m = 0.5; printf "%.2f", m }')
    compute=(--train_budget_minutes "$minutes" --num_train_epochs 100)
  else
    compute=(--num_train_epochs "$EPOCHS")   # equal epochs for every draft
  fi
  echo "== stage 2, round $ROUND: ${kinds[*]}, side by side, ${compute[*]} ($(date -u +%T))"
  for kind in "${kinds[@]}"; do
    read -r S N <<<"${SHAPE[$kind]}"
    fc=0.1; [ $((S * N)) -eq 1 ] && fc=1.0
    from=runs/smollm2-gpu-eagle2/final; recipe=$RECIPE; features=(); extra=()   # recipe.yaml's features_dir
    if is_e3 "$kind"; then
      features=(--features_dir runs/smollm2-gpu-features-e3); recipe=$E3_RECIPE
      extra=(--feature_fc_learning_rate_scale 1.0)
      case "$kind" in poss2e3|poss2e3pn) recipe=examples/smollm2_drafts/recipe_poss2e3.yaml ;; esac
      case "$kind" in eagle3pn|poss2e3pn)   # layers [2, 15, 30] (30: post-norm), a view of the same features
        extra+=(--feature_layers 2 15 30 --feature_fc_init identity --learning_rate 1e-4) ;; esac
      if after_e3 "$kind"; then from=runs/smollm2-gpu-eagle3/final; extra=(--feature_fc_learning_rate_scale $fc); fi
    fi
    $PY -m transformers_poss train --config "$recipe" "${DATA_SET[@]}" --device "$DEVICE" "${features[@]}" \
      --output_dir "runs/smollm2-gpu-$kind" --init_from "$from" \
      --num_specialists "$S" --positions_per_specialist "$N" --fc_learning_rate_scale $fc "${extra[@]}" \
      "${compute[@]}" --per_device_train_batch_size "$BATCH" --logging_steps 50 --save_steps 100000 \
      --dataloader_num_workers 2 "${EXTRA[@]}" >"runs/logs/$kind.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then echo "!! ${kinds[$i]} failed:"; tail -20 "runs/logs/${kinds[$i]}.log"; status=1; fi
  done
}
status=0
first=(); second=()
for kind in "${KINDS[@]}"; do if after_e3 "$kind"; then second+=("$kind"); else first+=("$kind"); fi; done
ROUND=1; [ ${#first[@]} -gt 0 ] && run_round "${first[@]}"
if [ $status -eq 0 ] && [ ${#second[@]} -gt 0 ]; then
  [ -f runs/smollm2-gpu-eagle3/final/config.json ] || { echo "!! ${second[*]} need eagle3 in KINDS"; exit 1; }
  ROUND=2; run_round "${second[@]}"
fi
echo "== done in $(( $(date +%s) - START )) s"
exit $status
