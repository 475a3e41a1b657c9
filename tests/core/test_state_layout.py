"""The runner's KDA state layout and a step's packed prefill sequences, on the CPU: every KDA layer's state tensors are
rows of one stack a name (so a snapshot copy or a reset is one op a name and reaches every layer), and a step builds
its prefill index tensors once for all layers."""

import torch

from deltaserve.cache_spec import KDAStateSpec, MLAPageSpec
from deltaserve.kernels.pdl import pdl_args
from deltaserve.kernels.varlen import pack_seqs
from deltaserve.runner.caches import LayerCaches, allocate_caches
from deltaserve.runner.host_batch import HostBatch

# what a model's cache_specs() says of a KDA, an MLA and another KDA layer
TWO_KINDS_OF_LAYER = [KDAStateSpec((6, 3), (2, 4, 4)), MLAPageSpec(5), KDAStateSpec((6, 3), (2, 4, 4))]


def test_kda_states_are_rows_of_one_stack_a_name():
    caches = allocate_caches(TWO_KINDS_OF_LAYER, num_pages=3, page_size=2, num_slots=4, dtype=torch.bfloat16,
                             device=torch.device("cpu"))
    assert isinstance(caches, LayerCaches) and len(caches) == 3
    assert caches.stacks["conv"].shape == (2, 4, 6, 3) and caches.stacks["conv"].dtype == torch.bfloat16
    assert caches.stacks["recurrent"].shape == (2, 4, 2, 4, 4) and caches.stacks["recurrent"].dtype == torch.float32
    assert caches[1]["latent"].shape == (3, 2, 5) and "conv" not in caches[1]
    caches[2]["recurrent"][3].fill_(7.0)  # the third layer is the stack's second row
    assert bool((caches.stacks["recurrent"][1, 3] == 7).all()) and not caches.stacks["recurrent"][0].any()
    caches.stacks["conv"][:, 1] = 1.0  # one op reaches every layer's slot
    assert bool((caches[0]["conv"][1] == 1).all()) and bool((caches[2]["conv"][1] == 1).all())
    assert caches[0]["conv"].is_contiguous() and caches[2]["recurrent"].is_contiguous()


def test_prefill_sequences_pack_as_the_kernels_take_them():
    host = HostBatch(input_ids=[1] * 9, positions=list(range(9)), slot_mapping=list(range(9)),
                     query_lens=[1, 5, 3], start_positions=[4, 0, 0], state_slots=[2, 7, 5],
                     block_tables=[[0, 1, 2], [3], [4]])
    _, batch = host.to_device(torch.device("cpu"))
    assert batch.prefill is None  # the CPU kernels read the host lists
    assert batch.prefill_cu_seqlens() == [0, 5, 8]
    packed = pack_seqs(batch.state_slot_list[batch.num_decodes:], batch.prefill_cu_seqlens(), torch.device("cpu"))
    assert packed.state_slots.tolist() == [7, 5] and packed.cu_seqlens.tolist() == [0, 5, 8]
    assert packed.cu_seqlens_cpu.tolist() == [0, 5, 8] and packed.max_len == 5
    assert packed.token_tiles.tolist() == [[0, 0], [1, 0]]
    assert pack_seqs([], [0], torch.device("cpu")).max_len == 0


def test_pdl_is_off_off_the_gpu():
    assert pdl_args(torch.device("cpu")) == {"PDL": False}


def test_snapshots_are_allocated_as_the_cache_plan_sizes_them():
    """Prefix caching's snapshots: like the state stacks (float32 recurrent states in a bf16 run), as many slots
    as asked (cache/sizing.py counts slot_bytes for each), each KDA layer's rows in its cache dict as views."""
    caches = allocate_caches(TWO_KINDS_OF_LAYER, num_pages=3, page_size=2, num_slots=4, dtype=torch.bfloat16,
                             device=torch.device("cpu"), num_snapshot_slots=5)
    for name, stack in caches.stacks.items():
        snapshots = caches.snapshots[name]
        assert snapshots.dtype == stack.dtype and snapshots.shape == (stack.shape[0], 5, *stack.shape[2:]), name
        assert caches[2][f"{name}_snapshots"].data_ptr() == snapshots[1].data_ptr()
    bytes_per_slot = sum(spec.slot_bytes(2) for spec in TWO_KINDS_OF_LAYER if isinstance(spec, KDAStateSpec))
    assert sum(s.numel() * s.element_size() for s in caches.snapshots.values()) == 5 * bytes_per_slot
    without = allocate_caches(TWO_KINDS_OF_LAYER, 3, 2, 4, torch.bfloat16, torch.device("cpu"))
    assert without.snapshots == {} and "conv_snapshots" not in without[0]
