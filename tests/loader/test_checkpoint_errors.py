"""Every broken checkpoint is a CheckpointError that names what is wrong: the tensor, the file, the shapes."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers.checkpoints import SMALL_RAW_CONFIG, read_tensors, rewrite_tensors, shard, write_small_checkpoint

from deltaserve.config import ModelConfig
from deltaserve.loader.checkpoint import CheckpointError
from deltaserve.loader.model_loader import load_model

KV_B = "model.layers.1.self_attn.kv_b_proj.weight"  # [H * (nope + v), kv_lora_rank] = [32, 16]
O_PROJ = "model.layers.0.self_attn.o_proj.weight"  # [hidden, H * K] = [32, 16]


@pytest.fixture
def folder(tmp_path):
    return write_small_checkpoint(tmp_path / "model")


def load(folder):
    return load_model(folder, ModelConfig.from_file(folder), torch.float32, "cpu")


def error_of(folder) -> str:
    with pytest.raises(CheckpointError) as info:
        load(folder)
    return str(info.value)


def test_missing_tensor_names_it_its_shape_and_the_folder(folder):
    tensors = read_tensors(folder)
    del tensors[KV_B]
    rewrite_tensors(folder, tensors)
    message = error_of(folder)
    assert "missing tensor" in message and KV_B in message
    assert "[32, 16]" in message, "the expected shape"
    assert str(folder) in message, "where it was looked for"


def test_unexpected_tensor_names_it_its_file_and_shape(folder):
    tensors = read_tensors(folder)
    tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(3, 5)
    rewrite_tensors(folder, tensors)
    message = error_of(folder)
    assert "unexpected tensor model.layers.0.self_attn.extra_proj.weight" in message
    assert "model.safetensors" in message and "[3, 5]" in message


def test_misshaped_tensor_names_it_its_file_and_both_shapes(folder):
    tensors = read_tensors(folder)
    tensors[O_PROJ] = tensors[O_PROJ].t()
    rewrite_tensors(folder, tensors)
    message = error_of(folder)
    assert O_PROJ in message and "model.safetensors" in message
    assert "[16, 32]" in message and "[32, 16]" in message


def test_misshaped_tensor_in_a_shard_names_that_shard(folder):
    tensors = read_tensors(folder)
    tensors[KV_B] = torch.zeros(32, 17)
    rewrite_tensors(folder, tensors)
    file = shard(folder, 3)[KV_B]
    message = error_of(folder)
    assert KV_B in message and file in message and "[32, 17]" in message and "[32, 16]" in message


def test_garbage_file_is_named(folder):
    (folder / "model.safetensors").write_bytes(b"\x00\x01 not a safetensors file " * 50)
    message = error_of(folder)
    assert "model.safetensors" in message and "not a readable safetensors file" in message


@pytest.mark.parametrize("keep", [0.5, 0.9], ids=["half", "tail-cut"])
def test_truncated_file_is_named(folder, keep):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    message = error_of(folder)
    assert str(path) in message
    assert re.search(r"corrupt|truncated|not a readable", message)


def test_truncated_header_is_named(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:6])
    assert str(path) in error_of(folder)


def test_index_pointing_at_a_missing_shard(folder):
    shard(folder, 3)
    (folder / "model-00002-of-00003.safetensors").unlink()
    message = error_of(folder)
    assert "model-00002-of-00003.safetensors" in message and "missing" in message
    assert "model.safetensors.index.json" in message


def test_index_that_is_not_json(folder):
    shard(folder, 2)
    (folder / "model.safetensors.index.json").write_text("{ this is not json")
    message = error_of(folder)
    assert "model.safetensors.index.json" in message and "not a valid index" in message


@pytest.mark.parametrize("index", [{"metadata": {}}, {"weight_map": ["a", "b"]}, {"weight_map": {"x": 3}}, [1, 2]])
def test_index_without_a_usable_weight_map(folder, index):
    shard(folder, 2)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    message = error_of(folder)
    assert "model.safetensors.index.json" in message and "weight_map" in message


def test_index_listing_a_tensor_its_file_lacks(folder):
    weight_map = shard(folder, 2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    other = {f for f in weight_map.values() if f != weight_map[KV_B]}.pop()
    index["weight_map"][KV_B] = other
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    message = error_of(folder)
    assert KV_B in message and other in message


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMALL_RAW_CONFIG))
    message = error_of(tmp_path)
    assert "no *.safetensors" in message and str(tmp_path) in message


def rewrite_config(folder, **changes):
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


def test_config_with_another_hidden_size(folder):
    rewrite_config(folder, hidden_size=48)
    message = error_of(folder)
    assert "has shape" in message and "config.json does not match the weights" in message


def test_config_with_more_layers_than_the_weights(folder):
    lin = dict(SMALL_RAW_CONFIG["linear_attn_config"], kda_layers=[1, 3, 4])
    rewrite_config(folder, num_hidden_layers=4, linear_attn_config=lin)
    message = error_of(folder)
    assert "missing tensor model.layers.3." in message


def test_config_with_fewer_layers_than_the_weights(folder):
    lin = dict(SMALL_RAW_CONFIG["linear_attn_config"], kda_layers=[1])
    rewrite_config(folder, num_hidden_layers=2, linear_attn_config=lin)
    message = error_of(folder)
    assert "unexpected tensor model.layers.2." in message and "check that config.json matches" in message


def test_config_that_swaps_kda_and_mla_layers(folder):
    lin = dict(SMALL_RAW_CONFIG["linear_attn_config"], kda_layers=[2, 3], full_attn_layers=[1])
    rewrite_config(folder, linear_attn_config=lin)
    message = error_of(folder)
    assert re.search(r"missing tensor model\.layers\.[01]\.self_attn\.", message)
