"""train_tiny_tokenizer: a small byte-level BPE with ChatML-like special tokens, for test and demo models."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from deltaserve.tokenizer.errors import TokenizerError
from deltaserve.tokenizer.hf import TOKENIZER_FILE
from deltaserve.tokenizer.sample_text import SAMPLE_TEXT
from deltaserve.tokenizer.tokenizer_config import CONFIG_FILE

BOS, EOS, IM_START, IM_END, PAD = "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END, PAD)
MODEL_MAX_LENGTH = 4096
_NUM_BYTES = 256

# ChatML; trim_blocks drops the newline after each {% %} tag, so each line below renders as written
CHAT_TEMPLATE = """\
{% if tools %}
<|im_start|>system
# Tools
{{ tools | tojson }}<|im_end|>
{% endif %}
{% for message in messages %}
<|im_start|>{{ message.role }}
{% if message.content is string %}{{ message.content }}{% else %}\
{% for part in message.content or [] if part.type == "text" %}{{ part.text }}{% endfor %}{% endif %}
{% if message.tool_calls %}{{ message.tool_calls | tojson }}{% endif %}
<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""


@dataclass(frozen=True)
class TinyTokenizerIds:
    """The special token ids, for the model's config.json; every id is below vocab_size."""

    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    im_start_id: int
    im_end_id: int
    vocab_size: int  # tokens the tokenizer has, at most the vocab_size asked for


def train_tiny_tokenizer(out_dir: str | Path, vocab_size: int, texts: Sequence[str] | None = None) -> TinyTokenizerIds:
    """Train on texts (default: a built-in English sample), write tokenizer.json and tokenizer_config.json.

    Deterministic for fixed arguments. The special tokens take the ids right after the trained vocabulary,
    which is smaller than vocab_size when the texts run out of merges."""
    min_size = _NUM_BYTES + len(SPECIAL_TOKENS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < min_size:
        raise TokenizerError(
            f"vocab_size = {vocab_size!r}, expected an integer >= {min_size} (256 bytes + "
            f"{len(SPECIAL_TOKENS)} special tokens); raise it"
        )
    tokenizer = _train(_check_texts(texts), vocab_size - len(SPECIAL_TOKENS))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / TOKENIZER_FILE))
    (out_dir / CONFIG_FILE).write_text(json.dumps(_tokenizer_config(ids), indent=2, ensure_ascii=False) + "\n")
    return TinyTokenizerIds(
        ids[BOS], ids[EOS], ids[PAD], ids[IM_START], ids[IM_END], tokenizer.get_vocab_size(with_added_tokens=True)
    )


def _check_texts(texts: Sequence[str] | None) -> list[str]:
    if texts is None:
        return [SAMPLE_TEXT]
    if isinstance(texts, str) or not texts or not all(isinstance(t, str) for t in texts):
        raise TokenizerError(f"texts = {texts!r:.80}, expected a non-empty list of strings, or None for the sample")
    return list(texts)


def _train(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _tokenizer_config(ids: dict[str, int]) -> dict:
    """transformers' layout, so that AutoTokenizer loads the folder too."""
    flags = dict(lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
    added = {str(token_id): dict(content=token, **flags) for token, token_id in ids.items()}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": MODEL_MAX_LENGTH,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
