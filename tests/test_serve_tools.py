"""Chat tools through the official `openai` client against one real server on the reference pair with a hermes chat
template (Qwen3's tool format): the tools reach the template, a forced call (`tool_choice` required or named) is plain
decoding under the call's grammar read back as OpenAI `tool_calls`, streamed too; tool turns render; and the hermes
reader itself on the cases vLLM's parser answers, every streamed chunking equal to the whole text's reading."""

from __future__ import annotations

import json

import openai
import pytest
import torch
import xgrammar as xgr

from adaflash_hf.engine.grammar import Grammars
from adaflash_hf.serve.tools import END, START, ToolStream, forced_call, parse_tool_calls

from reference_server import TIME, WEATHER, start_reference_server

HERMES = """{%- if tools %}<|im_start|>system
You may call functions. <tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>
Return a call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{{ m.content or "" }}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv():
    s = start_reference_server(max_len=256, chat_template=HERMES)
    yield s
    s["server"].close()


def prompt_ids(s, messages, tools=None) -> list[int]:
    text = s["tok"].apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return s["tok"](text, add_special_tokens=False)["input_ids"]


def plain_forced(s, ids, tools, choice, n: int) -> str:
    """Plain greedy `generate` under the forced call's grammar (xgrammar's transformers processor)."""
    grammar = Grammars(s["tok"], s["target"].config.vocab_size, [0]).json_schema(
        forced_call(tools, choice), START + "\n", "\n" + END, any_whitespace=False)
    with torch.no_grad():
        out = s["target"].generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, pad_token_id=0,
                                   logits_processor=[xgr.contrib.hf.LogitsProcessor(grammar.compiled)])
    return s["tok"].decode(out[0, len(ids):], skip_special_tokens=True)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_is_plain_decoding_under_its_grammar_streamed_and_not(srv, choice):
    tools = [WEATHER, TIME]
    name = choice if isinstance(choice, str) else choice["function"]["name"]
    want_content, want = parse_tool_calls(plain_forced(srv, prompt_ids(srv, ASK, tools), tools, name, 60))
    assert want and want_content is None
    kw = dict(model="ref", messages=ASK, tools=tools, tool_choice=choice, max_tokens=60, temperature=0)
    res = srv["client"].chat.completions.create(**kw).choices[0]
    assert res.finish_reason == "tool_calls" and res.message.content is None
    got = [(c.function.name, json.loads(c.function.arguments)) for c in res.message.tool_calls]
    assert got == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want]
    if name == "get_time":
        assert got[0][0] == "get_time"
    chunks = list(srv["client"].chat.completions.create(**kw, stream=True))
    calls = [c for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls for c in ch.choices[0].delta.tool_calls]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [(0, *g) for g in got]
    assert calls[0].id.startswith("call_") and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def test_tools_reach_the_template_and_tool_turns_render(srv):
    """`auto`: plain greedy decoding of the prompt with the tools in it (a control without them differs); `none`:
    the prompt without them; a conversation holding an assistant call and its tool result is answered."""
    def plain_text(ids):
        with torch.no_grad():
            out = srv["target"].generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, pad_token_id=0)
        return srv["tok"].decode(out[0, len(ids):], skip_special_tokens=True)

    kw = dict(model="ref", messages=ASK, max_tokens=12, temperature=0)
    auto = srv["client"].chat.completions.create(**kw, tools=[WEATHER]).choices[0].message.content
    none = srv["client"].chat.completions.create(**kw, tools=[WEATHER], tool_choice="none").choices[0].message.content
    assert auto == plain_text(prompt_ids(srv, ASK, [WEATHER])) and none == plain_text(prompt_ids(srv, ASK))
    assert auto != none
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    res = srv["client"].chat.completions.create(model="ref", messages=turns, tools=[WEATHER], max_tokens=12, temperature=0)
    assert res.choices[0].message.content == plain_text(prompt_ids(srv, turns, [WEATHER]))


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]}, "messages"),
])  # fmt: skip
def test_bad_tool_fields_are_refused_by_name(srv, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        srv["client"].post("/chat/completions", body={"messages": ASK, **body}, cast_to=object)
    assert e.value.body["param"] == param


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
READS = {  # text -> (content, [(name, arguments)]) as vLLM's hermes parser reads it
    "no call": ("It is sunny.", ("It is sunny.", [])),
    "content then a call": ("Let me look." + CALL, ("Let me look.", [("get_weather", {"city": "Paris"})])),
    "two calls": (CALL + "\n" + CALL.replace("Paris", "Rome"), (None, [("get_weather", {"city": "Paris"}),
                                                                      ("get_weather", {"city": "Rome"})])),
    "unclosed last call": (CALL[: -len(END)], (None, [("get_weather", {"city": "Paris"})])),
    "bad json": ('<tool_call>\n{"name": get_weather}\n</tool_call>', ('<tool_call>\n{"name": get_weather}\n</tool_call>', [])),
    "a tag's start only": ("Almost <tool_", ("Almost <tool_", [])),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(READS))
def test_the_hermes_reader_whole_and_streamed_in_any_chunking(case):
    text, (content, calls) = READS[case]
    got_content, got = parse_tool_calls(text)
    assert got_content == content and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    for size in (1, 2, 5, len(text)):  # chunkings: character by character up to the whole text at once
        stream, sent, sent_calls = ToolStream(), "", []
        for k in range(0, len(text), size):
            piece, new = stream.feed(text[k : k + size])
            sent, sent_calls = sent + piece, sent_calls + new
        piece, new = stream.close()
        sent, sent_calls = sent + piece, sent_calls + new
        assert sent == (content or "") and [c["index"] for c in sent_calls] == list(range(len(calls)))
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in sent_calls] == calls
