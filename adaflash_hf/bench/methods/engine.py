"""The serving engine (`adaflash_hf.engine.Engine`) as a benchmark method, one request per row."""

from __future__ import annotations

from .base import MethodOutput


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def _engine_for(ctx, policy: str | None, prompts: list[list[int]], max_new: int, prompt_ngrams=None):
    """The context's engine for (length policy, batch size), rebuilt when this batch does not fit it."""
    from ...engine import Engine, EngineConfig

    drafter = ctx.drafter if policy is not None else None
    block = drafter.config.block_size if drafter is not None else 1
    need_len = _pow2_at_least(max(map(len, prompts)) + max_new + block, 256)
    need_budget = _pow2_at_least(max(max(map(len, prompts)), len(prompts) * block), 64)
    key = (policy, len(prompts), prompt_ngrams)
    eng = ctx.engines.get(key)
    if eng is None or eng.max_len < need_len or eng.token_budget < need_budget:
        eng = Engine(ctx.target, drafter, EngineConfig(length_policy=policy, max_slots=len(prompts), max_len=need_len,
                                                      token_budget=need_budget, length_rate=ctx.length_rate,
                                                      halving_batch=ctx.halving_batch, prompt_ngrams=prompt_ngrams))
        eng.warmup(concurrency=len(prompts))  # the decode rounds' graphs, before any timed request
        ctx.engines[key] = eng
    return eng, block


def engine(policy: str | None, prompt_ngrams=None):
    """The serving engine with length policy `policy` (``None``: no drafter, plain decoding) and `prompt_ngrams`
    (``None``: the default rule; 0: the drafter alone), one request per row.

    The batch is submitted at once (concurrency = batch size). One engine per (mode, batch size) is
    kept in the context, sized with power-of-two headroom so that later batches reuse it (and its
    captured CUDA graphs); the warmup batch builds it outside the timed runs.
    """

    def run(ctx, input_ids, attention_mask, streamer):
        import torch

        from ...engine import SamplingParams
        from ...generation.stats import GenerationStats

        kw = ctx.generate_kwargs
        max_new = int(kw["max_new_tokens"])
        prompts = [row[m.bool()].tolist() for row, m in zip(input_ids, attention_mask)]
        eng, block = _engine_for(ctx, policy, prompts, max_new, prompt_ngrams)
        eos = kw.get("eos_token_id", ctx.target.generation_config.eos_token_id)
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else eos
        params = SamplingParams(kw.get("temperature") or 0.0, kw.get("top_k") or None, kw.get("top_p"), None, eos)
        streamer.put(input_ids)  # like generate: the prompt first, then every new token
        handles = [eng.submit(p, max_new, params, on_token=lambda t: streamer.put(t)) for p in prompts]
        outs = [h.result() for h in handles]
        width = max(len(o.token_ids) for o in outs)
        seq = torch.full((len(outs), input_ids.shape[1] + width), int(kw.get("pad_token_id") or 0), dtype=input_ids.dtype)
        seq[:, : input_ids.shape[1]] = input_ids.cpu()
        stats = GenerationStats(block_size=block, policy=f"engine {eng.layout}")
        for i, o in enumerate(outs):
            seq[i, input_ids.shape[1] : input_ids.shape[1] + len(o.token_ids)] = torch.tensor(o.token_ids, dtype=seq.dtype)
            for a, v in zip(o.accepted, o.verify_lengths):
                stats.record(i, v, a)
        stats.new_tokens = sum(len(o.token_ids) for o in outs)
        return MethodOutput(seq.to(input_ids.device), stats=stats)

    return run
