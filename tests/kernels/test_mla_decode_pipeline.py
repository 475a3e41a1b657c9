"""The MLA decode kernel's software pipeline, as Triton compiles it for Hopper (sm_90) on this CPU: its latent tile
must get num_stages - 1 shared-memory buffers, so one tile streams in while the program reads the other. A load in
the step that the tile's addresses depend on (the page ids, before d7a1e5f) leaves it one buffer at any num_stages,
and each step then waits for its own tile (what that cost: BENCHMARKS.md, stop 42). The interpreter runs the
kernel's arithmetic but not the compiler, so this is checked on the compiled kernel's TTGIR."""

import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deltaserve.kernels.mla import triton_decode as mla

stages, block_h, block_n, warps, reread = map(int, sys.argv[1:6])
cache = sys.argv[6]
args = dict(q_ptr="*bf16", qr_ptr="*bf16", cache_ptr=f"*{cache}", bt_ptr="*i64", lens_ptr="*i64", mid_o_ptr="*fp32",
            mid_lse_ptr="*fp32", q_stride_b="i32", q_stride_h="i32", qr_stride_b="i32", qr_stride_h="i32",
            bt_stride="i32", page_stride="i32", token_stride="i32", scale="fp32", num_splits="i32", min_split="i32",
            PAGE=16, H=32, R=512, DR=64, BR=512, BDR=64, BLOCK_H=block_h, BLOCK_N=block_n, IEEE=False,
            LAZY_SLACK=mla.LAZY_SLACK, REREAD=bool(reread), PDL=False)
fn = mla._mla_decode_split_kernel
runtime = {k: v for k, v in args.items() if isinstance(v, str)}
signature = {k: runtime.get(k, "constexpr") for k in args}
constexprs = {k: v for k, v in args.items() if k not in runtime}
aligned = [k for k, v in runtime.items() if v.startswith("*") or k.endswith("stride")]
attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned}
kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
print(kernel.asm["ttgir"])
"""


def _ttgir(stages: int, block_h: int, block_n: int, warps: int, cache: str = "bf16", reread: bool = False) -> str:
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton ships no ptxas: it cannot compile for sm_90 here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter's jit cannot compile
    argv = [str(stages), str(block_h), str(block_n), str(warps), str(int(reread)), cache]
    try:
        done = subprocess.run([sys.executable, "-c", COMPILE, *argv], capture_output=True, text=True, env=env,
                              timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("compiling the MLA decode kernel for sm_90 took over 300 s")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _tile_buffers(ttgir: str, block_n: int, dtype: str) -> list[int]:
    """The shared-memory buffers of each pipelined load of a [block_n, 512] latent tile (none: not pipelined)."""
    allocs = rf"local_alloc\s*:\s*\(\)\s*->\s*!\w+\.memdesc<(\d+)x{block_n}x512x{dtype}"
    return [int(n) for n in re.findall(allocs, ttgir)]


@pytest.mark.parametrize("block_h,block_n,warps", [(16, 32, 4), (32, 64, 8)])  # one sequence's launch; a batch's
def test_mla_decode_tile_gets_a_buffer_per_stage_in_flight(block_h, block_n, warps):
    from deltaserve.kernels.mla.triton_decode import NUM_STAGES

    assert _tile_buffers(_ttgir(NUM_STAGES, block_h, block_n, warps), block_n, "bf16") == [NUM_STAGES - 1]
    assert NUM_STAGES - 1 >= 2


def test_float8_tile_read_twice_streams_in_both_loads():
    """A float8 tile's one load feeds both products, each in a shared layout of its own, and is not pipelined; read
    twice (reread_tile), each load has one product and gets its buffers."""
    from deltaserve.kernels.mla.triton_decode import NUM_STAGES

    assert _tile_buffers(_ttgir(NUM_STAGES, 16, 32, 4, "fp8e4nv"), 32, "f8E4M3FN") == []
    assert _tile_buffers(_ttgir(NUM_STAGES, 16, 32, 4, "fp8e4nv", reread=True), 32, "f8E4M3FN") == [NUM_STAGES - 1] * 2
