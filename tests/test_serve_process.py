"""The OpenAI surface as a deployment serves it: a separate `adaflash serve --reference` process (CPU, float32, a free
port of 127.0.0.1, one for the whole module, always stopped) driven by the official `openai` client. logprobs and
top_logprobs (completions and chat, streamed and not), echo with max_tokens 0, prompt lists, presence / frequency
penalties, response_format, tools with tool_choice and a refused field, each against plain `generate` of the reference
target or the request's own contract; speculation stays on (the server's /metrics counts accepted drafts). Then
lm-evaluation-harness' own `local-completions` and `local-chat-completions` models against a server started the same
way, compared with its `hf` model on the plain target (examples/lm_eval/compare.py on four problems of each local
task; run on the second core while the in-process tests run: tests/conftest.py's `background`)."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
from pathlib import Path

import openai
import pytest
import torch

from adaflash_hf import load_reference_pair

from reference_server import (TIME, TOL, WEATHER, accepted_drafts, check_chat_logprobs, check_completion_logprobs,
                              plain)
from script_runner import Job

COMPARE = Path(__file__).resolve().parents[1] / "examples" / "lm_eval" / "compare.py"
MODEL = "adaflash-reference"
PROMPTS = ["Once upon a time there was", "The little dog ran to the", "She opened the door and"]
STORY = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """`adaflash serve --reference --max-len 1024` (room for lm-eval's few-shot prompts), its URL, an `openai` client,
    and the plain reference target and tokenizer to check answers against; stderr in ``log`` for failures. Stopped
    at the end of the module, or after 15 minutes should this process die first."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as err:
        try:
            start_server = runpy.run_path(str(COMPARE))["start_server"]  # lm-eval is imported only when it runs
            proc, url = start_server(max_len=1024, stderr=err, lifetime=900)
        except RuntimeError as e:
            pytest.fail(f"{e}; its stderr ends:\n{log.read_text(errors='replace')[-3000:]}")
    try:
        target, _, tok = load_reference_pair()
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield dict(url=url, client=client, target=target, tok=tok, log=log)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def chat_ids(s, messages) -> list[int]:
    """The prompt the server builds from ``messages`` (the tokenizer's chat template)."""
    text = s["tok"].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return s["tok"](text, add_special_tokens=False)["input_ids"]


def test_completion_logprobs_streamed_and_not_equal_plain_decoding(srv):
    ids = srv["tok"](PROMPTS[0])["input_ids"]
    before = accepted_drafts(srv)
    check_completion_logprobs(srv, dict(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=3),
                              *plain(srv, ids, 16), 3)
    assert accepted_drafts(srv) > before  # speculation stayed on with logprobs


def test_chat_logprobs_streamed_and_not_equal_plain_decoding(srv):
    kw = dict(model=MODEL, messages=STORY, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    check_chat_logprobs(srv, kw, *plain(srv, chat_ids(srv, STORY), 16), 2)


def test_echo_with_max_tokens_0_over_a_prompt_list(srv):
    """lm-eval's loglikelihood request: a list of token-id prompts, echo + logprobs, no new token: choice i holds
    prompt i's logprobs, equal to one plain forward's (the first token has none)."""
    batch = [srv["tok"](p)["input_ids"] for p in PROMPTS]
    res = srv["client"].completions.create(model=MODEL, prompt=batch, max_tokens=0, temperature=0, logprobs=1,
                                           echo=True)
    assert [c.index for c in res.choices] == [0, 1, 2] and res.usage.completion_tokens == 0
    for choice, ids in zip(res.choices, batch):
        assert choice.text == srv["tok"].decode(ids) and choice.logprobs.token_logprobs[0] is None
        with torch.no_grad():
            ref = srv["target"](torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs[1:]), want, atol=TOL)


def test_a_prompt_list_numbers_its_choices_prompt_by_prompt(srv):
    res = srv["client"].completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    want = [srv["tok"].decode(plain(srv, srv["tok"](p)["input_ids"], 8)[0], skip_special_tokens=True) for p in PROMPTS]
    assert [c.text for c in sorted(res.choices, key=lambda c: c.index)] == want
    assert sorted(c.index for c in res.choices) == [0, 1, 2] and len(set(want)) == 3


def test_penalised_greedy_equals_plain_decoding_with_the_same_penalties(srv):
    ids = srv["tok"](PROMPTS[1])["input_ids"]
    want, _ = plain(srv, ids, 24, 1.2, 0.6)
    assert want != plain(srv, ids, 24)[0]  # control: the penalties change the plain answer
    before = accepted_drafts(srv)
    for kw in (dict(model=MODEL, prompt=PROMPTS[1]), dict(model=MODEL, prompt=ids)):
        res = srv["client"].completions.create(**kw, max_tokens=24, temperature=0, presence_penalty=1.2,
                                               frequency_penalty=0.6)
        assert res.choices[0].text == srv["tok"].decode(want, skip_special_tokens=True)
    assert accepted_drafts(srv) > before


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("question,fmt", [
    ("What is 2+2?", {"type": "json_object"}),
    ("Give me a person as JSON", {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}),
])
def test_response_format_answers_parse_and_match_the_schema(srv, question, fmt):
    ask = [{"role": "user", "content": question}]
    free = srv["client"].chat.completions.create(model=MODEL, messages=ask, max_tokens=48, temperature=0)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)  # control: unconstrained, the model writes no JSON
    before = accepted_drafts(srv, "draft"), accepted_drafts(srv)
    for stream in (False, True):
        res = srv["client"].chat.completions.create(model=MODEL, messages=ask, max_tokens=48, temperature=0,
                                                    response_format=fmt, stream=stream)
        text = ("".join(c.choices[0].delta.content or "" for c in res if c.choices) if stream
                else res.choices[0].message.content)
        value = json.loads(text)
        assert isinstance(value, dict)
        if fmt["type"] == "json_schema":
            assert set(value) == {"name", "age"} and isinstance(value["name"], str) and type(value["age"]) is int
    assert accepted_drafts(srv, "draft") > before[0]  # speculation stayed on under the grammar: drafts verified
    if fmt["type"] == "json_schema":
        assert accepted_drafts(srv) > before[1]  # and accepted (a few tokens of {} and tabs need not accept any)


def test_tool_choice_forces_a_call_returned_as_tool_calls_streamed_and_not(srv):
    """A named function (streamed and not) and ``"required"``: one call, its arguments JSON of the tool's parameters;
    with ``"none"``, no call (control)."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, messages=ask, tools=[WEATHER, TIME], max_tokens=80, temperature=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    res = srv["client"].chat.completions.create(**kw, tool_choice=named).choices[0]
    assert res.finish_reason == "tool_calls" and res.message.content is None and len(res.message.tool_calls) == 1
    call = res.message.tool_calls[0].function
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    deltas = [c.choices[0] for c in srv["client"].chat.completions.create(**kw, tool_choice=named, stream=True)
              if c.choices]
    calls = [t.function for d in deltas for t in d.delta.tool_calls or []]
    assert [(f.name, f.arguments) for f in calls] == [(call.name, call.arguments)]
    assert deltas[-1].finish_reason == "tool_calls"
    required = srv["client"].chat.completions.create(**kw, tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
    fn = required.message.tool_calls[0].function
    assert fn.name in ("get_weather", "get_time") and isinstance(json.loads(fn.arguments), dict)
    free = srv["client"].chat.completions.create(**{**kw, "max_tokens": 12}, tool_choice="none").choices[0]
    assert free.message.tool_calls is None and "<tool_call>" not in free.message.content  # control: none unless forced


@pytest.mark.parametrize("kind,field,value", [("completion", "best_of", 3), ("chat", "modalities", ["audio"]),
                                              ("completion", "beam_width", 4)], ids=["best_of", "modalities", "unknown"])
def test_a_field_the_server_cannot_honour_is_a_400_naming_it(srv, kind, field, value):
    create = srv["client"].chat.completions.create if kind == "chat" else srv["client"].completions.create
    prompt = dict(messages=STORY) if kind == "chat" else dict(prompt="Hi")
    with pytest.raises(openai.BadRequestError) as e:
        create(model=MODEL, max_tokens=2, **prompt, extra_body={field: value})
    assert e.value.status_code == 400 and e.value.body["param"] == field and f"`{field}`" in e.value.body["message"]
    assert create(model=MODEL, max_tokens=2, **prompt).choices  # control: the same request without it is answered


# The lm-eval job: a server started as `srv` starts one (stopped after 15 minutes should its job die first, its stderr
# kept), then examples/lm_eval/compare.py against it, both in the job's process tree.
LM_EVAL_JOB = """
import runpy, sys
compare = runpy.run_path(sys.argv[1])
code = 1
try:
    proc, url = compare["start_server"](max_len=1024, stderr=open("serve.log", "w"), lifetime=900)
    try:
        code = compare["main"](["--url", url, *sys.argv[2:]])
    finally:
        proc.terminate()
        proc.wait(30)
finally:
    if code != 0:
        print("the server's stderr ends:\\n" + open("serve.log", errors="replace").read()[-2000:], file=sys.stderr)
sys.exit(code)
"""


def background_run(root: Path):
    """The lm-eval comparison (tests/conftest.py's `background` fixture), on the second core while the in-process
    tests run, against a server of its own: the same `adaflash serve --reference --max-len 1024 --max-slots 8` as
    `srv`. One lm-eval process for every task."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    (root / "lm_eval_job.py").write_text(LM_EVAL_JOB)
    argv = [root / "lm_eval_job.py", COMPARE, "--gsm8k", "4", "--mathqa", "4", "--max-gen-toks", "32"]
    return [Job("lm_eval", argv, cwd=root / "lm_eval", timeout=360.0)], env, ()


def test_lm_evaluation_harness_against_the_server_matches_its_hf_model(background):
    """lm-eval's `local-completions` (gsm8k generate-until, MathQA loglikelihood through echo + logprobs in batches)
    and `local-chat-completions` (gsm8k with the chat template) against an `adaflash serve --reference` process, and
    its `hf` model on the plain reference target: the same answers and scores, loglikelihoods within 1e-4."""
    proc = background["lm_eval"]
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and lines[-1:] == ["all equal: True"], (
        f"(timed out: {proc.timed_out})\n{proc.stdout}\n{proc.stderr[-6000:]}")
    for name in ("gsm8k local-completions: answers equal 4/4", "gsm8k local-chat-completions: answers equal 4/4",
                 "mathqa local-completions: max |loglikelihood diff|"):
        assert any(line.startswith(name) and line.endswith("-> equal") for line in lines), proc.stdout
