"""Engine-level test helpers: one tiny model per session, LLMs that must end idle, prompts and mixed sampling.

Every LLM runs with threads=1: on a shared 2-core machine torch's second thread spins against other jobs and
slows small steps a hundredfold.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.entrypoints.make_tiny import make_tiny

# 1 to 300 tokens, across KDA's 64-token chunk boundaries and the 16-token pages
PROMPT_LENS = (1, 2, 5, 15, 16, 17, 40, 63, 64, 65, 100, 128, 160, 200, 257, 300)
LOGPROB_ATOL = 1e-4  # one row's log_softmax alone vs in a batch: same float32 math, other matmul shapes
_TINY: dict[str, Path] = {}


def tiny_model_dir(tmp_path_factory) -> Path:
    """The make-tiny model (vocab 512, hidden 64, KDA and MLA layers, MoE, a tokenizer), written once a session."""
    if "tiny" not in _TINY:
        _TINY["tiny"] = make_tiny(tmp_path_factory.mktemp("tiny_model") / "model", seed=0)
    return _TINY["tiny"]


def without_tokenizer(model_dir: Path, out: Path) -> Path:
    """A copy of model_dir with only config.json and the weights: token ids in, token ids out."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, out / name)
    return out


class LLMFactory:
    """Builds LLMs on one model folder; check_idle() asserts that every one gave back all its pages and slots."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.made: list[LLM] = []

    def __call__(self, model_dir: Path | None = None, **options) -> LLM:
        options.setdefault("max_model_len", 512)
        options.setdefault("threads", 1)
        llm = LLM(str(model_dir or self.model_dir), device="cpu", **options)
        self.made.append(llm)
        return llm

    def check_idle(self) -> None:
        for llm in self.made:
            assert_idle(llm)


def assert_idle(llm: LLM) -> None:
    """No request left anywhere in the engine, and both pools full again."""
    engine = llm.engine
    cache = engine.scheduler.cache
    assert not engine.has_unfinished_requests(), f"requests left: {list(engine.scheduler.requests)}"
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    assert cache.num_free_blocks == cache.num_blocks, f"{cache.num_blocks - cache.num_free_blocks} pages not freed"
    assert cache.num_free_slots == cache.state_pool.num_slots, "a KDA state slot was not freed"
    if cache.snapshots is not None:  # prefix caching: every snapshot slot free or cached, none held or pinned
        assert cache.snapshots.num_available == cache.snapshots.num_slots, "a KDA snapshot slot is still held"
    assert not engine._tracked, f"the engine still tracks {list(engine._tracked)}"


def random_prompts(lengths, vocab_size: int = 512, seed: int = 0, low: int = 5) -> list[list[int]]:
    """One prompt of random token ids in [low, vocab_size) per length (ids below low are special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab_size, (n,), generator=gen).tolist() for n in lengths]


# Every kind of sampling the engine supports; the sampled kinds are seeded so that their tokens are comparable.
SAMPLING_KINDS = (
    dict(temperature=0),
    dict(temperature=0.8, top_p=0.9, seed=11),
    dict(temperature=1.0, top_k=5, seed=12),
    dict(temperature=1.2, seed=13, logprobs=2, prompt_logprobs=1),
    dict(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
    dict(temperature=1.0, min_p=0.1, seed=14),
    dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05, frequency_penalty=1.0, seed=15, logprobs=3),
)


def mixed_params(num: int, min_tokens: int = 6, **overrides) -> list[SamplingParams]:
    """num SamplingParams cycling through SAMPLING_KINDS (updated with overrides), max_tokens varying from
    min_tokens to min_tokens + 12."""
    kinds = [{**kind, **overrides} for kind in SAMPLING_KINDS]
    return [SamplingParams(max_tokens=min_tokens + (i * 5) % 13, ignore_eos=True, **kinds[i % len(kinds)])
            for i in range(num)]


def as_inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def generate_alone(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Each prompt generated on its own, one after another on the same engine."""
    return [llm.generate(as_inputs([p]), sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]


def assert_same_logprobs(got, expected, label: str) -> None:
    """Two lists of {token id: Logprob} (None entries allowed): the same ids, values equal to rounding."""
    assert (got is None) == (expected is None), label
    for g_step, e_step in zip(got or [], expected or [], strict=True):
        assert (g_step is None) == (e_step is None), label
        assert (g_step or {}).keys() == (e_step or {}).keys(), label
        for token_id in g_step or {}:
            assert g_step[token_id].logprob == pytest.approx(e_step[token_id].logprob, abs=LOGPROB_ATOL), label


def assert_same_outputs(got, expected, label: str) -> None:
    """Prompts, tokens and finish reasons equal; logprobs and prompt logprobs equal to rounding."""
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        where = f"{label}: prompt {i} ({len(e.prompt_token_ids)} tokens)"
        assert g.prompt_token_ids == e.prompt_token_ids, where
        assert_same_logprobs(g.prompt_logprobs, e.prompt_logprobs, where)
        g, e = g.outputs[0], e.outputs[0]
        assert g.token_ids == e.token_ids, where
        assert g.finish_reason == e.finish_reason == "length", where
        assert_same_logprobs(g.logprobs, e.logprobs, where)


def record_steps(llm: LLM) -> list[tuple[int, bool]]:
    """Wrap the engine's scheduler to record, for each step it schedules with tokens, its decode steps (1 + its
    lookahead) and whether it was scheduled while a step before it was in flight (a running request had outputs
    pending)."""
    scheduler = llm.engine.scheduler
    seen, schedule = [], scheduler.schedule

    def recording():
        ahead = any(r.num_pending_outputs for r in scheduler.running)
        out = schedule()
        if out.num_scheduled_tokens:
            seen.append((1 + max(out.num_lookahead_tokens.values(), default=0), ahead))
        return out

    scheduler.schedule = recording
    return seen


def assert_same_up_to_near_ties(got, expected, TIE=0.1):
    """The same tokens, or up to the first difference, where the token `got` took is one of `expected`'s returned
    logprobs within TIE of its top one: a near-tie of expected's own distribution (a random bf16 model's logits are
    flat, so the token taken may be the third or fourth, not only the second)."""
    i = next((i for i, (a, b) in enumerate(zip(got.token_ids, expected.token_ids)) if a != b), None)
    if i is None:
        return
    scores = {t: p.logprob for t, p in expected.logprobs[i].items()}
    took = got.token_ids[i]
    ranked = sorted(scores.items(), key=lambda kv: -kv[1])
    assert took in scores and ranked[0][1] - scores[took] < TIE, (i, took, ranked)


def with_bos(model_dir: Path, out: Path) -> Path:
    """A copy of model_dir whose tokenizer.json adds a BOS to encoded text (a TemplateProcessing post-processor, as
    Llama's does) and whose chat template writes `{{ bos_token }}` first: a chat prompt must get one BOS, not two."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    bos = config["bos_token"]
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    bos_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == bos)
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    config["chat_template"] = "{{ bos_token }}" + config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out
