"""transformers' own decoding paths: plain generate (dynamic and static cache), assisted generation
with a small autoregressive assistant, prompt-lookup decoding and the native DFlash path."""

from __future__ import annotations

from .base import MethodOutput


def run_plain(ctx, input_ids, attention_mask, streamer):
    return ctx.target.generate(input_ids, attention_mask=attention_mask, streamer=streamer, **ctx.generate_kwargs)


def run_plain_static(ctx, input_ids, attention_mask, streamer):
    kw = dict(ctx.generate_kwargs, cache_implementation="static")
    if ctx.device.type == "cuda":
        from transformers import CompileConfig

        kw["compile_config"] = CompileConfig()
    return ctx.target.generate(input_ids, attention_mask=attention_mask, streamer=streamer, **kw)


def _counting_target_forwards(ctx, input_ids, attention_mask, streamer, **kw) -> MethodOutput:
    """Generate with an assistant, counting target forwards: every one after the prefill is a verify round."""
    calls = []
    handle = ctx.target.register_forward_hook(lambda *_: calls.append(1))
    try:
        out = ctx.target.generate(input_ids, attention_mask=attention_mask, streamer=streamer, **kw, **ctx.generate_kwargs)
    finally:
        handle.remove()
    return MethodOutput(out, rounds=max(len(calls) - 1, 0))


def run_hf_assisted(ctx, input_ids, attention_mask, streamer):
    return _counting_target_forwards(ctx, input_ids, attention_mask, streamer, assistant_model=ctx.assistant)


def run_prompt_lookup(ctx, input_ids, attention_mask, streamer):
    return _counting_target_forwards(
        ctx, input_ids, attention_mask, streamer, prompt_lookup_num_tokens=ctx.prompt_lookup_num_tokens
    )


def run_dflash_native(ctx, input_ids, attention_mask, streamer):
    return _counting_target_forwards(
        ctx, input_ids, attention_mask, streamer, assistant_model=ctx.drafter, speculation_type="dflash"
    )
