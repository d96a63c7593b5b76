"""One real server on the embedded reference pair (float32, CPU) and an official `openai` client for it: what the
OpenAI-surface tests (logprobs, fields, tools) talk to."""

from __future__ import annotations

import httpx
import openai

from adaflash_hf import load_reference_pair
from adaflash_hf.engine import Engine
from adaflash_hf.serve.server import make_server


def start_reference_server(max_len: int = 160, chat_template: str | None = None) -> dict:
    """The server (speculative engine, default length policy, 8 slots) started on a free port of 127.0.0.1, with its
    target, tokenizer, engine and client; close it with ``s["server"].close()``."""
    target, drafter, tok = load_reference_pair()
    if chat_template is not None:
        tok.chat_template = chat_template
    engine = Engine(target, drafter, max_slots=8, max_len=max_len, token_budget=2 * max_len)
    server = make_server(engine, tok, port=0, model_name="ref", default_max_tokens=8).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return dict(server=server, target=target, tok=tok, engine=engine, client=client)


def accepted_drafts(s: dict) -> float:
    """Drafted tokens the server's engine has accepted so far, as its /metrics counts them (speculation at work)."""
    text = httpx.get(s["server"].url + "/metrics").text
    line = [x for x in text.splitlines() if x.startswith("adaflash_spec_decode_num_accepted_tokens_total ")]
    return float(line[0].split()[1]) if line else 0.0
