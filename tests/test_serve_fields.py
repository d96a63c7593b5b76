"""Every field of both OpenAI request bodies through the official `openai` client against one real server on the
reference pair: `response_format` (json_object, json_schema) enforced by xgrammar on the verify path, equal to plain
transformers decoding under the same grammar (xgrammar's own `generate` processor), with drafts accepted (/metrics); and a table
over every field: each one the server reads refuses a wrongly typed value by name, each inert one changes nothing,
each one it cannot honour is accepted only at the value that asks for nothing, an unknown one is refused by name."""

from __future__ import annotations

import json

import openai
import pytest
import torch
import xgrammar as xgr

from adaflash_hf import load_reference_pair
from adaflash_hf.engine import Engine
from adaflash_hf.engine.grammar import Grammars
from adaflash_hf.engine.sampling import SamplingParams
from adaflash_hf.serve.options import FIELDS

from reference_server import accepted_drafts, start_reference_server

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give me a person as JSON"}]


@pytest.fixture(scope="module")
def srv():
    s = start_reference_server()
    yield s
    s["server"].close()


def plain_under(s, ids: list[int], schema: dict, n: int) -> list[int]:
    """Plain greedy `generate` of the reference target under xgrammar's transformers processor for `schema`."""
    info = xgr.TokenizerInfo.from_huggingface(s["tok"], vocab_size=s["target"].config.vocab_size, stop_token_ids=[0])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    with torch.no_grad():
        out = s["target"].generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, pad_token_id=0,
                                   logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)])
    return [t for t in out[0, len(ids):].tolist() if t != 0]


@pytest.mark.parametrize("fmt,schema", [({"type": "json_object"}, {"type": "object"}),
                                        ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}, PERSON)])
def test_response_format_equals_plain_decoding_under_the_grammar(srv, fmt, schema):
    ids = srv["server"].service.parse({"messages": ASK}, "chat").prompts[0]
    want = srv["tok"].decode(plain_under(srv, ids, schema, 48), skip_special_tokens=True)
    kw = dict(model="ref", messages=ASK, max_tokens=48, temperature=0, response_format=fmt)
    before = accepted_drafts(srv)
    res = srv["client"].chat.completions.create(**kw).choices[0]
    assert res.message.content == want and accepted_drafts(srv) > before  # speculation stayed on
    streamed = "".join(c.choices[0].delta.content or "" for c in srv["client"].chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == want
    free = srv["client"].chat.completions.create(model="ref", messages=ASK, max_tokens=48, temperature=0)
    assert free.choices[0].message.content != want  # control: without the grammar, another answer
    if schema is PERSON:  # it ends inside the budget: valid JSON of the schema
        assert res.finish_reason == "stop" and set(json.loads(res.message.content)) == {"name", "age"}


def test_grammar_on_the_engine_greedy_and_sampled_accepts_drafts():
    """Engine level: greedy under the grammar equals plain decoding under it; a sampled request only ever commits
    tokens the grammar allows (the engine would fail it otherwise); drafts are accepted."""
    target, drafter, tok = load_reference_pair()
    s = {"target": target, "tok": tok}
    grammar = Grammars(tok, target.config.vocab_size, [0]).json_schema(PERSON)
    ids = tok('A record: {"name": "Tom", "age": 4}. Another: ')["input_ids"]
    engine = Engine(target, drafter, max_slots=4, max_len=128, token_budget=256)
    greedy = engine.submit(ids, 40, SamplingParams(grammar=grammar, eos_token_id=0))
    sampled = engine.submit(ids, 40, SamplingParams(temperature=1.0, seed=1, grammar=grammar, eos_token_id=0))
    g, r = greedy.result(), sampled.result()
    assert g.token_ids[:-1] == plain_under(s, ids, PERSON, 40) and g.finish_reason == "eos"
    assert r.finish_reason in ("eos", "length") and r.error is None
    if r.finish_reason == "eos":
        assert set(json.loads(tok.decode(r.token_ids[:-1]))) == {"name", "age"}
    assert sum(g.accepted) + sum(r.accepted) > 0


def _post(s, kind: str, body: dict):
    path = "/chat/completions" if kind == "chat" else "/completions"
    base = {"messages": [{"role": "user", "content": "Hi"}]} if kind == "chat" else {"prompt": "Once upon a time"}
    try:
        return s["client"].post(path, body={**base, "max_tokens": 3, "temperature": 0, **body}, cast_to=object), None
    except openai.BadRequestError as e:
        return None, e.body


WRONG_TYPE = {"stream_options": "x"}  # a value of the wrong type for each field the server reads (default: an object)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_every_field_does_what_it_says_or_is_refused_by_name(srv, kind):
    plain, err = _post(srv, kind, {})
    assert err is None
    answer = plain["choices"][0].get("text", plain["choices"][0].get("message", {}).get("content"))
    for field, rule in FIELDS[kind].items():
        if rule == "used":  # read: a wrongly typed value is a 400 naming it (what each does: the tests beside)
            _, err = _post(srv, kind, {field: WRONG_TYPE.get(field, {"bad": 1})})
            assert err is not None and err["param"] == field, (field, err)
            continue
        values = ["any", 7, {"k": "v"}] if rule == "inert" else list(rule)
        for value in values:  # no effect: the same answer
            res, err = _post(srv, kind, {field: value})
            assert err is None, (field, value, err)
            got = res["choices"][0].get("text", res["choices"][0].get("message", {}).get("content"))
            assert got == answer, (field, value)
        if rule != "inert":  # anything else is refused, naming the field
            _, err = _post(srv, kind, {field: "__something_else__"})
            assert err is not None and err["param"] == field and "not supported" in err["message"], (field, err)
    _, err = _post(srv, kind, {"no_such_field": 1})
    assert err["param"] == "no_such_field" and "unrecognized request argument" in err["message"]
