"""Our speculative loop (`adaflash_hf.generation.speculative_generate`) with a verify-length policy."""

from __future__ import annotations

from .base import MethodOutput


def has_trained_length_head(drafter) -> bool:
    return getattr(drafter, "length_head", None) is not None and bool(getattr(drafter.config, "length_head_trained", False))


def adaflash_policy(drafter) -> str:
    """``adaflash``'s verify-length policy: adaptive with a trained length head, else fixed."""
    # after the core move: spec.length_policy.default_policy(drafter) is the one rule
    return "adaptive" if has_trained_length_head(drafter) else "fixed"


def ours(policy):
    """Our loop with `policy` (a policy name, or a function of the drafter returning one)."""

    def run(ctx, input_ids, attention_mask, streamer):
        from ...generation import speculative_generate

        out, stats = speculative_generate(
            ctx.target,
            ctx.drafter,
            input_ids,
            attention_mask,
            length_policy=policy(ctx.drafter) if callable(policy) else policy,
            return_stats=True,
            streamer=streamer,
            **ctx.generate_kwargs,
        )
        return MethodOutput(out, stats=stats)

    return run
