"""What the command line imports before it has work to do: `--help` and argument errors answer without torch, and
`import deltaserve` costs neither torch nor torch._dynamo until LLM or the engine is used."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from deltaserve.entrypoints import cli

_RUN_CLI = """
import json, sys
from deltaserve.entrypoints.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""


def modules_after(code: str, *argv: str) -> set[str]:
    """The modules a fresh interpreter holds after running code (which prints them as its last line)."""
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"], ["chat", "--help"],
                                  ["bench", "--help"], ["parity", "check", "--help"], ["generate", "--max-tokens"]])
def test_help_and_argument_errors_import_no_torch(argv):
    loaded = modules_after(_RUN_CLI, *argv)
    assert "deltaserve.entrypoints.cli" in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "triton", "numpy")}


def test_import_deltaserve_is_light_and_its_names_load_on_use():
    loaded = modules_after("import json, sys, deltaserve\nprint(json.dumps(sorted(sys.modules)))")
    assert "torch" not in loaded


def test_starting_the_demo_model_imports_neither_dynamo_nor_sympy():
    loaded = modules_after("import json, sys\nfrom deltaserve import LLM, SamplingParams\n"
                           "LLM(device='cpu', max_model_len=64).generate('In', SamplingParams(max_tokens=2), False)\n"
                           "print(json.dumps(sorted(sys.modules)))")
    assert "torch" in loaded and "deltaserve.core.engine" in loaded
    # each costs about a second of start-up: torch.nn.attention.bias and Embedding's init on meta pull in dynamo,
    # empty_like of a meta tensor pulls in sympy
    assert not {"torch._dynamo", "sympy"} & loaded


def test_the_gpu_prefill_attention_imports_dynamo_only_for_a_chunk_after_a_cached_prefix():
    """The GPU's MLA prefill (PyTorch's SDPA; it runs on the CPU too): a prompt's first chunk needs no bias object,
    whose module imports torch._dynamo (~1 s of a GPU start); a chunk after cached tokens does."""
    code = ("import json, sys, torch\nfrom deltaserve.kernels.mla.attention import _sdpa_prefill\n"
            "T, L, H = 3, {L}, 2\n"
            "_sdpa_prefill(torch.randn(T, H, 8), torch.randn(T, H, 4), torch.randn(L, H, 8), torch.randn(L, 4), "
            "torch.randn(L, H, 6), 0.3, L - T)\nprint(json.dumps(sorted(sys.modules)))")
    assert "torch._dynamo" not in modules_after(code.format(L=3))
    assert "torch._dynamo" in modules_after(code.format(L=5))


def test_a_gpu_start_imports_no_compiler_stack_with_our_kernels():
    """What a GPU start imports to restore the tuning (all our kernel modules) and to build the engine: neither
    Dynamo, Inductor nor sympy (their imports and compiled graphs cost seconds a process), and no fla-core unless
    asked for. Needs Triton (the test extra brings it)."""
    pytest.importorskip("triton")
    loaded = modules_after("import json, sys\nfrom deltaserve.kernels import tuning_cache\n"
                           "tuning_cache._import_tuned_kernels()\nimport deltaserve.core.engine\n"
                           "print(json.dumps(sorted(sys.modules)))")
    assert "deltaserve.kernels.triton_norm" in loaded and "deltaserve.kernels.mla.triton_decode" in loaded
    assert not {"torch._dynamo", "torch._inductor", "sympy"} & loaded
    assert not {m for m in loaded if m.split(".")[0] == "fla"}


@pytest.mark.parametrize("preset", [None, ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64"),
                                    ("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")])
def test_import_deltaserve_defaults_the_cuda_allocator_to_expandable_segments_unless_set(preset):
    """The variable must be in the environment before torch loads (and for the processes the engine starts); a
    user's own setting, under either name torch reads, is kept, and after torch's import nothing is set."""
    env = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k}
    if preset:
        env[preset[0]] = preset[1]
    show = "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'), os.environ.get('PYTORCH_ALLOC_CONF'))"
    done = subprocess.run([sys.executable, "-c", f"import os, deltaserve; {show}"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    expected = {None: "expandable_segments:True None", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64 None",
                "PYTORCH_ALLOC_CONF": "None max_split_size_mb:64"}
    assert done.stdout.strip() == expected[preset[0] if preset else None]
    if preset is None:
        done = subprocess.run([sys.executable, "-c", f"import os, torch, deltaserve; {show}"], capture_output=True,
                              text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "None None"


def test_unknown_attribute_of_deltaserve_is_an_attribute_error():
    import deltaserve

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        deltaserve.Nope  # noqa: B018


def test_an_unexpected_error_is_one_line_and_exit_1_unless_debugging(monkeypatch, capsys):
    def fail(args):
        raise RuntimeError("the device\nwent away")

    monkeypatch.setitem(cli.COMMANDS, "make-tiny", fail)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    assert cli.main(["make-tiny", "unused"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    [line] = err.splitlines()
    assert line.startswith("error: RuntimeError: the device went away") and "DELTASERVE_DEBUG=1" in line
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(RuntimeError, match="went away"):
        cli.main(["make-tiny", "unused"])


def test_make_tiny_that_fails_halfway_leaves_no_folder(monkeypatch, capsys, tmp_path):
    from deltaserve.loader import writer

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(writer, "save_checkpoint", fail)  # make_tiny imports it when it writes
    assert cli.main(["make-tiny", str(tmp_path / "tiny")]) == 2
    assert "disk full" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "empty").mkdir()
    monkeypatch.undo()
    assert cli.main(["make-tiny", str(tmp_path / "empty")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and (tmp_path / "empty" / "config.json").is_file()


def test_bench_on_the_cpu_runs_without_triton():
    blocked = ("import sys\nsys.modules['triton'] = None  # import triton raises ImportError\n"
               "from deltaserve.entrypoints.cli import main\n"
               "sys.exit(main(['bench', '--load-format', 'dummy', '--device', 'cpu', '--batch-sizes', '1', "
               "'--prompt-len', '4', '--output-len', '2', '--threads', '1']))")
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert '"programmatic_dependent_launch": false' in done.stdout


def test_generate_sizes_the_engine_for_its_prompts_and_logs_its_start_up_phases(caplog, capsys, tiny_model):
    caplog.set_level(logging.INFO, logger="deltaserve")
    argv = ["generate", "--model", str(tiny_model), "--max-tokens", "2", "--threads", "1", "--max-model-len", "64",
            "--prompt-token-ids", "5,6", "--prompt-token-ids", "7"]
    assert cli.main(argv) == 0
    assert "+ 2 KDA state slots" in caplog.text
    phases = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up: ")]
    assert [line.split()[1] for line in phases] == ["weights", "cache"]
    assert all(float(line.split(" s")[0].split()[-1]) >= 0 for line in phases)
