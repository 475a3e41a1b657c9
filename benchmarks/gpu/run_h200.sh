#!/usr/bin/env bash
# One lease on an H200: install the carried wheels, run the GPU tests, bench the 48B shape (dummy weights),
# and a same-shape, fewer-layers comparison against transformers + fla-core. Writes logs under $OUT.
set -uo pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SRC=${SRC:-$PWD}  # a clean snapshot of the tree may be carried in .gpu/src
export PYTHONPATH=$PWD/.gpu/site:$SRC
cd "$SRC"
python3 -m pip install --no-deps --no-index --target "$OLDPWD/.gpu/site" "$OLDPWD"/wheels/fla_core-0.6.0-py3-none-any.whl \
    "$OLDPWD"/wheels/transformers-5.24.0-py3-none-any.whl >/dev/null 2>&1 || echo "wheel install failed"
python3 -c "import torch, triton, fla, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
CFG=benchmarks/configs/kimi-linear-48b-a3b.json
SMALL=${SMALL:-0}
[ "${TESTS:-}" = none ] || timeout 240 python3 -m pytest -q -p no:logging ${TESTS:-tests/gpu} 2>&1 | grep -v DEBUG | tail -25 | tee "$OUT/gpu_tests.txt"
if [ "$SMALL" = 1 ]; then exit 0; fi
python3 - <<'PY' > "$OUT/cfg4.json"
import json; c = json.load(open("benchmarks/configs/kimi-linear-48b-a3b.json")); c["num_hidden_layers"] = 4
c["linear_attn_config"]["kda_layers"] = [1, 2, 3]; c["linear_attn_config"]["full_attn_layers"] = [4]; print(json.dumps(c))
PY
B="timeout ${BENCH_TIMEOUT:-200} python3 -m deltaserve.entrypoints.cli bench --load-format dummy --device cuda"
$B --config "$OUT/cfg4.json" --batch-sizes 1 --prompt-len 2048 --output-len 32 --max-num-batched-tokens 8192 \
    --json-out "$OUT/bench_4layers.json" 2>&1 | tail -3
python3 benchmarks/gpu/transformers_baseline.py --config $CFG --layers 4 --prompt-len 2048 2>&1 | tail -1 | tee "$OUT/baseline_4layers.json"
$B --config $CFG --batch-sizes ${BATCHES:-1,64,256} --prompt-len 512 --output-len 32 --max-num-batched-tokens 8192 \
    --json-out "$OUT/bench_48b.json" 2>&1 | tail -6
$B --config $CFG --batch-sizes 1 --prompt-len 8192 --output-len 8 --max-num-batched-tokens 8192 \
    --json-out "$OUT/bench_48b_prefill8k.json" 2>&1 | tail -3
