#!/usr/bin/env bash
# Batch-1 decode on the CPU for this tree and for another commit, alternated (ABBA: the side that runs first is
# swapped every round, since this machine class drifts by more than the effects measured), with the same harness
# (this tree's benchmarks/offline_throughput.py) over both packages. Prints each run's TPOT and the medians.
#   bash benchmarks/cpu_ab.sh COMMIT [ROUNDS] [PRESETS]    # e.g. bash benchmarks/cpu_ab.sh a12fb4d 4 small,medium
# COMMIT's package goes to ab/before (add /ab/ to .git/info/exclude). OUTPUT_LEN (default 32), PROMPT_LEN (128) and
# REPEATS (3, the median of each run's batch-1 figure) tune a run.
set -euo pipefail
ROOT=$PWD
COMMIT=${1:?usage: cpu_ab.sh COMMIT [ROUNDS] [PRESETS]}
ROUNDS=${2:-4}
PRESETS=${3:-small,medium}
rm -rf ab/before && mkdir -p ab/before
git archive "$COMMIT" deltaserve pyproject.toml | tar -x -C ab/before
run() {  # run SIDE PRESET: one batch-1 run, its TPOT in ms
  local dir=$ROOT; [ "$1" = before ] && dir=$ROOT/ab/before
  PYTHONPATH=$dir python benchmarks/offline_throughput.py --preset "$2" --skip-transformers --concurrency 1 \
      --prompt-len "${PROMPT_LEN:-128}" --output-len "${OUTPUT_LEN:-32}" --repeats "${REPEATS:-3}" 2>/dev/null |
    tail -n 1 | python -c 'import json, sys; print("%.3f" % json.load(sys.stdin)["results"]["deltaserve"]["tpot_ms"])'
}
for preset in ${PRESETS//,/ }; do
  head_ms=() before_ms=()
  for ((round = 0; round < ROUNDS; round++)); do
    order="head before"; [ $((round % 2)) = 1 ] && order="before head"
    for side in $order; do
      ms=$(run "$side" "$preset")
      echo "$preset round $round $side: $ms ms/token"
      if [ "$side" = head ]; then head_ms+=("$ms"); else before_ms+=("$ms"); fi
    done
  done
  python - "$preset" "${head_ms[*]}" "${before_ms[*]}" <<'PY'
import statistics, sys
preset, head, before = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
h, b = statistics.median(head), statistics.median(before)
print(f"{preset}: median TPOT head {h:.3f} ms, before {b:.3f} ms, head/before {h / b:.3f}")
PY
done
