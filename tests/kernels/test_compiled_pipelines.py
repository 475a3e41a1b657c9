"""Our Triton kernels' software pipelines, as Triton compiles them for Hopper (sm_90) on this CPU: the tiles their
speed rests on must get num_stages - 1 shared-memory buffers, so one streams in while the program reads another.
The interpreter runs the kernels' arithmetic but not the compiler, so this is checked on the compiled TTGIR.

The MLA decode kernel is why (BENCHMARKS.md, stop 42): while each step loaded its tile's page ids, the load the
tile's addresses depend on, the pipeliner gave the tile one buffer at any num_stages, and each step waited for its
own tile."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

# compiles one kernel with benchmarks/gpu/compile_check.py's compile_kernel: argv[1] the script's path, argv[2] a JSON
# object of module, kernel, args (a runtime argument as its type, "*bf16", "i32", ...; a constexpr as its value,
# "tl.<dtype>" for a Triton dtype), warps and stages; prints the TTGIR
COMPILE = r"""
import importlib
import importlib.util
import json
import sys
import triton.language as tl

load = importlib.util.spec_from_file_location("compile_check", sys.argv[1])
cc = importlib.util.module_from_spec(load)
load.loader.exec_module(cc)
spec = json.loads(sys.argv[2])
fn = cc.jit_of(getattr(importlib.import_module(spec["module"]), spec["kernel"]))
args = {k: spec["args"][k] for k in fn.arg_names}  # in the kernel's order, every argument given
args = {k: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v for k, v in args.items()}
strides = tuple(k for k in args if k.endswith("stride"))  # multiples of 16 at the model's shapes, as the JIT sees
print(cc.compile_kernel(fn, args, spec["warps"], spec["stages"], strides).asm["ttgir"])
"""
COMPILE_CHECK = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "compile_check.py"


def _ttgir(module: str, kernel: str, args: dict, warps: int, stages: int) -> str:
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton ships no ptxas: it cannot compile for sm_90 here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter's jit cannot compile
    spec = json.dumps({"module": module, "kernel": kernel, "args": args, "warps": warps, "stages": stages})
    try:
        done = subprocess.run([sys.executable, "-c", COMPILE, str(COMPILE_CHECK), spec], capture_output=True,
                              text=True, env=env, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail(f"compiling {kernel} for sm_90 took over 300 s")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _buffers(ttgir: str, tile: str) -> list[int]:
    """The shared-memory buffers of each pipelined load of a tile ("32x512xbf16"; none: not pipelined)."""
    return [int(n) for n in re.findall(rf"local_alloc\s*:\s*\(\)\s*->\s*!\w+\.memdesc<(\d+)x{tile}\b", ttgir)]


def _mla_decode(block_h: int, block_n: int, warps: int, cache: str = "bf16", reread: bool = False,
                wide: int = 0) -> str:
    from deltaserve.kernels.mla import triton_decode as mla

    args = dict(q_ptr="*bf16", qr_ptr="*bf16", cache_ptr=f"*{cache}", bt_ptr="*i64", lens_ptr="*i64",
                mid_o_ptr="*fp32", mid_lse_ptr="*fp32", q_stride_b="i32", q_stride_h="i32", qr_stride_b="i32",
                qr_stride_h="i32", bt_stride="i32", page_stride="i32", token_stride="i32", scale="fp32",
                num_splits="i32", min_split="i32", wide_from="i32", PAGE=16, H=32, R=512, DR=64, BR=512, BDR=64,
                BLOCK_H=block_h, BLOCK_N=block_n, WIDE_H=wide, IEEE=False, LAZY_SLACK=mla.LAZY_SLACK, REREAD=reread,
                PDL=False)
    return _ttgir("deltaserve.kernels.mla.triton_decode", "_mla_decode_split_kernel", args, warps, mla.NUM_STAGES)


@pytest.mark.parametrize("block_h,block_n,warps", [(16, 32, 4), (32, 64, 8)])  # one sequence's launch; a batch's
def test_mla_decode_tile_gets_a_buffer_per_stage_in_flight(block_h, block_n, warps):
    from deltaserve.kernels.mla.triton_decode import NUM_STAGES

    assert NUM_STAGES - 1 >= 2
    assert _buffers(_mla_decode(block_h, block_n, warps), f"{block_n}x512xbf16") == [NUM_STAGES - 1]


def test_mla_decode_wide_mode_streams_both_paths_tiles():
    """With the wide mode compiled in (16 heads a program, all 32 from wide_from tokens), each path's loop keeps its
    tile's buffers: two loops, num_stages - 1 buffers each."""
    from deltaserve.kernels.mla.triton_decode import NUM_STAGES

    assert _buffers(_mla_decode(16, 32, 4, wide=32), "32x512xbf16") == [NUM_STAGES - 1] * 2


def test_float8_tile_read_twice_streams_in_both_loads():
    """A float8 tile's one load feeds both products, each in a shared layout of its own, and is not pipelined; read
    twice (reread_tile), each load has one product and gets its buffers."""
    from deltaserve.kernels.mla.triton_decode import NUM_STAGES

    assert _buffers(_mla_decode(16, 32, 4, "fp8e4nv"), "32x512xf8E4M3FN") == []
    assert _buffers(_mla_decode(16, 32, 4, "fp8e4nv", reread=True), "32x512xf8E4M3FN") == [NUM_STAGES - 1] * 2


def test_expert_block_kernels_stream_their_weight_tiles():
    """The batched decode's experts (kernels.moe.triton_blocks), ~0.9 of a 256-row step: gate and up weight tiles,
    the down weight tile and the rows' activations, each with num_stages - 1 buffers."""
    from deltaserve.kernels.moe import triton_blocks as tb

    tables = dict(order_ptr="*i64", expert_ptr="*i32", first_ptr="*i32", rows_ptr="*i32", K_SLOTS=8, D=2304, I=1024,
                  BLOCK_M=tb.BLOCK_M, IEEE=False, PDL=False)
    (n, k), (dn, dk) = tb.GATE_UP_TILE, tb.DOWN_TILE
    assert tb.NUM_STAGES - 1 >= 2
    gate_up = _ttgir("deltaserve.kernels.moe.triton_blocks", "_gate_up_kernel",
                     dict(x_ptr="*bf16", w13_ptr="*bf16", act_ptr="*bf16", **tables, BLOCK_N=n, BLOCK_K=k), 4,
                     tb.NUM_STAGES)
    assert _buffers(gate_up, f"{n}x{k}xbf16") == [tb.NUM_STAGES - 1] * 2
    assert _buffers(gate_up, f"{tb.BLOCK_M}x{k}xbf16") == [tb.NUM_STAGES - 1]
    down = _ttgir("deltaserve.kernels.moe.triton_blocks", "_down_kernel",
                  dict(act_ptr="*bf16", w2_ptr="*bf16", y_ptr="*fp32", **tables, BLOCK_N=dn, BLOCK_K=dk), 4,
                  tb.NUM_STAGES)
    assert _buffers(down, f"{dn}x{dk}xbf16") == [tb.NUM_STAGES - 1]


def test_fp8_grouped_expert_kernels_stream_their_weight_tiles():
    """--quantization fp8's grouped experts (Triton's default 3 stages): the float8 weight tiles, widened and scaled
    in registers after the load, are still streamed in, two buffers each."""
    from deltaserve.kernels.quant import triton_grouped as tg

    common = dict(order_ptr="*i64", expert_ptr="*i32", first_ptr="*i32", rows_ptr="*i32", D=2304, I=1024, S_ROWS=18,
                  S_COLS=18, BN=128, BK=128, ALIGNED=True, DOT_DTYPE="tl.bfloat16", BLOCK_M=tg._BLOCK_M,
                  BLOCK_N=tg._BLOCK_N, BLOCK_K=tg._BLOCK_K)
    weights = f"{tg._BLOCK_N}x{tg._BLOCK_K}xf8E4M3FN"
    gate_up = _ttgir("deltaserve.kernels.quant.triton_grouped", "_gate_up_kernel",
                     dict(x_ptr="*bf16", w13_ptr="*fp8e4nv", s13_ptr="*fp32", act_ptr="*fp32", K_SLOTS=8, **common), 4,
                     3)
    assert _buffers(gate_up, weights) == [2, 2]
    down = _ttgir("deltaserve.kernels.quant.triton_grouped", "_down_kernel",
                  dict(act_ptr="*fp32", w2_ptr="*fp8e4nv", s2_ptr="*fp32", weights_ptr="*fp32", y_ptr="*fp32",
                       **common), 4, 3)
    assert _buffers(down, weights) == [2]
