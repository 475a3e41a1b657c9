import datetime
import json

import pytest

from deltaserve.tokenizer import ChatTemplateError, load_tokenizer
from deltaserve.tokenizer.chat_template import ChatTemplate

SINGLE = [{"role": "user", "content": "Hi 日本"}]
MULTI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}]},
]


def test_single_turn(tokenizer):
    expected = "<|im_start|>user\nHi 日本<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(SINGLE) == expected


def test_multi_turn_without_generation_prompt(tokenizer):
    assert tokenizer.apply_chat_template(MULTI, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
    )


def test_tools_and_tool_calls(tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "description": "Adds, «exactly»."}}]
    calls = [{"type": "function", "function": {"name": "add", "arguments": "{}"}}]
    messages = [*SINGLE, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "content": "5", "tool_call_id": "0"}]
    assert tokenizer.apply_chat_template(messages, tools=tools) == (
        f"<|im_start|>system\n# Tools\n{json.dumps(tools, ensure_ascii=False)}<|im_end|>\n"
        "<|im_start|>user\nHi 日本<|im_end|>\n"
        f"<|im_start|>assistant\n{json.dumps(calls)}<|im_end|>\n"
        "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    )


def test_rendered_chat_encodes_to_special_ids(tokenizer, trained):
    ids = tokenizer.encode(tokenizer.apply_chat_template(SINGLE))
    assert ids[0] == trained[1].im_start_id and ids.count(trained[1].im_end_id) == 1


def test_matches_transformers(trained):
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(trained[0])
    ours = load_tokenizer(trained[0])
    for messages in (SINGLE, MULTI):
        text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == text
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False)


def test_template_sees_special_tokens_and_helpers():
    template = ChatTemplate("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ strftime_now('%Y') }}", "t.jinja")
    rendered = template.render(SINGLE, bos_token="[BOS]", eos_token="[EOS]")
    assert rendered == f"[BOS]|[EOS]||{datetime.datetime.now().year}"


def test_constructs_real_templates_use():
    source = (
        "{{ tools | tojson(separators=(',', ':')) }}|{{ messages[0].get('name') or messages[0]['role'] }}|"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|"
        "{{ dict(a=1) | tojson }}{% for m in messages %}{% if loop.first %}{% break %}{% endif %}{% endfor %}"
    )
    rendered = ChatTemplate(source, "t").render(SINGLE, tools=[{"name": "é"}])
    assert rendered == '[{"name":"é"}]|user|1|{"a": 1}'


def test_missing_fields_are_empty_like_in_transformers():
    template = ChatTemplate("{% for m in messages %}[{{ m.name }}]{% if m.tool_calls %}x{% endif %}{% endfor %}", "t")
    assert template.render(SINGLE) == "[]"


def test_raise_exception():
    template = ChatTemplate("{{ raise_exception('roles must alternate user/assistant') }}", "t.jinja")
    with pytest.raises(ChatTemplateError, match=r"^chat template in t.jinja rejected the chat: roles must alter"):
        template.render(SINGLE)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{% set ns = namespace(_secret=1) %}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ messages.append(1) }}",
        "{{ messages[0].update({'role': 'system'}) }}",
    ],
)
def test_sandbox_blocks_escapes(source):
    with pytest.raises(ChatTemplateError, match=r"^chat template in t.jinja tried an unsafe operation \("):
        ChatTemplate(source, "t.jinja").render(SINGLE)


def test_syntax_error_names_the_file(model_dir):
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match=r"chat_template.jinja does not compile: Unexpected end of template"):
        load_tokenizer(model_dir)


def test_template_runtime_error():
    with pytest.raises(ChatTemplateError, match=r"^chat template in t failed: TypeError: .* check that the messages"):
        ChatTemplate("{{ messages[0].content + 1 }}", "t").render(SINGLE)


def test_no_template(model_dir):
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json has no chat template; send a prompt or"):
        load_tokenizer(model_dir).apply_chat_template(SINGLE)


@pytest.mark.parametrize(
    "messages, message",
    [
        ("hello", r"messages = 'hello', expected a non-empty list of"),
        ([], r"messages = \[\], expected a non-empty list"),
        (["hi"], r"messages\[0\] = 'hi', expected a dict with 'role' and 'content'"),
        ([{"content": "x"}], r"messages\[0\] has role None, expected one of system, user, assistant, tool"),
        ([*SINGLE, {"role": "bot", "content": "x"}], r"messages\[1\] has role 'bot', expected one of system"),
        ([{"role": "user"}], r"messages\[0\] has content None, expected a string or a list of parts"),
        ([{"role": "user", "content": 3}], r"messages\[0\] has content 3, expected a string"),
        ([{"role": "assistant", "content": None}], r"None only for an assistant message with tool_calls"),
        ([{"role": "user", "content": ["hi"]}], r"messages\[0\].content\[0\] = 'hi', expected a dict with a str"),
        ([{"role": "user", "content": "x", "meta": object()}], r"messages\[0\].meta is a object, expected JSON"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         r"messages\[0\].content\[0\] is of type 'image_url': Kimi-Linear reads text only"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\].content\[0\] is of type 'text'"),
    ],
)
def test_bad_messages(tokenizer, messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        tokenizer.apply_chat_template(messages)


def test_bad_tools(tokenizer):
    with pytest.raises(ChatTemplateError, match=r"tools = 'add', expected None or a list of JSON-schema dicts"):
        tokenizer.apply_chat_template(SINGLE, tools="add")
