"""KDA's short causal depthwise conv (+ SiLU) over packed sequences, with per-request conv state slots."""

import torch
import torch.nn.functional as F

from deltaserve.forward_batch import PackedSeqs
from deltaserve.kernels.varlen import pack_seqs


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor,
                         pdl: bool = True):
    """One new token per sequence (pdl: the GPU kernel's programmatic dependent launch, kernels.pdl).

    x: [B, D]; weight: [D, W]; conv_state: [S, D, W-1] (the last W-1 inputs), updated in place at state_slots [B].
    Returns silu(conv) [B, D]."""
    if x.is_cuda:
        from deltaserve.kernels.conv1d_triton import conv1d_update

        return conv1d_update(x, weight, conv_state, state_slots, pdl)
    # batch 1 on the CPU: the state row as a view, no gather and scatter (same sums); not while torch.compile traces
    # a decode step (runner.model_runner, compile_decode): int() reads the slot on the host, a graph break
    if x.shape[0] == 1 and not torch.compiler.is_compiling():
        state = conv_state[int(state_slots)]  # [D, W-1]
        window = torch.cat([state, x.t()], dim=-1)  # [D, W]
        state.copy_(window[:, 1:])
        return F.silu((window * weight).sum(-1))[None]
    window = torch.cat([conv_state.index_select(0, state_slots), x[:, :, None]], dim=-1)  # [B, D, W]
    conv_state.index_copy_(0, state_slots, window[:, :, 1:])
    return F.silu((window * weight).sum(-1))


def causal_conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: list[int], cu_seqlens: list[int],
    packed: PackedSeqs | None = None, groups: int = 1,
) -> torch.Tensor:
    """Packed sequences; sequence b continues from conv_state[state_slots[b]] and leaves its last inputs there.

    x: [N, D]; weight: [D, W]; conv_state: [S, D, W-1]; cu_seqlens: B+1 host offsets. Returns silu(conv) [N, D], or
    with groups > 1 as [N, groups, D / groups] (KDA's q, k and v), each group's [N, D / groups] contiguous on a GPU
    (fla-core copies strided inputs), a view of [N, D] here. On a GPU, two Triton kernels
    (kernels.conv1d_triton.conv1d_varlen) over `packed`, the same sequences as tensors (made here when not given)."""
    if x.is_cuda:
        from deltaserve.kernels.conv1d_triton import conv1d_varlen

        return conv1d_varlen(x, weight, conv_state, packed or pack_seqs(state_slots, cu_seqlens, x.device), groups)
    D, W = weight.shape
    y = torch.empty_like(x)
    for b, slot in enumerate(state_slots):
        seq = x[cu_seqlens[b]: cu_seqlens[b + 1]]
        padded = torch.cat([conv_state[slot], seq.t()], dim=1)  # [D, W-1+T]
        y[cu_seqlens[b]: cu_seqlens[b + 1]] = F.conv1d(padded[None], weight[:, None, :], groups=D)[0].t()
        conv_state[slot] = padded[:, padded.shape[1] - (W - 1):]
    y = F.silu(y)
    return y if groups == 1 else y.view(y.shape[0], groups, D // groups)


def conv_states_at(x: torch.Tensor, conv_state: torch.Tensor, snapshots: torch.Tensor, state_slots: torch.Tensor,
                   snapshot_slots: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> None:
    """The conv states some sequences reach partway through x (prefix caching's saves inside a prefill chunk), with
    no conv run: sequence i continues conv_state[state_slots[i]] with the inputs x[starts[i]:ends[i]] ([N, D] rows)
    and snapshots[snapshot_slots[i]] gets its state then (its last W-1 inputs, those before starts[i] from
    conv_state). Index tensors [S] int64 on x's device. Call before causal_conv1d_varlen moves conv_state on."""
    if x.is_cuda:
        from deltaserve.kernels.conv1d_triton import conv1d_states_at

        return conv1d_states_at(x, conv_state, snapshots, state_slots, snapshot_slots, starts, ends)
    W1 = conv_state.shape[-1]
    for slot, snapshot, start, end in zip(*(t.tolist() for t in (state_slots, snapshot_slots, starts, ends))):
        window = torch.cat([conv_state[slot], x[start:end].t()], dim=1)  # [D, W-1 + tokens]
        snapshots[snapshot] = window[:, window.shape[1] - W1:]
