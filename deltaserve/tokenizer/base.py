"""Tokenizer: what the engine needs from one. Back ends supply the vocabulary; this class the rest."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from deltaserve.tokenizer.chat_template import ChatTemplate
from deltaserve.tokenizer.errors import ChatTemplateError, TokenizerError
from deltaserve.tokenizer.tokenizer_config import SPECIAL_TOKEN_FIELDS, TokenizerConfig

# Chat templates end a turn with one of these rather than with eos_token, so generation must stop there too
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")


class ChatText(str):
    """A chat template's rendered text (what apply_chat_template returns): encode_prompt adds nothing to it, since
    the template wrote what the prompt needs, a BOS included. An edit of it (a + b) is a plain str again."""

    __slots__ = ()


class Tokenizer(ABC):
    """A back end (tokenizer.json, tiktoken.model) plus its tokenizer_config.json.

    A back end builds its vocabulary first, then calls Tokenizer.__init__, which checks the config against it
    and sets bos_token_id, eos_token_ids (eos_token plus the chat template's end-of-turn tokens),
    all_special_ids and chat_template (None when the folder has none).
    Special-token strings in encoded text become their ids (the Kimi tiktoken back end: only with
    add_special_tokens=True; encode_prompt, which the engine uses for prompts, asks for it): the chat template's
    output relies on it."""

    def __init__(self, config: TokenizerConfig, config_origin: str):
        self.config = config
        self._config_origin = config_origin
        self._check_added_tokens()
        special_ids = {name: self._special_id(name) for name in SPECIAL_TOKEN_FIELDS}
        self.bos_token_id: int | None = special_ids["bos_token"]
        self.eos_token_ids: tuple[int, ...] = self._eos_token_ids(special_ids["eos_token"])
        from_config = {i for i, token in config.added_tokens.items() if token.special}
        named = {i for i in special_ids.values() if i is not None}
        self.all_special_ids: frozenset[int] = frozenset(self.backend_special_ids | from_config | named)
        self.chat_template = (
            ChatTemplate(config.chat_template, config.chat_template_origin) if config.chat_template else None
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text; add_special_tokens adds what the tokenizer's post-processor adds (e.g. BOS)."""
        if not isinstance(text, str):
            raise TokenizerError(
                f"encode takes a str, got {type(text).__name__}; pass text, or token ids to the engine"
            )
        if not text.isascii():
            try:  # the tokenizers back end failed with "TextInputSequence must be str", tiktoken made it U+FFFD
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise TokenizerError(
                    f"text holds an unpaired UTF-16 surrogate ({text[e.start]!r}) at character {e.start}, which is "
                    f"not Unicode text; join surrogate pairs into characters, or replace the lone one"
                ) from None
        return self._encode(text, add_special_tokens)

    def encode_prompt(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """A prompt's token ids: special-token strings become their ids, and what the post-processor adds (a BOS)
        is added when add_special_tokens, by default to plain text but not to a rendered chat (ChatText), whose
        template wrote it already: a template that writes `{{ bos_token }}` gets one BOS, not two, as vLLM encodes
        chat prompts (the OpenAI routes' `add_special_tokens` sets it per request, as vLLM's do)."""
        if add_special_tokens is None:
            add_special_tokens = not isinstance(text, ChatText)
        return self.encode(text, add_special_tokens=add_special_tokens)

    @abstractmethod
    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """encode() of a text already checked to be a str."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token_ids; bytes that are not valid UTF-8 become U+FFFD."""

    @abstractmethod
    def id_to_bytes(self, token_id: int) -> bytes:
        """The bytes token_id adds to the text; b'' for an id outside the vocabulary (decode skips those)."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of one whole token (as written in the vocabulary, or a special token), None if absent."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """One more than the largest token id."""

    @property
    @abstractmethod
    def backend_special_ids(self) -> frozenset[int]:
        """Ids the vocabulary file itself marks special."""

    def check_model_vocab(self, model_vocab_size: int, model_dir: str) -> None:
        """Every id this tokenizer can produce must be a row of the model's embedding; the model's vocabulary may
        be larger (Kimi pads it), never smaller."""
        if self.vocab_size > model_vocab_size:
            raise TokenizerError(
                f"the tokenizer files in {model_dir} do not belong to this model (ids up to {self.vocab_size - 1}, "
                f"model vocabulary {model_vocab_size}, config.json's vocab_size); put the model's own tokenizer "
                f"files there, or remove them to run on token ids"
            )

    @property
    def model_max_length(self) -> int | None:
        return self.config.model_max_length

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None) -> ChatText:
        """The prompt text for a chat; encode_prompt gives its token ids."""
        if self.chat_template is None:
            raise ChatTemplateError(
                f"the tokenizer in {self._config_origin} has no chat template; send a prompt or token ids, "
                f"or add a chat_template to tokenizer_config.json"
            )
        return ChatText(self.chat_template.render(messages, add_generation_prompt, tools,
                                                  **self.config.special_token_strings()))

    def _eos_token_ids(self, eos_token_id: int | None) -> tuple[int, ...]:
        """The config's eos_token plus the end-of-turn tokens that the chat template uses."""
        template = self.config.chat_template or ""
        ends = [self.token_to_id(token) for token in END_OF_TURN_TOKENS if token in template]
        return tuple(sorted({eos_token_id, *ends} - {None}))

    def _special_id(self, name: str) -> int | None:
        token = getattr(self.config, name)
        token_id = None if token is None else self.token_to_id(token)
        if token is not None and token_id is None:
            raise TokenizerError(
                f"{self._config_origin}: {name} = {token!r} is not in the vocabulary; "
                f"set it to a token the vocabulary has, or remove it"
            )
        return token_id

    def _check_added_tokens(self) -> None:
        for token_id, token in self.config.added_tokens.items():
            found = self.token_to_id(token.content)
            if found != token_id:
                raise TokenizerError(
                    f"{self._config_origin}: added token {token.content!r} has id {token_id} there but "
                    f"{found} in the vocabulary; the tokenizer files disagree: re-save them together"
                )
