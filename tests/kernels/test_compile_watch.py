"""CompileWatch: Triton's compiles and disk loads counted by a listener on its compiler, logged every few steps
while the engine serves (a stand-in count on the CPU; the listener itself on fake compiler calls)."""

from __future__ import annotations

import logging
import types

import pytest

from deltaserve.kernels.compile_watch import CompileCounts, CompileWatch


def test_the_watch_logs_the_compiles_and_loads_since_it_last_looked(caplog):
    counts = CompileCounts()
    counts.add("_gemv_kernel", cache_hit=False, us=900_000)  # start-up's: not the serving steps'
    watch = CompileWatch(every=4, counts=counts)
    caplog.set_level(logging.INFO, logger="deltaserve")
    for _ in range(4):
        watch.step()
    assert not caplog.records
    counts.add("_rms_norm_kernel", cache_hit=False, us=1_500_000)
    counts.add("_rms_norm_kernel", cache_hit=False, us=500_000)
    counts.add("chunk_gla_fwd_kernel_o", cache_hit=True, us=20_000)
    for _ in range(4):
        watch.step()
    assert len(caplog.records) == 1
    assert "steps 5-8 waited while Triton compiled 2 kernel variant(s) (2.00 s) and loaded 1 from its disk cache " \
           "(0.02 s): _rms_norm_kernel (2)" in caplog.text
    assert watch.check().compiled == 0 and len(caplog.records) == 1
    counts.add("_conv_varlen_kernel", cache_hit=False, us=10)
    watch.rebase()  # a start-up phase's compiles, logged with it
    assert watch.check().compiled == 0 and len(caplog.records) == 1


def test_the_listener_counts_compiles_and_keeps_a_listener_already_there(monkeypatch):
    pytest.importorskip("triton")
    from triton import knobs

    from deltaserve.kernels import compile_watch

    if not hasattr(getattr(knobs, "compilation", None), "listener"):
        pytest.skip("this Triton has no compilation listener")
    heard = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **event: heard.append(event["cache_hit"]))
    monkeypatch.setattr(compile_watch, "_installed", False)
    monkeypatch.setattr(compile_watch, "COUNTS", CompileCounts())
    assert compile_watch.record() and compile_watch.record()  # once a process
    event = dict(metadata={"name": "k"}, metadata_group={}, times=types.SimpleNamespace(total=3_000))
    knobs.compilation.listener(src=types.SimpleNamespace(name="_kda_kernel"), cache_hit=False, **event)
    knobs.compilation.listener(src=object(), cache_hit=True, **event)
    counts = compile_watch.COUNTS
    assert (counts.compiled, counts.compiled_us, counts.loaded, counts.loaded_us) == (1, 3_000, 1, 3_000)
    assert counts.kernels == {"_kda_kernel": 1} and heard == [False, True]


def test_each_compiled_variant_names_what_it_was_specialised_on():
    """variant_of reads a compile's source as Triton 3.x keeps it (argument names in the signature; constants and
    attributes keyed by the argument's index), so two variants of one kernel differ where their specialisations do;
    the counts keep each compiled variant in order, and `since` only the new ones."""
    from deltaserve.kernels.compile_watch import variant_of

    src = types.SimpleNamespace(
        name="_rms_norm_kernel", signature={"x_ptr": "*bf16", "n_rows": "i32", "x_stride": "i32", "D": "constexpr"},
        constants={(1,): 1, (3,): 2304}, attrs={(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]})
    assert variant_of(src) == "n_rows=1, D=2304, x_ptr%16, x_stride%16"
    assert variant_of(object()) == "" and variant_of(types.SimpleNamespace(signature={}, attrs={(0,): 5})) == "?"
    counts = CompileCounts()
    counts.add("_rms_norm_kernel", cache_hit=False, us=1, variant="n_rows=1")
    before = counts.copy()
    counts.add("_rms_norm_kernel", cache_hit=False, us=1, variant="x_stride%16")
    counts.add("_rms_norm_kernel", cache_hit=True, us=1, variant="ignored: a disk load")
    assert counts.variants == ["_rms_norm_kernel(n_rows=1)", "_rms_norm_kernel(x_stride%16)"]
    assert counts.since(before).variants == ["_rms_norm_kernel(x_stride%16)"]
