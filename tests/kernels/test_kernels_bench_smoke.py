"""benchmarks/gpu/kernels_bench.py at its tiny --smoke shapes (Triton through the CPU interpreter): each part runs
and its variants agree, so the script a GPU lease relies on is known to work before the lease."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.kernels import require_triton_interpreter

require_triton_interpreter()

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "kernels_bench.py"


@pytest.fixture(scope="module")
def kernels_bench():
    spec = importlib.util.spec_from_file_location("kernels_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("part,errors", [("mla_decode", ["rel_err"]), ("mla_prefill", ["naive_rel_err"]),
                                         ("fp8_experts", ["rel_err_dequantized"]), ("decode_experts", ["rel_err"]),
                                         ("batch_experts", ["rel_err"]),
                                         ("norm_gemv", ["rel_err"]), ("norms", ["rel_err"]),
                                         ("kda_prefill", ["rel_err"]), ("bookkeeping", ["rel_err"]),
                                         ("activation", ["rel_err"]), ("conv", ["rel_err"]),
                                         ("keys", ["rel_err"]), ("gather", ["rel_err"])])
def test_each_part_runs_and_its_variants_agree(kernels_bench, part, errors):
    rows = kernels_bench.PARTS[part]("cpu", smoke=True)
    assert rows
    for row in rows:
        assert all(row[e] < 1e-5 for e in errors), row
        assert all(v > 0 for key, v in row.items() if key.endswith("_us")), row


def test_mla_decode_ab_runs_against_a_kernel_file(tmp_path):
    """benchmarks/gpu/mla_decode_ab.py at its --smoke shapes, this tree's kernel against a copy of itself: every
    launch timed, the outputs equal."""
    ab = SCRIPT.parent / "mla_decode_ab.py"
    before = Path(__file__).resolve().parents[2] / "deltaserve" / "kernels" / "mla" / "triton_decode.py"
    out = tmp_path / "ab.json"
    subprocess.run([sys.executable, str(ab), "--before", str(before), "--smoke", "--rounds", "1", "--json-out",
                    str(out)], check=True, capture_output=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(row["rel_err_vs_before"] == 0 for row in rows)
    assert all(v > 0 for row in rows for v in row["GBps"].values())
    # its rows drawn by benchmarks/gpu/plot_mla_decode.py; a file of another shape is refused with a reason
    plot, png = SCRIPT.parent / "plot_mla_decode.py", tmp_path / "ab.png"
    subprocess.run([sys.executable, str(plot), str(out), "--out", str(png)], check=True, capture_output=True)
    assert png.stat().st_size > 0
    (tmp_path / "bad.json").write_text("[]")
    bad = subprocess.run([sys.executable, str(plot), str(tmp_path / "bad.json"), "--out", str(png)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "'rows'" in bad.stderr


def test_json_out_keeps_the_rows_of_a_run_cut_short(kernels_bench, tmp_path, monkeypatch):
    """--json-out is rewritten after every row, so a part cut off by its time limit (here: an error after its first
    row) leaves the rows it had measured."""
    def cut_short(device, smoke):
        rows = []
        kernels_bench.emit("cut", rows, {"batch": 1, "triton_us": 1.0})
        raise TimeoutError("the stage's limit")

    monkeypatch.setitem(kernels_bench.PARTS, "cut", cut_short)
    monkeypatch.setattr(kernels_bench, "_SINK", {})  # main's file, for this test only (the module is shared)
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["kernels_bench.py", "--smoke", "--parts", "cut", "--json-out", str(out)])
    with pytest.raises(TimeoutError):
        kernels_bench.main()
    assert json.loads(out.read_text())["cut"] == [{"batch": 1, "triton_us": 1.0}]
    assert not (tmp_path / "rows.json.tmp").exists()
