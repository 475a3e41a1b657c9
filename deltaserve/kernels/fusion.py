"""Elementwise chains fused into one GPU kernel by torch.compile; the same function runs eagerly on the CPU.

A decode step on a GPU is bound by launches, not bytes: an RMSNorm written in torch ops is six kernels, compiled
it is one. The eager function stays the spec (it is what runs on the CPU and in the tests' float32 runs)."""

from __future__ import annotations

import functools

import torch

RECOMPILE_LIMIT = 64


def fused_on_gpu(fn):
    """fn, compiled (dynamic shapes, whole graph) when its first argument is a CUDA tensor, eager otherwise."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        if not args[0].is_cuda:
            return fn(*args, **kwargs)
        if compiled is None:
            # one specialisation per dtype, eps, rank and layout met: several models in one process (tests, a server
            # restarting its engine) pass dynamo's default of 8 per function, which fails hard under fullgraph
            # (recompile_limit since torch 2.7; cache_size_limit before, still its alias)
            config = torch._dynamo.config
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        return compiled(*args, **kwargs)

    wrapper.eager = fn
    return wrapper

