"""ChatSession without a terminal: a chat the template refuses is reported, and the conversation stays usable."""

from __future__ import annotations

import os
import signal

from deltaserve import SamplingParams
from deltaserve.entrypoints.chat import ChatSession
from deltaserve.tokenizer.chat_template import ChatTemplate

REFUSES_SYSTEM = ("{% if messages[0].role == 'system' %}{{ raise_exception('system messages are not supported') }}"
                  "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")


class _Tokenizer:
    def __init__(self, template: str):
        self._template = ChatTemplate(template, "chat_template.jinja")

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return self._template.render(messages, add_generation_prompt)


class _LLM:
    def __init__(self, template: str):
        self.tokenizer = _Tokenizer(template)
        self.prompts = []

    def stream(self, prompt, params):
        self.prompts.append(prompt)
        return iter(())


def test_a_chat_the_template_refuses_is_reported_not_raised(capsys):
    session = ChatSession(_LLM(REFUSES_SYSTEM), SamplingParams(), system="be brief")
    assert session.answer("hello") == ""
    assert session.messages == [{"role": "system", "content": "be brief"}] and session.llm.prompts == []
    assert "error: chat template in chat_template.jinja rejected the chat: system messages are not supported" in (
        capsys.readouterr().err)


class _Output:
    def __init__(self, text: str, finished: bool = False):
        self.request_id, self.finished = "0", finished
        self.outputs = [type("Completion", (), {"text": text, "token_ids": text.split()})()]


class _InterruptedLLM(_LLM):
    """Streams three outputs; Ctrl-C arrives while the second is computed."""

    def __init__(self):
        super().__init__("{% for m in messages %}{{ m.content }}{% endfor %}")
        self.aborted = []

    def stream(self, prompt, params):
        yield _Output("In the")
        os.kill(os.getpid(), signal.SIGINT)  # the session's handler sets its flag
        yield _Output("In the beginning God")
        yield _Output("In the beginning God created", finished=True)

    def abort(self, request_id):
        self.aborted.append(request_id)


def test_after_ctrl_c_no_more_words_are_printed(capsys):
    session = ChatSession(_InterruptedLLM(), SamplingParams())
    assert session.answer("hello") == "In the"
    out, err = capsys.readouterr()
    assert out == "In the\n" and "[2 tokens" in err and "stopped]" in err
    assert session.llm.aborted == ["0"] and session.messages[-1] == {"role": "assistant", "content": "In the"}


def test_the_chat_command_encodes_its_prompt_as_a_chat(tiny_model, tmp_path):
    """One BOS when the template writes it and the tokenizer would add one too (the rendered ChatText reaches the
    engine unedited)."""
    from helpers.engine import with_bos

    from deltaserve import LLM

    with LLM(str(with_bos(tiny_model, tmp_path / "bos")), max_model_len=128, threads=1) as llm:
        prompts = []

        def stream(prompt, params):
            prompts.append(llm.tokenizer.encode_prompt(prompt))
            return iter(())

        llm.stream = stream
        ChatSession(llm, SamplingParams(max_tokens=1)).answer("hi")
        [ids] = prompts
        assert ids[0] == llm.tokenizer.bos_token_id and ids.count(llm.tokenizer.bos_token_id) == 1
