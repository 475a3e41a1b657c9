"""ChatSession without a terminal: a chat the template refuses is reported, and the conversation stays usable."""

from __future__ import annotations

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
