"""Checkpoints that must load: shards with an index, the three layouts of DESIGN.md section 2, mixed dtypes."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers.checkpoints import read_tensors, rewrite_tensors, shard, small_model, write_small_checkpoint

from deltaserve.config import ModelConfig
from deltaserve.loader.model_loader import load_model
from deltaserve.loader.names import FLOAT32_PARAMS
from deltaserve.loader.writer import LAYOUTS, save_checkpoint


def load(folder, dtype=torch.float32):
    return load_model(folder, ModelConfig.from_file(folder), dtype, "cpu")


def assert_same_parameters(a, b):
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize("num_shards", [2, 5])
def test_shards_with_an_index_load_like_one_file(tmp_path, num_shards):
    one = write_small_checkpoint(tmp_path / "one")
    sharded = shutil.copytree(one, tmp_path / "sharded")
    shard(sharded, num_shards)
    assert not (sharded / "model.safetensors").exists()
    assert_same_parameters(load(sharded), load(one))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_round_trips_every_parameter(tmp_path, layout):
    raw, cfg, model = small_model(seed=3)
    save_checkpoint(model, cfg, raw, tmp_path, layout)
    assert_same_parameters(load(tmp_path), model)


def test_layouts_spell_names_as_design_says(tmp_path):
    """Moonshot's dense layer under mlp., save_pretrained's under block_sparse_moe., transformers' stacked experts,
    one conv1d and the forget_gate submodule."""
    raw, cfg, model = small_model()
    names = {}
    for layout in LAYOUTS:
        save_checkpoint(model, cfg, raw, tmp_path / layout, layout)
        names[layout] = set(read_tensors(tmp_path / layout))
    layer0, layer1 = "model.layers.0.", "model.layers.2."  # dense KDA layer, MoE KDA layer
    assert layer0 + "mlp.gate_proj.weight" in names["moonshot"]
    assert layer0 + "block_sparse_moe.gate_proj.weight" in names["saved"]
    assert layer0 + "mlp.gate_proj.weight" in names["transformers"]
    for layout in ("moonshot", "saved"):
        assert {layer1 + "block_sparse_moe.experts.3.w2.weight", layer1 + "self_attn.q_conv1d.weight",
                layer1 + "self_attn.A_log", layer1 + "block_sparse_moe.gate.e_score_correction_bias"} <= names[layout]
    assert {layer1 + "mlp.experts.gate_up_proj", layer1 + "mlp.experts.down_proj", layer1 + "self_attn.conv1d.weight",
            layer1 + "self_attn.forget_gate.A_log",
            layer1 + "mlp.gate.e_score_correction_bias"} <= names["transformers"]


def test_bfloat16_checkpoint_with_float32_decay_params(tmp_path):
    """The published checkpoint is bf16 with A_log and dt_bias in f32: loading in f32 upcasts the bf16 tensors
    exactly and keeps the f32 ones as stored."""
    folder = write_small_checkpoint(tmp_path)
    tensors = read_tensors(folder)
    stored = {n: (t if n.endswith(("A_log", "dt_bias")) else t.bfloat16()) for n, t in tensors.items()}
    rewrite_tensors(folder, stored)
    model = load(folder)
    state = dict(model.named_parameters())
    assert torch.equal(state["layers.0.self_attn.A_log"], stored["model.layers.0.self_attn.A_log"].flatten())
    assert torch.equal(state["layers.0.self_attn.dt_bias"], stored["model.layers.0.self_attn.dt_bias"])
    assert torch.equal(state["layers.1.self_attn.kv_b_proj.weight"],
                       stored["model.layers.1.self_attn.kv_b_proj.weight"].float())


def test_bfloat16_run_keeps_router_and_decay_params_in_float32(tmp_path):
    model = load(write_small_checkpoint(tmp_path), dtype=torch.bfloat16)
    for name, param in model.named_parameters():
        expected = torch.float32 if name.rsplit(".", 1)[-1] in FLOAT32_PARAMS else torch.bfloat16
        assert param.dtype == expected, name
    kept_float32 = {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert kept_float32 == set(FLOAT32_PARAMS)


def test_a_log_stored_flat_loads_like_the_four_dim_one(tmp_path):
    folder = write_small_checkpoint(tmp_path)
    reference = load(folder)
    tensors = read_tensors(folder)
    tensors = {n: (t.flatten() if n.endswith("A_log") else t) for n, t in tensors.items()}
    assert tensors["model.layers.0.self_attn.A_log"].shape == (2,)
    rewrite_tensors(folder, tensors)
    assert_same_parameters(load(folder), reference)
