"""SamplingParams: how one request picks its tokens and when it stops; validated at construction."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from deltaserve.config import is_int, read_json_object

MAX_LOGPROBS = 20
# the fields of a model folder's generation_config.json that set sampling defaults (those vLLM reads too)
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MAX_CHOICES = 1024  # StructuredOutputsParams.choice: alternatives per request
# a logit_bias value is applied clamped to [-100, 100] (OpenAI's range; vLLM clamps): RequestState.logit_bias
LOGIT_BIAS_LIMIT = 100.0


def is_num(value) -> bool:
    """A number field's check: an int or float (not a bool), finite."""
    finite = isinstance(value, (int, float)) and value == value and abs(value) != float("inf")
    return finite and not isinstance(value, bool)


class ParamError(ValueError):
    """A bad field of SamplingParams or StructuredOutputsParams; field names it (None: the fields together), so that
    the server's 400 can name the request's field."""

    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # pickled whole (an exception pickles its args alone, here only the message)
        return ParamError, (str(self), self.field)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a constrained request's output must match: exactly one of a JSON schema (a dict or its JSON text), any
    JSON object (json_object), a regular expression, one of a list of strings (choice) or an EBNF grammar (vLLM's
    `structured_outputs` shape). Checked for shape here; deltaserve.structured checks and compiles the content."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    # vLLM's options, taken and met either way: JSON is always compiled without free whitespace and without properties
    # the schema does not name (structured/backend.py), which either setting allows; there is no backend to fall back to
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False

    def __post_init__(self):
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ParamError(f"StructuredOutputsParams: set exactly one of json, regex, choice, grammar or "
                             f"json_object; got {given or 'none'}", None)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ParamError(f"StructuredOutputsParams.json is {type(self.json).__name__}: pass a JSON schema as a "
                             "dict or as JSON text", "json")
        if isinstance(self.json, dict):
            try:
                self.key  # the schema's JSON text: the cache key, and what the grammar compiler reads
            except (TypeError, ValueError, RecursionError) as e:
                raise ParamError(f"StructuredOutputsParams.json is not JSON: {e}; pass a schema of dicts, lists, "
                                 "strings, numbers, booleans and None", "json") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ParamError(f"StructuredOutputsParams.{name} = {value!r:.80}: must be a non-empty string", name)
        if self.choice is not None and not (0 < len(self.choice) <= MAX_CHOICES
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ParamError(f"StructuredOutputsParams.choice = {self.choice!r:.80}: must be 1 to {MAX_CHOICES} "
                             "non-empty strings", "choice")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what a compiled grammar is cached by."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)  # key order is the output's
            return "json", text
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


@dataclass
class SamplingParams:
    n: int = 1  # outputs per prompt (LLM.generate and stream run n requests; with a seed, output i uses seed + i)
    max_tokens: int = 16
    # outputs before EOS, stop_token_ids or a stop string may end it (vLLM's); max_tokens and max_model_len still do
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None  # per request: the same tokens whatever else is in the batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-n logprobs per sampled token (the sampled one is always included)
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (deltaserve.structured)
    # token id -> added to its logit before sampling, clamped to [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT] (vLLM's)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's); None: any

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        for name in ("stop", "stop_token_ids"):  # None or a tuple as a list; anything else, validate names
            value = getattr(self, name)
            if value is None or isinstance(value, tuple):
                setattr(self, name, list(value or ()))
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """ParamError naming the first bad field. Run at construction and again by Engine.add_request: the fields
        can be set after construction (a dataclass), and a bad value there failed deep in a step, or not at all."""
        def bad(name, expectation):
            raise ParamError(f"SamplingParams.{name} = {getattr(self, name)!r}: {expectation}", name)

        if not is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not is_int(self.max_tokens) or self.max_tokens < 0:
            bad("max_tokens", "must be an integer >= 0")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens = {self.max_tokens}]; lower it or raise "
                "max_tokens")
        if not is_num(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a number >= 0 (0 means greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be an integer >= 1, or 0 / -1 for no limit")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an integer or None")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0 (1 means no penalty)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be True or False")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams or None")
        self._validate_token_sets()

    def _validate_token_sets(self) -> None:
        """logit_bias and allowed_token_ids: ParamError naming the first bad entry (not the whole of a long one)."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ParamError(f"SamplingParams.logit_bias = {self.logit_bias!r:.80}: must be a dict of token ids "
                                 "to numbers, or None", "logit_bias")
            entry = next(((t, v) for t, v in self.logit_bias.items() if not (is_int(t) and t >= 0 and is_num(v))),
                         None)
            if entry is not None:
                raise ParamError(f"SamplingParams.logit_bias[{entry[0]!r:.40}] = {entry[1]!r:.40}: keys must be token "
                                 "ids (integers >= 0) and values finite numbers", "logit_bias")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ParamError(f"SamplingParams.allowed_token_ids = {self.allowed_token_ids!r:.80}: must be a "
                                 "non-empty list of token ids, or None for any", "allowed_token_ids")
            bad = next((i for i, t in enumerate(self.allowed_token_ids) if not (is_int(t) and t >= 0)), None)
            if bad is not None:
                raise ParamError(f"SamplingParams.allowed_token_ids[{bad}] = {self.allowed_token_ids[bad]!r:.40}: "
                                 "token ids are integers >= 0", "allowed_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on: the sampler then needs the prompt and output tokens so far."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def host_between_tokens(self) -> bool:
        """Whether the host must see each token before the next is sampled (logprobs, stop strings, penalties, a
        grammar): such a request keeps its batch out of lookahead decode steps."""
        return self.logprobs is not None or bool(self.stop) or self.samples_from_outputs

    @property
    def samples_from_outputs(self) -> bool:
        """Whether sampling a token reads the outputs before it on the host (penalties count them, a grammar's mask
        follows them): a step scheduled while the one before it is in flight samples such a request only once that
        step is applied (the runner's forward pass goes ahead)."""
        return self.penalized or self.structured_outputs is not None


def generation_defaults(folder: str | os.PathLike) -> dict:
    """The sampling defaults that the model folder's generation_config.json sets (GENERATION_CONFIG_FIELDS), checked
    by SamplingParams' own rules; {} where the folder has no such file. A bad file is a ValueError naming it."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    raw = read_json_object(path, "fix or delete it")
    defaults = {name: raw[name] for name in GENERATION_CONFIG_FIELDS if raw.get(name) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path}: {e}; fix or delete the file") from e
    return defaults
