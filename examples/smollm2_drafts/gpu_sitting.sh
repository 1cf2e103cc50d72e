#!/usr/bin/env bash
# The shipped SmolLM2 drafts, continued in one short GPU sitting (a time budget of minutes, not hours):
#   1. split: the same 200 held-out conversations as on the CPU (split_data.py, seed 0);
#   2. data: the target answers as many prompts as DATA_MIN minutes allow (make_data.py, bf16, batch GEN_BATCH),
#      first those written earlier and not yet answered, then new ones it writes, up to NEW_PROMPTS beyond the
#      answered conversations; appended to data/smollm2-135m-instruct/;
#   3. features of every training conversation (old and new) and of the held-out ones, bf16 autocast;
#   4. stage 1: the EAGLE-2 draft START continued at lr 5e-4, its cosine schedule sized to its share of the time;
#   5. stage 2: PosS-3, PosS-2 and EAGLE-2 continued, all from the stage-1 draft, side by side for the same wall time
#      (lr 1e-4, fc at 0.1 x for the six-step kinds), each schedule sized to the time left.
# Every stage is timed from the start of the script so that the whole sitting ends near END_S seconds. A draft's step
# is timed before the other two trainings load the GPU, so the six-step drafts size their schedules to 1 / SHARE of
# the stage's time (SHARE: how much slower a step runs with three trainings on the GPU) and every training stops at
# 1.15 x the stage's time (max_train_minutes). The drafts land in RUNS/KIND/final (float32); with OUT set, each is
# also written there in bf16 as it is shipped, as soon as its stage ends.
#
#   bash examples/smollm2_drafts/gpu_sitting.sh                         # START=drafts/eagle2-smollm2-135m-instruct
#   END_S=900 DATA_MIN=4 NEW_PROMPTS=12000 bash examples/smollm2_drafts/gpu_sitting.sh
#   DEVICE=cpu SMALL=1 NEW_PROMPTS=8 GEN_BATCH=8 bash examples/smollm2_drafts/gpu_sitting.sh   # a rehearsal
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
log() { echo "== [$(el)s $(date -u +%T)] $*"; }
DEVICE=${DEVICE:-cuda}; R=${RUNS:-$HOME/.cache/transformers-poss/runs/gpu-sitting}; OUT=${OUT:-}
END_S=${END_S:-475}; DATA_MIN=${DATA_MIN:-1.5}; NEW_PROMPTS=${NEW_PROMPTS:-6000}; GEN_BATCH=${GEN_BATCH:-2048}
SMALL=${SMALL:-}; START=${START:-drafts/eagle2-smollm2-135m-instruct}; BATCH=${BATCH:-32}; BATCH2=${BATCH2:-$BATCH}
SHARE=${SHARE:-2}
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$R/logs"
RECIPE=examples/smollm2_drafts/recipe.yaml
DATA=data/smollm2-135m-instruct
OLD=$(zcat $DATA/conversations.jsonl.gz | wc -l)
LIMIT=(); STEPS1=(); STEPS2=()
if [ -n "$SMALL" ]; then LIMIT=(--max_conversations 96); STEPS1=(--max_steps 3); STEPS2=(--max_steps 3); fi
budget() {  # MINUTES [SHARE]: a schedule sized to MINUTES / SHARE of a step timed alone, stopped at 1.15 x MINUTES
  awk -v m="$1" -v s="${2:-1}" \
    'BEGIN { printf "--train_budget_minutes %.2f --max_train_minutes %.2f", m / s, m * 1.15 + 0.2 }'
}
ship() {  # KIND: RUNS/KIND/final in bf16 (as shipped) under OUT/KIND, saved by the draft itself (card included)
  [ -n "$OUT" ] || return 0
  rm -rf "${OUT:?}/$1" && mkdir -p "$OUT" && $PY -c "import sys, torch; from transformers_poss import PosSDraftModel
PosSDraftModel.from_pretrained(sys.argv[1]).to(torch.bfloat16).save_pretrained(sys.argv[2])" "$R/$1/final" "$OUT/$1" \
    && log "shipped $1 to $OUT/$1"
}

log "split (the held-out conversations of the CPU runs)"
$PY examples/smollm2_drafts/split_data.py --out "$R/split" || exit 1

log "data: +$NEW_PROMPTS prompts over $OLD conversations, batch $GEN_BATCH, at most $DATA_MIN min"
$PY examples/smollm2_drafts/make_data.py --device "$DEVICE" --precision bfloat16 --prompts $((OLD + NEW_PROMPTS)) \
  --max-new-tokens 384 --batch-size "$GEN_BATCH" --prompt-batch-size "$GEN_BATCH" --chunk "$GEN_BATCH" \
  --minutes "$DATA_MIN" >"$R/logs/data.log" 2>&1 || { tail -20 "$R/logs/data.log"; exit 1; }
grep '^\[data\]' "$R/logs/data.log" | tail -3
$PY - "$OLD" "$DATA/conversations.jsonl" "$R/new.jsonl" <<'PYEOF'
import json, sys
old, answers, new = int(sys.argv[1]), sys.argv[2], sys.argv[3]
fresh = [line for line in open(answers, encoding="utf-8") if line.strip() and json.loads(line)["id"] >= old]
open(new, "w", encoding="utf-8").writelines(fresh)
print(f"new conversations: {len(fresh)}")
PYEOF
TRAIN=(--train "$R/split/train.jsonl.gz"); [ -s "$R/new.jsonl" ] && TRAIN+=("$R/new.jsonl")
COMMON=(--config "$RECIPE" "${TRAIN[@]}" --eval "$R/split/heldout.jsonl.gz" --features_dir "$R/features"
        --features_autocast true --device "$DEVICE" --init_from "$START" "${LIMIT[@]}")

log "features"
$PY -m transformers_poss train "${COMMON[@]}" --stage features --features_batch_size 128 \
  --output_dir "$R/features-run" >"$R/logs/features.log" 2>&1 || { tail -30 "$R/logs/features.log"; exit 1; }

left=$(( END_S - $(el) - 20 ))
B1=$(awk -v s="$left" 'BEGIN { m = (0.42 * s - 25) / 60; if (m < 0.3) m = 0.3; printf "%.2f", m }')
log "stage 1: EAGLE-2 from $START, $B1 min (lr 5e-4, batch $BATCH)"
# shellcheck disable=SC2046
$PY -m transformers_poss train "${COMMON[@]}" --output_dir "$R/eagle2" --num_specialists 1 \
  --positions_per_specialist 1 --learning_rate 5e-4 --warmup_steps 50 --fc_learning_rate_scale 1 $(budget "$B1") \
  --num_train_epochs 20 --per_device_train_batch_size "$BATCH" --logging_steps 100 --save_steps 100000 \
  --dataloader_num_workers 4 "${STEPS1[@]}" >"$R/logs/eagle2.log" 2>&1 || { tail -30 "$R/logs/eagle2.log"; exit 1; }
grep -E "train_budget_minutes|eval_acc_1" "$R/logs/eagle2.log" | tail -2
ship eagle2

left=$(( END_S - $(el) - 15 ))
B2=$(awk -v s="$left" 'BEGIN { m = (s - 30) / 60; if (m < 0.3) m = 0.3; printf "%.2f", m }')
log "stage 2: poss3 poss2 eagle2c side by side from stage 1, $B2 min each (lr 1e-4, batch $BATCH2)"
pids=(); kinds=(poss3 poss2 eagle2c)
declare -A SHAPE=([eagle2c]="1 1" [poss2]="3 2" [poss3]="2 3")
for kind in "${kinds[@]}"; do
  read -r S N <<<"${SHAPE[$kind]}"; fc=0.1; share=$SHARE; [ $((S * N)) -eq 1 ] && fc=1.0 && share=1
  # shellcheck disable=SC2046
  $PY -m transformers_poss train "${COMMON[@]}" --output_dir "$R/$kind" --init_from "$R/eagle2/final" \
    --num_specialists "$S" --positions_per_specialist "$N" --learning_rate 1e-4 --warmup_steps 20 \
    --fc_learning_rate_scale $fc $(budget "$B2" "$share") --num_train_epochs 20 \
    --per_device_train_batch_size "$BATCH2" \
    --logging_steps 100 --save_steps 100000 --dataloader_num_workers 4 "${STEPS2[@]}" >"$R/logs/$kind.log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then grep -E "train_budget_minutes|eval_acc_1" "$R/logs/${kinds[$i]}.log" | tail -2
    ship "${kinds[$i]}"
  else log "!! ${kinds[$i]} failed"; tail -20 "$R/logs/${kinds[$i]}.log"; status=1; fi
done
log "done: drafts in $R/{eagle2,poss3,poss2,eagle2c}/final"
log "held-out accuracy: eval_drafts.py --features $R/features/eval LABEL=FOLDER ..."
exit $status
