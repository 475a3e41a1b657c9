"""`parity check` end to end on a small random model: float32 passes strictly, a planted one-weight perturbation
is a real divergence where it enters, and the bfloat16 regime's divergences are all classified."""

from __future__ import annotations

import re
import shutil

from safetensors.torch import load_file, save_file

from deltaserve.entrypoints.cli import main
from deltaserve.parity.golden import Golden, load_golden

DIVERGENCE = re.compile(r"^  (free-running: first divergence|teacher-forced: top-1 differs) at token (\d+): .* -> "
                        r"(near-tie|REAL)$")


def check(capsys, *args: str) -> tuple[int, list[str]]:
    status = main(["parity", "check", *args])
    return status, capsys.readouterr().out.splitlines()


def by_prompt(lines: list[str]) -> dict[int, list[str]]:
    """Each `prompt i: ...` line with the divergence lines under it."""
    groups: dict[int, list[str]] = {}
    for line in lines:
        if m := re.match(r"^prompt (\d+): ", line):
            current = groups.setdefault(int(m.group(1)), [])
        if line.startswith(("prompt ", "  ")):
            current.append(line)
    return groups


def test_float32_strict_check_matches_every_token(captured, capsys):
    status, lines = check(capsys, "--model", str(captured.model), "--golden", str(captured.golden), "--strict")
    total = captured.num_prompts * captured.max_tokens
    assert status == 0, "\n".join(lines)
    assert lines[-1] == f"match {total}/{total}"
    assert f"top-1 agreement {total}/{total}" in "\n".join(lines)
    assert not any(DIVERGENCE.match(line) for line in lines)


def fed_once(golden: Golden) -> tuple[int, int]:
    """(p, j): output token j of prompt p is fed to the model there first, and in no other sequence."""
    fed = [gp.prompt_token_ids + gp.output_token_ids[:-1] for gp in golden.prompts]
    for p, gp in enumerate(golden.prompts):
        start = len(gp.prompt_token_ids)
        for j, token in enumerate(gp.output_token_ids[:-1]):
            elsewhere = any(token in seq for q, seq in enumerate(fed) if q != p)
            if token not in fed[p][: start + j] and not elsewhere and gp.top2[j + 1][2] > 1e-3:
                return p, j
    raise AssertionError("no output token is fed in one sequence only; pick another seed")


def test_planted_perturbation_is_a_real_divergence_where_it_enters(captured, capsys, tmp_path):
    golden = load_golden(captured.golden)
    p, j = fed_once(golden)
    token, next_token = golden.prompts[p].output_token_ids[j], golden.prompts[p].output_token_ids[j + 1]
    model = tmp_path / "perturbed"
    shutil.copytree(captured.model, model)
    tensors = load_file(str(model / "model.safetensors"))
    other = tensors["lm_head.weight"][(next_token + 1) % golden.vocab_size]
    tensors["model.embed_tokens.weight"][token] = 100 * other / other.norm()  # the one edited tensor row
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})

    status, lines = check(capsys, "--model", str(model), "--golden", str(captured.golden))

    total, M = captured.num_prompts * captured.max_tokens, captured.max_tokens
    assert status == 1
    groups = by_prompt(lines)
    for q, group in groups.items():
        if q != p:
            assert group[0].startswith(f"prompt {q}: match {M}/{M}; teacher-forced top-1 {M}/{M}"), group
    assert groups[p][0].startswith(f"prompt {p}: match {j + 1}/{M};")
    first = DIVERGENCE.match(groups[p][1])
    assert first and first.groups() == ("free-running: first divergence", str(j + 1), "REAL"), groups[p]
    assert lines[-1] == f"match {total - (M - j - 1)}/{total}"


def test_bfloat16_check_of_the_same_model_passes_and_classifies_every_divergence(captured, capsys):
    status, lines = check(capsys, "--model", str(captured.model), "--golden", str(captured.golden),
                          "--dtype", "bfloat16")
    text = "\n".join(lines)
    divergences = [DIVERGENCE.match(line) for line in lines if line.startswith("  ")]
    assert all(divergences), text
    kinds = [m.group(3) for m in divergences]
    more = re.search(r"^\.\.\. (\d+) more divergences", text, re.MULTILINE)
    summary = re.search(r"divergences: (\d+) \((\d+) near-tie, (\d+) real\)", text)
    assert summary and int(summary.group(1)) == len(kinds) + (int(more.group(1)) if more else 0)
    assert "REAL" not in kinds and summary.group(3) == "0"
    assert status == 0 and "verdict: pass" in lines, text
    assert re.search(r"teacher-forced: top-1 agreement \d+/\d+ .*KL\(golden \|\| ours\) mean", text)
    assert re.fullmatch(r"match \d+/\d+", lines[-1])
    assert "checking deltaserve bfloat16" in lines[0]


def test_bfloat16_passes_against_a_float32_golden_for_every_make_tiny_layout(capsys, tmp_path):
    golden = tmp_path / "golden.json"
    for layout in ("moonshot", "saved", "transformers"):
        assert main(["make-tiny", str(tmp_path / layout), "--layout", layout]) == 0
    assert main(["parity", "capture", "--model", str(tmp_path / "moonshot"), "--out", str(golden), "--num-prompts",
                 "4", "--prompt-len", "32", "--max-tokens", "32"]) == 0
    for layout in ("moonshot", "saved", "transformers"):
        status, lines = check(capsys, "--model", str(tmp_path / layout), "--golden", str(golden), "--dtype", "bfloat16")
        assert status == 0 and "verdict: pass" in lines, (layout, lines[-4:])


def test_deltaserve_reference_golden_from_a_prompts_file_checks_strictly(captured, capsys, tmp_path):
    """--reference deltaserve records the engine's own greedy path; prompts of several lengths from a file."""
    (tmp_path / "prompts.txt").write_text("[5, 6, 7]\n\n[9, 8, 7, 6, 5, 4, 3]\n[1]\n")
    golden = tmp_path / "golden.json"
    assert main(["parity", "capture", "--model", str(captured.model), "--out", str(golden), "--reference",
                 "deltaserve", "--prompts", str(tmp_path / "prompts.txt"), "--max-tokens", "5"]) == 0
    assert [p.prompt_token_ids for p in load_golden(golden).prompts] == [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [1]]
    status, lines = check(capsys, "--model", str(captured.model), "--golden", str(golden), "--strict")
    assert status == 0 and lines[-1] == "match 15/15"


def test_model_without_full_attention_is_captured_without_the_reference_cache(capsys, tmp_path):
    """transformers' cache cannot serve a KDA-only model; capture then recomputes the whole sequence each step."""
    from helpers.reference import SPECS, build_reference

    build_reference(SPECS["kda_only"], seed=0).save_pretrained(tmp_path / "model")
    golden = tmp_path / "golden.json"
    assert main(["parity", "capture", "--model", str(tmp_path / "model"), "--out", str(golden), "--num-prompts", "2",
                 "--prompt-len", "5", "--max-tokens", "4"]) == 0
    status, lines = check(capsys, "--model", str(tmp_path / "model"), "--golden", str(golden), "--strict")
    assert status == 0 and lines[-1] == "match 8/8"
