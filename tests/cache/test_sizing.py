"""Cache specs and pool sizing, on the real 48B config and on budgets made to fit or not."""

import json
import re
from pathlib import Path

import pytest

from deltaserve.cache.sizing import DEFAULT_CPU_CACHE_BYTES, describe_plan, plan_cache
from deltaserve.cache_spec import KDAStateSpec, MLAPageSpec, layer_cache_specs
from deltaserve.config import ConfigError, EngineConfig, ModelConfig

CONFIG_48B = Path("/work/shared/models/kimi-linear-48b-a3b/config.json")


@pytest.fixture(scope="module")
def raw_48b():
    if not CONFIG_48B.is_file():
        pytest.skip(f"{CONFIG_48B} is not present")
    return json.loads(CONFIG_48B.read_text())


@pytest.fixture(scope="module")
def model_48b(raw_48b):
    return ModelConfig.from_dict(raw_48b)


def test_48b_specs_follow_the_layer_types(model_48b):
    specs = layer_cache_specs(model_48b)
    mla = [i + 1 for i, s in enumerate(specs) if isinstance(s, MLAPageSpec)]
    assert mla == [4, 8, 12, 16, 20, 24, 27] and sum(isinstance(s, KDAStateSpec) for s in specs) == 20
    assert specs[0] == KDAStateSpec((3 * 4096, 3), (32, 128, 128)) and specs[3] == MLAPageSpec(576)
    assert layer_cache_specs(model_48b, world_size=2)[0] == KDAStateSpec((3 * 2048, 3), (16, 128, 128))


def test_48b_bytes_per_token_and_per_slot_in_bf16(model_48b):
    plan = plan_cache(model_48b, EngineConfig(dtype="bfloat16", num_cache_blocks=10), max_model_len=4096)
    assert plan.bytes_per_block == 16 * 7 * 576 * 2  # ~8 KB a token
    conv = 3 * 4096 * 3 * 2
    assert plan.bytes_per_slot == 20 * (32 * 128 * 128 * 4 + conv)
    assert 41e6 < plan.bytes_per_slot < 44e6  # ~42 MB a sequence


def test_conv_state_follows_the_run_dtype_recurrent_state_stays_f32(model_48b):
    bf16 = plan_cache(model_48b, EngineConfig(dtype="bfloat16", num_cache_blocks=1), 64)
    f32 = plan_cache(model_48b, EngineConfig(dtype="float32", num_cache_blocks=1), 64)
    assert f32.bytes_per_slot - bf16.bytes_per_slot == 20 * 3 * 4096 * 3 * 2
    assert f32.bytes_per_block == 2 * bf16.bytes_per_block


def test_a_float8_latent_cache_prices_a_page_at_one_byte_a_value(model_48b):
    """--kv-cache-dtype fp8: MLA pages half their bf16 bytes (so a budget holds twice the tokens); KDA slots keep
    the run dtype's."""
    bf16 = plan_cache(model_48b, EngineConfig(dtype="bfloat16", cache_bytes=8 << 30), 4096)
    fp8 = plan_cache(model_48b, EngineConfig(dtype="bfloat16", kv_cache_dtype="fp8", cache_bytes=8 << 30), 4096)
    assert fp8.bytes_per_block == 16 * 7 * 576 and 2 * fp8.bytes_per_block == bf16.bytes_per_block
    assert fp8.bytes_per_slot == bf16.bytes_per_slot and (fp8.latent_dtype, bf16.latent_dtype) == (
        "float8_e4m3fn", "bfloat16")
    assert fp8.num_blocks > 1.9 * bf16.num_blocks
    assert re.search(r" tokens \([\d.]+ GiB, float8\) \+ 32 KDA state slots", describe_plan(fp8)), describe_plan(fp8)
    with pytest.raises(ConfigError, match="engine option kv_cache_dtype = 'int8': must be one of auto, fp8"):
        EngineConfig(kv_cache_dtype="int8")


@pytest.mark.parametrize("caching, num_snapshots", [(False, 0), (True, 8)])
def test_budget_minus_slots_and_snapshots_divided_into_pages(model_48b, caching, num_snapshots):
    """Prefix caching's snapshots (default 2 x max_num_seqs, a state slot's bytes each) come out of the budget."""
    engine = EngineConfig(dtype="bfloat16", max_num_seqs=4, block_size=16, enable_prefix_caching=caching)
    probe = plan_cache(model_48b, engine, 4096, budget_bytes=10 << 30)
    budget = (4 + num_snapshots) * probe.bytes_per_slot + 20000 * probe.bytes_per_block + probe.bytes_per_block - 1
    plan = plan_cache(model_48b, engine, 4096, budget_bytes=budget)
    assert (plan.num_blocks, plan.num_slots, plan.block_size, plan.num_snapshot_slots) == (20000, 4, 16, num_snapshots)


def test_default_snapshots_take_at_most_a_quarter_of_the_budget(model_48b):
    """256 slots on an H200's ~30 GiB: two snapshots a slot (21 GiB) would leave no room for pages."""
    engine = EngineConfig(dtype="bfloat16", max_num_seqs=256, enable_prefix_caching=True)
    budget = 30 << 30
    plan = plan_cache(model_48b, engine, 4096, budget_bytes=budget)
    assert 0 < plan.num_snapshot_slots * plan.bytes_per_slot <= budget // 4 < (plan.num_snapshot_slots + 1) * (
        plan.bytes_per_slot)
    assert plan.num_blocks > 0
    explicit = EngineConfig(dtype="bfloat16", max_num_seqs=256, num_snapshot_slots=300)
    assert plan_cache(model_48b, explicit, 4096, budget_bytes=budget).num_snapshot_slots == 300  # as asked


def test_num_snapshot_slots_sets_the_snapshot_budget(model_48b):
    engine = EngineConfig(dtype="bfloat16", max_num_seqs=4, num_snapshot_slots=3, cache_bytes=1 << 30)
    plan = plan_cache(model_48b, engine, 4096)
    assert plan.num_snapshot_slots == 3
    assert plan.num_blocks == ((1 << 30) - 7 * plan.bytes_per_slot) // plan.bytes_per_block
    assert "3 KDA snapshots for prefix caching" in describe_plan(plan)
    with pytest.raises(ConfigError, match="num_snapshot_slots"):
        EngineConfig(num_snapshot_slots=0)


def test_engine_cache_bytes_is_the_budget_and_num_cache_blocks_overrides_it(model_48b):
    engine = EngineConfig(dtype="bfloat16", max_num_seqs=1, cache_bytes=100 << 20, enable_prefix_caching=False)
    plan = plan_cache(model_48b, engine, 4096)
    assert plan.num_blocks == ((100 << 20) - plan.bytes_per_slot) // plan.bytes_per_block
    forced = EngineConfig(dtype="bfloat16", max_num_seqs=1, cache_bytes=100 << 20, num_cache_blocks=3)
    assert plan_cache(model_48b, forced, 4096).num_blocks == 3


def test_budget_that_cannot_hold_the_slots_and_a_page_is_an_error(model_48b):
    engine = EngineConfig(dtype="bfloat16", max_num_seqs=32, cache_bytes=1 << 30)
    with pytest.raises(ConfigError, match=r"cannot hold 32 KDA state slots .* lower max_num_seqs"):
        plan_cache(model_48b, engine, 4096)


def test_an_overdrawn_gpu_budget_names_its_size_and_what_holds_the_memory(model_48b):
    held = r"\(-2\.0 GiB\) cannot hold .* free the memory other processes or engines hold"
    with pytest.raises(ConfigError, match=held):
        plan_cache(model_48b, EngineConfig(device="cuda", max_num_seqs=4), 4096, budget_bytes=-(2 << 30))


def test_cpu_default_fits_max_num_seqs_full_sequences(model_48b):
    engine = EngineConfig(dtype="bfloat16", max_num_seqs=2, block_size=16)
    assert plan_cache(model_48b, engine, max_model_len=1000).num_blocks == 2 * 63


def test_cpu_default_is_capped(model_48b):
    plan = plan_cache(model_48b, EngineConfig(dtype="bfloat16", max_num_seqs=2), max_model_len=1 << 20)
    total = plan.num_blocks * plan.bytes_per_block + (plan.num_slots + plan.num_snapshot_slots) * plan.bytes_per_slot
    assert DEFAULT_CPU_CACHE_BYTES - plan.bytes_per_block < total <= DEFAULT_CPU_CACHE_BYTES


def test_gpu_needs_a_budget(model_48b):
    with pytest.raises(ConfigError, match="pass the runner.s measurement"):
        plan_cache(model_48b, EngineConfig(device="cuda"), 4096)


def test_gpu_budget_is_the_share_less_the_weights_and_never_more_than_is_free():
    from deltaserve.runner.model_runner import ACTIVATION_RESERVE_BYTES as RESERVE
    from deltaserve.runner.model_runner import gpu_cache_budget

    GB = 10**9
    # alone on a 141 GB card, 98 GB of weights loaded: 0.9 x 141 - 98, less the reserve
    assert gpu_cache_budget(141 * GB, 43 * GB, 98 * GB, 0.9) == int(0.9 * 141 * GB) - 98 * GB - RESERVE
    # another engine (in this process or not) holds 120 GB: only what is free now, less the reserve
    assert gpu_cache_budget(141 * GB, 20 * GB, 1 * GB, 0.9) == 20 * GB - RESERVE
    # weights past the share: negative, and plan_cache turns that into an error naming the options
    assert gpu_cache_budget(80 * GB, 2 * GB, 78 * GB, 0.9) < 0


def test_byte_counts_print_in_binary_units_keeping_a_negative_sign():
    from deltaserve.cache.sizing import format_bytes

    assert format_bytes(1536) == "1.5 KiB" and format_bytes(-(2 << 30)) == "-2.0 GiB" and format_bytes(100) == "100 B"


def test_model_without_mla_layers_gets_a_full_page_table_per_slot(raw_48b):
    lin = dict(raw_48b["linear_attn_config"], kda_layers=list(range(1, 28)), full_attn_layers=[])
    model = ModelConfig.from_dict(dict(raw_48b, linear_attn_config=lin))
    plan = plan_cache(model, EngineConfig(max_num_seqs=3, block_size=16), max_model_len=160)
    assert plan.bytes_per_block == 0 and plan.num_blocks == 3 * 10


def test_description_is_one_line_with_the_counts(model_48b):
    plan = plan_cache(model_48b, EngineConfig(dtype="bfloat16", max_num_seqs=2, num_cache_blocks=100), 4096)
    line = describe_plan(plan)
    assert "\n" not in line and "100 MLA pages x 16 tokens = 1600 tokens" in line and "2 KDA state slots" in line
