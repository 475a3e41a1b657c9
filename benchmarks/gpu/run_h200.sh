#!/usr/bin/env bash
# One lease on an H200: install the carried wheels, then the stages named in STAGES (default: all), each writing
# its log under $OUT:
#   tests     tests/gpu (kernels against their twins, float32 GPU = CPU, FP8 GPU = CPU fallback), one pytest a file
#   (in this order:) tests, kernels, bench, fp8, pdl, async, normgemv, parity, profile, prefill, baseline
#   kernels   benchmarks/gpu/kernels_bench.py: MLA decode, MLA prefill, FP8 experts, the decode experts' tiles, the
#             dense GEMV, the router, norms inside GEMVs and the norms' kernels against torch.compile (KPARTS: a
#             comma-separated subset of those parts)
#   longparity  bfloat16 against a float32 golden (both on the GPU) at a 128k-token context: the demo model (its
#             length limit raised) and the random ~0.5B `medium` model of benchmarks/offline_throughput.py, 2 prompts
#             of 131,072 tokens x 64 teacher-forced positions each (T_PARITY a command)
#   parity    the demo model: bfloat16 on the GPU against a float32 golden captured on the GPU, 8 prompts x 64
#             tokens, and 4 random prompts of 32k tokens x 128 (the demo's config.json raised past its 4k limit)
#   bench     the 48B shape (dummy weights), bf16: batch 1, 64, 256 at prompt 512, and one 8k-token prompt
#   fp8       the 48B shape with --quantization fp8 at 51% of the card's memory (an 80 GB H100's share)
#   pdl       batch-1 bench with programmatic dependent launch (the default) and without (DELTASERVE_PDL=0); the
#             second recompiles every Triton kernel (PDL is a compile-time constant): over 100 s of engine start
#   async     batch 1 with asynchronous scheduling and without, alternated on one engine (async_ab.py): the same
#             greedy tokens, and TPOT each way
#   normgemv  batch 1 (and 16) with the norms inside the GEMVs (the default) and apart (DELTASERVE_NORM_GEMV=0),
#             one process each
#   profile   kernel time of a batch-1 decode step, bf16 (and fp8)
#   prefill   one 8k-token prompt, bf16, alone
#   baseline  4 layers (3 KDA + 1 MLA) of the 48B shape: deltaserve and transformers + fla-core, same call
#   firstgen  (not in the default list; name it first, on a fresh machine) the demo model's `generate` on the GPU,
#             timed shell to exit, three times: the first pays compile and tune (the shipped tuning table, if the card
#             has one), the others read the caches it left (KEEP_PYC=1: Python's bytecode kept too; PROFILE=1: a
#             fourth under cProfile and a fifth with -X importtime)
#   servestart (not in the default list) `deltaserve serve` of the 48B shape (dummy weights) to /health 200, twice,
#             with its start-up phases (benchmarks/serve_start.py; issue 26); QUANT=fp8 serves FP8 weights
#   serve     (not in the default list) the HTTP server against the offline engine on the same requests, 48B shape,
#             prompt 512, output 128, at SERVE_CONC (default 64,256) streams, streaming chat at 64 (SERVE_CHAT)
#             and SERVE_NUM requests (default 256) at each Poisson rate of SERVE_RATE (default none, e.g. 16,inf)
#             (benchmarks/serve_bench.py; issue 25), the engine in a process of its own and in the server's
#             (SERVE_PLACES); needs the server's wheels and aiohttp's in wheels/server; QUANT=fp8 as above
#   kvfp8     (not in the default list) batch-1 decode at KVFP8_LENS (default 262144) with the bf16 latent cache,
#             then with --kv-cache-dtype fp8, one process each (issue 24: TPOT at long context)
#   structured (not in the default list) the 48B shape, 64 concurrent requests, half constrained by a JSON schema
#             against none (benchmarks/structured_outputs.py), once per maxLength in SO_MAX_LENGTHS (default 0:
#             unbounded strings); needs the xgrammar and apache_tvm_ffi wheels in wheels/
# Time limits: T_TESTS, T_KERNELS, T_BENCH, T_FP8 (whole stage) and T_PARITY (each parity command); a fresh
# machine's first chunked prefill compiles fla-core's kernels for over 100 s, so a bench stage needs ~200 s. Do not
# wrap this script in `timeout`: that kills bash and leaves its python child holding the GPU (a lease's later tests
# then ran out of memory); the limits here kill the python processes themselves.
set -uo pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-tests kernels parity bench fp8 pdl async normgemv profile prefill baseline}
export PYTHONPATH=$PWD/.gpu/site:$PWD
# wheels/ (ignored) fetched here with: pip download --no-deps -d wheels fla-core==0.6.0 transformers==5.24.0
python3 -m pip install --no-deps --no-index --target "$PWD/.gpu/site" wheels/fla_core-0.6.0-py3-none-any.whl \
    wheels/transformers-5.24.0-py3-none-any.whl >/dev/null 2>&1 || echo "wheel install failed"
if ls wheels/xgrammar-*.whl >/dev/null 2>&1; then  # the structured extra, when its wheels were carried
  python3 -c "import pydantic" 2>/dev/null || PYDANTIC_WHEELS="wheels/pydantic-*.whl wheels/pydantic_core-*.whl
      wheels/annotated_types-*.whl wheels/typing_inspection-*.whl wheels/typing_extensions-*.whl"  # the image lacks it
  python3 -m pip install --no-deps --no-index --target "$PWD/.gpu/site" wheels/xgrammar-*.whl \
      wheels/apache_tvm_ffi-*.whl ${PYDANTIC_WHEELS:-} >/dev/null 2>&1 || echo "xgrammar wheel install failed"
fi
# the server's wheels (fastapi, uvicorn, pydantic, ...) where the image lacks them; fetched here (wheels/ is ignored)
# with: pip download --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
#   --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d wheels/server fastapi uvicorn pydantic \
#   prometheus-client tiktoken aiohttp
if [ -d wheels/server ]; then
  for w in wheels/server/*.whl; do
    mod=$(basename "$w" | cut -d- -f1)  # the import name of every wheel there but opentelemetry_api's
    if [ "$mod" = typing_extensions ] || ! python3 -c "import $mod" 2>/dev/null; then
      python3 -m pip install --no-deps --no-index --target "$PWD/.gpu/site" "$w" >/dev/null 2>&1 || echo "$w: install failed"
    fi
  done
  python3 -c "import fastapi, uvicorn, pydantic, prometheus_client, tiktoken, aiohttp" || echo "the server's imports fail"
fi
python3 -c "import torch, triton, fla, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
CFG=${CONFIG:-benchmarks/configs/kimi-linear-48b-a3b.json}  # CONFIG: another config (the 12-layer one on an H100)
DS="python3 -m deltaserve.entrypoints.cli"
# NDS: --num-decode-steps for the bench stages (default: the engine's, 8)
B="$DS bench --load-format dummy --device cuda --max-num-batched-tokens 8192 ${NDS:+--num-decode-steps $NDS}"
# the kernel tests first: fla-core's first chunked prefill compiles and autotunes for over 100 s (measured on the
# H200), so the whole list needs ~10 minutes, a call of its own
GPU_TESTS="tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_fp8_grouped.py
           tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_prefix_caching.py"
has() { [[ " $STAGES " == *" $1 "* ]] && echo "== $1 $(date +%T)"; }

# -p no:faulthandler: the image's pytest ends the whole run when one test passes 100 s (a faulthandler watchdog:
# "Timeout (0:01:40)!"), and fla-core's first chunked prefill compiles for longer than that
PYTEST="python3 -m pytest -q -p no:logging -p no:cacheprovider -p no:faulthandler"
if has firstgen; then  # first on a fresh machine: the demo model's first generate, then the same again (issue 26)
  # the image sets PYTHONDONTWRITEBYTECODE=1 (every process compiles torch's and fla's sources: ~6 s); KEEP_PYC=1
  # unsets it, as a normal install is; the file counts show which cache each process still fills (the 2nd process
  # was slow and the 3rd not, with the same tuning decisions)
  [ "${KEEP_PYC:-}" = 1 ] && unset PYTHONDONTWRITEBYTECODE
  caches() { for d in ~/.triton/cache /tmp/torchinductor_$(whoami) ~/.cache/deltaserve; do
    printf "  %s: %s files\n" "$d" "$(find "$d" -type f 2>/dev/null | wc -l)"; done; }
  ls ~/.cache/deltaserve/autotune 2>/dev/null | sed 's/^/tuning cache before: /'
  for run in first again third; do
    start=$(date +%s%N)
    timeout 200 $DS generate --device cuda --prompt "Once upon a time" --max-tokens 32 > "$OUT/firstgen_$run.txt" 2>&1
    echo "generate ($run): exit $?, $(( ($(date +%s%N) - start) / 1000000 )) ms shell to exit"
    grep -iE "start-up|autotuning|tokens in" "$OUT/firstgen_$run.txt" | cut -c1-160
    caches
  done
  # the floor of a warm start: torch imported and a CUDA context made and torn down, nothing of ours
  start=$(date +%s%N)
  python3 -c "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"
  echo "floor (import torch, a CUDA context, exit): $(( ($(date +%s%N) - start) / 1000000 )) ms shell to exit"
  # PROFILE=1: one more run under cProfile (where a warm start's seconds go) and one with -X importtime
  if [ "${PROFILE:-}" = 1 ]; then
    timeout 100 python3 -m cProfile -o "$OUT/firstgen.prof" -m deltaserve.entrypoints.cli generate --device cuda \
        --prompt "Once upon a time" --max-tokens 32 > /dev/null 2>&1
    python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('cumulative').print_stats(70)
s.sort_stats('tottime').print_stats(30)" "$OUT/firstgen.prof" > "$OUT/firstgen_profile.txt" 2>&1
    timeout 100 python3 -X importtime -m deltaserve.entrypoints.cli generate --device cuda \
        --prompt "Once upon a time" --max-tokens 32 2> "$OUT/firstgen_importtime.txt" > /dev/null
    sort -t'|' -k2 -n "$OUT/firstgen_importtime.txt" | tail -25
  fi
fi
if has tests; then
  env | grep -i pytest
  # TESTS_BACKGROUND=1: kernel-only tests (no engine, little memory) alongside the next stage's weight loading
  if [ "${TESTS_BACKGROUND:-}" = 1 ]; then
    (timeout ${T_TESTS:-600} $PYTEST ${TESTS:-$GPU_TESTS} \
        > "$OUT/gpu_tests.txt" 2>&1) &
  else
    # one pytest a file, each until the stage's deadline: the files that ended keep their results and failures
    # (pytest prints them at its end, so a run cut by the limit printed none of a whole list's)
    deadline=$(( $(date +%s) + ${T_TESTS:-600} ))
    for f in ${TESTS:-$GPU_TESTS}; do
      left=$(( deadline - $(date +%s) ))
      [ $left -le 0 ] && { echo "$f: not run (T_TESTS spent)"; continue; }
      echo "== $f" >> "$OUT/gpu_tests.txt"  # one file back for all (a call returns at most 8)
      timeout $left $PYTEST --tb=short -rf "$f" >> "$OUT/gpu_tests.txt" 2>&1
      echo "$f: exit $?, $(tail -1 "$OUT/gpu_tests.txt" | cut -c1-120)"
    done
  fi
fi

if has kernels; then
  timeout ${T_KERNELS:-240} python3 benchmarks/gpu/kernels_bench.py ${KPARTS:+--parts $KPARTS} --json-out "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1
  cut -c1-300 "$OUT/kernels.txt" | tail -20
fi
if has bench; then
  timeout ${T_BENCH:-300} $B --config $CFG --batch-sizes ${BATCHES:-1,64,256} --prompt-len 512 --output-len 32 \
      --long-prompt-len ${LONG:-8192} --json-out "$OUT/bench_48b.json" > "$OUT/bench_48b.txt" 2>&1; tail -8 "$OUT/bench_48b.txt" | cut -c1-200
fi
if has fp8; then
  timeout ${T_FP8:-300} $B --config $CFG --quantization fp8 --gpu-memory-utilization 0.51 --batch-sizes 1,64 --prompt-len 512 \
      --output-len 32 --json-out "$OUT/bench_48b_fp8.json" > "$OUT/bench_48b_fp8.txt" 2>&1
  tail -6 "$OUT/bench_48b_fp8.txt" | cut -c1-200
fi
if has pdl; then
  for v in 1 0; do
    DELTASERVE_PDL=$v timeout ${T_PDL:-200} $B --config $CFG --batch-sizes 1 --prompt-len 512 --output-len 32 \
        --json-out "$OUT/bench_pdl$v.json" > "$OUT/bench_pdl$v.txt" 2>&1
    echo "DELTASERVE_PDL=$v"; grep -A2 "batch  " "$OUT/bench_pdl$v.txt" | cut -c1-130
  done
fi
if has async; then
  timeout ${T_ASYNC:-300} python3 benchmarks/gpu/async_ab.py --config $CFG --batch 1 --rounds 3 --output-len 64 \
      --json-out "$OUT/async_ab.json" > "$OUT/async_ab.txt" 2>&1
  grep -E "^greedy|^round|Error" "$OUT/async_ab.txt" | cut -c1-200
fi
if has normgemv; then
  for v in 1 0; do
    DELTASERVE_NORM_GEMV=$v timeout ${T_NORM:-250} $B --config $CFG --batch-sizes 1,16 --prompt-len 512 --output-len 64 \
        --json-out "$OUT/bench_norm_gemv$v.json" > "$OUT/bench_norm_gemv$v.txt" 2>&1
    echo "DELTASERVE_NORM_GEMV=$v"; grep -A3 "batch  " "$OUT/bench_norm_gemv$v.txt" | cut -c1-130
  done
fi
if has parity; then
  (
    DS="timeout ${T_PARITY:-200} $DS"  # this subshell's commands only
    cp -r deltaserve/assets/demo-model /tmp/demo32k
    python3 -c "import json; p='/tmp/demo32k/config.json'; c=json.load(open(p)); c['model_max_length']=40000; json.dump(c, open(p,'w'))"
    # PARITY=short: the 512 positions only; PARITY=long: the 32k context only
    if [ "${PARITY:-}" != long ]; then
      $DS parity capture --reference deltaserve --device cuda --dtype float32 --max-tokens 64 --out "$OUT/golden_texts.json"
      $DS parity check --golden "$OUT/golden_texts.json" --device cuda --dtype bfloat16 --plot "$OUT/parity_texts.png"
      [ "${PARITY:-}" = short ] && exit 0
      $DS parity capture --reference deltaserve --device cuda --dtype float32 --max-tokens 32 --num-prompts 16 \
          --out "$OUT/golden_random.json"
      $DS parity check --golden "$OUT/golden_random.json" --device cuda --dtype bfloat16
    fi
    $DS parity capture --model /tmp/demo32k --reference deltaserve --device cuda --dtype float32 --num-prompts 4 \
        --prompt-len 32768 --max-tokens 128 --out /tmp/golden_32k.json
    $DS parity check --model /tmp/demo32k --golden /tmp/golden_32k.json --device cuda --dtype bfloat16 \
        --plot "$OUT/parity_32k.png"
  ) > "$OUT/parity.txt" 2>&1
  grep -E "^golden:|^teacher-forced:|^divergences:|^match" "$OUT/parity.txt"
fi
if has longparity; then
  (
    DS="timeout ${T_PARITY:-200} $DS"
    cp -r deltaserve/assets/demo-model /tmp/demo128k
    MEDIUM=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from offline_throughput import make_model; print(make_model('medium'))")
    for m in /tmp/demo128k "$MEDIUM"; do
      python3 -c "import json, sys; p=sys.argv[1]+'/config.json'; c=json.load(open(p)); c['model_max_length']=c['max_position_embeddings']=140000; json.dump(c, open(p,'w'))" "$m"
      name=$(basename "$m")
      $DS parity capture --model "$m" --reference deltaserve --device cuda --dtype float32 --num-prompts 2 \
          --prompt-len 131072 --max-tokens 64 --out "/tmp/golden_128k_$name.json"
      $DS parity check --model "$m" --golden "/tmp/golden_128k_$name.json" --device cuda --dtype bfloat16 \
          --plot "$OUT/parity_128k_$name.png"
    done
  ) > "$OUT/longparity.txt" 2>&1
  grep -E "^golden:|^teacher-forced:|^divergences:|^match" "$OUT/longparity.txt"
fi
if has profile; then
  timeout 200 python3 benchmarks/gpu/profile_decode.py --config $CFG --batch 1 --json-out "$OUT/profile_b1.json" \
      > "$OUT/profile_b1.txt" 2>&1; head -30 "$OUT/profile_b1.txt" | grep -v DEBUG | cut -c1-150
  if has fp8; then
    timeout 150 python3 benchmarks/gpu/profile_decode.py --config $CFG --batch 1 --quantization fp8 --top 12 \
        > "$OUT/profile_b1_fp8.txt" 2>&1; head -16 "$OUT/profile_b1_fp8.txt" | cut -c1-150
  fi
fi
if has prefill; then
  timeout 200 $B --config $CFG --batch-sizes 1 --prompt-len 8192 --output-len 8 \
      --json-out "$OUT/bench_48b_prefill8k.json" > "$OUT/bench_48b_prefill8k.txt" 2>&1
  tail -4 "$OUT/bench_48b_prefill8k.txt" | cut -c1-200
fi
if has baseline; then
  python3 - <<'PY' > "$OUT/cfg4.json"
import json; c = json.load(open("benchmarks/configs/kimi-linear-48b-a3b.json")); c["num_hidden_layers"] = 4
c["linear_attn_config"]["kda_layers"] = [1, 2, 3]; c["linear_attn_config"]["full_attn_layers"] = [4]; print(json.dumps(c))
PY
  timeout 200 $B --config "$OUT/cfg4.json" --batch-sizes 1 --prompt-len 2048 --output-len 32 \
      --json-out "$OUT/bench_4layers.json" > "$OUT/bench_4layers.txt" 2>&1; tail -4 "$OUT/bench_4layers.txt" | cut -c1-200
  timeout 200 python3 benchmarks/gpu/transformers_baseline.py --config $CFG --layers 4 --prompt-len 2048 2>&1 \
      | tail -1 | tee "$OUT/baseline_4layers.json"
fi
if has kvfp8; then
  for kv in auto fp8; do
    timeout ${T_KVFP8:-280} $B --config $CFG --batch-sizes 1 --prompt-len 512 --output-len 32 --kv-cache-dtype $kv \
        --long-prompt-len ${KVFP8_LENS:-262144} --json-out "$OUT/bench_kv_$kv.json" > "$OUT/bench_kv_$kv.txt" 2>&1
    echo "--kv-cache-dtype $kv"; grep -A4 "batch  " "$OUT/bench_kv_$kv.txt" | cut -c1-130
  done
fi
if has servestart; then
  timeout ${T_SERVESTART:-400} python3 benchmarks/serve_start.py --config $CFG --device cuda --starts 2 ${QUANT:+--quantization $QUANT} \
      --timeout 300 --json-out "$OUT/serve_start.json" > "$OUT/serve_start.txt" 2>&1; tail -12 "$OUT/serve_start.txt"
fi
if has serve; then
  chat=${SERVE_CHAT-64}  # SERVE_CHAT= (empty): no chat run
  for place in ${SERVE_PLACES:-engine-process no-engine-process}; do
    echo "serve --$place $(date +%T)"
    timeout ${T_SERVE:-560} python3 benchmarks/serve_bench.py --config $CFG --load-format dummy --device cuda ${QUANT:+--quantization $QUANT} \
        --concurrency ${SERVE_CONC:-64,256} ${chat:+--chat-concurrency $chat} --prompt-len 512 --output-len 128 \
        ${SERVE_RATE:+--request-rate $SERVE_RATE --num-requests ${SERVE_NUM:-256}} \
        --$place --server-log "$OUT/serve_log_$place.txt" --json-out "$OUT/serve_$place.json" \
        > "$OUT/serve_$place.txt" 2>&1
    grep -vE '^\{|^http ' "$OUT/serve_$place.txt" | tail -12 | cut -c1-220
    # what the engines built while they served (kernels tuned or compiled inside a step), and their warm-up
    grep -E "prefill warm-up|autotuning: [0-9]+ new|waited while Triton|allocator ran out" \
        "$OUT/serve_log_$place.txt" | cut -c1-300
    pkill -f serve_bench_engine.py; pkill -f multiprocessing.spawn; sleep 2  # a run cut by its limit leaves these
  done
fi
if has structured; then
  for ml in ${SO_MAX_LENGTHS:-0}; do
    timeout ${T_STRUCTURED:-450} python3 benchmarks/structured_outputs.py --config $CFG --concurrency 64 \
        --prompt-len 512 --output-len 128 --rounds 3 --max-length $ml --json-out "$OUT/structured_ml$ml.json" \
        > "$OUT/structured_ml$ml.txt" 2>&1
    echo "maxLength $ml"; grep -E "^round|^\||half / none|Error" "$OUT/structured_ml$ml.txt" | cut -c1-200
  done
fi
wait
[ "${TESTS_BACKGROUND:-}" = 1 ] && tail -4 "$OUT/gpu_tests.txt"
cp ~/.cache/deltaserve/autotune/*.json "$OUT/" 2>/dev/null  # the card's tuning decisions, to ship as a table (issue 26)
exit 0
