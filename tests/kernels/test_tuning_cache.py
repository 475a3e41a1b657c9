"""Autotuning decisions on disk (kernels/tuning_cache.py), with a fake tuner: what one process tuned, the next
gets back before it launches; a changed candidate list or a damaged file means tuning again, never a wrong tile."""

from __future__ import annotations

import json

import pytest

from deltaserve.kernels.tuning_cache import decisions_path, load_decisions, save_decisions


class FakeConfig:
    def __init__(self, tile: int):
        self.tile = tile

    def __str__(self) -> str:
        return f"TILE: {self.tile}, num_warps: 4"


class FakeTuner:
    """What triton's Autotuner offers: its candidates, and the chosen one per key (shape arguments and dtypes)."""

    def __init__(self, tiles=(16, 32, 64)):
        self.configs = [FakeConfig(t) for t in tiles]
        self.cache = {}


def test_decisions_come_back_in_a_new_process(tmp_path):
    path = tmp_path / "gpu.json"
    tuned = FakeTuner()
    tuned.cache = {(1, 2304, "torch.bfloat16"): tuned.configs[2], (64, 2304, "torch.bfloat16"): tuned.configs[0]}
    assert save_decisions(path, {"gemv": tuned}) == 2
    fresh = FakeTuner()
    assert load_decisions(path, {"gemv": fresh, "unknown": FakeTuner()}) == 2
    assert fresh.cache == {(1, 2304, "torch.bfloat16"): fresh.configs[2],
                           (64, 2304, "torch.bfloat16"): fresh.configs[0]}


def test_saving_keeps_what_other_processes_tuned(tmp_path):
    path = tmp_path / "gpu.json"
    first, second = FakeTuner(), FakeTuner()
    first.cache = {(1,): first.configs[1]}
    second.cache = {(8,): second.configs[2], (1,): second.configs[0]}
    save_decisions(path, {"k": first})
    assert save_decisions(path, {"k": second}) == 2
    fresh = FakeTuner()
    load_decisions(path, {"k": fresh})
    assert fresh.cache == {(8,): fresh.configs[2], (1,): fresh.configs[0]}, "the newer decision for (1,) wins"


def test_a_kernel_whose_candidates_changed_tunes_again(tmp_path):
    path = tmp_path / "gpu.json"
    tuned = FakeTuner()
    tuned.cache = {(1,): tuned.configs[2]}
    save_decisions(path, {"k": tuned})
    changed = FakeTuner(tiles=(16, 32, 128))
    assert load_decisions(path, {"k": changed}) == 0 and changed.cache == {}


def test_a_damaged_file_is_ignored_and_replaced(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text("{not json")
    fresh = FakeTuner()
    assert load_decisions(path, {"k": fresh}) == 0
    fresh.cache = {(1,): fresh.configs[0]}
    assert save_decisions(path, {"k": fresh}) == 1
    assert list(json.loads(path.read_text())) == ["k"] and [p.name for p in tmp_path.iterdir()] == ["gpu.json"]


@pytest.mark.parametrize("content", [{"k": [1]}, {"k": {"candidates": 3}}, {"k": {"candidates": "x", "chosen": [[1]]}},
                                     ["a list"]])
def test_a_file_of_another_shape_is_ignored_and_replaced(tmp_path, content):
    """Valid JSON that is not what save_decisions writes: no decision restored, no crash at start or exit."""
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(content))
    fresh = FakeTuner()
    assert load_decisions(path, {"k": fresh}) == 0 and fresh.cache == {}
    fresh.cache = {(1,): fresh.configs[0]}
    assert save_decisions(path, {"k": fresh}) == 1


def test_unstorable_keys_are_skipped(tmp_path):
    tuned = FakeTuner()
    tuned.cache = {(1, object()): tuned.configs[0], (2,): tuned.configs[1]}
    assert save_decisions(tmp_path / "gpu.json", {"k": tuned}) == 1


def test_the_file_is_per_gpu_and_triton_version(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    h200, h100 = decisions_path("NVIDIA H200", "3.5.0"), decisions_path("NVIDIA H100 80GB HBM3", "3.5.0")
    assert h200 == tmp_path / "deltaserve" / "autotune" / "NVIDIA_H200-triton-3.5.0.json"
    assert len({h200, h100, decisions_path("NVIDIA H200", "3.6.0")}) == 3


def test_find_autotuners_finds_our_tuned_kernels():
    pytest.importorskip("triton")
    import deltaserve.kernels.gemv  # noqa: F401
    import deltaserve.kernels.moe.triton_decode  # noqa: F401
    from deltaserve.kernels.tuning_cache import find_autotuners

    found = find_autotuners()
    assert {"deltaserve.kernels.gemv._gemv_kernel", "deltaserve.kernels.gemv._fp8_gemv_kernel"} <= set(found)
    assert any(name.startswith("deltaserve.kernels.moe.triton_decode.") for name in found)
    assert all(isinstance(t.configs, list) and isinstance(t.cache, dict) for t in found.values())


def test_shipped_tables_fill_only_the_keys_this_machine_has_not_tuned(monkeypatch, tmp_path):
    from deltaserve.kernels.tuning_cache import restore_decisions

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    own, table = FakeTuner(), FakeTuner()
    own.cache = {(1,): own.configs[0]}
    table.cache = {(1,): table.configs[2], (64,): table.configs[1]}
    save_decisions(decisions_path("NVIDIA H200", "3.6.0"), {"k": own})
    save_decisions(decisions_path("NVIDIA H200", "3.6.0", tmp_path / "shipped"), {"k": table})
    fresh = FakeTuner()
    path = restore_decisions("NVIDIA H200", "3.6.0", {"k": fresh}, shipped_dir=tmp_path / "shipped")
    assert path == decisions_path("NVIDIA H200", "3.6.0")
    assert fresh.cache == {(1,): fresh.configs[0], (64,): fresh.configs[1]}, "the machine's own decision wins"
    other = FakeTuner()
    restore_decisions("NVIDIA H100 80GB HBM3", "3.6.0", {"k": other}, shipped_dir=tmp_path / "shipped")
    assert other.cache == {}, "another card's table is not used"


def test_the_shipped_tables_are_as_save_decisions_writes_them():
    from deltaserve.kernels.tuning_cache import SHIPPED_TABLES, _well_formed

    for path in SHIPPED_TABLES.glob("*.json"):
        stored = json.loads(path.read_text())
        assert stored and all(_well_formed(entry) for entry in stored.values()), path.name


def test_restoring_the_tuning_imports_our_kernels_and_never_fla(monkeypatch):
    """fla-core's imports take seconds (all of fla.ops): the start imports our kernel modules only."""
    import importlib

    from deltaserve.kernels import tuning_cache

    imported = []
    monkeypatch.setattr(importlib, "import_module", imported.append)
    tuning_cache._import_tuned_kernels()
    assert "deltaserve.kernels.moe.triton_decode" in imported and "deltaserve.kernels.kda.triton_decode" in imported
    assert tuning_cache.FLA_MODULE not in imported


def test_the_first_import_of_fla_chunk_restores_fla_tuning(monkeypatch, tmp_path):
    """The first long prefill imports kernels.kda.fla_chunk (and so fla-core): fla's autotuners then get this
    machine's stored decisions, as ours got them at the start. fla-core is faked (it is not on this machine)."""
    import importlib
    import sys
    import types

    import torch

    from deltaserve.kernels import tuning_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tuned = FakeTuner()
    tuned.cache = {(64, "torch.bfloat16"): tuned.configs[1]}
    save_decisions(decisions_path("Fake GPU", __import__("triton").__version__), {"fla.ops.kda.chunk.k": tuned})
    fresh = FakeTuner()
    fake_fla = {name: types.ModuleType(name) for name in ("fla", "fla.ops", "fla.ops.kda", "fla.ops.kda.chunk")}
    fake_fla["fla.ops.kda"].chunk_kda = None
    fake_fla["fla.ops.kda.chunk"].k = fresh
    for name, module in fake_fla.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(tuning_cache, "find_autotuners",  # FakeTuner is not triton's Autotuner
                        lambda prefixes: {f"{n}.k": m.k for n, m in fake_fla.items() if hasattr(m, "k")
                                          and n.startswith(prefixes)})
    monkeypatch.delitem(sys.modules, tuning_cache.FLA_MODULE, raising=False)
    try:
        importlib.import_module(tuning_cache.FLA_MODULE)
    finally:  # the module bound to the fake fla-core leaves with it
        sys.modules.pop(tuning_cache.FLA_MODULE, None)
        monkeypatch.delattr("deltaserve.kernels.kda.fla_chunk", raising=False)
    assert fresh.cache == {(64, "torch.bfloat16"): fresh.configs[1]}



def test_importing_fla_chunk_without_a_gpu_restores_nothing(monkeypatch):
    """Tuning decisions are per GPU: an import of kernels.kda.fla_chunk where no GPU is (fla-core faked) must not
    ask for a device name."""
    import importlib
    import sys
    import types

    import torch

    from deltaserve.kernels import tuning_cache

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: 1 / 0)
    for name in ("fla", "fla.ops", "fla.ops.kda"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["fla.ops.kda"].chunk_kda = None
    monkeypatch.delitem(sys.modules, tuning_cache.FLA_MODULE, raising=False)
    try:
        importlib.import_module(tuning_cache.FLA_MODULE)  # must not raise
    finally:
        sys.modules.pop(tuning_cache.FLA_MODULE, None)
        monkeypatch.delattr("deltaserve.kernels.kda.fla_chunk", raising=False)


def test_the_tuning_watch_logs_and_saves_what_kernels_tuned_while_serving_not_what_was_restored(tmp_path, caplog):
    """A new key tuned inside a step (fla-core's l2norm at a new length bucket) is logged with its kernel and saved
    at once; decisions restored from disk, those start-up made, and a tuner found under two names are not new."""
    import logging

    from deltaserve.kernels.tuning_cache import TuningWatch

    shipped, path = tmp_path / "shipped.json", tmp_path / "machine.json"
    table = FakeTuner()
    table.cache = {(128, 1): table.configs[0], (128, 2): table.configs[1]}
    save_decisions(shipped, {"fla.l2norm": table})
    l2norm, gemv = FakeTuner(), FakeTuner()
    gemv.cache = {(1, 2304): gemv.configs[2]}  # tuned by start-up's warm-up
    tuners = {"fla.l2norm": l2norm, "gemv": gemv}
    assert load_decisions(shipped, tuners) == 2
    found = {**tuners, "fla.norm.l2norm": l2norm}  # one tuner, two module names
    saves = []
    watch = TuningWatch(path, every=4, find=lambda: found, save=lambda p, t: saves.append(p) or save_decisions(p, t))
    caplog.set_level(logging.INFO, logger="deltaserve")
    for _ in range(4):
        watch.step()
    assert watch.check() == 0 and not saves and not caplog.records
    l2norm.cache[(128, 3)] = l2norm.configs[2]  # a prefill chunk in a new bucket tunes
    for _ in range(3):
        watch.step()
    assert not saves
    watch.step()
    assert saves == [path] and len(caplog.records) == 1
    assert "1 new decision(s) in steps 5-8" in caplog.text and "fla.l2norm (1)" in caplog.text
    fresh = FakeTuner()
    assert load_decisions(path, {"fla.l2norm": fresh}) == 3 and fresh.cache[(128, 3)] is fresh.configs[2]
    assert watch.check() == 0 and len(saves) == 1


def test_the_tuning_watch_warns_and_goes_on_when_the_file_cannot_be_written(tmp_path, caplog):
    from deltaserve.kernels.tuning_cache import TuningWatch

    tuner = FakeTuner()

    def save(path, tuners):
        raise OSError("read-only file system")

    watch = TuningWatch(tmp_path / "gpu.json", find=lambda: {"k": tuner}, save=save)
    tuner.cache[(64,)] = tuner.configs[0]
    assert watch.check() == 1
    assert "could not save the autotuning decisions" in caplog.text and "read-only" in caplog.text
