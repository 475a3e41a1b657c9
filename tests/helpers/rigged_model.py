"""A tiny Kimi-Linear checkpoint with Kimi tokenizer files, rigged so that greedy decoding writes a chosen text.

The output is a chain of distinct tokens: special tokens by name, plain text pieces as extra tiktoken ranks (one
rank a piece, so no token occurs twice). Every attention and MLP output projection is zero, so the residual
stream at a position is its token's embedding and the logits depend on that token alone. Chain token j embeds
as the unit vector e_j and lm_head row of token j+1 is SCALE * e_j: after the final RMSNorm (weight 1) the next
token's logit is SCALE * sqrt(hidden) and every other logit is 0. The chain starts at <|im_middle|>, the last
token of the Kimi chat template's generation prompt, and ends with [EOS].
"""

from __future__ import annotations

from pathlib import Path

import torch

from deltaserve.config import ModelConfig
from deltaserve.loader.model_loader import build_model, init_dummy_weights
from deltaserve.loader.writer import save_checkpoint
from deltaserve.tokenizer import load_tokenizer
from helpers.checkpoints import SMALL_RAW_CONFIG
from helpers.kimi_tokenizer import synthetic_ranks, write_kimi_files

GENERATION_PROMPT_END = "<|im_middle|>"
SCALE = 100.0
_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "mlp.w2")


def write_rigged_model(folder: Path, pieces: list[str]) -> Path:
    """A model folder whose greedy answer to any chat is "".join(pieces), then [EOS]. Each piece is a special
    token of the Kimi tokenizer (e.g. <|tool_call_begin|>) or plain text; each must occur once."""
    if len(set(pieces)) != len(pieces):
        raise ValueError(f"pieces = {pieces!r}: a piece occurs twice, so the next token would be ambiguous")
    plain = [piece.encode() for piece in pieces if not piece.startswith("<|")]
    write_kimi_files(folder, synthetic_ranks(256) + plain)
    tokenizer = load_tokenizer(folder)
    chain = [tokenizer.token_to_id(piece) for piece in [GENERATION_PROMPT_END, *pieces, "[EOS]"]]
    ids = dict(bos_token_id=tokenizer.token_to_id("[BOS]"), eos_token_id=chain[-1],
               pad_token_id=tokenizer.token_to_id("[PAD]"))
    raw = {**SMALL_RAW_CONFIG, **ids, "vocab_size": tokenizer.vocab_size}
    cfg = ModelConfig.from_dict(raw)
    if len(chain) - 1 > cfg.hidden_size:
        raise ValueError(f"{len(pieces)} pieces need {len(chain) - 1} embedding directions; "
                         f"hidden_size is {cfg.hidden_size}")
    model = build_model(cfg, torch.float32, "cpu")
    init_dummy_weights(model, seed=0, std=0.1)
    _rig(model, chain)
    save_checkpoint(model, cfg, raw, folder)
    return Path(folder)


@torch.no_grad()
def _rig(model: torch.nn.Module, chain: list[int]) -> None:
    for name, param in model.named_parameters():
        if name.endswith(_OUTPUT_PROJECTIONS):
            param.zero_()
    model.norm.weight.fill_(1.0)
    model.embed_tokens.weight.zero_()
    model.lm_head.weight.zero_()
    for j, (token, next_token) in enumerate(zip(chain, chain[1:])):
        model.embed_tokens.weight[token, j] = 1.0
        model.lm_head.weight[next_token, j] = SCALE
