"""deltaserve's name table against what transformers really writes: a reference model is saved, loaded by
deltaserve and written back by deltaserve.loader.writer in each layout; every layout's tensors (names, shapes,
values) are exactly those of the reference's own files."""

from __future__ import annotations

import pytest
import torch
from helpers.checkpoints import read_tensors
from helpers.reference import SPECS, build_reference, save_layouts

from deltaserve.config import ModelConfig
from deltaserve.loader.model_loader import load_model
from deltaserve.loader.writer import save_checkpoint


@pytest.mark.parametrize("spec", ["hybrid", "mla_first_dense_middle"])
def test_writer_reproduces_every_layout_of_the_reference(tmp_path, spec):
    folders = save_layouts(build_reference(SPECS[spec], seed=5), tmp_path / "ref")
    cfg = ModelConfig.from_file(folders["saved"])
    model = load_model(folders["saved"], cfg, torch.float32, "cpu")
    for layout, folder in folders.items():
        ours = tmp_path / "ours" / layout
        save_checkpoint(model, cfg, {"model_type": "kimi_linear"}, ours, layout)
        want, got = read_tensors(folder), read_tensors(ours)
        assert set(got) == set(want), f"{layout}: only ours {sorted(set(got) - set(want))[:4]}, " \
                                      f"only the reference's {sorted(set(want) - set(got))[:4]}"
        for name in want:
            assert got[name].shape == want[name].shape and torch.equal(got[name], want[name]), f"{layout}: {name}"
