"""The round cost measured where it runs, kept on disk: what the ``cost`` verify-length rule weighs, timed on this
device, dtype and pair of models once (:func:`~.warmup.measure_round_cost`: the target's forward per batch bucket and
tokens per request, the drafter's body and head, and real rounds' overheads, seconds on a GPU and on the CPU's static
path), then read back by every engine of the same key (:func:`round_cost_key`: the models, the device, the dtype, the
engine's shape and the library versions). Files live beside the kernel tuning cache
(:func:`~.kernels.tuning_cache.cache_dir` ``("round_cost")``: ``~/.cache/adaflash_hf/round_cost`` by default), written
atomically. ``EngineConfig(round_cost="measured")`` uses it; ``adaflash info --round-costs`` prints what it holds and
``adaflash info ... --profile-cost`` measures again.

Example:
    >>> engine = Engine(target, drafter, EngineConfig(cuda_graphs=True, round_cost="measured"))  # doctest: +SKIP
    >>> engine.round_cost.unit_ms  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import warnings

import torch

from ..speculation.length.cost import RoundCost
from .kernels.tuning_cache import entries, load_entry, save_entry, versions

__all__ = ["KIND", "cached_costs", "cached_round_cost", "measure_if_asked", "round_cost_key"]

KIND = "round_cost"
FORMAT = 1  # the layout of a saved table (RoundCost.to_json) and of its key; a new layout takes a new number


def _model_id(model) -> dict:
    """A model as the cost depends on it: its name or path and a digest of its config and parameter shapes."""
    cfg = model.config
    shapes = [(n, list(p.shape)) for n, p in model.named_parameters()]
    text = cfg.to_json_string(use_diff=False) + json.dumps(shapes)
    return {"name": str(getattr(cfg, "_name_or_path", "") or type(model).__name__),
            "digest": hashlib.sha256(text.encode()).hexdigest()[:16]}


def round_cost_key(engine) -> dict:
    """Everything an engine's measured round cost depends on: the target and drafter (name, config and shapes), the
    device (its name on CUDA), the dtype, the engine's layout, slots, token budget, block, decode steps, fused kernels,
    and the library versions."""
    device = engine.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"format": FORMAT, "device": name, "dtype": str(next(engine.target.parameters()).dtype),
            "target": _model_id(engine.target), "drafter": _model_id(engine.drafter), "layout": engine.layout,
            "max_slots": engine.max_slots, "token_budget": engine.token_budget, "block_size": engine.block_size,
            "decode_steps": engine.decode_steps, "fused": engine.fused is not None, **versions()}


def cached_round_cost(engine, refresh: bool = False, context: int | None = None, reps: int = 5) -> RoundCost:
    """``engine``'s round cost from the cache, or measured now (``refresh``: always) and saved. The engine must be idle,
    with a drafter and the graph path (``cuda_graphs`` on; on the CPU the static path, eager): ``ValueError`` before
    anything runs otherwise. ``context``: the cached tokens each timed forward attends over (default: up to 256, what
    ``max_len`` leaves room for)."""
    from .warmup import measure_round_cost

    if engine.drafter is None or engine.graphs is None or engine.draft_graphs is None:
        raise ValueError("a measured round cost needs an engine with a drafter on the graph path (cuda_graphs=True; on "
                         "the CPU the same static path runs eagerly)")
    key = round_cost_key(engine)
    saved = None if refresh else load_entry(key, KIND)
    if saved is not None:
        return RoundCost.from_json(saved)
    if context is None:
        context = max(1, min(256, (engine.max_len - 2 * engine.block_size) // 2))
    cost = measure_round_cost(engine, context=context, reps=reps)
    save_entry(key, cost.to_json(), KIND)
    return cost


def measure_if_asked(engine, asked) -> None:
    """An engine's ``round_cost`` argument ``asked`` carried out: ``"measured"``, and the default (``None``) under
    ``cost`` on CUDA's graph path, set the engine's round cost to :func:`cached_round_cost`'s; a default that cannot
    be measured (a slot too short for the timed rounds, or timed rounds that did not run as planned) keeps SPEC's
    table, with a warning: building an engine never fails on its cost measurement unless it was asked for."""
    from ..speculation.length.names import LengthPolicy

    default = asked is None and engine.policy is LengthPolicy.COST and engine.device.type == "cuda" \
        and engine.graphs is not None
    if engine.drafter is None or not (asked == "measured" or default):
        return
    try:
        engine.round_cost = cached_round_cost(engine)
    except (ValueError, RuntimeError) as e:  # a measurement that cannot run, or whose rounds did not follow its plan
        if not default:
            raise
        warnings.warn(f"Engine: the round cost was not measured ({e}); the cost rule weighs SPEC's table",
                      RuntimeWarning, stacklevel=3)


def cached_costs() -> list[tuple[dict, RoundCost]]:
    """Every round cost the cache holds, with its key, oldest first (for ``adaflash info --round-costs``)."""
    out = []
    for _, key, value in entries(KIND):
        try:
            out.append((key, RoundCost.from_json(value)))
        except (KeyError, TypeError, ValueError):
            continue  # a file another version wrote: not a table this one reads
    return out
