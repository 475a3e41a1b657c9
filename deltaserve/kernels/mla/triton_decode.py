"""Paged MLA decode on the GPU in the latent space, split along the context (flash-decoding).

Each program takes one block of heads of one sequence and one slice of its context; it reads that slice's latents [c_kv
R | k_rot Dr] straight from the pages named by the block table (once for the whole head block: the latent is shared by
every head), keeps an online softmax, and writes its partial output and log-sum-exp. A second kernel merges the slices.
Work and traffic follow each sequence's context length, not the block table's width, so a CUDA graph captured with a
table wide enough for the model's whole length costs nothing extra for short contexts.

Twin: attention.mla_decode's torch path (gather every page, masked softmax), tested against it."""

import torch
import triton
import triton.language as tl

from deltaserve.kernels.pdl import pdl_args, pdl_enter

_BLOCK_N = 32  # context tokens per inner step
_TARGET_PROGRAMS = 264  # ~2 per SM of an H100/H200, each streaming its slice with pipelined loads
MIN_SPLIT_TOKENS = 64  # a long context's slices: ~_TARGET_PROGRAMS of them, each at least this long
SHORT_SLICES = tl.constexpr(64)  # a short context: up to this many slices of _BLOCK_N tokens (one step each)
NUM_STAGES = 3  # software pipelining of the split kernel's loads: two tiles' buffers, one read while the next one
# streams in (benchmarks/gpu/compile_check.py uses it too); float32 tiles keep one buffer (NUM_STAGES_FLOAT32)
NUM_STAGES_FLOAT32 = 2
LAZY_SLACK = 8.0  # how far a head's score max may rise before the accumulator is rescaled (0: at every rise)
# the merge kernel's programs: a (sequence, head) row's slices are weighed in steps of [slices, columns] tiles; a
# batch of few rows splits its columns over more programs, down to MERGE_MIN_COLS columns a program (a row a
# program, one sequence's 32 programs each walked their 132 slices serially: BENCHMARKS.md, stop 43)
MERGE_PROGRAMS = 2 * _TARGET_PROGRAMS
MERGE_MIN_COLS = 32
MERGE_TILE = 4096  # slices x columns a step, at most (one sequence: 128 slices of 32 columns, its 132 in two steps)
WIDE_FROM = 131072  # a sequence of this many context tokens or more: every head a program (triton_mla_decode)


@triton.jit
def _used_slices(ctx, num_splits, min_split, BLOCK_N: tl.constexpr):
    """Slices a context of ctx tokens uses, of the launch's num_splits: up to SHORT_SLICES of BLOCK_N tokens (a
    short context: short slices, one inner step each), and for a long one as many as keep each >= min_split."""
    return tl.minimum(num_splits, tl.maximum(tl.cdiv(ctx, min_split), tl.minimum(tl.cdiv(ctx, BLOCK_N), SHORT_SLICES)))


@triton.jit
def _slice_of(ctx, i_split, num_splits, min_split, BLOCK_N: tl.constexpr):
    """(start, end) of slice i_split of a context of ctx tokens split num_splits ways: empty for the slices past
    those it uses."""
    used = _used_slices(ctx, num_splits, min_split, BLOCK_N)
    per_split = tl.cdiv(tl.cdiv(ctx, used), BLOCK_N) * BLOCK_N
    start = i_split * per_split
    return start, tl.minimum(start + per_split, ctx)


@triton.jit
def _tile(row_ptrs, row_mask, cols, col_mask):
    """The [rows, cols] tile whose rows start at row_ptrs, 0 where a row or column is masked."""
    return tl.load(row_ptrs[:, None] + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def _tile_pages(table_ptr, n0, end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The page ids of the tile of context tokens n0 + [0, BLOCK_N) (n0 a multiple of BLOCK_N), from the sequence's
    block table: one a page for a page size that is a power of two (such a page holds whole tiles or is held whole
    by one: max(BLOCK_N // PAGE, 1) pages), else one a token. 0 past end."""
    if (PAGE & (PAGE - 1)) == 0:
        first = n0 // PAGE + tl.arange(0, max(BLOCK_N // PAGE, 1))
        pages = tl.load(table_ptr + first, mask=first * PAGE < end, other=0)
    else:
        toks = n0 + tl.arange(0, BLOCK_N)
        pages = tl.load(table_ptr + toks // PAGE, mask=toks < end, other=0)
    return pages


@triton.jit
def _latent_rows(cache_ptr, pages, n0, page_stride, token_stride, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where each of the tile's context tokens n0 + [0, BLOCK_N) starts its latent row in the paged cache, given
    _tile_pages' ids. With a power-of-two page size each row is its page's base plus a constant offset."""
    rows = tl.arange(0, BLOCK_N)
    if (PAGE & (PAGE - 1)) == 0:
        ROWS: tl.constexpr = min(PAGE, BLOCK_N)  # the tile's rows in each of its pages
        if BLOCK_N > PAGE:
            page = tl.gather(pages, rows // ROWS, 0)
        else:
            page = tl.broadcast_to(tl.sum(pages, 0), [BLOCK_N])
        in_page = n0 % PAGE + rows % ROWS
    else:
        page = pages
        in_page = (n0 + rows) % PAGE
    # the page id is expanded above and multiplied here: the compiler then knows each row is as aligned as the
    # strides are and reads it in 16-byte vectors (a select of the products lost that on Triton 3.9, a reshape of
    # the page ids on 3.6)
    return cache_ptr + page.to(tl.int64) * page_stride + in_page.to(tl.int64) * token_stride


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """a @ b (+ acc), exact in float32 where IEEE (the float32 twin tests), else on the tensor cores."""
    if IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _attend_slice(q_ptr, qr_ptr, cache_ptr, bt_ptr, bt_stride, mid_o_ptr, mid_lse_ptr, b, heads, ctx, i_slice,
                  n_slices, mid_stride, min_split, q_stride_b, q_stride_h, qr_stride_b, qr_stride_h, page_stride,
                  token_stride, scale, PAGE: tl.constexpr, H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr,
                  BR: tl.constexpr, BDR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  IEEE: tl.constexpr, LAZY_SLACK: tl.constexpr, REREAD: tl.constexpr):
    """The BLOCK_H heads (past H: masked) of sequence b attend to slice i_slice of its context split n_slices ways;
    the partial output and log-sum-exp go to slot i_slice of each head's mid_stride."""
    mh = heads < H
    start, end = _slice_of(ctx, i_slice, n_slices, min_split, BLOCK_N)
    mid = (b * H + heads) * mid_stride + i_slice  # [BLOCK_H]
    if start < end:  # a slice past the context reads nothing: weight zero in the merge
        offs_r, offs_dr = tl.arange(0, BR), tl.arange(0, BDR)
        mr, mdr = offs_r < R, offs_dr < DR
        q = _tile(q_ptr + b * q_stride_b + heads * q_stride_h, mh, offs_r, mr)  # [BLOCK_H, BR]
        qr = _tile(qr_ptr + b * qr_stride_b + heads * qr_stride_h, mh, offs_dr, mdr)  # [BLOCK_H, BDR]
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BR], dtype=tl.float32)
        # computed here, in the branch: before it, Triton 3.9 gave the 16-head launch more registers and spills
        table = bt_ptr + b * bt_stride
        pages = _tile_pages(table, start, end, PAGE, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            toks = n0 + tl.arange(0, BLOCK_N)
            mt = toks < end
            row = _latent_rows(cache_ptr, pages, n0, page_stride, token_stride, PAGE, BLOCK_N)
            # the next tile's page ids, a step ahead: its tile's loads then depend on no load of their own step, so
            # the pipeliner gives the tile num_stages - 1 buffers (a page-id load in the step left it one: each
            # step's tile waited for the step before to finish with the buffer)
            pages = _tile_pages(table, n0 + BLOCK_N, end, PAGE, BLOCK_N)
            kv = _tile(row, mt, offs_r, mr).to(q.dtype)  # a float8 cache widened as read
            kr = _tile(row + R, mt, offs_dr, mdr).to(q.dtype)
            s = _dot(q, tl.trans(kv), _dot(qr, tl.trans(kr), None, IEEE), IEEE)  # [BLOCK_H, BLOCK_N] float32
            s = tl.where(mt[None, :], s * scale, float("-inf"))
            m_tile = tl.max(s, axis=1)
            # the running max moves (and the accumulator is rescaled) only when a head's max grows by more than
            # LAZY_SLACK: until then p stays below exp(LAZY_SLACK), which float32 sums and bfloat16 weights hold
            if tl.max(m_tile - m_i, axis=0) > LAZY_SLACK:
                m_new = tl.maximum(m_i, m_tile)
                alpha = tl.exp(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            p = tl.exp(s - m_i[:, None])
            l_i = l_i + tl.sum(p, axis=1)
            if REREAD:  # the same rows again, a load of their own (another eviction policy: not merged with the first)
                kv = tl.load(row[:, None] + offs_r[None, :], mask=mt[:, None] & mr[None, :], other=0.0,
                             eviction_policy="evict_first").to(q.dtype)
            acc = _dot(p.to(kv.dtype), kv, acc, IEEE)
        tl.store(mid_o_ptr + mid[:, None] * R + offs_r[None, :], acc / l_i[:, None], mask=mh[:, None] & mr[None, :])
        tl.store(mid_lse_ptr + mid, m_i + tl.log(l_i), mask=mh)
    else:
        tl.store(mid_lse_ptr + mid, tl.full([BLOCK_H], float("-inf"), dtype=tl.float32), mask=mh)


# unspecialised: the block table's width and the split count follow the step's contexts; an eager decode beside a
# prompt meets any value, and a value of 1 or a multiple of 16 would compile a variant of its own while serving
@triton.jit(do_not_specialize=["bt_stride", "num_splits"])
def _mla_decode_split_kernel(
    q_ptr, qr_ptr, cache_ptr, bt_ptr, lens_ptr, mid_o_ptr, mid_lse_ptr,
    q_stride_b, q_stride_h, qr_stride_b, qr_stride_h, bt_stride, page_stride, token_stride, scale,
    num_splits, min_split, wide_from, PAGE: tl.constexpr, H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr,
    BR: tl.constexpr, BDR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, WIDE_H: tl.constexpr,
    IEEE: tl.constexpr, LAZY_SLACK: tl.constexpr, REREAD: tl.constexpr, PDL: tl.constexpr,
):
    """num_splits and min_split are runtime arguments: the split count follows the batch and the table width, and a
    constant would compile a variant per value while serving. The page size (PAGE) is the engine's, one value: a
    constant, so a token's page and row are shifts, not divisions. A sequence uses _used_slices of the num_splits
    slices (a short context in a wide table: few, each partial output worth its traffic); the slices past those are
    empty. WIDE_H (0: none): the wide mode's head block, all H heads. A sequence of wide_from tokens or more is split
    head_blocks x num_splits ways instead, each of the launch's programs taking one slice with every head, so each
    tile is read once, not once per head block (triton_mla_decode's wide_from). REREAD: the latent tile loaded a
    second time for the P.V product (triton_mla_decode's reread_tile). PDL: kernels.pdl."""
    pdl_enter(PDL)
    i_hb, i_split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    mid_stride = num_splits * tl.num_programs(0) if WIDE_H > 0 else num_splits
    heads = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    if WIDE_H > 0:
        if ctx >= wide_from:  # every head, slice i_hb * num_splits + i_split of mid_stride
            _attend_slice(q_ptr, qr_ptr, cache_ptr, bt_ptr, bt_stride, mid_o_ptr, mid_lse_ptr, b, tl.arange(0, WIDE_H),
                          ctx, i_hb * num_splits + i_split, mid_stride, mid_stride, min_split, q_stride_b, q_stride_h,
                          qr_stride_b, qr_stride_h, page_stride, token_stride, scale, PAGE, H, R, DR, BR, BDR, WIDE_H,
                          BLOCK_N, IEEE, LAZY_SLACK, REREAD)
        else:
            _attend_slice(q_ptr, qr_ptr, cache_ptr, bt_ptr, bt_stride, mid_o_ptr, mid_lse_ptr, b, heads, ctx, i_split,
                          num_splits, mid_stride, min_split, q_stride_b, q_stride_h, qr_stride_b, qr_stride_h,
                          page_stride, token_stride, scale, PAGE, H, R, DR, BR, BDR, BLOCK_H, BLOCK_N, IEEE, LAZY_SLACK,
                          REREAD)
    else:  # the same call as just above: a launch without the wide mode compiles no branch for it
        _attend_slice(q_ptr, qr_ptr, cache_ptr, bt_ptr, bt_stride, mid_o_ptr, mid_lse_ptr, b, heads, ctx, i_split,
                      num_splits, mid_stride, min_split, q_stride_b, q_stride_h, qr_stride_b, qr_stride_h, page_stride,
                      token_stride, scale, PAGE, H, R, DR, BR, BDR, BLOCK_H, BLOCK_N, IEEE, LAZY_SLACK, REREAD)


@triton.jit(do_not_specialize=["num_splits", "mid_stride"])  # as the split kernel's: any step's contexts, one variant
def _mla_decode_merge_kernel(mid_o_ptr, mid_lse_ptr, lens_ptr, o_ptr, num_splits, min_split, mid_stride, wide_from,
                             H: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, BLOCK_N: tl.constexpr,
                             SLICES: tl.constexpr, PDL: tl.constexpr):
    """One (sequence, head) and BR of its R columns (program axis 1): the used slices' outputs weighted by exp(lse -
    max) (the split kernel's rule for how many slices a context uses and how long each is: of num_splits, or of
    mid_stride, each row's slots, from wide_from tokens; a slice past the context, lse -inf, weighs 0), SLICES slices
    a step."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)  # b * H + h
    ctx = tl.load(lens_ptr + row // H).to(tl.int32)
    used = _used_slices(ctx, tl.where(ctx >= wide_from, mid_stride, num_splits), min_split, BLOCK_N)
    offs_r = tl.program_id(1) * BR + tl.arange(0, BR)
    mr = offs_r < R
    offs_s = tl.arange(0, SLICES)
    lse_row = mid_lse_ptr + row * mid_stride
    m = tl.full([SLICES], float("-inf"), tl.float32)
    for s0 in range(0, used, SLICES):
        m = tl.maximum(m, tl.load(lse_row + s0 + offs_s, mask=s0 + offs_s < used, other=float("-inf")))
    m_all = tl.max(m, axis=0)  # finite: slice 0 is never empty (contexts are >= 1 token)
    acc = tl.zeros([BR], dtype=tl.float32)
    total = 0.0
    for s0 in range(0, used, SLICES):
        s = s0 + offs_s
        w = tl.exp(tl.load(lse_row + s, mask=s < used, other=float("-inf")) - m_all)  # [SLICES]
        part = tl.load(mid_o_ptr + (row * mid_stride + s[:, None]) * R + offs_r[None, :],
                       mask=(s[:, None] < used) & mr[None, :], other=0.0)
        acc += tl.sum(tl.where(w[:, None] > 0, w[:, None] * part, 0.0), axis=0)  # an empty slice's was never written
        total += tl.sum(w, axis=0)
    tl.store(o_ptr + row * R + offs_r, (acc / total).to(o_ptr.dtype.element_ty), mask=mr)


def num_splits(batch: int, head_blocks: int, max_tokens: int, min_split: int = MIN_SPLIT_TOKENS) -> int:
    """Context slices per (sequence, head block) at most: enough programs to fill the GPU when the contexts fill
    the table (max_tokens), a slice at least min_split tokens. Depends on shapes only, so a CUDA graph captures one
    value; each sequence uses as many as its own context needs."""
    want = triton.cdiv(_TARGET_PROGRAMS, batch * head_blocks)
    return max(1, min(want, triton.cdiv(max_tokens, min_split)))


def merge_tiles(rows: int, R: int, splits: int) -> tuple[int, int]:
    """(slices a step, columns a program) of the merge kernel for rows (sequence, head) pairs of R latent columns
    and splits slices each: columns split until there are MERGE_PROGRAMS programs or MERGE_MIN_COLS columns a
    program, then as many slices a step as fill MERGE_TILE (no more than the launch has). Powers of two."""
    col_blocks = min(triton.cdiv(R, MERGE_MIN_COLS), triton.next_power_of_2(triton.cdiv(MERGE_PROGRAMS, rows)))
    cols = triton.next_power_of_2(triton.cdiv(R, col_blocks))
    return min(triton.next_power_of_2(splits), max(1, MERGE_TILE // cols)), cols


def triton_mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, min_split: int = MIN_SPLIT_TOKENS,
                      max_head_block: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, splits: int | None = None, pdl: bool = True,
                      block_n: int | None = None, lazy_slack: float = LAZY_SLACK, merge_slices: int | None = None,
                      merge_cols: int | None = None, reread_tile: bool | None = None,
                      wide_from: int | None = WIDE_FROM) -> torch.Tensor:
    """Same contract as attention.mla_decode: q_latent [B, H, R], q_rope [B, H, Dr], cache [P, page, R+Dr] (in
    q_latent's dtype or float8_e4m3fn), block_tables [B, max_blocks], context_lens [B] (>= 1 each). Returns [B, H, R]
    in q_latent's dtype. Only the first context_lens[b] tokens of each table are read; entries past them may hold
    anything. The launch knobs (shortest long-context slice, heads a program, warps, pipeline stages, slices at most:
    num_splits' by default, context tokens an inner step: a power of two >= 16) have the defaults the benchmark
    chose; kernels_bench and mla_decode_ab sweep them. One sequence: 16 heads a program (twice the programs: a
    short context's step is latency), 4 warps, 32 tokens a step; a batch: 32 heads (the latents read once for all
    heads), 8 warps, 64 tokens a step (bf16; float32 keeps 4 warps and 32 tokens); NUM_STAGES stages (float32:
    NUM_STAGES_FLOAT32, whose tiles are twice as wide). merge_slices and merge_cols: the merge kernel's slices a step
    and latent columns a program, merge_tiles' by default (for the batch's power of two and the most slices it can
    have, so that every table width shares one merge variant). reread_tile: load each latent tile twice, once for
    each product; on by default for a float8 cache. A float8 tile's one load feeds both products, each in a
    shared-memory layout of its own, and Triton's pipeliner leaves such a load synchronous (into registers, then
    copied for each product); loaded twice, each load has one product and both stream in asynchronously, at twice
    the L2 reads (faster at every context timed: BENCHMARKS.md, stop 43). A bf16 tile's one load is pipelined
    already.
    wide_from (None: off): a sequence of at least this many context tokens is attended by every program of the launch
    with all heads at once, each over its own slice of the context (head blocks x slices of them), so each tile is
    read once, not once per head block. Where a launch has one head block (a batch's 32 heads), or its table holds
    fewer than wide_from tokens (a model length below it), the wide path is not compiled in: compiled in, it costs
    the other path registers. All heads a program stream faster from 256k tokens, about as fast at 128k (faster
    than the 16-head path with the wide path compiled in) and slower at 32k and below, so WIDE_FROM is the default
    (BENCHMARKS.md, stop 44); a CUDA graph's launch cannot follow the context, this choice inside the kernel can."""
    B, H, R = q_latent.shape
    DR = q_rope.shape[-1]
    page = cache.shape[1]
    assert cache.shape[2] == R + DR and cache.stride(2) == 1 and q_latent.stride(2) == 1 and q_rope.stride(2) == 1
    assert block_tables.stride(1) == 1 and context_lens.is_contiguous()
    if (merge_slices is not None and (merge_slices < 1 or merge_slices & (merge_slices - 1))) or (
            merge_cols is not None and merge_cols < 1):
        raise ValueError(f"merge_slices must be a power of two and merge_cols positive; got {merge_slices}, "
                         f"{merge_cols}")
    max_head_block = max_head_block or (16 if B == 1 else 32)
    batch_tiles = B > 1 and q_latent.element_size() <= 2  # float32 tiles of 64 tokens would not fit in shared memory
    num_warps = num_warps or (8 if batch_tiles else 4)
    block_n = block_n or (2 * _BLOCK_N if batch_tiles else _BLOCK_N)
    num_stages = num_stages or (NUM_STAGES_FLOAT32 if q_latent.dtype == torch.float32 else NUM_STAGES)
    block_h = max(min(triton.next_power_of_2(H), max_head_block), 16)  # tl.dot needs 16 rows
    head_blocks = triton.cdiv(H, block_h)
    table_tokens = block_tables.shape[1] * page
    # the merge's tiles follow the batch's power of two P and the most slices a sequence of a batch of P/2+1 to P
    # (the smallest has the most) can use in a table of any width, not this table's: an eager decode beside a prompt
    # meets every width, and one merge variant then serves them all (the engine's warm-up builds one at each power)
    most_splits = splits or num_splits(triton.next_power_of_2(B) // 2 + 1, head_blocks, 2**31 - 1, min_split)
    splits = splits or num_splits(B, head_blocks, table_tokens, min_split)
    wide_mode = wide_from is not None and head_blocks > 1 and table_tokens >= wide_from
    slots = splits * head_blocks if wide_mode else splits  # each (sequence, head)'s partial outputs
    mid_o = torch.empty(B, H, slots, R, dtype=torch.float32, device=q_latent.device)
    mid_lse = torch.empty(B, H, slots, dtype=torch.float32, device=q_latent.device)
    wide_from = max(1, wide_from) if wide_mode else 2**31 - 1  # never, as an int32 context length
    q_rope = q_rope.to(q_latent.dtype)
    if reread_tile is None:
        reread_tile = cache.element_size() == 1
    _mla_decode_split_kernel[(head_blocks, splits, B)](
        q_latent, q_rope, cache, block_tables, context_lens, mid_o, mid_lse,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), block_tables.stride(0),
        cache.stride(0), cache.stride(1), scale, splits, min_split, wide_from, PAGE=page,
        H=H, R=R, DR=DR, BR=triton.next_power_of_2(R), BDR=max(16, triton.next_power_of_2(DR)), BLOCK_H=block_h,
        BLOCK_N=block_n, WIDE_H=triton.next_power_of_2(H) if wide_mode else 0, IEEE=q_latent.dtype == torch.float32,
        LAZY_SLACK=lazy_slack, REREAD=reread_tile,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(q_latent.device, pdl),
    )
    out = torch.empty(B, H, R, dtype=q_latent.dtype, device=q_latent.device)
    most_slots = most_splits * head_blocks if wide_mode else most_splits
    auto_slices, auto_cols = merge_tiles(triton.next_power_of_2(B) * H, R, most_slots)
    merge_slices = merge_slices or auto_slices
    merge_br = triton.next_power_of_2(merge_cols or auto_cols)
    _mla_decode_merge_kernel[(B * H, triton.cdiv(R, merge_br))](
        mid_o, mid_lse, context_lens, out, splits, min_split, slots, wide_from, H=H, R=R, BR=merge_br, BLOCK_N=block_n,
        SLICES=merge_slices, num_warps=4, **pdl_args(q_latent.device, pdl))
    return out
