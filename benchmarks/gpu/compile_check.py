"""Compile our Triton kernels for sm_90 (Hopper) on a machine without a GPU: Triton ships ptxas, so typing and
lowering errors that the CPU interpreter never meets show up here, before a lease is spent. Prints ok (with the
shared memory a program takes) or the error, per kernel and variant, at the 48B model's shapes. With --asm, also
the machine code's registers a thread and bytes of stack (spills) and the widths of its global loads (e.g.
LDGSTS.E.BYPASS.128: 16-byte asynchronous copies; LDG.E.U16: one bf16 a load).

Like the JIT, which specializes every launch, pointers are taken as 16-byte aligned, and so are the integer
arguments a check names as such (strides that are multiples of 16 at the model's shapes): without that the
compiler cannot prove a row's alignment and loads bf16 tiles two bytes at a time.

    env -u TRITON_INTERPRET python benchmarks/gpu/compile_check.py [--asm]
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from deltaserve.kernels import conv1d_triton, gemv, norm_gemv, triton_norm
from deltaserve.kernels.kda import triton_decode as kda_triton_decode
from deltaserve.kernels.mla import triton_decode as mla_triton_decode
from deltaserve.kernels.moe import triton_blocks, triton_combine, triton_decode, triton_routing
from deltaserve.kernels.quant import triton_linear

TARGET = GPUTarget("cuda", 90, 32)
# the MLA decode kernel's strides: multiples of 16 elements at the model's shapes (576-wide latent rows, 16-token pages)
MLA_STRIDES = ("q_stride_b", "q_stride_h", "qr_stride_b", "qr_stride_h", "bt_stride", "page_stride", "token_stride")
TYPES = ("*", "i32", "i64", "fp32")  # an argument given as a string starting so is a runtime argument of that type


ASM = "--asm" in sys.argv[1:]
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")  # ptxas, cuobjdump


def compile_kernel(fn, args: dict, num_warps: int = 4, num_stages: int = 3, aligned: tuple[str, ...] = ()):
    """fn compiled for TARGET. args: each kernel argument, as its type ("*bf16", "i32", ...) or as its constexpr
    value; aligned: integer arguments that are multiples of 16 (pointers always are taken so)."""
    runtime = {k: v for k, v in args.items() if isinstance(v, str) and v.startswith(TYPES)}
    signature = {k: runtime.get(k, "constexpr") for k in args}
    constexprs = {k: v for k, v in args.items() if k not in runtime}
    divisible = [k for k, v in runtime.items() if v.startswith("*") or k in aligned]
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in divisible}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})


def check(name: str, fn, args: dict, num_warps: int = 4, num_stages: int = 3, aligned: tuple[str, ...] = ()) -> bool:
    """compile_kernel, its outcome printed (ok with the shared memory a program takes, or the error)."""
    try:
        kernel = compile_kernel(fn, args, num_warps, num_stages, aligned)
    except Exception as e:  # noqa: BLE001 -- report every kernel's outcome, then fail
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[:2000]}")
        return False
    print(f"ok   {name}: shared {kernel.metadata.shared} B" + (f"; {machine_code(kernel.asm['cubin'])}" if ASM else ""))
    return True


def machine_code(cubin: bytes) -> str:
    """Registers a thread and bytes of stack (spills) the kernel's machine code takes (cuobjdump's resource usage:
    the ptxas a Triton release ships may be older than the PTX version it writes, so the cubin Triton built is read,
    not the PTX assembled again), and its global loads by instruction (the most used first)."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "k.cubin").write_bytes(cubin)
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", str(Path(tmp, "k.cubin"))],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", str(Path(tmp, "k.cubin"))],
                              capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    loads = collections.Counter(re.findall(r"\b(LDG[.\w]*|LDGSTS[.\w]*|UTMALDG[.\w]*)", sass))
    return (f"{regs.group(1) if regs else '?'} registers, {stack.group(1) if stack else '?'} B of stack; loads "
            + ", ".join(f"{op} x{n}" for op, n in loads.most_common(3)))


def jit_of(kernel):
    """The jitted function under autotune and heuristics wrappers."""
    while not isinstance(kernel, triton.runtime.JITFunction):
        kernel = kernel.fn
    return kernel


def main() -> int:
    ok = check("router", triton_routing._route_kernel, dict(
        logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i64", E=256, K=8, RENORMALIZE=True,
        SCALE=2.446, BLOCK_E=256, BLOCK_K=8, PDL=True), num_warps=1)
    for block_e, block_d in triton_routing._ROUTER_TILES:  # the router's logits: the GEMV kernel, float32 weights
        ok &= check(f"router logits {block_e}x{block_d}", jit_of(triton_routing._router_logits_kernel), dict(
            x_ptr="*bf16", w_ptr="*fp32", y_ptr="*fp32", x_stride="i32", y_stride="i32", T_BUCKET="i32", N=256,
            K=2304, GROUP_N=256, BLOCK_N=block_e, BLOCK_K=block_d, **gemv.NO_SCALES, PDL=True))
    for block_n, block_k in gemv.GEMV_TILES:
        for N, K, group_n in ((2304, 4096, 2304), (6720, 2304, 6720), (8192, 128, 4096)):  # o_proj, MLA in, KDA fg
            ok &= check(f"gemv {block_n}x{block_k}, {N}x{K} in groups of {group_n}", jit_of(gemv._gemv_kernel), dict(
                x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", x_stride="i32", y_stride="i32", T_BUCKET="i32", N=N,
                K=K, GROUP_N=group_n, BLOCK_N=block_n, BLOCK_K=block_k, **gemv.NO_SCALES, PDL=True))
    norm_args = dict(x_ptr="*bf16", r_ptr="*bf16", nw_ptr="*bf16", h_ptr="*bf16", stream_ptr="*bf16",
                     x_stride="i32", r_stride="i32", y_stride="i32", eps="fp32", T_BUCKET="i32", PDL=True)
    fp8_scales = dict(s_ptr="*fp32", SCALED=True, S_COLS=18, BN=128, BK=128)
    for weights, scales, tiles in (("*bf16", gemv.NO_SCALES, gemv.GEMV_TILES),
                                   ("*fp8e4nv", fp8_scales, gemv.FP8_GEMV_TILES)):
        for block_n, block_k in tiles:  # norms inside GEMVs: KDA's in_proj, o_proj; the router's logits
            ok &= check(f"add norm gemv {weights} {block_n}x{block_k}", norm_gemv._norm_gemv_jit, dict(
                **norm_args, w_ptr=weights, y_ptr="*bf16", N=12576, K=2304, GATED=False, HEAD=1, STORE_H=False,
                **scales, BLOCK_N=block_n, BLOCK_K=block_k))
            ok &= check(f"gated norm gemv {weights} {block_n}x{block_k}", norm_gemv._norm_gemv_jit, dict(
                **norm_args, w_ptr=weights, y_ptr="*bf16", N=2304, K=4096, GATED=True, HEAD=128, STORE_H=False,
                **dict(scales, S_COLS=32), BLOCK_N=block_n, BLOCK_K=block_k))
    for block_e, block_d in triton_routing._ROUTER_TILES:
        ok &= check(f"add norm router {block_e}x{block_d}", norm_gemv._norm_gemv_jit, dict(
            **norm_args, w_ptr="*fp32", y_ptr="*fp32", N=256, K=2304, GATED=False, HEAD=1, STORE_H=True,
            **gemv.NO_SCALES, BLOCK_N=block_e, BLOCK_K=block_d))
    for D, add, gated, w in ((2304, True, False, "*bf16"), (2304, False, False, "*bf16"), (512, False, False, "*bf16"),
                             (128, False, True, "*fp32")):  # the decoder's norms, MLA's latent norm, KDA's gated one
        ok &= check(f"rms norm {D}, add {add}, gated {gated}", triton_norm._rms_norm_kernel, dict(
            x_ptr="*bf16", r_ptr="*bf16", g_ptr="*fp32" if gated else "*bf16", w_ptr=w, out_ptr="*bf16",
            sum_ptr="*bf16", n_rows="i32", x_stride="i32", r_stride="i32", g_stride="i32", eps="fp32", D=D,
            BLOCK_D=triton.next_power_of_2(D), BLOCK_ROWS=max(1, triton_norm.TILE // triton.next_power_of_2(D)),
            ADD=add, GATED=gated), num_warps=4,
            aligned=("x_stride", "r_stride", "g_stride"))
    ok &= check("moe slot sum", triton_decode._sum_slots_kernel, dict(
        y_ptr="*fp32", out_ptr="*bf16", SLOTS=9, D=2304, BLOCK_D=triton_decode._SUM_BLOCK_D, PDL=True))
    ok &= check("moe weighted sum", triton_combine._weighted_sum_kernel, dict(
        y_ptr="*bf16", where_ptr="*i64", w_ptr="*fp32", out_ptr="*bf16", D=2304, K_SLOTS=8, BLOCK_D=512))
    blocks = dict(order_ptr="*i64", expert_ptr="*i32", first_ptr="*i32", rows_ptr="*i32", K_SLOTS=8, D=2304, I=1024,
                  BLOCK_M=triton_blocks.BLOCK_M, IEEE=False, PDL=True)
    for name, kernel, tile, args in (
            ("gate/up", triton_blocks._gate_up_kernel, triton_blocks.GATE_UP_TILE, dict(x_ptr="*bf16", w13_ptr="*bf16",
                                                                                       act_ptr="*bf16")),
            ("down", triton_blocks._down_kernel, triton_blocks.DOWN_TILE, dict(act_ptr="*bf16", w2_ptr="*bf16",
                                                                             y_ptr="*fp32"))):
        given = {**args, **blocks, "BLOCK_N": tile[0], "BLOCK_K": tile[1]}
        ok &= check(f"expert blocks {name} {tile[0]}x{tile[1]}", kernel, {k: given[k] for k in kernel.arg_names},
                    num_stages=triton_blocks.NUM_STAGES)
    ok &= check("conv update", conv1d_triton._conv_update_kernel, dict(
        x_ptr="*bf16", w_ptr="*bf16", state_ptr="*bf16", slots_ptr="*i64", y_ptr="*bf16", x_stride="i32", C=12288, W=4,
        BLOCK_C=256, PDL=True))
    for dtype in ("*bf16", "*fp32"):  # prefill's short conv: the 48B shape's channels
        ok &= check(f"conv varlen {dtype}", conv1d_triton._conv_varlen_kernel, dict(
            x_ptr=dtype, w_ptr=dtype, state_ptr=dtype, slots_ptr="*i64", cu_ptr="*i64", tiles_ptr="*i64", y_ptr=dtype,
            x_stride="i32", C=12288, W=4, BLOCK_T=conv1d_triton.TOKEN_TILE, BLOCK_C=conv1d_triton._VARLEN_BLOCK_C))
        ok &= check(f"conv varlen state {dtype}", conv1d_triton._conv_state_kernel, dict(
            x_ptr=dtype, state_ptr=dtype, slots_ptr="*i64", cu_ptr="*i64", x_stride="i32", C=12288, W=4, BLOCK_W=4,
            BLOCK_C=256))
    for block_n, block_k in gemv.FP8_GEMV_TILES:  # FP8 weights with 128 x 128 block scales
        for N, K in ((2304, 4096), (12544, 2304)):  # o_proj, KDA's in_proj
            ok &= check(f"fp8 gemv {block_n}x{block_k}, {N}x{K}", jit_of(gemv._fp8_gemv_kernel), dict(
                x_ptr="*bf16", w_ptr="*fp8e4nv", y_ptr="*bf16", x_stride="i32", y_stride="i32", T_BUCKET="i32",
                N=N, K=K, GROUP_N=N, BLOCK_N=block_n, BLOCK_K=block_k, s_ptr="*fp32", SCALED=True,
                S_COLS=-(-K // 128), BN=128, BK=128, PDL=True))
    for K in (128, 48):  # the 48B model's head width; the demo model's (not a power of two)
        for varlen in (False, True):  # a decode step; a short prefill
            ok &= check(f"KDA {'short prefill' if varlen else 'decode'}, K {K}",
                        kda_triton_decode._kda_recurrent_kernel, dict(
                            q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", graw_ptr="*bf16", braw_ptr="*bf16",
                            dt_bias_ptr="*fp32", a_log_ptr="*fp32", state_ptr="*fp32", slots_ptr="*i64",
                            cu_ptr="*i64", o_ptr="*bf16", qkv_stride="i32", g_stride="i32", b_stride="i32",
                            scale="fp32", H=32, K=K, V=K, BK=triton.next_power_of_2(K),
                            BV=min(triton.next_power_of_2(K), 32), VARLEN=varlen, PDL=True))
    # heads a program, tokens a step, warps: one sequence's launch (16, 32, 4) and a batch's (32, 64, 8); a page size
    # not a power of two looks up every token's page
    for dtype, cache, (block_h, block_n, warps), page, reread, wide in (
            ("bf16", "bf16", (16, 32, 4), 16, False, 0), ("bf16", "bf16", (32, 64, 8), 16, False, 0),
            ("bf16", "bf16", (32, 32, 4), 16, False, 0), ("fp32", "fp32", (32, 32, 4), 16, False, 0),
            ("bf16", "fp8e4nv", (32, 64, 8), 16, False, 0), ("bf16", "fp8e4nv", (16, 32, 4), 16, True, 0),
            ("bf16", "bf16", (32, 32, 4), 24, False, 0), ("bf16", "bf16", (16, 32, 4), 16, False, 32),
            ("fp32", "fp32", (16, 32, 4), 16, False, 32)):  # float32's eager decode past WIDE_FROM
        ok &= check(f"MLA decode, {dtype}, cache {cache}, {block_h} heads, {block_n} tokens, {warps} warps, "
                    f"page {page}" + (", tile read twice" if reread else "") + (f", wide mode {wide}" if wide else ""),
                    mla_triton_decode._mla_decode_split_kernel, dict(
                        q_ptr=f"*{dtype}", qr_ptr=f"*{dtype}", cache_ptr=f"*{cache}", bt_ptr="*i64", lens_ptr="*i64",
                        mid_o_ptr="*fp32", mid_lse_ptr="*fp32", q_stride_b="i32", q_stride_h="i32",
                        qr_stride_b="i32", qr_stride_h="i32", bt_stride="i32", page_stride="i32",
                        token_stride="i32", scale="fp32", num_splits="i32", min_split="i32", wide_from="i32",
                        PAGE=page, H=32, R=512, DR=64, BR=512, BDR=64, BLOCK_H=block_h, BLOCK_N=block_n, WIDE_H=wide,
                        IEEE=dtype == "fp32", LAZY_SLACK=mla_triton_decode.LAZY_SLACK, REREAD=reread, PDL=True),
                    num_warps=warps, aligned=MLA_STRIDES, num_stages=mla_triton_decode.NUM_STAGES_FLOAT32
                    if dtype == "fp32" else mla_triton_decode.NUM_STAGES)
    for dtype, cols, slices in (("bf16", 512, 1), ("fp32", 512, 1), ("bf16", 32, 128), ("bf16", 256, 16),
                                ("bf16", 512, 4)):
        ok &= check(f"MLA merge, {dtype}, {cols} columns, {slices} slices a step",
                    mla_triton_decode._mla_decode_merge_kernel, dict(
                        mid_o_ptr="*fp32", mid_lse_ptr="*fp32", lens_ptr="*i64", o_ptr=f"*{dtype}",
                        num_splits="i32", min_split="i32", mid_stride="i32", wide_from="i32", H=32, R=512, BR=cols,
                        BLOCK_N=32, SLICES=slices, PDL=True))
    for aligned in (True, False):
        ok &= check(f"fp8 matmul, aligned {aligned}", triton_linear._matmul_kernel, dict(
            x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", y_ptr="*fp32", M="i32", N="i32", K=4096, S_COLS=32,
            K_PER_SPLIT=256, DOT_DTYPE=tl.bfloat16, BN=128, BK=128, ALIGNED=aligned, BLOCK_M=16, BLOCK_N=64,
            BLOCK_K=128))
    gate_up, down = jit_of(triton_decode._gate_up_kernel), jit_of(triton_decode._down_kernel)
    for scaled, aligned, w_type in ((False, True, "*bf16"), (True, True, "*fp8e4nv"), (True, False, "*fp8e4nv")):
        s_type = "*fp32" if scaled else w_type  # unscaled: the weights stand in for the scales, never read
        scales = dict(SCALED=scaled, BN=128, BK=128, ALIGNED=aligned)
        slots = 9  # with the shared expert as the ninth slot (a variant without it only drops that branch)
        for (bi, bd), (bn, bk) in zip(triton_decode._GATE_UP_TILES, triton_decode._DOWN_TILES):
            ok &= check(f"expert gate/up {bi}x{bd}, scaled {scaled}, aligned {aligned}", gate_up, dict(
                x_ptr="*bf16", w13_ptr=w_type, s13_ptr=s_type, shared13_ptr=w_type, shared_s13_ptr=s_type,
                ids_ptr="*i64", act_ptr="*fp32", PAIRS_BUCKET="i32", K_SLOTS=8, SLOTS=slots, D=2304, I=1024, S_ROWS=16,
                S_COLS=18, **scales, BLOCK_I=bi, BLOCK_D=bd, PDL=True))
            ok &= check(f"expert down {bn}x{bk}, scaled {scaled}, aligned {aligned}", down, dict(
                act_ptr="*fp32", w2_ptr=w_type, s2_ptr=s_type, shared2_ptr=w_type, shared_s2_ptr=s_type, ids_ptr="*i64",
                weights_ptr="*fp32", y_ptr="*fp32", PAIRS_BUCKET="i32", K_SLOTS=8, SLOTS=slots, D=2304, I=1024,
                S_ROWS=18, S_COLS=8, **scales, BLOCK_N=bn, BLOCK_K=bk, PDL=True))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
