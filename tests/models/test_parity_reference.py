"""deltaserve in float32 is the reference (transformers.models.kimi_linear) on small random models.

Each case builds a reference model from one of helpers.reference.SPECS (they vary KDA heads and head dims, MLA
heads / kv_lora_rank / nope / rope / v dims, expert count, top-k, expert groups, which layers are KDA or MLA,
which are dense, the conv kernel), writes it in the three checkpoint layouts, and loads it with deltaserve.
Prompts of 1, 63, 64, 65 and 200 tokens cross the KDA chunk boundaries (chunk size 64).
"""

from __future__ import annotations

from functools import cached_property

import pytest
import torch
from helpers.hand_runner import HandRunner, prefill_logits, relative_error
from helpers.reference import LAYOUTS, SPECS, build_reference, reference_greedy, reference_logits, save_layouts
from safetensors import safe_open

from deltaserve import LLM, SamplingParams
from deltaserve.config import ModelConfig
from deltaserve.loader.model_loader import load_model

PROMPT_LENS = (1, 63, 64, 65, 200)
NUM_TOKENS = 32
PREFILL_RTOL = 1e-4  # deltaserve vs the reference: different kernels, same float32 math
DECODE_RTOL = 1e-5  # deltaserve's recurrent decode vs deltaserve's chunked prefill over the same tokens


class Case:
    """One reference model, its three checkpoint folders, deltaserve's model loaded from the saved one."""

    def __init__(self, name: str, seed: int, root):
        self.name = f"{name}-seed{seed}"
        self.ref = build_reference(SPECS[name], seed)
        self.folders = save_layouts(self.ref, root)
        self.cfg = ModelConfig.from_file(self.folders["saved"])
        self.model = load_model(self.folders["saved"], self.cfg, torch.float32, "cpu")
        gen = torch.Generator().manual_seed(1000 + seed)
        self.prompts = [torch.randint(3, self.cfg.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]

    @cached_property
    def ref_greedy(self) -> list[list[int]]:
        return [reference_greedy(self.ref, p, NUM_TOKENS) for p in self.prompts]


CASES = [("hybrid", 0), ("hybrid", 5), ("mla_first_dense_middle", 1), ("kda_only", 2), ("mla_only", 3), ("deep", 4),
         ("deep", 6)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{name}-seed{seed}" for name, seed in CASES])
def case(request, tmp_path_factory) -> Case:
    name, seed = request.param
    return Case(name, seed, tmp_path_factory.mktemp(f"{name}-seed{seed}"))


def test_every_layout_loads_the_same_weights(case):
    expected_logits = prefill_logits(case.model, case.prompts[3])
    tensor_names = {}
    for layout in LAYOUTS:
        with safe_open(str(case.folders[layout] / "model.safetensors"), framework="pt") as f:
            tensor_names[layout] = set(f.keys())
        cfg = ModelConfig.from_file(case.folders[layout])
        assert cfg == case.cfg, f"{layout}: config.json parses differently"
        model = load_model(case.folders[layout], cfg, torch.float32, "cpu")
        for (name, got), (_, want) in zip(model.named_parameters(), case.model.named_parameters()):
            assert torch.equal(got, want), f"{layout}: parameter {name} differs from the saved layout's"
        assert torch.equal(prefill_logits(model, case.prompts[3]), expected_logits), layout
    # the layouts really spell the names differently (saved and Moonshot's differ only in dense layers)
    assert tensor_names["saved"] != tensor_names["transformers"]
    assert (tensor_names["saved"] != tensor_names["moonshot"]) == ("dense" in case.cfg.mlp_types)


def test_prefill_logits_match_reference(case):
    for prompt in case.prompts:
        runner = HandRunner(case.model, seed=len(prompt))
        logits = runner.step([(runner.new_sequence(), prompt)])[0]
        err = relative_error(logits, reference_logits(case.ref, prompt))
        assert err <= PREFILL_RTOL, f"{case.name}, prompt of {len(prompt)}: relative error {err:.2e}"
        assert runner.untouched_slots_intact()


def test_packed_prefill_of_all_prompts_matches_reference(case):
    """All prompts in one forward pass (the 1-token one takes the decode path), pages scattered at random."""
    runner = HandRunner(case.model, seed=7)
    all_logits = runner.step([(runner.new_sequence(), p) for p in case.prompts])
    for prompt, logits in zip(case.prompts, all_logits):
        err = relative_error(logits, reference_logits(case.ref, prompt))
        assert err <= PREFILL_RTOL, f"{case.name}, prompt of {len(prompt)}: relative error {err:.2e}"
    assert runner.untouched_slots_intact()


@pytest.mark.parametrize("engine_options", [
    dict(),  # every prompt prefilled in one step, then batched decode
    dict(max_num_batched_tokens=24, block_size=8),  # chunked prefill: chunks that do not align with KDA's 64
    dict(max_num_seqs=2),  # requests wait, then reuse the pages and state slots of finished ones
    # 256 cached tokens for the 553 the prompts and outputs need, 32-token steps: preemption and recomputation
    dict(num_cache_blocks=16, block_size=16, max_num_batched_tokens=32),
], ids=["one-step-prefill", "chunked-prefill", "slot-reuse", "preemption"])
def test_greedy_generation_matches_reference(case, engine_options):
    llm = LLM(str(case.folders["saved"]), device="cpu", max_model_len=512, **engine_options)
    outputs = llm.generate([{"prompt_token_ids": p} for p in case.prompts],
                           SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out, expected in zip(case.prompts, outputs, case.ref_greedy):
        assert out.outputs[0].token_ids == expected, f"{case.name}, prompt of {len(prompt)}"
        assert out.outputs[0].finish_reason == "length"


def test_step_by_step_decode_matches_one_prefill(case):
    """Prefill the prompt, then feed the greedy tokens one at a time (two sequences decoding together while a
    third prefills in chunks): every step's logits equal one prefill's over the same tokens."""
    picks = [3, 0, 4]  # prompts of 65, 1 and 200 tokens
    tokens = [case.prompts[i] + case.ref_greedy[i] for i in picks]
    full = [prefill_logits(case.model, t[:-1]) for t in tokens]

    runner = HandRunner(case.model, seed=3)
    seqs = [runner.new_sequence() for _ in picks]
    got = [[] for _ in picks]
    prompt_lens = [len(case.prompts[i]) for i in picks]
    # the third sequence prefills in chunks of 37 tokens while the others decode
    for i, logits in enumerate(runner.step([(s, tokens[j][:prompt_lens[j]]) for j, s in enumerate(seqs[:2])])):
        got[i].append(logits)
    pos = [prompt_lens[0], prompt_lens[1], 0]
    while any(pos[j] < len(tokens[j]) - 1 for j in range(3)):
        work, who = [], []
        for j in range(3):
            if pos[j] < len(tokens[j]) - 1:
                n = 1 if j < 2 or pos[j] >= prompt_lens[2] else min(37, prompt_lens[2] - pos[j])
                work.append((seqs[j], tokens[j][pos[j]: pos[j] + n]))
                who.append(j)
                pos[j] += n
        for j, logits in zip(who, runner.step(work)):
            got[j].append(logits)
    for j in range(3):
        stepped = torch.cat(got[j])
        err = relative_error(stepped, full[j])
        assert err <= DECODE_RTOL, f"{case.name}, sequence {j}: relative error {err:.2e}"
        start = prompt_lens[j] - 1
        assert stepped[start:].argmax(-1).tolist() == tokens[j][start + 1:], f"{case.name}, sequence {j}"
    assert runner.untouched_slots_intact()
