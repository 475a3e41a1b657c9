"""Train the bundled demo model: a small Kimi-Linear on the King James Bible, on the CPU, from a seed.

    apt-get install bible-kjv      # the corpus: Debian's bible-kjv-text, dumped by its `bible` command
    nice -n 19 python scripts/train_demo_model.py --out deltaserve/assets/demo-model

The model is transformers' KimiLinearForCausalLM (KDA and MLA layers, a dense first MLP, MoE with a shared
expert), trained with PyTorch autograd; one chapter in 20 is held out. The result is checked against deltaserve
(greedy tokens and log-probabilities) and written in Moonshot's checkpoint layout with a ChatML tokenizer.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers.models.kimi_linear.modeling_kimi_linear as kimi
from tokenizers import Tokenizer
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from deltaserve import LLM, SamplingParams
from deltaserve.config import ModelConfig
from deltaserve.entrypoints.make_tiny import kimi_raw_config
from deltaserve.loader.model_loader import load_model
from deltaserve.loader.writer import save_checkpoint
from deltaserve.tokenizer import load_tokenizer
from deltaserve.tokenizer.train import train_tiny_tokenizer

VOCAB = 4096
LAYERS = "KKMKKM"  # K = KDA, M = MLA; 2 to 1 as the 48B model's 3 to 1, MLA last as there
HELD_OUT_EVERY = 20  # chapter i is held out when i % 20 == 10
# generation_config.json: greedy decoding of a model this small soon loops on a phrase; these sample readable text
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}
CHAT_SHARE = 4  # one train chapter in 4 also becomes a ChatML conversation, so the model answers and stops


def raw_config(ids) -> dict:
    """config.json in Moonshot's spelling: 4.9M parameters, 19.6 MB as float32."""
    return kimi_raw_config(ids, LAYERS, vocab=VOCAB, hidden=192, intermediate=512, moe_intermediate=80, heads=4,
                           kv_lora_rank=64, nope=32, rope=16, v=32, kda_head_dim=48)


# ---- corpus ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Chapter:
    title: str  # "Genesis 1"
    verses: list[str]


def read_kjv(corpus_file: str | None) -> list[Chapter]:
    """The 1189 chapters of `bible -l 100000 gen1:1-rev22:21` (or of a file holding that output)."""
    if corpus_file:
        text = Path(corpus_file).read_text()
    elif shutil.which("bible") is None:
        sys.exit("error: the `bible` command is missing; run `apt-get install bible-kjv` (or pass --corpus-file)")
    else:
        text = subprocess.run(["bible", "-l", "100000", "gen1:1-rev22:21"], check=True, capture_output=True,
                              text=True).stdout
    chapters: list[Chapter] = []
    for line in filter(str.strip, text.splitlines()):
        verse = re.match(r"^\s+\d+ (.*)$", line)
        if verse:
            chapters[-1].verses.append(verse.group(1).strip())
        else:
            chapters.append(Chapter(line.strip(), []))
    return chapters


def chat_text(tokenizer, chapter: Chapter, rng: torch.Generator) -> str:
    """One to three turns: the user says a verse, the assistant answers with the next one or two."""
    messages, i = [], int(torch.randint(0, max(1, len(chapter.verses) - 2), (), generator=rng))
    for _ in range(int(torch.randint(1, 4, (), generator=rng))):
        if i + 1 >= len(chapter.verses):
            break
        n = int(torch.randint(1, 3, (), generator=rng))
        messages += [{"role": "user", "content": chapter.verses[i]},
                     {"role": "assistant", "content": " ".join(chapter.verses[i + 1:i + 1 + n])}]
        i += 1 + n
    return tokenizer.apply_chat_template(messages, add_generation_prompt=False) if messages else ""


def token_stream(tok: Tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    """The texts' tokens, each text followed by <|eos|>, as one long 1-D tensor."""
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids + [eos_id])
    return torch.tensor(ids, dtype=torch.long)


# ---- a faster chunked KDA for training (same math as transformers' reference op, checked at start) -----------

def chunk_kda(query, key, value, g, beta, chunk_size=16, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' chunk_kimi_delta_attention ([B, T, H, K] in, [B, T, H, V] out) with small chunks, every
    chunk's decays and WY inverse computed at once (matmuls, no per-row loop); the reference's row loop makes
    autograd 30x slower on the CPU."""
    dtype = query.dtype
    q, k, v, g = [x.transpose(1, 2).float() for x in (query, key, value, g)]  # [B, H, T, K]
    beta = beta.transpose(1, 2).float()  # [B, H, T]
    if use_qk_l2norm_in_kernel:
        q, k = [x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k)]
    B, H, T, K = k.shape
    C = chunk_size
    pad = (C - T % C) % C
    q, k, v, g = [F.pad(x, (0, 0, 0, pad)).reshape(B, H, -1, C, x.shape[-1]) for x in (q, k, v, g)]  # [B,H,N,C,K]
    beta = F.pad(beta, (0, pad)).reshape(B, H, -1, C, 1)
    q, G = q * K ** -0.5, g.cumsum(-2)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    decay = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~causal[..., None], -math.inf).exp()  # [..,Ci,Cj,K]
    k_decayed = k.unsqueeze(-3) * decay
    A_qk = (q.unsqueeze(-2) * k_decayed).sum(-1)  # [B, H, N, C, C], j <= i
    X = -beta * (k.unsqueeze(-2) * k_decayed).sum(-1).tril(-1)
    eye = torch.eye(C)
    inverse, power = eye + X, 1  # (I - X)^-1 = (I + X)(I + X^2)(I + X^4)..., X strictly lower so nilpotent
    while 2 * power < C:
        X = X @ X
        inverse, power = inverse @ (eye + X), 2 * power
    u, w = inverse @ (beta * v), inverse @ (beta * k * G.exp())
    q_decayed, k_to_end = q * G.exp(), k * (G[..., -1:, :] - G).exp()
    chunk_decay = G[..., -1, :].exp().unsqueeze(-1)  # [B, H, N, K, 1]
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float()
    outs = []
    for n in range(q.shape[2]):
        v_new = u[:, :, n] - w[:, :, n] @ S
        outs.append(q_decayed[:, :, n] @ S + A_qk[:, :, n] @ v_new)
        S = chunk_decay[:, :, n] * S + k_to_end[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2).flatten(2, 3)[:, :, :T]
    return o.transpose(1, 2).contiguous().to(dtype), (S if output_final_state else None)


def install_fast_kda(chunk_size: int) -> None:
    """Swap the op in (transformers looks it up by module name) after checking it against the reference."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(2, 45, 3, 16, generator=gen) for _ in range(3)]
    g, beta = -3 * torch.rand(2, 45, 3, 16, generator=gen), torch.rand(2, 45, 3, generator=gen)
    ref, ref_state = kimi.chunk_kimi_delta_attention(q, k, v, g, beta, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    out, state = chunk_kda(q, k, v, g, beta, chunk_size, None, True, True)
    err = max((out - ref).abs().max().item(), (state - ref_state).abs().max().item())
    assert err < 1e-4, f"the training KDA op differs from transformers' by {err}"
    kimi.chunk_kimi_delta_attention = functools.partial(chunk_kda, chunk_size=chunk_size)


# ---- training ----------------------------------------------------------------------------------------------------

class RouterBalancer:
    """Auxiliary-loss-free balancing (the e_score_correction_bias of DeepSeek-V3 and Kimi): after each step, raise
    the bias of experts that got fewer tokens than average and lower it for those that got more."""

    def __init__(self, model: KimiLinearForCausalLM, rate: float):
        self.rate, self.counts = rate, {}
        for module in model.modules():
            if isinstance(module, kimi.KimiLinearTopkRouter):
                module.register_forward_hook(self._count)

    def _count(self, router, _inputs, outputs) -> None:
        counts = torch.bincount(outputs[2].flatten(), minlength=router.num_experts).float()
        self.counts[router] = self.counts.get(router, 0) + counts

    def step(self) -> None:
        for router, counts in self.counts.items():
            router.e_score_correction_bias += self.rate * torch.sign(counts.mean() - counts)
        self.counts.clear()


def train(model, stream: torch.Tensor, args) -> float:
    """AdamW, linear warm-up then cosine decay to a tenth; random windows of the stream. Returns seconds."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    lr_at = lambda s: args.lr * min((s + 1) / args.warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * s / args.steps)))  # noqa: E731
    balancer, gen = RouterBalancer(model, 1e-3), torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([stream[s:s + args.seq_len + 1] for s in starts.tolist()])
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        balancer.step()
        if step % 25 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - start
            print(f"step {step:4d}  loss {loss.item():.3f}  lr {lr_at(step):.2e}  {elapsed / 60:5.1f} min  "
                  f"{(step + 1) * batch.numel() / elapsed:.0f} tok/s", flush=True)
    return time.perf_counter() - start


@torch.no_grad()
def held_out_perplexity(model, stream: torch.Tensor, seq_len: int) -> tuple[float, torch.Tensor]:
    """exp(mean NLL) over non-overlapping windows of the held-out stream; also the predicted targets."""
    n = (len(stream) - 1) // seq_len
    inputs = stream[:n * seq_len].view(n, seq_len)
    targets = stream[1:n * seq_len + 1].view(n, seq_len)
    nll = sum(F.cross_entropy(model(input_ids=x, use_cache=False).logits.flatten(0, 1), y.flatten(), reduction="sum")
              for x, y in zip(inputs.split(16), targets.split(16)))
    return math.exp(nll.item() / targets.numel()), targets.flatten()


def unigram_perplexity(train_stream: torch.Tensor, targets: torch.Tensor) -> float:
    """The same targets under token frequencies of the training text (add-one smoothed)."""
    counts = torch.bincount(train_stream, minlength=VOCAB).double() + 1
    return math.exp(-(counts / counts.sum()).log()[targets].mean().item())


# ---- save and check ----------------------------------------------------------------------------------------------

def save_moonshot(model: KimiLinearForCausalLM, raw: dict, out: Path) -> None:
    """save_pretrained, load that with deltaserve, write it back in Moonshot's published layout."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        cfg = ModelConfig.from_dict(raw)
        save_checkpoint(load_model(tmp, cfg, torch.float32, "cpu"), cfg, raw, out, layout="moonshot")


@torch.no_grad()
def check_against_deltaserve(model: KimiLinearForCausalLM, out: Path, prompts: list[str]) -> str:
    """deltaserve on the written folder: each greedy token is the reference's argmax (up to a tie), and the
    log-probabilities along greedy and sampled continuations are the reference's. Returns the sampled text."""
    llm = LLM(out, device="cpu", threads=torch.get_num_threads())
    greedy = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    sampled = llm.generate(prompts[0], SamplingParams(max_tokens=48, temperature=0.7, top_p=0.9, seed=0),
                           use_tqdm=False)[0]
    greedy_scores = [compare_logprobs(model, llm, output) for output in greedy]
    logprob_error = max([error for error, _ in greedy_scores] + [compare_logprobs(model, llm, sampled)[0]])
    margin = max(below_argmax for _, below_argmax in greedy_scores)
    assert margin < 1e-4, f"a greedy token is {margin} below the reference's argmax"
    assert logprob_error < 1e-3, f"log-probabilities differ from the reference's by {logprob_error}"
    print(f"deltaserve matches transformers: greedy tokens are its argmax (within {margin:.1e}), log-probs "
          f"within {logprob_error:.1e}", flush=True)
    return sampled.outputs[0].text


def compare_logprobs(model: KimiLinearForCausalLM, llm: LLM, output) -> tuple[float, float]:
    """Over the output's prompt + generated tokens: the largest gap between deltaserve's and the reference's
    log-probabilities, and how far below the reference's best each generated token was at most."""
    seq = output.prompt_token_ids + output.outputs[0].token_ids
    scored = llm.generate({"prompt_token_ids": seq}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ours = torch.tensor([next(iter(lp.values())).logprob for lp in scored[0].prompt_logprobs[1:]])
    ref = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, :-1].log_softmax(-1)  # [T - 1, V]
    chosen = ref.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    below_best = (ref.max(-1).values - chosen)[len(output.prompt_token_ids) - 1:]
    return (ours - chosen).abs().max().item(), below_best.max().item()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="model folder to write (replaced)")
    p.add_argument("--corpus-file", default=None, help="saved output of `bible -l 100000 gen1:1-rev22:21`")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kda-chunk", type=int, default=16, help="chunk of the training KDA op (speed only)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    chapters = read_kjv(args.corpus_file)
    train_ch = [c for i, c in enumerate(chapters) if i % HELD_OUT_EVERY != HELD_OUT_EVERY // 2]
    held_ch = [c for i, c in enumerate(chapters) if i % HELD_OUT_EVERY == HELD_OUT_EVERY // 2]
    train_texts = ["\n".join(c.verses) for c in train_ch]
    shutil.rmtree(out, ignore_errors=True)
    ids = train_tiny_tokenizer(out, VOCAB, texts=train_texts)
    tok, chat_tok = Tokenizer.from_file(str(out / "tokenizer.json")), load_tokenizer(out)
    rng = torch.Generator().manual_seed(args.seed)
    chats = [chat_text(chat_tok, c, rng) for c in train_ch[::CHAT_SHARE]]
    plain = token_stream(tok, train_texts, ids.eos_token_id)
    order = torch.randperm(len(train_texts) + len(chats), generator=rng).tolist()
    stream = token_stream(tok, [(train_texts + chats)[i] for i in order], ids.eos_token_id)
    held = token_stream(tok, ["\n".join(c.verses) for c in held_ch], ids.eos_token_id)
    print(f"corpus: {len(train_ch)} train chapters ({len(plain)} tokens) + {len(chats)} chats = {len(stream)} "
          f"tokens; {len(held_ch)} held-out chapters ({len(held)} tokens)", flush=True)
    raw = raw_config(ids)
    install_fast_kda(args.kda_chunk)
    model = KimiLinearForCausalLM(KimiLinearConfig(**raw))
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, layers {LAYERS}", flush=True)
    seconds = train(model.train(), stream, args)
    model.eval()
    ppl, targets = held_out_perplexity(model, held, args.seq_len)
    print(f"trained {args.steps} steps in {seconds / 60:.1f} min; held-out perplexity {ppl:.1f}, "
          f"unigram baseline {unigram_perplexity(plain, targets):.1f} ({len(targets)} tokens)", flush=True)
    save_moonshot(model, raw, out)
    (out / "generation_config.json").write_text(json.dumps(SAMPLING, indent=2) + "\n")
    print(f"wrote {out} ({(out / 'model.safetensors').stat().st_size / 1e6:.1f} MB)")
    sample = check_against_deltaserve(model, out, ["Once upon a time", "And the LORD said"])
    print(f"sample (temperature 0.7, top-p 0.9, seed 0): Once upon a time{sample}")
    answer = LLM(out, device="cpu", threads=args.threads).chat(
        [{"role": "user", "content": "Who made the heaven and the earth?"}],
        SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=0))
    print(f"chat sample: Who made the heaven and the earth? -> {answer.outputs[0].text!r} "
          f"({answer.outputs[0].finish_reason})")


if __name__ == "__main__":
    main()
