#!/usr/bin/env bash
# Batch-1 TPOT at long contexts with the paged MLA decode kernel's default launch and with candidate knobs
# (benchmarks/gpu/with_mla_knobs.py), one process each, alternated (issue 24). After run_h200.sh has installed the
# wheels (STAGES=none does only that). MLA_KNOBS: the candidate (JSON); MLA_LENS: the long prompts;
# CONFIG: the model shape; ROUNDS: how many baseline/candidate pairs.
set -uo pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/.gpu/site:$PWD
CFG=${CONFIG:-benchmarks/configs/kimi-linear-48b-a3b.json}
KNOBS=${MLA_KNOBS:-'{"max_head_block": 32}'}  # at batch 1, 32 heads a program (the default: 16)
for round in $(seq 1 "${ROUNDS:-1}"); do
  for name in default candidate; do
    knobs='{}'; [ "$name" = candidate ] && knobs=$KNOBS
    timeout "${T_E2E:-150}" python3 benchmarks/gpu/with_mla_knobs.py "$knobs" bench --config "$CFG" --load-format dummy \
        --device cuda --max-num-batched-tokens 8192 --batch-sizes 1 --prompt-len 512 --output-len 32 \
        --long-prompt-len "${MLA_LENS:-262144}" --json-out "$OUT/mla_e2e_${name}_$round.json" \
        > "$OUT/mla_e2e_${name}_$round.txt" 2>&1
    echo "$name (round $round): $knobs"; grep -A4 "batch  " "$OUT/mla_e2e_${name}_$round.txt" | cut -c1-130
  done
done
