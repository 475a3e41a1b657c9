"""Synthetic Kimi tokenizer files in Moonshot's published format: tiktoken.model + tokenizer_config.json.

The ranks are learned from sample text by a small byte-level BPE (the tokenizers library's trainer), then
written as tiktoken's `<base64 bytes> <rank>` lines: the 256 single bytes first, then the merges in the order
they were learned. tokenizer_config.json names the special ids at the offsets the published file uses.
"""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from deltaserve.tokenizer.sample_text import SAMPLE_TEXT

# offset from the first special id -> (token, special); the published file leaves the other offsets unnamed
NAMED_SPECIAL_OFFSETS = {
    0: ("[BOS]", True),
    1: ("[EOS]", True),
    2: ("<|im_end|>", True),
    3: ("<|im_user|>", True),
    4: ("<|im_assistant|>", True),
    6: ("<|start_header_id|>", True),
    7: ("<|end_header_id|>", True),
    9: ("[EOT]", True),
    10: ("<|im_system|>", True),
    11: ("<|tool_calls_section_begin|>", False),
    12: ("<|tool_calls_section_end|>", False),
    13: ("<|tool_call_begin|>", False),
    14: ("<|tool_call_argument_begin|>", False),
    15: ("<|tool_call_end|>", False),
    17: ("<|im_middle|>", True),
    254: ("[UNK]", True),
    255: ("[PAD]", True),
}
PUBLISHED_NUM_RANKS = 163_584

# A chat template in the Kimi-K2 / Kimi-Linear Instruct format: a tool_declare turn with compact JSON, a
# default system turn, <|im_{role}|>NAME<|im_middle|>...<|im_end|> turns, the tool-call section, "## Return of"
CHAT_TEMPLATE = """\
{%- macro render_content(msg) -%}
{%- set c = msg.get('content') -%}
{%- if c is string -%}
{{ c }}
{%- elif c is not none -%}
{%- for part in c -%}
{%- if part['type'] == 'text' -%}
{{ part['text'] }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- set role_name = message.get('name') or message['role'] -%}
{%- if message['role'] == 'user' -%}
<|im_user|>{{ role_name }}<|im_middle|>
{%- elif message['role'] == 'assistant' -%}
<|im_assistant|>{{ role_name }}<|im_middle|>
{%- else -%}
<|im_system|>{{ role_name }}<|im_middle|>
{%- endif -%}
{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
{{ render_content(message) }}<|tool_calls_section_begin|>
{%- for tool_call in message['tool_calls'] -%}
<|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>
{%- if tool_call['function']['arguments'] is string -%}
{{ tool_call['function']['arguments'] }}
{%- else -%}
{{ tool_call['function']['arguments'] | tojson }}
{%- endif -%}
<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- elif message['role'] == 'tool' -%}
## Return of {{ message['tool_call_id'] }}
{{ render_content(message) }}
{%- else -%}
{{ render_content(message) }}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""


def write_kimi_tokenizer(out_dir: str | Path, num_ranks: int = 3000, chat_template: str | None = CHAT_TEMPLATE) -> int:
    """Train num_ranks ranks on sample text and write both files into out_dir; returns the first special id."""
    ranks = train_ranks(num_ranks)
    write_kimi_files(out_dir, ranks, chat_template)
    return len(ranks)


def train_ranks(num_ranks: int) -> list[bytes]:
    """The tokens in rank order: 256 single bytes, then byte-level BPE merges learned from sample_texts()."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=num_ranks, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(sample_texts(), trainer=trainer)
    byte_of_char = _byte_of_char()
    learned = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    merged = [bytes(byte_of_char[c] for c in token) for token, _ in learned if len(token) > 1]
    return [bytes([b]) for b in range(256)] + merged


def synthetic_ranks(num_ranks: int) -> list[bytes]:
    """num_ranks distinct tokens without training (for files of the published size): bytes, pairs, triples."""
    tokens = [bytes([b]) for b in range(256)]
    tokens += [bytes([a, b]) for a in range(256) for b in range(256)]
    tokens += [bytes([a, b, c]) for a in range(97, 123) for b in range(256) for c in range(256)]
    return tokens[:num_ranks]


def write_kimi_files(out_dir: str | Path, ranks: list[bytes], chat_template: str | None = CHAT_TEMPLATE) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = (f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(ranks))
    (out_dir / "tiktoken.model").write_text("".join(lines))
    config = tokenizer_config(len(ranks), chat_template)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def tokenizer_config(first_special_id: int, chat_template: str | None) -> dict:
    """The published layout (transformers' AddedToken fields, the remote-code class) for these special ids."""
    flags = dict(lstrip=False, normalized=False, rstrip=False, single_word=False)
    added = {str(first_special_id + offset): dict(content=token, **flags, special=special)
             for offset, (token, special) in NAMED_SPECIAL_OFFSETS.items()}
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def sample_texts() -> list[str]:
    """The package's sample paragraphs plus seeded pseudo-words, Han and kana runs, numbers and contractions,
    so that a few thousand merges exist, including ones that join the bytes of multi-byte characters."""
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ng", "qu"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(4000)]
    han = "".join(chr(rng.randint(0x4E00, 0x4E00 + 300)) for _ in range(3000))
    kana = "".join(chr(rng.randint(0x3041, 0x3096)) for _ in range(1000))
    numbers = " ".join(str(rng.randint(0, 99999)) for _ in range(500))
    contractions = "don't can't it's they're we've I'm you'll he'd DON'T IT'S " * 20
    return [SAMPLE_TEXT, " ".join(words), han, kana, numbers, contractions, "🙂🚀🌍👍🏽 " * 20]


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character the trainer uses for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    unprintable = [b for b in range(256) if b not in printable]
    chars = [*map(chr, printable), *(chr(256 + n) for n in range(len(unprintable)))]
    return dict(zip(chars, [*printable, *unprintable]))
