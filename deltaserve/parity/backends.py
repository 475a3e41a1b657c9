"""The two models parity runs: transformers' KimiLinearForCausalLM (the reference) and deltaserve's engine.

Both answer the same two questions:
    greedy(prompts, max_tokens)  -> per prompt its greedy tokens and, per token, the top-2 ids and logit margin
    teacher_forced(prompt, continuation) -> logits [M, V] float32 at the M positions that predict continuation"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.parity.defaults import REFERENCES
from deltaserve.parity.logits import top2

_MAX_BATCH = 8


@dataclass
class Greedy:
    output_token_ids: list[int]
    top2: list[tuple[int, int, float]]  # per output token: best id, runner-up id, their logit gap


class DeltaserveBackend:
    """The engine's own greedy path (continuous batching, paged cache) and a one-pass teacher-forced forward."""

    name = "deltaserve"

    def __init__(self, model_dir: str, dtype: str, device: str | None, max_model_len: int, max_num_seqs: int,
                 quantization: str | None = None, kv_cache_dtype: str = "auto"):
        from deltaserve.entrypoints.llm import LLM

        self.llm = LLM(model_dir, dtype=dtype, device=device, max_model_len=max_model_len,
                       max_num_seqs=max(1, min(max_num_seqs, 32)), quantization=quantization,
                       kv_cache_dtype=kv_cache_dtype)
        self.model = self.llm.engine.model
        self.latent_dtype = getattr(torch, self.llm.engine.cache_plan.latent_dtype)

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[Greedy]:
        from deltaserve.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [Greedy(o.outputs[0].token_ids, [_top2_of(entry) for entry in o.outputs[0].logprobs]) for o in outputs]

    def teacher_forced(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        from deltaserve.parity.sequence import sequence_logits

        return sequence_logits(self.model, prompt + continuation[:-1], len(prompt) - 1, self.latent_dtype)


def _top2_of(entry: dict) -> tuple[int, int, float]:
    """A sampled position's logprobs (asked with logprobs=2) -> (best, runner-up, gap); the gap of logprobs is
    the gap of logits, the normaliser cancels."""
    (best, a), (second, b) = sorted(entry.items(), key=lambda kv: kv[1].rank)[:2]
    return best, second, max(a.logprob - b.logprob, 0.0)


class TransformersBackend:
    """transformers.models.kimi_linear, prompts of equal length batched; greedy by our own loop over its logits
    (no generation config, logits processor or eos handling can change which token is the argmax)."""

    name = "transformers"

    def __init__(self, model_dir: str, dtype: str, device: str | None):
        try:
            from transformers import KimiLinearForCausalLM
        except ImportError:
            raise ValueError("--reference transformers needs transformers >= 5.24 (pip install "
                             "'deltaserve[parity]'), or pass --reference deltaserve") from None
        from deltaserve.distributed import check_device
        from deltaserve.loader.model_loader import DTYPES

        check_device(device or "cpu")
        self.device = torch.device(device or "cpu")
        self.model = KimiLinearForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(self.device).eval()
        # the reference's cache serves only models with a full-attention layer; others recompute every step
        self.cached = "full_attention" in self.model.config.layer_types

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[Greedy]:
        results: dict[int, Greedy] = {}
        for group in _equal_length_groups([len(p) for p in prompts]):
            ids = torch.tensor([prompts[i] for i in group], device=self.device)
            logits = self._greedy_logits(ids, max_tokens)  # [B, M, V]
            for i, row in zip(group, logits):
                results[i] = Greedy(row.argmax(-1).tolist(), top2(row))
        return [results[i] for i in range(len(prompts))]

    @torch.inference_mode()
    def _greedy_logits(self, ids: torch.Tensor, max_tokens: int) -> torch.Tensor:
        """ids [B, P] -> the logits [B, M, V] float32 of each greedy step (step t's argmax is fed at t + 1)."""
        steps = []
        out = self.model(ids, use_cache=self.cached, logits_to_keep=1)
        for step in range(max_tokens):
            steps.append(out.logits[:, -1].float())
            if step + 1 == max_tokens:
                break
            next_ids = steps[-1].argmax(-1, keepdim=True)  # [B, 1]
            ids = torch.cat([ids, next_ids], dim=1)
            out = (self.model(next_ids, cache=out.cache, use_cache=True, logits_to_keep=1)
                   if self.cached else self.model(ids, use_cache=False, logits_to_keep=1))
        return torch.stack(steps, dim=1)

    @torch.inference_mode()
    def teacher_forced(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + continuation[:-1]], device=self.device)
        return self.model(ids, use_cache=False).logits[0, len(prompt) - 1:].float()


def _equal_length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices grouped by length (no padding anywhere), at most _MAX_BATCH a group."""
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(n, []).append(i)
    return [ids[s: s + _MAX_BATCH] for ids in by_length.values() for s in range(0, len(ids), _MAX_BATCH)]


def open_backend(name: str, model_dir: str, dtype: str, device: str | None, max_model_len: int, num_prompts: int):
    if name == "transformers":
        return TransformersBackend(model_dir, dtype, device)
    if name == "deltaserve":
        return DeltaserveBackend(model_dir, dtype, device, max_model_len, num_prompts)
    raise ValueError(f"unknown reference {name!r}: expected one of {', '.join(REFERENCES)}")
