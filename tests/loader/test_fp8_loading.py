"""FP8 weights at load time: an FP8 checkpoint (X.weight float8_e4m3fn + X.weight_scale_inv) in each layout loads the
same parameters as quantizing the high-precision checkpoint at load; scales follow their tensors through the name
mapping, the stacking of experts and tensor-parallel shards; malformed FP8 checkpoints are refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.checkpoints import read_tensors, rewrite_tensors, write_fp8_checkpoint, write_small_checkpoint

from deltaserve.config import ModelConfig, QuantConfig
from deltaserve.distributed import ParallelConfig
from deltaserve.kernels.quant import FP8, dequantize_fp8
from deltaserve.kernels.quant.naive import naive_dequantize
from deltaserve.loader.checkpoint import CheckpointError
from deltaserve.loader.model_loader import load_model
from deltaserve.loader.sharding import shard_specs

# the small model's stacked tensors (q, k, v: 16 rows; f_a, g_a: 8; MLA q: 24; experts: 16) fill whole 8-row blocks
BLOCK = (8, 8)
HIGH_PRECISION = ("f_b_proj", "g_b_proj", "kv_b_proj")  # what the model keeps in high precision


def params(folder, quant: QuantConfig | None = None, parallel: ParallelConfig | None = None) -> dict:
    cfg = ModelConfig.from_file(folder)
    if quant is not None:  # quantize at load, in these blocks
        cfg = dataclasses.replace(cfg, quantization=quant)
    options = {} if parallel is None else {"parallel": parallel}
    return dict(load_model(folder, cfg, torch.float32, "cpu", **options).named_parameters())


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(*(t.view(torch.uint8) if t.dtype == FP8 else t for t in (a, b)))


@pytest.mark.parametrize("layout", ["moonshot", "saved", "transformers"])
def test_fp8_checkpoint_loads_what_quantizing_at_load_gives(tmp_path, layout):
    src = write_small_checkpoint(tmp_path / "bf16", layout)
    fp8 = write_fp8_checkpoint(src, tmp_path / "fp8", QuantConfig(block_size=BLOCK,
                                                                  modules_to_not_convert=HIGH_PRECISION))
    assert any(name.endswith("_scale_inv") for name in read_tensors(fp8))
    loaded, quantized = params(fp8), params(src, QuantConfig(block_size=BLOCK))
    assert loaded.keys() == quantized.keys()
    assert loaded["layers.1.mlp.w13"].dtype == FP8 and loaded["layers.0.self_attn.in_proj.weight"].dtype == FP8
    assert loaded["layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float32
    for name in loaded:
        assert same(loaded[name], quantized[name]), name


def test_fp8_tensors_of_high_precision_parameters_are_dequantized(tmp_path):
    src = write_small_checkpoint(tmp_path / "bf16")
    fp8 = write_fp8_checkpoint(src, tmp_path / "fp8", QuantConfig(block_size=BLOCK))  # kv_b_proj in FP8 too
    tensors = read_tensors(fp8)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    expected = naive_dequantize(tensors[name], tensors[name + "_scale_inv"], BLOCK)
    assert torch.equal(params(fp8)["layers.1.self_attn.kv_b_proj.weight"], expected)


@pytest.mark.parametrize("source", ["fp8 checkpoint", "quantized at load"])
def test_each_tensor_parallel_rank_holds_its_slice_of_the_dequantized_weights(tmp_path, source):
    src = write_small_checkpoint(tmp_path / "bf16")
    block = (4, 4)  # divides every shard of the small model at 2 ranks
    quant = QuantConfig(block_size=block)
    folder = write_fp8_checkpoint(src, tmp_path / "fp8", quant) if source == "fp8 checkpoint" else src
    quant = None if source == "fp8 checkpoint" else quant
    cfg = ModelConfig.from_file(folder)
    full = params(folder, quant)
    for expert_parallel in (False, True):
        for rank in range(2):
            parallel = ParallelConfig(rank, 2, expert_parallel)
            local, specs = params(folder, quant, parallel), shard_specs(cfg, parallel)
            for name, whole in full.items():
                if whole.dtype != FP8:
                    continue
                dense = dequantize_fp8(whole, full[name + "_scale_inv"], block)
                mine = dequantize_fp8(local[name], local[name + "_scale_inv"], block)
                if name in specs:
                    dim, ranges = specs[name]
                    dense = torch.cat([dense.narrow(dim, a, b - a) for a, b in ranges], dim)
                assert torch.equal(mine, dense), (name, rank, expert_parallel)


def test_a_shard_that_splits_an_fp8_block_is_refused(tmp_path):
    """At 8-row blocks, rank 1's MLA query rows (12 of 24) start mid-block."""
    fp8 = write_fp8_checkpoint(write_small_checkpoint(tmp_path / "bf16"), tmp_path / "fp8",
                               QuantConfig(block_size=BLOCK))
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.in_proj\.weight.*tensor_parallel_size"):
        params(fp8, parallel=ParallelConfig(1, 2))


def test_malformed_fp8_checkpoints_are_refused_naming_the_tensor(tmp_path):
    src = write_small_checkpoint(tmp_path / "bf16")
    fp8 = write_fp8_checkpoint(src, tmp_path / "fp8", QuantConfig(block_size=BLOCK))
    tensors = read_tensors(fp8)
    name = "model.layers.0.mlp.down_proj.weight"
    rewrite_tensors(fp8, {**tensors, name + "_scale_inv": tensors[name + "_scale_inv"][:1]})
    with pytest.raises(CheckpointError, match=f"{name}_scale_inv.*weight_block_size"):
        params(fp8)
    rewrite_tensors(fp8, {n: t for n, t in tensors.items() if n != name + "_scale_inv"})
    with pytest.raises(CheckpointError, match=f"{name}.*float8_e4m3fn.*no {name}_scale_inv"):
        params(fp8)
    rewrite_tensors(fp8, tensors)
    raw = json.loads((fp8 / "config.json").read_text())
    del raw["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="scale_inv.*no quantization_config"):
        params(fp8)


@pytest.mark.parametrize("suffix", ["", "_scale_inv"])
def test_nan_in_fp8_values_or_scales_is_refused_naming_the_tensor(tmp_path, suffix):
    fp8 = write_fp8_checkpoint(write_small_checkpoint(tmp_path / "bf16"), tmp_path / "fp8",
                               QuantConfig(block_size=BLOCK))
    tensors = read_tensors(fp8)
    name = "model.layers.1.block_sparse_moe.experts.0.w1.weight" + suffix
    bad = tensors[name].view(torch.uint8) if suffix == "" else tensors[name]
    bad.view(-1)[0] = 0x7F if suffix == "" else float("nan")  # 0x7F: a NaN of float8_e4m3fn
    rewrite_tensors(fp8, tensors)
    with pytest.raises(CheckpointError, match=rf"tensor {name} in .*model.safetensors holds NaN or Inf"):
        params(fp8)


def test_dummy_fp8_weights_have_the_dense_models_spread(tmp_path):
    from deltaserve.loader.model_loader import build_model, init_dummy_weights

    cfg = dataclasses.replace(ModelConfig.from_file(write_small_checkpoint(tmp_path / "bf16")),
                              quantization=QuantConfig())
    model = build_model(cfg, torch.float32, "cpu")
    init_dummy_weights(model, seed=0, std=0.02)
    mlp = model.layers[1].mlp
    w13 = dequantize_fp8(mlp.w13, mlp.w13_scale_inv, (128, 128))
    assert mlp.w13.dtype == FP8 and 0.015 < w13.std().item() < 0.025 and torch.isfinite(w13).all()
