"""How dummy weights route: distinct experts per MoE layer per decode step, and the busiest expert's load.

The 48B config (benchmarks/configs/kimi-linear-48b-a3b.json) cut to --layers layers, with the vocabulary and the
MLP widths reduced so that it runs on a CPU: the router, the hidden size, the attention and the norms that shape
the router's inputs stay as they are (--attention-heads reduces those too). Each batch runs bench's routing pass
(entrypoints/bench.py, measure_routing): random prompts, greedy decode, every decode step's chosen experts counted.
It also prints, per MoE layer, how much of the router's input all tokens share (the norm of the mean input over the
mean input norm; independent random inputs give about 1 / sqrt(tokens)).

    python benchmarks/dummy_routing.py --layers 4 --batch-sizes 64,256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch

from deltaserve.config import EngineConfig
from deltaserve.core.engine import Engine
from deltaserve.entrypoints.bench import measure_routing
from deltaserve.entrypoints.routing_stats import uniform_distinct_experts
from deltaserve.layers.moe import MoE

CONFIG_48B = Path(__file__).resolve().parent / "configs" / "kimi-linear-48b-a3b.json"


def cut_config(layers: int, heads: int | None) -> dict:
    """The 48B config with `layers` layers (MLA every fourth, as in the model), vocabulary 4096, MLP widths cut."""
    raw = json.loads(CONFIG_48B.read_text())
    raw.update(num_hidden_layers=layers, vocab_size=4096, intermediate_size=256, moe_intermediate_size=16,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
    raw["linear_attn_config"].update(kda_layers=[i for i in range(1, layers + 1) if i % 4],
                                     full_attn_layers=[i for i in range(1, layers + 1) if i % 4 == 0])
    if heads:
        raw.update(num_attention_heads=heads, num_key_value_heads=heads)
        raw["linear_attn_config"]["num_heads"] = heads
    return raw


def shared_fraction(engine: Engine, batch: int, prompt_len: int, seed: int) -> list[float]:
    """Per MoE layer, |mean router input| / mean |router input| over the 3 decode steps of one more routing pass
    (the router's input: the output of the MoE layer's post-attention norm)."""
    norms = [layer.post_attention_layernorm for layer in engine.model.layers if isinstance(layer.mlp, MoE)]
    inputs: list[list[torch.Tensor]] = [[] for _ in norms]
    handles = [norm.register_forward_hook(lambda mod, args, out, i=i: inputs[i].append(out[0].float()))
               for i, norm in enumerate(norms)]
    measure_routing(engine, batch, prompt_len, 4, seed)
    for handle in handles:
        handle.remove()
    fractions = []
    for per_step in inputs:
        x = torch.cat([t for t in per_step if t.shape[0] == batch])  # decode steps (prefill chunks differ in size)
        fractions.append((x.mean(0).norm() / x.norm(dim=1).mean()).item())
    return fractions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--attention-heads", type=int, default=None, help="default: the 48B config's 32")
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(cut_config(args.layers, args.attention_heads)))
    engine = Engine(str(folder), EngineConfig(
        load_format="dummy", threads=args.threads, max_model_len=args.prompt_len + args.output_len,
        max_num_seqs=max(batches), max_num_batched_tokens=8192, cache_bytes=4 << 30))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}, CPU, float32, 48B config cut to {args.layers} layers, prompt {args.prompt_len}, "
          f"output {args.output_len}")
    print(f"{'batch':>6} {'distinct':>9} {'balanced':>9} {'busiest/mean':>13} {'picks/layer':>12}")
    for batch in batches:
        stats = measure_routing(engine, batch, args.prompt_len, args.output_len, seed=batch)
        picks = stats.num_steps * batch * engine.model_config.num_experts_per_token
        print(f"{batch:>6} {stats.distinct_experts:>9.1f} {uniform_distinct_experts(256, 8, batch):>9.1f} "
              f"{stats.busiest_expert_load:>13.2f} {picks:>12}")
    fractions = shared_fraction(engine, batches[0], args.prompt_len, seed=1)
    print(f"shared input per MoE layer at batch {batches[0]} (noise ~{(batches[0] * 3) ** -0.5:.3f}): "
          + " ".join(f"{f:.3f}" for f in fractions))


if __name__ == "__main__":
    main()
