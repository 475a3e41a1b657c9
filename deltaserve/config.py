"""ModelConfig (parsed and validated from config.json) and EngineConfig (engine options, validated once)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

KDA, MLA = "kda", "mla"
DENSE, MOE = "dense", "moe"


class ConfigError(ValueError):
    """A config.json or engine option that deltaserve cannot run; the message names the field and the fix."""


def read_json_object(path: Path, fix: str) -> dict:
    """The JSON object in the file at path; ConfigError (a ValueError) naming the file, with `fix` as the remedy,
    when it is not valid JSON or holds something else."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); {fix}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _require(cond: bool, field_name: str, value, expectation: str) -> None:
    if not cond:
        raise ConfigError(f"config field '{field_name}' = {value!r}: {expectation}")


def _get(raw: dict, *names: str, default=None):
    """The first of `names` present in raw (Moonshot's name first, then transformers' aliases)."""
    for name in names:
        if name in raw and raw[name] is not None:
            return raw[name]
    return default


def _named(raw: dict, *names: str) -> str:
    """Which of `names` _get reads (the first when none is present): the field an error names."""
    return next((name for name in names if raw.get(name) is not None), names[0])


QUANTIZATION_METHODS = ("fp8",)


@dataclass(frozen=True)
class QuantConfig:
    """Block-wise FP8 (e4m3) weights, the format of FP8 checkpoints on the hub: per [block_n, block_k] block of a weight
    [N, K], one float32 dequantization multiplier (`weight_scale_inv`, shape [ceil(N/block_n), ceil(K/block_k)])."""

    method: str = "fp8"
    block_size: tuple[int, int] = (128, 128)
    # the checkpoint's modules stored in high precision (quantization_config's modules_to_not_convert /
    # ignored_layers), validated and kept for writing checkpoints; the engine's FP8 set is fixed (layers/fp8.py):
    # a module listed here that the engine runs in FP8 is quantized at load from its stored high-precision tensor
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self):
        _require(self.method in QUANTIZATION_METHODS, "quantization_config.quant_method", self.method,
                 f"only {', '.join(QUANTIZATION_METHODS)} is supported; use a bfloat16 checkpoint otherwise")
        _require(len(self.block_size) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1
                                                   for b in self.block_size),
                 "quantization_config.weight_block_size", list(self.block_size),
                 "must be two positive integers [block_n, block_k], e.g. [128, 128]")

    def keeps_high_precision(self, checkpoint_name: str) -> bool:
        """Whether a checkpoint tensor belongs to a module listed in modules_to_not_convert."""
        return any(module in checkpoint_name for module in self.modules_to_not_convert)


def _quantization(raw) -> QuantConfig | None:
    """config.json's quantization_config (FP8 checkpoints: quant_method fp8, fmt e4m3, block scales), validated."""
    if raw is None:
        return None
    _require(isinstance(raw, dict), "quantization_config", raw, "must be an object")
    method = raw.get("quant_method")
    _require(method in QUANTIZATION_METHODS, "quantization_config.quant_method", method,
             f"only {', '.join(QUANTIZATION_METHODS)} is supported; use a bfloat16 checkpoint otherwise")
    fmt = raw.get("fmt", "e4m3")
    _require(fmt == "e4m3", "quantization_config.fmt", fmt, "only 'e4m3' (float8_e4m3fn) weights are supported")
    scheme = raw.get("activation_scheme", "dynamic")
    _require(scheme == "dynamic", "quantization_config.activation_scheme", scheme,
             "only 'dynamic' is supported (activations are not quantized); static activation scales are not")
    block = raw.get("weight_block_size")
    _require(isinstance(block, list) and len(block) == 2, "quantization_config.weight_block_size", block,
             "must be [block_n, block_k], e.g. [128, 128]: per-tensor and per-channel FP8 are not supported")
    skipped = []
    for name in ("modules_to_not_convert", "ignored_layers"):
        value = raw.get(name) or []
        _require(isinstance(value, list) and all(isinstance(m, str) and m for m in value),
                 f"quantization_config.{name}", value, "must be a list of module names")
        skipped += value
    return QuantConfig(method, tuple(block), tuple(skipped))


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    # MLA (NoPE): q_lora_rank is always None
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    # MoE
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    num_expert_group: int
    topk_group: int
    moe_renormalize: bool
    routed_scaling_factor: float
    # per layer, 0-based: "kda" | "mla" and "dense" | "moe"
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    max_position_embeddings: int = 1 << 20
    tie_word_embeddings: bool = False
    kv_a_layernorm_eps: float = 1e-6  # the reference builds kv_a_layernorm with its default eps, not rms_norm_eps
    # how the linear layers' weights are held at run time: the checkpoint's quantization_config, or the engine's
    # quantization option (quantize at load); None: the run's dtype
    quantization: QuantConfig | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per MLA layer: the normalised c_kv and the shared k_rot."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == KDA]

    @classmethod
    def from_file(cls, path: str | os.PathLike, quantization: str | None = None) -> "ModelConfig":
        """quantization: the engine option; "fp8" quantizes a high-precision checkpoint at load (128 x 128
        blocks). A checkpoint whose config.json carries a quantization_config runs quantized either way."""
        path = Path(path)
        if path.is_file() and path.suffix != ".json":  # a model's weights, say: not a config.json to fix
            raise ConfigError(f"{path} is a file, not a model folder: pass the folder that holds config.json and the "
                              "weights (or, with load_format dummy, a config.json)")
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            if path.suffix == ".json" and path.name != "config.json" and not path.exists():
                raise ConfigError(f"{path} does not exist: pass the path of a config.json, or a model folder")
            raise ConfigError(f"no config.json at {path}: pass a model folder that holds config.json")
        raw = read_json_object(path, "re-download or fix the file")
        if path.name != "config.json" and "model_type" not in raw:  # tokenizer.json, say, passed for the folder
            raise ConfigError(f"{path} is not a model's config.json (it has no model_type): pass the model folder "
                              "that holds config.json (or, with load_format dummy, a config.json)")
        cfg = cls.from_dict(raw)
        if quantization is not None and cfg.quantization is None:
            cfg = replace(cfg, quantization=QuantConfig(method=quantization))
        return cfg

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        _check_supported(raw)
        num_layers = _int(raw, "num_hidden_layers")
        lin = raw.get("linear_attn_config") or {}
        _require(isinstance(lin, dict), "linear_attn_config", lin, "must be an object")
        layer_types = _layer_types(raw, lin, num_layers)
        has_kda = KDA in layer_types
        eos = _get(raw, "eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        cfg = cls(
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=_int(raw, "hidden_size"),
            intermediate_size=_int(raw, "intermediate_size"),
            moe_intermediate_size=_int(raw, "moe_intermediate_size"),
            num_hidden_layers=num_layers,
            rms_norm_eps=_float(raw, "rms_norm_eps", default=1e-5),
            num_attention_heads=_int(raw, "num_attention_heads"),
            kv_lora_rank=_int(raw, "kv_lora_rank"),
            qk_nope_head_dim=_int(raw, "qk_nope_head_dim"),
            qk_rope_head_dim=_int(raw, "qk_rope_head_dim"),
            v_head_dim=_int(raw, "v_head_dim"),
            kda_num_heads=_kda_size(raw, lin, "num_heads", "linear_num_heads", 32, has_kda),
            kda_head_dim=_kda_size(raw, lin, "head_dim", "linear_head_dim", 128, has_kda),
            conv_kernel_size=_int(
                lin, "short_conv_kernel_size", default=_get(raw, "linear_conv_kernel_dim", default=4),
                prefix="linear_attn_config.",
            ),
            num_experts=_int(raw, "num_experts", "num_local_experts"),
            num_experts_per_token=_int(raw, "num_experts_per_token", "num_experts_per_tok"),
            num_shared_experts=_int(raw, "num_shared_experts", "n_shared_experts", default=1, minimum=0),
            num_expert_group=_int(raw, "num_expert_group", "n_group", default=1),
            topk_group=_int(raw, "topk_group", default=1),
            moe_renormalize=_bool(raw, "moe_renormalize", "norm_topk_prob", default=True),
            routed_scaling_factor=_float(raw, "routed_scaling_factor", default=1.0),
            layer_types=layer_types,
            mlp_types=_mlp_types(raw, num_layers),
            bos_token_id=_get(raw, "bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=_get(raw, "pad_token_id"),
            # >= 2: a prompt token and a generated one
            max_position_embeddings=_int(raw, "model_max_length", "max_position_embeddings", default=1 << 20,
                                         minimum=2),
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", default=False),
            quantization=_quantization(raw.get("quantization_config")),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        _require(
            self.num_experts % self.num_expert_group == 0, "num_expert_group", self.num_expert_group,
            f"must divide num_experts ({self.num_experts})",
        )
        per_group = self.num_experts // self.num_expert_group
        _require(per_group >= 2, "num_expert_group", self.num_expert_group,
                 f"leaves {per_group} expert per group; the group score sums the top 2, so a group needs >= 2")
        _require(1 <= self.topk_group <= self.num_expert_group, "topk_group", self.topk_group,
                 f"must be in [1, num_expert_group={self.num_expert_group}]")
        allowed = self.topk_group * per_group
        _require(self.num_experts_per_token <= allowed, "num_experts_per_token", self.num_experts_per_token,
                 f"must be <= topk_group * experts per group = {allowed}")
        _require(self.conv_kernel_size >= 2, "linear_attn_config.short_conv_kernel_size", self.conv_kernel_size,
                 "must be >= 2")
        for eid in self.eos_token_ids:
            _require(is_int(eid) and 0 <= eid < self.vocab_size, "eos_token_id", eid,
                     f"must be a token id (an integer, not a string or bool) in [0, vocab_size={self.vocab_size})")
        for name in ("bos_token_id", "pad_token_id"):  # unused by the engine; transformers' defaults may lie outside
            token_id = getattr(self, name)  # a small test model's vocabulary, so only the type is checked
            _require(token_id is None or is_int(token_id), name, token_id, "must be an integer token id (or null)")


def _check_supported(raw: dict) -> None:
    model_type = raw.get("model_type")
    _require(model_type == "kimi_linear", "model_type", model_type, "deltaserve runs only 'kimi_linear' models")
    _require(raw.get("mla_use_nope", True) is True, "mla_use_nope", raw.get("mla_use_nope"),
             "only the NoPE MLA of Kimi-Linear (true) is supported")
    _require(raw.get("hidden_act", "silu") == "silu", "hidden_act", raw.get("hidden_act"), "only 'silu' is supported")
    _require(raw.get("q_lora_rank") is None, "q_lora_rank", raw.get("q_lora_rank"),
             "must be null: Kimi-Linear projects queries with a full q_proj; low-rank queries are not supported")
    act = raw.get("moe_router_activation_func", "sigmoid")
    _require(act == "sigmoid", "moe_router_activation_func", act, "only the 'sigmoid' router is supported")
    _require(not raw.get("attention_bias", False), "attention_bias", raw.get("attention_bias"), "must be false")
    _require(raw.get("num_nextn_predict_layers", 0) in (0, None), "num_nextn_predict_layers",
             raw.get("num_nextn_predict_layers"), "multi-token prediction layers are not supported; use 0")


def _int(raw: dict, *names: str, default=None, minimum: int = 1, prefix: str = "") -> int:
    value, name = _get(raw, *names, default=default), prefix + _named(raw, *names)
    _require(value is not None, name, value, "is required")
    _require(is_int(value) and value >= minimum, name, value, f"must be an integer >= {minimum}")
    return value


def _float(raw: dict, name: str, default: float) -> float:
    value = raw.get(name, default)
    # json.loads reads Infinity and NaN, which would make every logit NaN
    _require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
             name, value, "must be a positive number, finite (not Infinity or NaN)")
    return float(value)


def _bool(raw: dict, *names: str, default: bool) -> bool:
    """A JSON true/false ("false", a string, is truthy: it would silently mean true)."""
    value = _get(raw, *names, default=default)
    _require(isinstance(value, bool), _named(raw, *names), value,
             "must be true or false (a JSON boolean, not a string)")
    return value


_COPY_LINEAR = "copy linear_attn_config from the model's original config.json"


def _kda_size(raw: dict, lin: dict, name: str, alias: str, default: int, has_kda: bool) -> int:
    """A KDA size from linear_attn_config (Moonshot) or its top-level linear_* alias (transformers); required where
    the model has KDA layers: a default (transformers' 32 heads of 128) would only be contradicted by the weights."""
    value = _get(lin, name, default=_get(raw, alias))
    _require(value is not None or not has_kda, f"linear_attn_config.{name}", value,
             f"is required (transformers' name: {alias}): the size of the KDA layers; {_COPY_LINEAR}")
    return _int({name: value}, name, default=default, prefix="linear_attn_config.")


def _layer_types(raw: dict, lin: dict, num_layers: int) -> tuple[str, ...]:
    if "kda_layers" in lin or "full_attn_layers" in lin:
        kda, full = lin.get("kda_layers", []), lin.get("full_attn_layers", [])
        types: list[str | None] = [None] * num_layers
        for name, ids, kind in (("kda_layers", kda, KDA), ("full_attn_layers", full, MLA)):
            _require(isinstance(ids, list), f"linear_attn_config.{name}", ids,
                     "must be a list of 1-based layer numbers, e.g. [1, 2, 3]")
            for i in ids:
                _require(is_int(i) and 1 <= i <= num_layers, f"linear_attn_config.{name}", ids,
                         f"layers are 1-based and must be in [1, num_hidden_layers={num_layers}]")
                _require(types[i - 1] is None, f"linear_attn_config.{name}", ids, f"layer {i} is listed twice")
                types[i - 1] = kind
        missing = [i + 1 for i, t in enumerate(types) if t is None]
        _require(not missing, "linear_attn_config", {"kda_layers": kda, "full_attn_layers": full},
                 f"layers {missing} (1-based) are in neither kda_layers nor full_attn_layers")
        return tuple(types)
    named = raw.get("layer_types")
    # transformers would place full attention every 4th layer; a checkpoint's config.json always says where it is
    _require(named is not None, "linear_attn_config.kda_layers", None,
             "is required with full_attn_layers (transformers' name: layer_types): which layers are KDA and which "
             f"MLA; {_COPY_LINEAR}")
    names = {"linear_attention": KDA, "full_attention": MLA}
    _require(isinstance(named, list) and len(named) == num_layers and all(t in names for t in named), "layer_types",
             named, f"must list {num_layers} of 'linear_attention' / 'full_attention'")
    return tuple(names[t] for t in named)


def _mlp_types(raw: dict, num_layers: int) -> tuple[str, ...]:
    named = raw.get("mlp_layer_types")
    if named is not None:
        names = {"dense": DENSE, "sparse": MOE}
        _require(isinstance(named, list) and len(named) == num_layers and all(t in names for t in named),
                 "mlp_layer_types", named, f"must list {num_layers} of 'dense' / 'sparse'")
        return tuple(names[t] for t in named)
    first_dense = _int(raw, "first_k_dense_replace", default=1, minimum=0)
    freq = _int(raw, "moe_layer_freq", default=1)
    return tuple(MOE if i >= first_dense and i % freq == 0 else DENSE for i in range(num_layers))  # DeepSeek's rule


DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8")  # the MLA latent cache's: "auto" the run dtype, "fp8" float8_e4m3fn
MAX_DECODE_STEPS = 64


def is_int(value) -> bool:
    """An integer option's check: an int, and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineConfig:
    """Options of the serving engine, shared by generate/chat/serve/bench; validated at construction."""

    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # on by default (a multi-turn chat's TTFT much lower); the cost: KDA snapshot copies, and a second KDA kernel
    # pass over the few tokens of a step's chunks that lie past a snapshot position
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    device: str = "cpu"
    cache_bytes: int | None = None  # CPU budget for MLA pages + KDA slots; None: sized for max_num_seqs full-length
    gpu_memory_utilization: float = 0.9
    num_cache_blocks: int | None = None  # explicit page count overrides the budget (tests use it to force preemption)
    # prefix caching's budget of KDA state snapshots (each one state slot's bytes, taken from the cache budget);
    # None: 2 * max_num_seqs, a prompt-end and a finish snapshot per running request
    num_snapshot_slots: int | None = None
    threads: int | None = None
    load_format: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1  # processes (GPUs) one model is split over, by attention head and MLP column
    enable_expert_parallel: bool = False  # with tensor_parallel_size > 1: routed experts split whole across ranks
    # None: weights in dtype (or as the checkpoint stores them); "fp8": linear layers and experts quantized at
    # load to float8_e4m3fn with 128 x 128 block scales (README, "FP8 weights")
    quantization: str | None = None
    # the MLA latent cache: "auto" in dtype; "fp8" in float8_e4m3fn, unscaled (values clamped to +-448), half the
    # bytes of bf16 (twice the tokens a budget holds, half the bytes a long-context decode step reads), rounded to
    # 3 mantissa bits (README, "FP8 latent cache")
    kv_cache_dtype: str = "auto"
    # decode steps a scheduler step may run back to back (1 + its lookahead tokens; README, "Decode bursts"): the
    # host schedules, syncs and detokenizes once per burst, not once per token; 1 turns it off
    num_decode_steps: int = 8
    # keep one step in flight (core/scheduler.py), so the host's work between steps overlaps the device's; None: on
    # for a GPU, off on the CPU (where the host is the device: a request that stops costs a step for nothing)
    async_scheduling: bool | None = None
    # CPU: decode-only steps of up to runner.model_runner.COMPILED_DECODE_MAX_SEQS requests run the model's forward
    # through torch.compile (one graph a batch size, compiled at its first step: seconds). Faster at batch 1 on small
    # models, but inductor sums in its own order (logits within ~1e-5 of eager's), so off by default
    compile_decode: bool = False
    # CPU, float32: products of up to 4 rows through our kernel (kernels/cpu_gemv.py, where it builds), which sums in
    # its own order (the last bits differ from MKL's); False: PyTorch's products only
    cpu_gemv: bool = True
    # GPU, half precision: a norm inside the GEMV of the projection that reads it (kernels/norm_gemv.py; the bf16
    # roundings may differ in the last bits); False: norm and projection apart
    norm_gemv: bool = True
    # GPU, Hopper and later: programmatic dependent launch of our decode-step kernels (kernels/pdl.py: a kernel's
    # launch overlaps the one before it); changes timing only, not values. False: plain launches, for profiles
    pdl: bool = True
    # GPU: at start, prefill a few random prompts in steps that meet every length bucket the prefill kernels key their
    # tuning on and Triton's ways of compiling their integer arguments (Engine.warm_up_prefill), so their compiling and
    # tuning happen before the engine takes requests, not inside a client's first long prompt (fla-core's chunked KDA:
    # ~100 s on a new machine). serve turns it on
    warmup_prefill: bool = False

    @property
    def latent_dtype(self) -> str:
        """The MLA latent cache's dtype name (kv_cache_dtype resolved)."""
        return "float8_e4m3fn" if self.kv_cache_dtype == "fp8" else self.dtype

    def __post_init__(self):
        def bad(name, value, expectation):
            raise ConfigError(f"engine option {name} = {value!r}: {expectation}")

        if not is_int(self.num_decode_steps) or not 1 <= self.num_decode_steps <= MAX_DECODE_STEPS:
            bad("num_decode_steps", self.num_decode_steps, f"must be an integer in [1, {MAX_DECODE_STEPS}]")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                bad(name, value, "must be a positive integer")
        for name in ("max_model_len", "cache_bytes", "num_cache_blocks", "num_snapshot_slots", "threads"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                bad(name, value, "must be a positive integer (or None for the default)")
        for name in ("enable_prefix_caching", "enable_expert_parallel", "compile_decode", "cpu_gemv", "norm_gemv",
                     "pdl", "warmup_prefill"):
            if not isinstance(getattr(self, name), bool):
                bad(name, getattr(self, name), "must be True or False")
        if not isinstance(self.device, str):
            bad("device", self.device, "must be a string: 'cpu' or 'cuda[:N]'")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or isinstance(self.gpu_memory_utilization, bool):
            bad("gpu_memory_utilization", self.gpu_memory_utilization, "must be a number in (0, 1]")
        if not is_int(self.seed) or not 0 <= self.seed < 2**63:
            bad("seed", self.seed, "must be an integer in [0, 2**63)")
        if self.block_size > 1024:
            bad("block_size", self.block_size, "must be <= 1024 (small pages: 16 to 64 tokens)")
        if self.dtype not in DTYPES:
            bad("dtype", self.dtype, f"must be one of {', '.join(DTYPES)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            bad("device", self.device, "must be 'cpu' or 'cuda[:N]'")
        if not 0 < self.gpu_memory_utilization <= 1:
            bad("gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            bad("quantization", self.quantization, f"must be None or one of {', '.join(QUANTIZATION_METHODS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", self.kv_cache_dtype, f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.load_format not in ("auto", "dummy"):
            bad("load_format", self.load_format, "must be 'auto' or 'dummy'")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            bad("enable_expert_parallel", True, "needs tensor_parallel_size > 1 (experts are split over its ranks)")
        if self.compile_decode and self.device != "cpu":
            bad("compile_decode", True, "is for the CPU (on a GPU, decode steps replay CUDA graphs)")
        if self.compile_decode and self.tensor_parallel_size > 1:
            bad("compile_decode", True, "runs one process's whole forward: needs tensor_parallel_size 1")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            bad("async_scheduling", self.async_scheduling, "must be True, False or None (on for a GPU)")
