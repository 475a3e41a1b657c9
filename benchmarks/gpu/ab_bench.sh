#!/usr/bin/env bash
# The 48B bench for this tree and for another commit, one after the other in one device call (same card, same
# process conditions): the A/B that BENCHMARKS.md's comparisons rest on.
#   here:        bash benchmarks/gpu/ab_bench.sh prepare COMMIT   # COMMIT's code into ab/before (add /ab/ to
#                                                                 # .git/info/exclude; carry ["wheels", "ab"])
#   on the GPU:  bash benchmarks/gpu/ab_bench.sh run              # writes $OUT/bench_{head,before}.{txt,json}
# BATCHES (default 1,64,256), LONG (default 8192) and T_BENCH (seconds per side, default 175) as in run_h200.sh.
set -uo pipefail
ROOT=$PWD
if [ "${1:-}" = prepare ]; then
  rm -rf ab/before && mkdir -p ab/before
  git archive "${2:?usage: ab_bench.sh prepare COMMIT}" deltaserve benchmarks/configs pyproject.toml | tar -x -C ab/before
  rm -f ab/before/deltaserve/assets/demo-model/*.safetensors  # the bench needs no weights: keep the carry small
  exit 0
fi
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install --no-deps --no-index --target "$ROOT/.gpu/site" wheels/*.whl >/dev/null 2>&1 || echo "wheel install failed"
B="python3 -m deltaserve.entrypoints.cli bench --load-format dummy --device cuda --max-num-batched-tokens 8192
   --config benchmarks/configs/kimi-linear-48b-a3b.json --prompt-len 512 --output-len 32
   --batch-sizes ${BATCHES:-1,64,256} --long-prompt-len ${LONG:-8192}"
for side in head before; do
  echo "== bench $side $(date +%T)"
  dir=$ROOT; [ $side = before ] && dir=$ROOT/ab/before
  (cd "$dir" && PYTHONPATH=$ROOT/.gpu/site:$dir timeout ${T_BENCH:-175} $B --json-out "$OUT/bench_$side.json" \
      > "$OUT/bench_$side.txt" 2>&1)
  grep -A6 "batch  " "$OUT/bench_$side.txt" | cut -c1-130
done
