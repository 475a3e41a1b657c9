"""Fused attention with its log-sum-exp for MLA prefill on the GPU in half precision.

A prefill chunk attends to its own tokens (causal) and to the cached prefix (every key visible), the prefix in
blocks of keys expanded one at a time; each part comes back with its log-sum-exp, so the parts merge exactly
(attention.merge_blocks) and no context length needs all its keys expanded at once.

The work goes to PyTorch's fused attention ops, which never materialise the scores. Keys are 192 wide (nope 128
+ the shared rope 64) and values 128. Backends, tried in this order the first time a device and dtype are seen,
the first one that runs these shapes is kept:

  cudnn       cuDNN's fused attention, which takes different key and value widths as they are (query counts
              padded to a few lengths: cuDNN plans each new shape once, at tens of milliseconds)
  flash       FlashAttention-2, with the values zero-padded to the keys' width (it needs one head size)
  efficient   the memory-efficient kernel (any widths; the slowest of the three on Hopper)

Twin: attention_lse_naive (float32 scores, plain softmax), the spec the tests hold each backend to."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

BACKENDS = ("cudnn", "flash", "efficient")
_chosen: dict[tuple[str, torch.dtype], str] = {}  # (device, dtype) -> the backend that ran there first
_contiguous: set[tuple[str, torch.dtype]] = set()  # where the chosen backend ran only on contiguous copies


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                  backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [L, H, D], v [L, H, Dv] -> (out [T, H, Dv] in q's dtype, lse [T, H] float32: the
    log-sum-exp of each query's scaled scores). causal: query t sees keys 0..t (T == L); else every key.

    backend: one of BACKENDS; None takes the one chosen for this device and dtype (probing on first use: each in
    BACKENDS' order, on the inputs as they lie, then on contiguous copies of strided ones, which every later call
    then makes if only they ran)."""
    if causal and q.shape[0] != k.shape[0]:
        raise ValueError(f"causal attention needs as many queries as keys, got {q.shape[0]} and {k.shape[0]}")
    if backend is not None:
        return _RUN[backend](q, k, v, scale, causal)
    key = (str(q.device), q.dtype)
    if key in _chosen:
        if key in _contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return _RUN[_chosen[key]](q, k, v, scale, causal)
    strided = not all(t.is_contiguous() for t in (q, k, v))  # the layer's queries and values are views
    for name in BACKENDS:
        for copies in (False, True) if strided else (False,):  # a backend that refuses strides keeps its place
            try:
                result = _RUN[name](*((q.contiguous(), k.contiguous(), v.contiguous()) if copies else (q, k, v)),
                                    scale, causal)
            except torch.OutOfMemoryError:  # not a missing kernel: never a reason to drop a backend for good
                raise
            except RuntimeError:  # this build or device has no kernel for these shapes (or strides): try on
                continue
            _chosen[key] = name
            if copies:
                _contiguous.add(key)
            return result
    raise RuntimeError(f"no fused attention backend ran q {list(q.shape)}, v {list(v.shape)} in {q.dtype} on "
                       f"{q.device}")


def attention_lse_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_lse in float32 with the whole [H, T, L] score matrix (the spec; small shapes only)."""
    scores = torch.einsum("thd,lhd->htl", q.float(), k.float()) * scale
    if causal:
        T = q.shape[0]
        scores.masked_fill_(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)  # [H, T]
    out = torch.einsum("htl,lhd->thd", (scores - lse[..., None]).exp(), v.float())
    return out.to(q.dtype), lse.t()


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[N, H, D] -> [1, H, N, D] (a view)."""
    return x.transpose(0, 1)[None]


def _result(out: torch.Tensor, lse: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ops' [1, H, T, Dv] output and [1, H, >= T(, 1)] log-sum-exp -> ([T, H, Dv], [T, H] float32)."""
    H = out.shape[1]
    return out[0].transpose(0, 1), lse.reshape(H, -1)[:, :T].t().float()


def _cudnn(q, k, v, scale: float, causal: bool):
    """cuDNN's kernel on shapes rounded up (padded): cuDNN builds an execution plan for each new shape, tens of
    milliseconds, so a server's ragged chunks would otherwise pay one for every new length."""
    return padded(_cudnn_as_is, q, k, v, scale, causal)


def _cudnn_as_is(q, k, v, scale: float, causal: bool):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), None, True, 0.0, causal, False, scale=scale)[:2]
    return _result(out, lse, q.shape[0])


def padded(run: Callable, q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """run(q, k, v, scale, causal) with the queries' count rounded up by padded_length: zero rows appended to the
    queries are dropped from the result; a causal call gets as many zero keys and values appended, which sit after
    every real query's own position, so the mask hides them. A non-causal call's keys are left as they are
    (mla_prefill_fused gives those a few lengths)."""
    T = q.shape[0]
    rows = padded_length(T) - T
    if rows:
        q = F.pad(q, (0, 0, 0, 0, 0, rows))
        if causal:
            k, v = F.pad(k, (0, 0, 0, 0, 0, rows)), F.pad(v, (0, 0, 0, 0, 0, rows))
    out, lse = run(q, k, v, scale, causal)
    return out[:T], lse[:T]


def padded_length(n: int) -> int:
    """n rounded up to a length of the form m * 2^e with 4 <= m < 8 (at least 64): four lengths an octave, so past
    64 a padded call has at most a quarter more queries (up to 1.56x a causal call's work), and a server's chunks
    (causal calls of up to 2,047 + 8,192 rows in mla_prefill_fused) meet 30 lengths, not thousands; its calls on a
    cached prefix of 2,048 keys or more add these query counts times a few key counts."""
    if n <= 64:
        return 64
    step = 1 << max((n - 1).bit_length() - 3, 0)
    return -(-n // step) * step


def _flash(q, k, v, scale: float, causal: bool):
    Dv = v.shape[-1]
    v_wide = F.pad(v, (0, q.shape[-1] - Dv)) if Dv < q.shape[-1] else v
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        _heads_first(q), _heads_first(k), _heads_first(v_wide), 0.0, causal, False, scale=scale)[:2]
    return _result(out[..., :Dv], lse, q.shape[0])


def _efficient(q, k, v, scale: float, causal: bool):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), None, True, 0.0, causal, scale=scale)[:2]
    return _result(out, lse, q.shape[0])


_RUN = {"cudnn": _cudnn, "flash": _flash, "efficient": _efficient}
