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
# Kinds: eagle2 (stage 1), eagle2c, hass, poss1, poss2, poss3, and the EAGLE-3-style ones, which read three target
# layers ([2, 15, 27], multi-layer features computed once into RUNS/smollm2-features-e3, same conversations):
#   eagle3   one layer, six unrolled steps, token loss only (recipe_eagle3.yaml), warm-started from BASE
#   poss2e3  PosS-2 on EAGLE-3: 3 specialists x 2 positions started from the trained eagle3 draft (recipe_poss2e3.yaml)
#   eagle3c  the eagle3 draft continued for the same compute as poss2e3 (the fair baseline for it)
# poss2e3 and eagle3c start from RUNS/smollm2-eagle3/final: after eagle3 in the same call, or in a later one
# (`--train-only eagle3`, then `--train-only poss2e3 eagle3c`). Two more read layers [2, 15, 30] instead, 30 being
# the post-norm feature (a view of the same feature folder): with feature_fc the identity on it they start exactly as
# BASE, so they get the same compute from BASE as eagle2c / hass / poss2, with EAGLE-3's objective:
#   eagle3pn   one layer, six unrolled steps, token loss only
#   poss2e3pn  3 specialists x 2 positions, EAGLE-3's objective
#
# Compute per draft: the continued EAGLE-2 draft gets as many unrolled draft steps as a six-step draft (6 optimiser
# steps for each of theirs, same batch), chosen one of two ways:
#   EPOCHS=E          six-step drafts train E epochs, the continued EAGLE-2 draft 6 x E epochs; the default, E = 1
#   BUDGET_MINUTES=M  six-step drafts size their schedule to M minutes (train_budget_minutes, at most EPOCHS
#                     epochs); the continued EAGLE-2 draft then trains 6 x the steps the first of them chose
# Other settings: RUNS (run folders, outside the work tree), MAX_CONVERSATIONS (a prefix of the data), LR, FC_LR_SCALE,
# THREADS (torch threads per training process; the kinds train side by side), PROMPTS and MAX_NEW_TOKENS (the bench).
# Training on the whole data set with a held-out split no shipped draft saw (split_data.py), stage 1 included:
#   SPLIT=FOLDER          train on FOLDER/train.jsonl.gz (follow-up turns included), measure on FOLDER/heldout.jsonl.gz
#                         (written by split_data.py on the first call); features go to RUNS/smollm2-features-split
#   STAGE1_FROM=DRAFT     stage 1 continues DRAFT (e.g. the shipped EAGLE-2 draft) instead of starting from random
#                         weights: STAGE1_EPOCHS (default 2; 8 from random) at STAGE1_LR (default 5e-4; 1e-3 from random);
#                         the held-out table and the bench then show DRAFT too, as eagle2-start
#   FEATURES_AUTOCAST=1   target features under bf16 autocast (about 1.7x faster on CPUs with bf16 units; see
#                         docs/training.md); every run of the call reads them
#   SPLIT=~/.cache/transformers-poss/runs/split STAGE1_FROM=drafts/eagle2-smollm2-135m-instruct FEATURES_AUTOCAST=1 \
#     BASE=~/.cache/transformers-poss/runs/smollm2-eagle2-full bash examples/smollm2_drafts/train_drafts.sh \
#     --train-only poss2 poss3 eagle2c
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
# stage-2 learning rate: 1e-4 keeps the EAGLE-2 start's position-1 accuracy (within 0.003) and gains at positions
# 2-6 (held-out); at 5e-4 (the [2, 15, 27] kinds and the earlier PosS-2 were trained so: LR=5.0e-4) all lost at 1
LR=${LR:-1.0e-4}
FC_LR_SCALE=${FC_LR_SCALE:-0.1}
THREADS=${THREADS:-1}
PROMPTS=${PROMPTS:-24}   # MT-Bench questions in the benchmark (80: all of them)
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-96}
declare -A SHAPE=(
  [eagle2]="1 1"    # one layer, one step, from random weights (stage 1; skipped when BASE exists)
  [eagle2c]="1 1"   # the EAGLE-2 draft continued for the same compute as the others
  [hass]="1 6"      # one layer, six harmonised steps
  [poss1]="6 1"     # six specialists, one position each
  [poss2]="3 2"     # three specialists, two positions each
  [poss3]="2 3"     # two specialists, three positions each
  [eagle3]="1 6"    # EAGLE-3 style: one layer, six steps of training-time test, three target layers
  [poss2e3]="3 2"   # PosS-2 on the EAGLE-3-style draft
  [eagle3c]="1 6"   # the EAGLE-3-style draft continued
  [eagle3pn]="1 6"  # EAGLE-3 style on layers [2, 15, 30], from BASE
  [poss2e3pn]="3 2" # PosS-2 on layers [2, 15, 30], from BASE
)
E3_RECIPE=examples/smollm2_drafts/recipe_eagle3.yaml
E3_FEATURES="$RUNS/smollm2-features-e3"
E3_FINAL="$RUNS/smollm2-eagle3/final"
is_e3() { case "$1" in eagle3|poss2e3|eagle3c|eagle3pn|poss2e3pn) return 0 ;; *) return 1 ;; esac; }
post_norm_e3() { case "$1" in eagle3pn|poss2e3pn) return 0 ;; *) return 1 ;; esac; }   # layers [2, 15, 30]
after_e3() { case "$1" in poss2e3|eagle3c) return 0 ;; *) return 1 ;; esac; }   # start from the trained eagle3 draft
recipe_of() { case "$1" in poss2e3|poss2e3pn) echo examples/smollm2_drafts/recipe_poss2e3.yaml ;;
  eagle3|eagle3c|eagle3pn) echo "$E3_RECIPE" ;;
  *) echo "$RECIPE" ;; esac; }
if [ $# -gt 0 ]; then KINDS=("$@"); else KINDS=(eagle2c hass poss2); fi
for kind in "${KINDS[@]}"; do [ -n "${SHAPE[$kind]:-}" ] || { echo "unknown kind $kind (${!SHAPE[*]})"; exit 2; }; done
LIMIT=(); [ -n "$MAX_CONVERSATIONS" ] && LIMIT=(--max_conversations "$MAX_CONVERSATIONS")
SPLIT=${SPLIT:-}; STAGE1_FROM=${STAGE1_FROM:-}; FEATURES_AUTOCAST=${FEATURES_AUTOCAST:-}
FEATURES="$RUNS/smollm2-features"
if [ -n "$SPLIT" ]; then
  python examples/smollm2_drafts/split_data.py --out "$SPLIT"   # leaves an existing split as it is
  LIMIT+=(--train "$SPLIT/train.jsonl.gz" --eval "$SPLIT/heldout.jsonl.gz"); FEATURES="$RUNS/smollm2-features-split"
fi
[ -n "$FEATURES_AUTOCAST" ] && LIMIT+=(--features_autocast true)
COMMON=(--config "$RECIPE" --features_dir "$FEATURES" "${LIMIT[@]}")
mkdir -p "$RUNS/logs"
want_e2=""; want_e3=""; SHOWN=("${KINDS[@]}")   # SHOWN: the kinds evaluated and benchmarked
for kind in "${KINDS[@]}"; do if is_e3 "$kind"; then want_e3=1; else want_e2=1; fi; done
if [ -n "$want_e3" ] && [[ " ${KINDS[*]} " != *" eagle3 "* ]] && [ -f "$E3_FINAL/config.json" ]; then
  SHOWN=(eagle3 "${SHOWN[@]}")   # the drafts started from eagle3 are shown beside it
fi

if [ "$MODE" != bench ]; then
  STAGE1_RUN="$RUNS/smollm2-eagle2${STAGE1_FROM:+-continued}"   # a continued run never resumes a from-scratch one
  if [ -n "$STAGE1_FROM" ] && [ -f "$BASE/config.json" ] && [ ! -f "$STAGE1_RUN/final/config.json" ]; then
    echo "!! STAGE1_FROM writes stage 1 into BASE, and $BASE already holds a draft: set BASE to a new folder"; exit 2
  fi
  if [ ! -f "$BASE/config.json" ]; then
    if [ -n "$STAGE1_FROM" ]; then
      start=(--init_from "$STAGE1_FROM" --learning_rate "${STAGE1_LR:-5e-4}" --num_train_epochs "${STAGE1_EPOCHS:-2}")
    else
      start=(--init_from None --learning_rate "${STAGE1_LR:-1e-3}" --num_train_epochs "${STAGE1_EPOCHS:-8}")
    fi
    echo "== stage 1: EAGLE-2 from ${STAGE1_FROM:-random weights}, ${start[*]:2} -> $BASE"
    poss train "${COMMON[@]}" --output_dir "$STAGE1_RUN" --num_specialists 1 --positions_per_specialist 1 \
      "${start[@]}" --warmup_steps 50 --fc_learning_rate_scale 1 >"$RUNS/logs/eagle2.log" 2>&1 \
      || { echo "!! stage 1 failed:"; tail -20 "$RUNS/logs/eagle2.log"; exit 1; }
    mkdir -p "$BASE" && cp "$STAGE1_RUN/final/"* "$BASE/"
  fi
  if [ -n "$want_e2" ]; then
    echo "== features (computed once, shared by every single-feature draft)"
    poss train "${COMMON[@]}" --output_dir "$RUNS/smollm2-features-run" --stage features
  fi
  if [ -n "$want_e3" ]; then
    echo "== multi-layer features [2, 15, 27] + post-norm (computed once, shared by the EAGLE-3-style drafts)"
    poss train --config "$E3_RECIPE" --features_dir "$E3_FEATURES" "${LIMIT[@]}" --init_from "$BASE" \
      --output_dir "$RUNS/smollm2-features-e3-run" --stage features
  fi
  status=0
  # phase 1: the kinds that start from BASE; phase 2: those that start from the trained eagle3 draft
  for phase in 1 2; do
    phase_kinds=()
    for kind in "${KINDS[@]}"; do
      if { [ "$phase" = 1 ] && ! after_e3 "$kind"; } || { [ "$phase" = 2 ] && after_e3 "$kind"; }; then phase_kinds+=("$kind"); fi
    done
    [ ${#phase_kinds[@]} -gt 0 ] || continue
    if [ "$phase" = 2 ] && [ ! -f "$E3_FINAL/config.json" ]; then
      echo "!! ${phase_kinds[*]} start from $E3_FINAL: train eagle3 first (train_drafts.sh --train-only eagle3)"; exit 1
    fi
    pids=(); names=()
    first_deep=""
    for kind in $(for k in "${phase_kinds[@]}"; do read -r S N <<<"${SHAPE[$k]}"; echo "$((S * N)) $k"; done | sort -rn | cut -d' ' -f2); do
      read -r S N <<<"${SHAPE[$kind]}"
      if [ $((S * N)) -gt 1 ]; then
        if [ -n "$BUDGET_MINUTES" ]; then
          compute=(--train_budget_minutes "$BUDGET_MINUTES" --num_train_epochs "$EPOCHS")
        else
          compute=(--num_train_epochs "$EPOCHS")
        fi
        [ -z "$first_deep" ] && first_deep=$kind
        fc=$FC_LR_SCALE
      else
        if [ -n "$BUDGET_MINUTES" ] && [ -n "$first_deep" ]; then
          schedule="$RUNS/smollm2-$first_deep/schedule.json"
          while [ ! -f "$schedule" ]; do sleep 10; done   # written once the six-step draft has timed its batches
          steps=$(python -c "import json; print(6 * json.load(open('$schedule'))['max_steps'])")
          compute=(--max_steps "$steps")
        else
          compute=(--num_train_epochs "$(awk -v e="$EPOCHS" 'BEGIN { print 6 * e }')")
        fi
        fc=1.0   # a one-step draft has no later steps pulling on fc
      fi
      from=$BASE; features=$FEATURES; extra=()
      if is_e3 "$kind"; then
        features=$E3_FEATURES
        if after_e3 "$kind"; then
          from=$E3_FINAL; extra=(--feature_fc_learning_rate_scale "$fc")   # trained feature_fc: as slow as fc
        else
          extra=(--feature_fc_learning_rate_scale 1.0)   # the warm start's new feature_fc learns at the full rate
        fi
        if post_norm_e3 "$kind"; then
          extra+=(--feature_layers 2 15 30 --feature_fc_init identity)   # starts exactly as BASE
        fi
      fi
      echo "== stage 2: $kind (S=$S N=$N) from $from, ${compute[*]}, fc lr x $fc"
      OMP_NUM_THREADS=$THREADS poss train --config "$(recipe_of "$kind")" --features_dir "$features" "${LIMIT[@]}" \
        --output_dir "$RUNS/smollm2-$kind" --num_specialists "$S" --positions_per_specialist "$N" --init_from "$from" \
        --learning_rate "$LR" --warmup_steps 20 --fc_learning_rate_scale "$fc" "${extra[@]}" \
        "${compute[@]}" >"$RUNS/logs/$kind.log" 2>&1 &
      pids+=($!); names+=("$kind")
      sleep 30   # one process at a time checks the shared feature shards
    done
    for i in "${!pids[@]}"; do
      if ! wait "${pids[$i]}"; then echo "!! ${names[$i]} failed:"; tail -20 "$RUNS/logs/${names[$i]}.log"; status=1; fi
    done
    [ $status -eq 0 ] || exit $status
  done
  echo "== held-out accuracy by position"
  LABELS=(); HELDOUT=()
  if [ -f "$FEATURES/eval/features.json" ]; then   # the single-feature drafts and the eagle2 baseline
    LABELS+=("eagle2=$BASE"); HELDOUT+=(--features "$FEATURES/eval")
    [ -n "$STAGE1_FROM" ] && LABELS=("eagle2-start=$STAGE1_FROM" "${LABELS[@]}")   # stage 1 before and after
  fi
  [ -n "$want_e3" ] && HELDOUT+=(--features "$E3_FEATURES/eval")   # the same held-out conversations, three layers
  for kind in "${SHOWN[@]}"; do LABELS+=("$kind=$RUNS/smollm2-$kind/final"); done
  python examples/smollm2_drafts/eval_drafts.py "${HELDOUT[@]}" "${LABELS[@]}" \
    --output "$RUNS/heldout.json" --plot "$RUNS/heldout.png"
fi
[ "$MODE" = train ] && exit 0
# one greedy run on MT-Bench, int8: every draft with the fixed 16-node tree (depth 6, top-k 4) and with its automatic
# budget (at most 16 nodes), each output checked against plain decoding of the same int8 target
DRAFTS=(--draft "eagle2=$BASE"); [ -n "$STAGE1_FROM" ] && DRAFTS=(--draft "eagle2-start=$STAGE1_FROM" "${DRAFTS[@]}")
for kind in "${SHOWN[@]}"; do DRAFTS+=(--draft "$kind=$RUNS/smollm2-$kind/final"); done
poss bench --target smollm2-135m-instruct "${DRAFTS[@]}" --quantize int8 \
  --questions ../shared/data/mt_bench.jsonl --num-prompts "$PROMPTS" --max-new-tokens "$MAX_NEW_TOKENS" \
  --sweep --sweep-depths 6 --sweep-total-tokens 16,auto --no-sweep-chains --tree-top-k 4 \
  --output "$RUNS/smollm2-bench.json"
