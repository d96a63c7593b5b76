"""One real server on the embedded reference pair (float32, CPU) and an official `openai` client for it: what the
OpenAI-surface tests (logprobs, fields, tools) talk to; and what they compare its answers with (plain greedy
`generate` of the reference target, OpenAI's penalties as a transformers logits processor)."""

from __future__ import annotations

import httpx
import openai
import torch
from transformers import LogitsProcessor

from adaflash_hf import load_reference_pair
from adaflash_hf.engine import Engine
from adaflash_hf.serve.server import make_server

TOL = 1e-4  # logprobs against plain decoding's, float32
# Two tools in OpenAI's format: one with an argument constrained to an enum, one with none.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def start_reference_server(max_len: int = 160, chat_template: str | None = None) -> dict:
    """The server (speculative engine, default length policy, 8 slots) started on a free port of 127.0.0.1, with its
    target, tokenizer, engine and client; close it with ``s["server"].close()``."""
    target, drafter, tok = load_reference_pair()
    if chat_template is not None:
        tok.chat_template = chat_template
    engine = Engine(target, drafter, max_slots=8, max_len=max_len, token_budget=2 * max_len)
    server = make_server(engine, tok, port=0, model_name="ref", default_max_tokens=8).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return dict(server=server, url=server.url, target=target, tok=tok, engine=engine, client=client)


def accepted_drafts(s: dict, counter: str = "accepted") -> float:
    """Drafted tokens the server at ``s["url"]`` has accepted so far (``counter="draft"``: verified), as its /metrics
    counts them (speculation at work)."""
    text = httpx.get(s["url"] + "/metrics").text
    line = [x for x in text.splitlines() if x.startswith(f"adaflash_spec_decode_num_{counter}_tokens_total ")]
    return float(line[0].split()[1]) if line else 0.0


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence / frequency penalties over the generated tokens: the plain reference."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        gen = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, gen, torch.ones_like(gen, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def plain(s, ids: list[int], n: int, presence: float = 0.0, frequency: float = 0.0):
    """Plain greedy `generate` of the reference target: the tokens and each step's processed logprobs [n, V]."""
    procs = [OpenAIPenalties(len(ids), presence, frequency)] if presence or frequency else None
    with torch.no_grad():
        out = s["target"].generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, logits_processor=procs,
                                   output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(ids):].tolist(), torch.stack(out.scores)[:, 0].float().log_softmax(-1)


def check_entries(s, tokens, values, tops, ref_lp, k: int) -> None:
    """Each token's logprob and its top k alternatives (ids by text, values) against the reference rows."""
    assert len(values) == ref_lp.shape[0]
    for i, (t, v) in enumerate(zip(tokens, values)):
        assert abs(v - float(ref_lp[i, t])) < TOL, (i, v, float(ref_lp[i, t]))
        want = ref_lp[i].topk(k)
        got = sorted(tops[i].values(), reverse=True)[:k] if isinstance(tops[i], dict) else [x.logprob for x in tops[i]]
        assert torch.allclose(torch.tensor(got), want.values, atol=TOL), (i, got, want.values)


def check_completion_logprobs(s, kw: dict, ref: list[int], ref_lp, k: int) -> None:
    """A completion request ``kw`` (logprobs=k), non-streamed and streamed: its text, tokens and logprobs are plain
    decoding's ``ref`` / ``ref_lp``, and the stream's pieces add up to the whole answer's."""
    res = s["client"].completions.create(**kw).choices[0]
    assert res.text == s["tok"].decode(ref, skip_special_tokens=True)
    lp = res.logprobs
    assert lp.tokens == [s["tok"].decode([t]) for t in ref]
    check_entries(s, ref, lp.token_logprobs, lp.top_logprobs, ref_lp, k)
    chunks = [c.choices[0] for c in s["client"].completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == res.text
    streamed = [c.logprobs for c in chunks if c.logprobs]
    streamed_lp = sum((x.token_logprobs for x in streamed), [])  # another round layout: float noise only
    assert torch.allclose(torch.tensor(streamed_lp), torch.tensor(lp.token_logprobs), atol=TOL)
    assert sum((x.text_offset for x in streamed), []) == lp.text_offset


def check_chat_logprobs(s, kw: dict, ref: list[int], ref_lp, k: int) -> None:
    """A chat request ``kw`` (logprobs, top_logprobs=k), non-streamed and streamed: its tokens and logprobs are plain
    decoding's ``ref`` / ``ref_lp``."""
    content = s["client"].chat.completions.create(**kw).choices[0].logprobs.content
    assert [c.token for c in content] == [s["tok"].decode([t]) for t in ref]
    check_entries(s, ref, [c.logprob for c in content], [c.top_logprobs for c in content], ref_lp, k)
    streamed = [c for ch in s["client"].chat.completions.create(**kw, stream=True)
                if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < TOL
