#!/usr/bin/env bash
# The 48B bench for this tree and for another commit, one after the other in one device call (same card, same
# process conditions): the A/B that BENCHMARKS.md's comparisons rest on.
#   here:        bash benchmarks/gpu/ab_bench.sh prepare COMMIT   # COMMIT's code into ab/before (add /ab/ to
#                                                                 # .git/info/exclude; carry ["wheels", "ab"])
#   on the GPU:  bash benchmarks/gpu/ab_bench.sh run              # writes $OUT/bench_{head,before}.{txt,json}
# BATCHES (default 1,64,256), LONG (default 8192; empty for none) and T_BENCH (seconds per side, default 175) as
# in run_h200.sh; T_FIRST (default T_BENCH) for the call's first process, which compiles fla-core's kernels on a fresh
# machine; T_BEFORE (default T_BENCH) for the before side's processes (a commit without kernels/tuning_cache.py, e.g.
# eff5dd2, autotunes in every process: ~100 s on an H100, so give it ~220 s). CONFIG (default the 48B shape): another config.json, e.g. benchmarks/configs/kimi-linear-48b-a3b-12layers.json
# (the 48B layer shapes in 12 layers, ~45 GB in bf16: fits an 80 GB H100).
# ROUNDS (default 1): rounds of both sides, the side that runs first swapped each round (ABBA; the first process
# measured ~6% more copy bandwidth), each round's files suffixed _rN. FIRST_ROUND (default 0) numbers the rounds from
# there: FIRST_ROUND=1 starts with the before side (a second call that continues the first call's ABBA).
#   on the GPU:  bash benchmarks/gpu/ab_bench.sh resident        # both sides started once and kept resident on the
#                card (benchmarks/gpu/ab_resident.py), ROUNDS (default 3) of ABBA in one call: rows at prompt 512,
#                output 32, BATCHES; the 48B shape in 8 layers on an 80 GB card, 12 on an H200 (CONFIG: another)
set -uo pipefail
ROOT=$PWD
if [ "${1:-}" = prepare ]; then
  rm -rf ab/before && mkdir -p ab/before
  git archive "${2:?usage: ab_bench.sh prepare COMMIT}" deltaserve benchmarks/configs pyproject.toml | tar -x -C ab/before
  rm -f ab/before/deltaserve/assets/demo-model/*.safetensors  # the bench needs no weights: keep the carry small
  # a commit before 2748a7a draws dummy routers that send every token to the same ~85 of 256 experts (BENCHMARKS.md,
  # "Dummy weights' routing"): its batched decode reads a third of the expert weights this tree's does. Give it
  # this tree's routers, so that both sides do the same work and the A/B times the code, not the weights.
  if ! git merge-base --is-ancestor 2748a7a "$2"; then
    git diff 2748a7a^ 2748a7a -- deltaserve/loader/model_loader.py | patch -s -p1 -d ab/before || exit 1
  fi
  exit 0
fi
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LONG=${LONG-8192}  # LONG= (empty): no long-prompt row
python3 -m pip install --no-deps --no-index --target "$ROOT/.gpu/site" wheels/*.whl >/dev/null 2>&1 || echo "wheel install failed"
if [ "${1:-}" = resident ]; then  # both sides resident on the card, ROUNDS (default 3) of ABBA in one call
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  layers=8; [ "$mem" -ge 100000 ] && layers=12  # two copies: 8 layers (~30 GB each) on an H100, 12 on an H200
  PYTHONPATH=$ROOT/.gpu/site:$ROOT python3 benchmarks/gpu/ab_resident.py --tree head=$ROOT --tree before=$ROOT/ab/before \
      --rounds ${ROUNDS:-3} --model ${CONFIG:-benchmarks/configs/kimi-linear-48b-a3b-${layers}layers.json} \
      --device cuda --batch-sizes ${BATCHES:-1,64,256} --log-dir "$OUT" --json-out "$OUT/ab_resident.json"
  exit $?
fi
B="python3 -m deltaserve.entrypoints.cli bench --load-format dummy --device cuda --max-num-batched-tokens 8192
   --config $ROOT/${CONFIG:-benchmarks/configs/kimi-linear-48b-a3b.json} --prompt-len 512 --output-len 32
   --batch-sizes ${BATCHES:-1,64,256} ${LONG:+--long-prompt-len $LONG}"
for ((round = ${FIRST_ROUND:-0}; round < ${FIRST_ROUND:-0} + ${ROUNDS:-1}; round++)); do
  order="head before"; [ $((round % 2)) = 1 ] && order="before head"
  suffix=""; [ "${ROUNDS:-1}" -gt 1 ] || [ "${FIRST_ROUND:-0}" -gt 0 ] && suffix="_r$round"
  for side in $order; do
    echo "== bench $side round $round $(date +%T)"
    dir=$ROOT; [ $side = before ] && dir=$ROOT/ab/before
    limit=${T_BENCH:-175}; [ $side = before ] && limit=${T_BEFORE:-$limit}
    [ -z "${started:-}" ] && limit=${T_FIRST:-$limit}; started=1
    (cd "$dir" && PYTHONPATH=$ROOT/.gpu/site:$dir timeout $limit $B \
        --json-out "$OUT/bench_$side$suffix.json" > "$OUT/bench_$side$suffix.txt" 2>&1)
    grep -A6 "batch  " "$OUT/bench_$side$suffix.txt" | cut -c1-130; echo "ended $(date +%T)"
  done
done
cp ~/.cache/deltaserve/autotune/*.json "$OUT/" 2>/dev/null  # the card's tuning decisions, to ship as a table (issue 26)
