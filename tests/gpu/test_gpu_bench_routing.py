"""bench's routing statistics on a GPU: the timed decode steps replay CUDA graphs padded to a captured size, the
measured ones count the real requests only. Skipped without CUDA."""

import pytest
import torch

from deltaserve.config import EngineConfig
from deltaserve.entrypoints.bench import bench
from deltaserve.entrypoints.make_tiny import make_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("num_decode_steps", [1, 4])
def test_routing_counts_the_real_rows_of_padded_graph_batches(tmp_path, num_decode_steps):
    tiny = make_tiny(tmp_path / "model", seed=3)
    config = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=64, max_num_seqs=8,
                          num_decode_steps=num_decode_steps)
    rows = bench(str(tiny), config, [3, 5], prompt_len=9, output_len=9)["rows"]  # graphs of 4 and 8 rows
    assert [row["routed_tokens_per_step"] for row in rows] == [3.0, 5.0]
    assert all(2 <= row["distinct_experts"] <= 8 and not row["faster_than_floor"] for row in rows)
