"""Our speculative loop (`adaflash_hf.generation.speculative_generate`) with a verify-length policy."""

from __future__ import annotations

from .base import MethodOutput


def adaflash_policy(drafter) -> str:
    """``adaflash``'s verify-length policy: the drafter's default (adaptive with a trained length head)."""
    from ...speculation.length.names import default_policy

    return default_policy(drafter.config).value


def ours(policy, prompt_ngrams=None):
    """Our loop with `policy` (a policy name, or a function of the drafter returning one) and `prompt_ngrams`
    (``None``: the default rule; 0: the drafter alone)."""

    def run(ctx, input_ids, attention_mask, streamer):
        from ...generation import speculative_generate

        out, stats = speculative_generate(
            ctx.target,
            ctx.drafter,
            input_ids,
            attention_mask,
            length_policy=policy(ctx.drafter) if callable(policy) else policy,
            length_rate=ctx.length_rate,
            return_stats=True,
            streamer=streamer,
            prompt_ngrams=prompt_ngrams,
            fast_path=ctx.fast_path,
            **ctx.generate_kwargs,
        )
        return MethodOutput(out, stats=stats)

    return run
