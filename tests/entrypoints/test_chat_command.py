"""`deltaserve chat` under a pseudo-terminal: streamed multi-turn answers, /reset, /exit, and Ctrl-C."""

from __future__ import annotations

import re
import sys

import pytest

from deltaserve import SamplingParams

pexpect = pytest.importorskip("pexpect")

STATS = re.compile(r"\[(\d+) tokens, [0-9.]+ tok/s(, stopped)?\]")
PROMPT = ">>> "


def spawn_chat(model_dir, *options: str):
    child = pexpect.spawn(sys.executable, ["-m", "deltaserve.entrypoints.cli", "chat", "--model", str(model_dir),
                                           "--threads", "1", *options],
                          encoding="utf-8", codec_errors="replace", timeout=30)
    child.expect_exact(PROMPT)
    return child


def send_turn(child, text: str) -> tuple[str, re.Match]:
    """Send a line; return what was printed between its echo and the stats line, and the stats."""
    child.sendline(text)
    child.expect_exact(text + "\r\n")  # the terminal's echo
    child.expect(STATS)
    return child.before.replace("\r\n", "\n"), child.match


def exit_chat(child) -> None:
    child.expect_exact(PROMPT)
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_two_turns_stream_the_template_answers_then_exit(tiny_model, make_llm):
    """Each answer is the model's greedy answer to the whole conversation so far; /reset starts over."""
    llm, params = make_llm(), SamplingParams(max_tokens=8, temperature=0)
    first = llm.chat([{"role": "user", "content": "Hello"}], params).outputs[0].text
    second = llm.chat([{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first},
                       {"role": "user", "content": "Who are you?"}], params).outputs[0].text
    assert second != llm.chat([{"role": "user", "content": "Who are you?"}], params).outputs[0].text

    child = spawn_chat(tiny_model, "--temperature", "0", "--max-tokens", "8")
    printed, stats = send_turn(child, "Hello")
    assert printed == first + "\n" and stats.group(1) == "8"
    printed, _ = send_turn(child, "Who are you?")
    assert printed == second + "\n"
    child.sendline("/reset")
    child.expect_exact("(conversation reset)")
    printed, _ = send_turn(child, "Hello")
    assert printed == first + "\n"
    exit_chat(child)


def test_ctrl_c_stops_the_answer_not_the_program(tiny_model, make_llm):
    question = "Tell me a very long story about a dragon"
    full = make_llm(max_model_len=4096).chat([{"role": "user", "content": question}],
                                             SamplingParams(max_tokens=4000, temperature=0))
    num_full = len(full.outputs[0].token_ids)
    assert num_full >= 200, "the tiny model's greedy answer is too short to interrupt; pick another question"

    child = spawn_chat(tiny_model, "--temperature", "0", "--max-tokens", "4000")
    child.sendline(question)
    child.expect_exact(question + "\r\n")
    child.expect(r"\S")  # the answer has started streaming
    child.sendintr()
    child.expect(STATS)
    assert child.match.group(2) == ", stopped" and int(child.match.group(1)) < num_full
    assert child.isalive()
    printed, stats = send_turn(child, "Hello")  # the next turn runs as usual
    assert printed.strip() and stats.group(2) is None
    exit_chat(child)
