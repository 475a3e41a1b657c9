"""Every broken checkpoint is a CheckpointError that names what is wrong: the tensor, the file, the shapes."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from helpers.checkpoints import SMALL_RAW_CONFIG, read_tensors, rewrite_tensors, shard, write_small_checkpoint

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.loader.checkpoint import CheckpointError
from deltaserve.loader.model_loader import build_model, load_model

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


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"  # a piece of the KDA in_proj


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool, torch.float8_e5m2])
def test_weight_of_a_non_float_dtype_names_it(folder, dtype):
    tensors = read_tensors(folder)
    tensors[Q_PROJ] = tensors[Q_PROJ].to(dtype)
    rewrite_tensors(folder, tensors)
    message = error_of(folder)
    assert Q_PROJ in message and "model.safetensors" in message and "weights must be F16, BF16, F32 or F64" in message
    assert "re-download" in message and "re-convert" in message


def test_header_dtype_edited_to_an_integer_type(folder):
    """F32 -> I32 in the header alone: same bytes, same shape, but copy_ would cast integers into the weights."""
    path = folder / "model.safetensors"
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header[Q_PROJ]["dtype"] = "I32"
    edited = json.dumps(header, separators=(",", ":")).encode().ljust(size)  # padded with spaces, as allowed
    path.write_bytes(data[:8] + edited + data[8 + size:])
    message = error_of(folder)
    assert Q_PROJ in message and "I32" in message


def test_float64_weights_load(folder):
    tensors = read_tensors(folder)
    tensors[Q_PROJ] = tensors[Q_PROJ].double()
    rewrite_tensors(folder, tensors)
    load(folder)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", [Q_PROJ, KV_B, "model.layers.1.self_attn.kv_a_layernorm.weight"])
def test_weight_holding_nan_or_inf_names_it(folder, bad, name):
    tensors = read_tensors(folder)
    tensors[name].view(-1)[3] = bad
    rewrite_tensors(folder, tensors)
    file = shard(folder, 2)[name]
    message = error_of(folder)
    assert name in message and file in message and "NaN or Inf" in message


def test_finite_weights_beyond_the_run_dtype_are_named(folder):
    tensors = read_tensors(folder)
    tensors[Q_PROJ].view(-1)[0] = 1e30  # finite in float32, inf in float16
    rewrite_tensors(folder, tensors)
    with pytest.raises(CheckpointError, match=rf"{Q_PROJ} .* beyond the range of torch.float16"):
        load_model(folder, ModelConfig.from_file(folder), torch.float16, "cpu")
    load(folder)  # float32 holds it


def test_config_far_too_large_is_a_shape_error_not_an_allocation_failure(folder):
    """The weights are checked against config.json before the model takes memory."""
    rewrite_config(folder, hidden_size=10**12)
    message = error_of(folder)
    assert "model.safetensors has shape" in message and "config.json does not match the weights" in message


def test_model_too_large_to_allocate_says_how_large():
    raw = dict(SMALL_RAW_CONFIG, hidden_size=10**12)
    with pytest.raises(ConfigError, match=r"the model's weights need [\d,.]+ GB .* cannot allocate them"):
        build_model(ModelConfig.from_dict(raw), torch.float32, "cpu")


def test_dangling_symlink_is_named_as_one(folder):
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(folder / "gone.safetensors")
    message = error_of(folder)
    assert "broken symlink" in message and "gone.safetensors" in message and "index" not in message


def test_directory_named_like_the_weights(folder):
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    message = error_of(folder)
    assert "not a regular file" in message and "index" not in message


def test_two_copies_of_the_weights_without_an_index(folder):
    shutil.copy(folder / "model.safetensors", folder / "model-copy.safetensors")
    message = error_of(folder)
    assert "is in both model-copy.safetensors and model.safetensors" in message
    assert "remove the stray file" in message and "the index says" not in message


@pytest.mark.parametrize("target", ["../outside.safetensors", "/tmp/outside.safetensors", "a/../../x.safetensors"])
def test_index_naming_a_file_outside_the_folder(folder, target):
    shard(folder, 2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"][KV_B] = target
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    message = error_of(folder)
    assert "outside the model folder" in message and repr(target) in message


def test_index_may_name_files_that_link_out_of_the_folder(folder, tmp_path):
    """The Hugging Face cache: a snapshot's shards are links to blobs elsewhere."""
    weight_map = shard(folder, 2)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for file in set(weight_map.values()):
        (folder / file).rename(blobs / file)
        (folder / file).symlink_to(blobs / file)
    load(folder)
