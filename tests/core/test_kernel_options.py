"""Kernel choices are engine options passed down to the layers; the environment only gives the CLI its defaults."""

from __future__ import annotations

import pytest
import torch

from deltaserve.entrypoints.cli import build_parser
from deltaserve.kernel_options import KernelOptions
from deltaserve.kernels.pdl import pdl_args

SWITCHES = {"cpu_gemv": "DELTASERVE_CPU_GEMV", "norm_gemv": "DELTASERVE_NORM_GEMV", "pdl": "DELTASERVE_PDL"}


def test_every_layer_that_chooses_a_kernel_gets_the_engines_options(make_llm):
    llm = make_llm(norm_gemv=False, pdl=False, cpu_gemv=False)
    model = llm.engine.model
    chosen = [m.kernels for m in model.modules() if isinstance(getattr(type(m), "kernels", None), KernelOptions)]
    assert len(chosen) > len(model.layers)  # decoder layers, attention, MLPs, projections
    assert {(k.cpu_gemv, k.norm_gemv, k.pdl) for k in chosen} == {(False, False, False)}


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_cli_flags_default_on_and_the_environment_only_sets_that_default(monkeypatch, name):
    monkeypatch.delenv(SWITCHES[name], raising=False)
    flag = "--" + name.replace("_", "-")
    assert getattr(build_parser().parse_args(["bench"]), name) is True
    assert getattr(build_parser().parse_args(["bench", "--no-" + flag[2:]]), name) is False
    monkeypatch.setenv(SWITCHES[name], "0")
    assert getattr(build_parser().parse_args(["bench"]), name) is False
    assert getattr(build_parser().parse_args(["bench", flag]), name) is True


def test_pdl_off_by_option_needs_no_gpu():
    assert pdl_args(torch.device("cuda"), pdl=False) == {"PDL": False}
