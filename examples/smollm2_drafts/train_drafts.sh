#!/usr/bin/env bash
# Train EAGLE-2, HASS and PosS-1/2/3 drafts for the embedded SmolLM2-135M-Instruct target on the same
# self-distilled data with the same budget, then compare them in ONE `poss bench` run on MT-Bench.
# Every step resumes, so the script can be stopped and run again across sittings.
#
#   python examples/smollm2_drafts/make_data.py --prompts 6000 --minutes 120   # (repeat until enough data)
#   bash examples/smollm2_drafts/train_drafts.sh [--train-only | --bench-only] [KIND ...]   # default: all five
set -euo pipefail
MODE=all
case "${1:-}" in --train-only) MODE=train; shift ;; --bench-only) MODE=bench; shift ;; esac
cd "$(dirname "$0")/../.."
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
RECIPE=examples/smollm2_drafts/recipe.yaml

declare -A SHAPE=(
  [eagle2]="1 1"   # one layer, trained one step deep (EAGLE-2)
  [hass]="1 6"     # one layer, six harmonised steps (HASS)
  [poss1]="6 1"    # six specialists, one position each
  [poss2]="3 2"    # three specialists, two positions each
  [poss3]="2 3"    # two specialists, three positions each
)
if [ $# -gt 0 ]; then KINDS=("$@"); else KINDS=(eagle2 hass poss1 poss2 poss3); fi

for kind in "${KINDS[@]}"; do
  [ "$MODE" = bench ] && break
  read -r S N <<<"${SHAPE[$kind]}"
  echo "== $kind: S=$S N=$N"
  poss train --config "$RECIPE" --set output_dir="runs/smollm2-$kind" \
    --set draft.num_specialists="$S" --set draft.positions_per_specialist="$N"
done

[ "$MODE" = train ] && exit 0
DRAFTS=()
for kind in "${KINDS[@]}"; do DRAFTS+=(--draft "$kind=runs/smollm2-$kind/final"); done
poss bench --target smollm2-135m-instruct "${DRAFTS[@]}" \
  --questions ../shared/data/mt_bench.jsonl --num-prompts 80 --max-new-tokens 128 \
  --tree-depth 4 --tree-top-k 4 --tree-total-tokens 16 --output runs/smollm2-bench.json
