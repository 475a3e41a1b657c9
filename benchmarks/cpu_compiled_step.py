"""Issue 3's probe: a batch-1 float32 CPU decode step of the small preset compiled as one graph, against the engine.

    python benchmarks/cpu_compiled_step.py --mode check --variant direct-cppw      # tokens against the engine
    python benchmarks/cpu_compiled_step.py --mode time --variant default,cppw,direct-cppw --threads 1,2
    python benchmarks/cpu_compiled_step.py --mode explain                          # graphs and graph breaks

Variant words: cppw = inductor's cpp_wrapper, freeze = freezing, dyn = the MLA context as the graph's one symbolic
size, direct = inductor's compiled function called without dynamo (no guard checks per call: what an engine holding
the compiled artifact pays), sum = experts as multiply-and-sum, floor = the step's matrix products alone, eager.
TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 for cold compile times.

This is a measurement, not engine code: DecodeStep re-states the model's decode math for one sequence with tensors
only (token id and position as [1] tensors), over the engine's own loaded parameters and its own contiguous states
(conv [C, W-1], recurrent [H, K, V], MLA latents [MAX_LEN, R + Dr] masked past the position), so that dynamo
captures it whole (1 graph, 0 breaks). It answers whether a compiled decode step reaches issue 3's small-model target
(BENCHMARKS.md, "CPU" section); the engine's forward would have to become graph-safe itself to use it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import offline_throughput as bench
import torch
import torch.nn.functional as F
from torch import nn

MAX_LEN = 512


class DecodeStep(nn.Module):
    """step(token [1], pos [1], states) -> (next token [1], logits [V]); states updated in place."""

    def __init__(self, model, experts: str = "bmm", dyn: bool = False):
        super().__init__()
        # dyn: pos is arange(L) [L] (L = context length, this token included; its size the graph's one dynamic dim)
        # and MLA attends cache[:L]; else pos [1] and MLA attends the whole MAX_LEN buffer, masked past pos
        self.model, self.cfg, self.experts, self.dyn = model, model.cfg, experts, dyn

    def new_states(self) -> list[torch.Tensor]:
        states = []
        for layer in self.model.layers:
            a = layer.self_attn
            if layer.is_kda:
                C, W = a.conv_weight.shape
                states += [torch.zeros(C, W - 1), torch.zeros(a.num_heads, a.head_dim, a.head_dim)]
            else:
                states.append(torch.zeros(MAX_LEN, a.kv_lora_rank + a.rope_dim))
        return states

    def forward(self, token: torch.Tensor, pos: torch.Tensor, states: list[torch.Tensor]):
        m = self.model
        x = m.embed_tokens.weight.index_select(0, token)  # [1, D]
        residual = None
        it = iter(states)
        for layer in m.layers:
            if residual is None:
                residual = x
                h = F.rms_norm(x, x.shape[-1:], layer.input_layernorm.weight, layer.input_layernorm.eps)
            else:
                residual = x + residual
                h = F.rms_norm(residual, x.shape[-1:], layer.input_layernorm.weight, layer.input_layernorm.eps)
            if layer.is_kda:
                attn = self._kda(layer.self_attn, h, next(it), next(it))
            else:
                attn = self._mla(layer.self_attn, h, next(it), pos, self.dyn)
            residual = attn + residual
            pn = layer.post_attention_layernorm
            h = F.rms_norm(residual, x.shape[-1:], pn.weight, pn.eps)
            x = self._moe(layer.mlp, h) if hasattr(layer.mlp, "w13") else self._swiglu(layer.mlp, h)
        hidden = F.rms_norm(x + residual, x.shape[-1:], m.norm.weight, m.norm.eps)
        logits = F.linear(hidden, m.lm_head.weight)[0]  # [V]
        return logits.argmax().view(1), logits

    @staticmethod
    def _kda(a, h, conv_state, S):
        H, K = a.num_heads, a.head_dim
        projected = F.linear(h, a.in_proj.weight)
        qkv, fg_a, b = projected.split(a.split, dim=-1)  # [1, 3HK], [1, 2K], [1, H]
        window = torch.cat([conv_state, qkv.t()], dim=-1)  # [C, W]
        conv_state.copy_(window[:, 1:])
        qkv = F.silu((window * a.conv_weight).sum(-1)).view(3, H, K)
        w = a.fg_b_proj.weight.view(2, -1, K)
        g_raw, gate = F.linear(fg_a[:, :K], w[0]), F.linear(fg_a[:, K:], w[1])  # [1, HK] each
        beta = torch.sigmoid(b)[0]  # [H]
        qk = qkv[:2]
        qk = qk / torch.sqrt((qk * qk).sum(-1, keepdim=True) + 1e-6)
        q, k, v = qk[0] * K ** -0.5, qk[1], qkv[2]  # [H, K]
        g = -a.A_log.exp()[:, None] * F.softplus(g_raw + a.dt_bias, threshold=20.0).view(H, K)
        S.mul_(g.exp()[:, :, None])
        predicted = torch.bmm(k[:, None, :], S)[:, 0]  # [H, V]
        S.baddbmm_(k[:, :, None], ((v - predicted) * beta[:, None])[:, None, :])
        o = torch.bmm(q[:, None, :], S)[:, 0]  # [H, V]
        o = F.rms_norm(o, (K,), a.o_norm_weight, a.eps) * torch.sigmoid(gate.view(H, K))
        return F.linear(o.view(1, H * K), a.o_proj.weight)

    @staticmethod
    def _mla(a, h, cache, pos, dyn):
        H, R, Dn = a.num_heads, a.kv_lora_rank, a.nope_dim
        projected = F.linear(h, a.in_proj.weight)
        q, ckv = projected.split(a.split, dim=-1)
        q = q.view(H, Dn + a.rope_dim)
        q_nope, q_rope = q[:, :Dn], q[:, Dn:]
        latent = torch.cat([F.rms_norm(ckv[:, :R], (R,), a.kv_a_norm_weight, a.kv_norm_eps), ckv[:, R:]], dim=-1)
        cache.index_copy_(0, pos[-1:], latent)
        w = a.kv_b_proj.weight.view(H, Dn + a.v_dim, R)
        q_latent = torch.bmm(q_nope[:, None, :], w[:, :Dn])[:, 0]  # [H, R]
        ctx = cache[: pos.shape[0]] if dyn else cache
        c_kv, k_rope = ctx[:, :R], ctx[:, R:]  # [L, R], [L, Dr]
        scores = (q_latent @ c_kv.t() + q_rope @ k_rope.t()) * a.scale  # [H, L]
        if not dyn:
            scores = scores.masked_fill((torch.arange(cache.shape[0]) > pos)[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o_latent = probs @ c_kv  # [H, R]
        out = torch.bmm(o_latent[:, None, :], w[:, Dn:].transpose(1, 2))[:, 0]  # [H, Dv]
        return F.linear(out.reshape(1, H * a.v_dim), a.o_proj.weight)

    @staticmethod
    def _swiglu(mlp, h):
        gate, up = F.linear(h, mlp.gate_up_proj.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, mlp.down_proj.weight)

    def _moe(self, moe, h):
        cfg = self.cfg
        assert cfg.topk_group >= cfg.num_expert_group  # the small preset: no group masking
        scores = F.linear(h, moe.gate_weight)[0].sigmoid()  # [E]
        ids = (scores + moe.e_score_correction_bias).topk(cfg.num_experts_per_token, sorted=False)[1]  # [k]
        weights = scores[ids]
        if cfg.moe_renormalize:
            weights = weights / (weights.sum() + 1e-20)
        weights = weights * cfg.routed_scaling_factor
        if self.experts == "bmm":
            gu = torch.bmm(moe.w13[ids], h.expand(ids.shape[0], -1)[:, :, None])[:, :, 0]  # [k, 2I]
            gate, up = gu.chunk(2, dim=-1)
            y = torch.bmm(moe.w2[ids], (F.silu(gate) * up)[:, :, None])[:, :, 0]  # [k, D]
        else:  # mul + sum: inductor may fuse the indexed weight load into the reduction (no gathered copy)
            gu = (moe.w13[ids] * h[:, None, :]).sum(-1)
            gate, up = gu.chunk(2, dim=-1)
            y = (moe.w2[ids] * (F.silu(gate) * up)[:, None, :]).sum(-1)
        routed = (y * weights[:, None]).sum(0, keepdim=True)  # k=2: a+b, the engine's sum exactly
        return routed + self._swiglu(moe.shared_experts, h)


def matmul_floor(model):
    """The step's matrix products alone (same weights, layouts and shapes; 2 experts a MoE layer), eager: a floor."""
    from deltaserve.layers.linear import Linear

    weights = [(n, mod.weight) for n, mod in model.named_modules() if isinstance(mod, Linear)]
    moes = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "w13")]

    def run(token, pos, states):
        for name, w in weights:
            if name.endswith("kv_b_proj"):
                x = torch.ones(4, 1, w.shape[1])  # the small preset's 4 MLA heads
                torch.bmm(x, w.view(4, -1, w.shape[1]).transpose(1, 2))
            elif name.endswith("fg_b_proj"):
                K = w.shape[1]
                F.linear(torch.ones(1, K), w.view(2, -1, K)[0]), F.linear(torch.ones(1, K), w.view(2, -1, K)[1])
            else:
                F.linear(torch.ones(1, w.shape[1]), w)
        for moe in moes:
            F.linear(torch.ones(1, moe.gate_weight.shape[1]), moe.gate_weight)
            for e in (1, 5):
                F.linear(torch.ones(1, moe.w2.shape[2]), moe.w2[e])
                F.linear(torch.ones(1, moe.w13.shape[2]), moe.w13[e])
        return token, None

    return run


def load_engine():
    from deltaserve import LLM

    folder = bench.make_model("small")
    llm = LLM(folder, device="cpu", max_model_len=4096, max_num_seqs=1, max_num_batched_tokens=2048)
    return llm, llm.engine.model


def engine_generate(llm, prompt, n, record=False):
    from deltaserve import SamplingParams

    model = llm.engine.model
    logits = []
    if record:
        orig = type(model).compute_logits
        model.compute_logits = lambda hidden: logits.append(orig(model, hidden).clone()) or logits[-1]
    try:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=n, temperature=0,
                                                                         ignore_eos=True), use_tqdm=False)
    finally:
        if record:
            del model.compute_logits
    return out[0].outputs[0].token_ids, logits


def probe_generate(step, prompt, n, timed=False):
    """Prefill one token at a time through step, then n greedy tokens. Returns (tokens, logits [n, V], step times)."""
    states = STEP.new_states()
    tokens, logits, times = [], [], []
    token = None
    with torch.inference_mode():
        for p, t in enumerate(prompt):
            token, lg = step(torch.tensor([t]), torch.tensor([p]), states)
        for i in range(n):
            tokens.append(int(token))
            logits.append(lg.clone())
            if i == n - 1:
                break
            t0 = time.perf_counter()
            token, lg = step(token, torch.tensor([len(prompt) + i]), states)
            int(token)
            times.append(time.perf_counter() - t0)
    return tokens, torch.stack(logits), times


STEP: DecodeStep | None = None


def _options(variant: str) -> dict:
    options = {}
    if "cppw" in variant:
        options["cpp_wrapper"] = True
    if "freeze" in variant:
        options["freezing"] = True
    if "autotune" in variant:
        options["max_autotune"] = True
    return options


def compile_step(variant: str, step=None):
    """torch.compile, whole graph, static shapes; 'direct' variants call inductor's compiled graph without dynamo
    (no guard evaluation per call: what an engine holding the compiled artifact, like vLLM's dispatcher, pays)."""
    step = step or STEP
    if variant == "floor":
        return matmul_floor(step.model)
    if "direct" in variant:
        return compile_direct(variant, step)
    options = _options(variant)
    kwargs = {"options": options} if options else {}
    if "dyn" not in variant:
        return torch.compile(step, fullgraph=True, dynamic=False, **kwargs)
    step.dyn = True
    compiled = torch.compile(step, fullgraph=True, **kwargs)  # automatic dynamic: L static at 1, then symbolic
    return lambda token, pos, states: compiled(token, torch.arange(int(pos) + 1), states)


def compile_direct(variant: str, step):
    from torch._inductor.compile_fx import compile_fx

    captured = {}

    def backend(gm, example_inputs):
        inputs = list(example_inputs)
        fn = compile_fx(gm, example_inputs, config_patches=_options(variant))
        assert "fn" not in captured, "compiled more than once"
        captured.update(fn=fn, inputs=inputs)
        return fn

    token, pos, states = torch.tensor([1]), torch.tensor([0]), step.new_states()
    with torch.inference_mode():
        torch.compile(step, backend=backend, fullgraph=True, dynamic=False)(token, pos, states)
    base = captured["inputs"]
    where = {id(t): i for i, t in enumerate(base)}
    i_tok, i_pos, i_states = where[id(token)], where[id(pos)], [where[id(s)] for s in states]
    fn = captured["fn"]

    def run(token, pos, states):
        args = list(base)
        args[i_tok], args[i_pos] = token, pos
        for i, s in zip(i_states, states):
            args[i] = s
        return fn(*args)  # aot_module_simplified's forward: not boxed, whatever its copied _boxed_call says

    return run


def engine_tpot(llm, prompt, n, repeats):
    """The benchmark's figure: (time of n+1 tokens - time of 1) / n, medians of repeats."""
    from deltaserve import SamplingParams

    g = lambda k: SamplingParams(max_tokens=k, temperature=0, ignore_eos=True)  # noqa: E731
    run = lambda k: llm.generate([{"prompt_token_ids": prompt}], g(k), use_tqdm=False)  # noqa: E731
    run(2)
    first = bench._timed(lambda: run(1), repeats)
    full = bench._timed(lambda: run(n + 1), repeats)
    return 1000 * (full - first) / n


def main():
    global STEP
    torch._dynamo.config.recompile_limit = 64  # one graph per variant and thread count (num_threads is guarded)
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="check", choices=["check", "time", "explain"])
    parser.add_argument("--variant", default="default")
    parser.add_argument("--experts", default="bmm", choices=["bmm", "sum"])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--no-engine", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    llm, model = load_engine()
    STEP = DecodeStep(model, args.experts).eval()
    prompt = bench.prompts(1, args.prompt_len, model.cfg.vocab_size)[0]

    if args.mode == "explain":
        states = STEP.new_states()
        with torch.inference_mode():
            ex = torch._dynamo.explain(STEP)(torch.tensor([prompt[0]]), torch.tensor([0]), states)
        print(f"graphs {ex.graph_count} graph_breaks {ex.graph_break_count} ops {ex.op_count}")
        for b in ex.break_reasons:
            print("  break:", b.reason)
        return

    if args.mode == "check":
        ref_tokens, ref_logits = engine_generate(llm, prompt, args.tokens, record=True)
        ref_logits = torch.cat(ref_logits)  # [n, V]: one row per sampled token
        e_tokens, e_logits, _ = probe_generate(STEP, prompt, args.tokens)
        print(f"engine tokens[:12] {ref_tokens[:12]}")
        same = sum(a == b for a, b in zip(e_tokens, ref_tokens))
        print(f"eager probe: tokens equal to engine {same}/{len(ref_tokens)}; "
              f"max |logit diff| vs engine {(e_logits - ref_logits).abs().max().item():.3e}")
        for variant in args.variant.split(","):
            t0 = time.perf_counter()
            compiled = compile_step(variant, DecodeStep(model, "sum" if "sum" in variant else "bmm").eval())
            with torch.inference_mode():
                compiled(torch.tensor([prompt[0]]), torch.tensor([0]), STEP.new_states())
            compile_s = time.perf_counter() - t0
            c_tokens, c_logits, _ = probe_generate(compiled, prompt, args.tokens)
            same = sum(a == b for a, b in zip(c_tokens, ref_tokens))
            vs_engine, vs_eager = (c_logits - ref_logits).abs().max().item(), (c_logits - e_logits).abs().max().item()
            print(f"compiled {variant} (compile + first call {compile_s:.1f} s): tokens equal to engine "
                  f"{same}/{len(ref_tokens)}; max |logit diff| vs engine {vs_engine:.3e}, vs eager {vs_eager:.3e}")
        return

    # time: alternate variants within rounds; probe at a ~128-token context, like the benchmark's engine figure
    prompt = bench.prompts(1, 128, model.cfg.vocab_size)[0]
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        fns = [("eager", STEP)]
        for variant in args.variant.split(","):
            experts = "sum" if "sum" in variant else "bmm"
            step = DecodeStep(model, experts).eval()
            t0 = time.perf_counter()
            compiled = compile_step(variant, step)
            with torch.inference_mode():
                compiled(torch.tensor([prompt[0]]), torch.tensor([0]), STEP.new_states())
            print(f"threads {threads} variant {variant}: compile {time.perf_counter() - t0:.1f} s")
            fns.append((variant, compiled))
        runs = {name: Decoder(fn, prompt) for name, fn in fns}
        times: dict[str, list[float]] = {name: [] for name in runs}
        engine = []
        for r in range(args.rounds):  # interleaved bursts: this machine's speed drifts by up to 2x within a minute
            for name, dec in runs.items():
                times[name].append(dec.burst(args.burst))
            if not args.no_engine and r % 2 == 0:
                engine.append(engine_tpot(llm, prompt, 32, 1))
        row = [f"{n} {1000 * statistics.median(ts):.3f} (min {1000 * min(ts):.3f})" for n, ts in times.items()]
        if engine:
            row.append(f"engine {statistics.median(engine):.3f} (min {min(engine):.3f})")
        print(f"threads {threads}, median (min) of {args.rounds} burst medians of {args.burst} steps: "
              + "  ".join(row) + " ms/token", flush=True)


class Decoder:
    """A probe sequence prefilled once, then decoded in bursts at positions cycling over [P, P + 256)."""

    def __init__(self, fn, prompt):
        self.fn, self.prompt, self.states, self.i = fn, prompt, STEP.new_states(), 0
        with torch.inference_mode():
            for p, t in enumerate(prompt):
                self.token, _ = fn(torch.tensor([t]), torch.tensor([p]), self.states)
        self.burst(16)

    @torch.inference_mode()
    def burst(self, n: int) -> float:
        times = []
        for _ in range(n):
            pos = torch.tensor([len(self.prompt) + self.i % 256])
            t0 = time.perf_counter()
            self.token, _ = self.fn(self.token, pos, self.states)
            int(self.token)
            times.append(time.perf_counter() - t0)
            self.i += 1
        return statistics.median(times)


if __name__ == "__main__":
    main()
