#!/usr/bin/env bash
# The paper's recipe for the embedded SmolLM2-135M-Instruct target, on the CPU over as many sittings as it takes:
#   1. an EAGLE-2 draft (one layer, one step) is trained first (or taken from drafts/eagle2-smollm2-135m-instruct);
#   2. HASS and PosS-1/2/3 start from it: every specialist and fc are copied from the EAGLE-2 layer and its
#      reduced-vocabulary map is kept (draft.init_from), then trained with a schedule that always runs to its end;
#   3. the EAGLE-2 draft is continued for the same extra compute, so the comparison is fair;
#   4. one `poss bench` run on MT-Bench compares them (every output checked against plain decoding).
# Every stage resumes (features, checkpoints, the chosen schedule), so stop and rerun at will.
#
#   bash examples/smollm2_drafts/train_drafts.sh [--train-only | --bench-only] [KIND ...]   # default: eagle2c hass poss2
#
# Compute per draft, one of:
#   EPOCHS=E          six-step drafts train E epochs, the continued EAGLE-2 draft 6 x E epochs (the same number of
#                     unrolled draft steps per token); the default, E = 1
#   BUDGET_MINUTES=M  every draft gets M minutes of wall time; its schedule is sized to fit (train_budget_minutes)
# Other settings: RUNS (run folders, outside the work tree), MAX_CONVERSATIONS (a prefix of the data), LR, FC_LR_SCALE,
# THREADS (torch threads per training process; the kinds train side by side).
set -euo pipefail
MODE=all
case "${1:-}" in --train-only) MODE=train; shift ;; --bench-only) MODE=bench; shift ;; esac
cd "$(dirname "$0")/../.."
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
RECIPE=examples/smollm2_drafts/recipe.yaml
RUNS=${RUNS:-$HOME/.cache/transformers-poss/runs}
BASE=${BASE:-drafts/eagle2-smollm2-135m-instruct}   # the trained EAGLE-2 draft every other draft starts from
EPOCHS=${EPOCHS:-1}
BUDGET_MINUTES=${BUDGET_MINUTES:-}
MAX_CONVERSATIONS=${MAX_CONVERSATIONS:-}   # empty: all of the data
LR=${LR:-5.0e-4}
FC_LR_SCALE=${FC_LR_SCALE:-0.1}
THREADS=${THREADS:-1}
PROMPTS=${PROMPTS:-24}
declare -A SHAPE=(
  [eagle2]="1 1"    # one layer, one step, from random weights (stage 1; skipped when BASE exists)
  [eagle2c]="1 1"   # the EAGLE-2 draft continued for the same compute as the others
  [hass]="1 6"      # one layer, six harmonised steps
  [poss1]="6 1"     # six specialists, one position each
  [poss2]="3 2"     # three specialists, two positions each
  [poss3]="2 3"     # two specialists, three positions each
)
if [ $# -gt 0 ]; then KINDS=("$@"); else KINDS=(eagle2c hass poss2); fi
COMMON=(--config "$RECIPE" --features_dir "$RUNS/smollm2-features")
[ -n "$MAX_CONVERSATIONS" ] && COMMON+=(--max_conversations "$MAX_CONVERSATIONS")
mkdir -p "$RUNS/logs"

if [ "$MODE" != bench ]; then
  if [ ! -f "$BASE/config.json" ]; then
    echo "== stage 1: EAGLE-2 from random weights -> $BASE"
    poss train "${COMMON[@]}" --output_dir "$RUNS/smollm2-eagle2" --num_specialists 1 --positions_per_specialist 1 \
      --init_from None --learning_rate 1e-3 --warmup_steps 50 --fc_learning_rate_scale 1 --num_train_epochs 8
    mkdir -p "$BASE" && cp "$RUNS/smollm2-eagle2/final/"* "$BASE/"
  fi
  echo "== features (computed once, shared by every draft)"
  poss train "${COMMON[@]}" --output_dir "$RUNS/smollm2-features-run" --stage features
  pids=()
  for kind in "${KINDS[@]}"; do
    read -r S N <<<"${SHAPE[$kind]}"
    if [ -n "$BUDGET_MINUTES" ]; then
      compute=(--train_budget_minutes "$BUDGET_MINUTES" --num_train_epochs 100)
    else
      epochs=$EPOCHS; [ $((S * N)) -eq 1 ] && epochs=$(awk -v e="$EPOCHS" 'BEGIN { print 6 * e }')
      compute=(--num_train_epochs "$epochs")
    fi
    fc=$FC_LR_SCALE; [ $((S * N)) -eq 1 ] && fc=1.0   # a one-step draft has no later steps pulling on fc
    echo "== stage 2: $kind (S=$S N=$N) from $BASE, ${compute[*]}, fc lr x $fc"
    OMP_NUM_THREADS=$THREADS poss train "${COMMON[@]}" --output_dir "$RUNS/smollm2-$kind" \
      --num_specialists "$S" --positions_per_specialist "$N" --init_from "$BASE" \
      --learning_rate "$LR" --warmup_steps 20 --fc_learning_rate_scale "$fc" \
      "${compute[@]}" >"$RUNS/logs/$kind.log" 2>&1 &
    pids+=($!)
  done
  status=0
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then echo "!! ${KINDS[$i]} failed:"; tail -20 "$RUNS/logs/${KINDS[$i]}.log"; status=1; fi
  done
  [ $status -eq 0 ] || exit $status
  echo "== held-out accuracy by position"
  LABELS=("eagle2=$BASE"); for kind in "${KINDS[@]}"; do LABELS+=("$kind=$RUNS/smollm2-$kind/final"); done
  python examples/smollm2_drafts/eval_drafts.py --features "$RUNS/smollm2-features/eval" "${LABELS[@]}" \
    --output "$RUNS/heldout.json" --plot "$RUNS/heldout.png"
fi
[ "$MODE" = train ] && exit 0
DRAFTS=(); for kind in "${KINDS[@]}"; do DRAFTS+=(--draft "$kind=$RUNS/smollm2-$kind/final"); done
poss bench --target smollm2-135m-instruct "${DRAFTS[@]}" --quantize int8 \
  --questions ../shared/data/mt_bench.jsonl --num-prompts "$PROMPTS" --max-new-tokens 96 \
  --tree-depth 6 --tree-top-k 4 --tree-total-tokens 16 --output "$RUNS/smollm2-bench.json"
