"""quantization_config (FP8 checkpoints) and the quantization engine option: validated where they enter, errors
naming the field."""

import pytest
from helpers.checkpoints import SMALL_RAW_CONFIG

from deltaserve.config import ConfigError, EngineConfig, ModelConfig, QuantConfig

HUB = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_hub_fp8_config_is_read():
    cfg = ModelConfig.from_dict({**SMALL_RAW_CONFIG, "quantization_config": {
        **HUB, "modules_to_not_convert": ["lm_head"], "ignored_layers": ["kv_b_proj"]}})
    assert cfg.quantization == QuantConfig("fp8", (128, 128), ("lm_head", "kv_b_proj"))
    assert cfg.quantization.keeps_high_precision("model.layers.3.self_attn.kv_b_proj.weight")
    assert ModelConfig.from_dict(SMALL_RAW_CONFIG).quantization is None


@pytest.mark.parametrize("change, field", [
    (dict(quant_method="awq"), "quantization_config.quant_method"),
    (dict(fmt="e5m2"), "quantization_config.fmt"),
    (dict(activation_scheme="static"), "quantization_config.activation_scheme"),
    (dict(weight_block_size=None), "quantization_config.weight_block_size"),
    (dict(weight_block_size=[128]), "quantization_config.weight_block_size"),
    (dict(weight_block_size=[128, 0]), "quantization_config.weight_block_size"),
    (dict(modules_to_not_convert="lm_head"), "quantization_config.modules_to_not_convert"),
    (dict(ignored_layers=[3]), "quantization_config.ignored_layers"),
])
def test_unsupported_quantization_config_is_refused_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=rf"'{field}'"):
        ModelConfig.from_dict({**SMALL_RAW_CONFIG, "quantization_config": {**HUB, **change}})


def test_quantization_option_is_validated_and_reaches_the_model_config(tmp_path):
    from helpers.checkpoints import write_small_checkpoint

    with pytest.raises(ConfigError, match="quantization = 'int8'"):
        EngineConfig(quantization="int8")
    folder = write_small_checkpoint(tmp_path / "m")
    assert ModelConfig.from_file(folder, quantization="fp8").quantization == QuantConfig()
    assert ModelConfig.from_file(folder).quantization is None
