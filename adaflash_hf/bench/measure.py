"""Measuring one cell: warm up, time every batch (with an online adapter attached for the online
methods), then fill the cell's throughput, latency, tau and acceptance figures."""

from __future__ import annotations

import sys
import time

import torch

from ..generation.prompts import left_pad
from ..speculation.rounds import tau_from_totals
from .methods import BenchContext, adaflash_policy
from .timing import run_batch


def _progress(config, total: int, desc: str):
    """A per-cell bar over its batches on stderr; off under --quiet and when stderr is not a terminal."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="batch", leave=False, file=sys.stderr, dynamic_ncols=True,
                disable=None if config.verbose else True)


def _private_drafter(drafter, target):
    """A copy of `drafter` for one online cell, so its updates never reach the drafter the other methods use."""
    from ..online.adapter import copy_drafter

    return copy_drafter(drafter, target).eval()


def _warm_up(method, ctx, cell, config, eos_ids, warm_pool, warmed, pad_id, device, on_cuda) -> None:
    """Untimed batches the first time a (method, concurrency) runs on a set: one-time set-up is not decoding.
    ``warm_pool``: the set's prompts, longest first, so that an engine sized for the batch (its cache length,
    its graph buckets) is built and captured here, not inside a timed batch of the set's longer prompts."""
    conc = cell.concurrency
    if config.warmup <= 0 or (method.name, conc, cell.dataset) in warmed:
        return
    picks = [warm_pool[i % len(warm_pool)] for i in range(max(config.warmup, conc))]
    for i in range(0, len(picks) - conc + 1, conc):
        ids, mask = left_pad(picks[i : i + conc], pad_id, device)
        run_batch(method, ctx, ids, mask, eos_ids, config.seed, on_cuda)
    warmed.add((method.name, conc, cell.dataset))


def _attach_adapter(method, ctx, config, dataset):
    from ..online import OnlineAdapter

    return OnlineAdapter(
        ctx.drafter, ctx.target, method=method.online, sample_unit=config.online_sample_unit,
        samples_per_update=config.online_samples_per_update,
        epochs=config.online_epochs, lr=config.online_lr, seed=config.seed, domain=dataset,
    ).attach()  # fmt: skip


class _Timings:
    """What the timed batches of one cell add up to."""

    def __init__(self):
        self.rows, self.walls, self.ttfts, self.tpots = [], [], [], []
        self.merged, self.rounds_est, self.waited = None, 0, 0.0
        self.settings = None  # the method's knobs (MethodOutput.settings), the same for every batch

    def add(self, out, rows, wall, ttft) -> None:
        self.rows += rows
        longest = max(len(r) for r in rows)
        if ttft is not None:
            self.ttfts.append(ttft)
            if longest > 1:
                self.tpots.append((wall - ttft) / (longest - 1))
        self.walls.append(wall)
        if out.stats is not None:
            self.merged = merge_stats(self.merged, out.stats)
        if out.rounds is not None:
            self.rounds_est += out.rounds
        self.settings = out.settings


def measure(method, ctx, cell, layouts, config, eos_ids, warm_pool, warmed, pad_id, device, on_cuda, hardware, online=None):
    """Time every batch of one cell and fill it in; the generated rows of all its prompts."""
    if method.online:  # a fresh copy of the drafter per cell: every cell's curve starts from the given weights
        ctx = BenchContext(ctx.target, _private_drafter(ctx.drafter, ctx.target), ctx.assistant, ctx.tokenizer, ctx.device,
                           ctx.generate_kwargs, prompt_lookup_num_tokens=ctx.prompt_lookup_num_tokens,
                           length_rate=ctx.length_rate, halving_batch=ctx.halving_batch,
                           fast_path=ctx.fast_path)  # fmt: skip
    _warm_up(method, ctx, cell, config, eos_ids, warm_pool, warmed, pad_id, device, on_cuda)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    # attached after the warmup: the adapter learns from the timed stream only
    adapter = _attach_adapter(method, ctx, config, cell.dataset) if method.online else None
    t = _Timings()
    bar = _progress(config, len(layouts), f"{cell.dataset} c={cell.concurrency} {method.name}")
    try:
        for bi, (ids, mask) in enumerate(layouts):
            t.add(*run_batch(method, ctx, ids, mask, eos_ids, config.seed + bi, on_cuda))  # TPOT without the wait below
            if adapter is not None and config.online_wait:  # the update's cost is the stream's: timed
                t0 = time.perf_counter()
                adapter.wait_for_update()
                if on_cuda:
                    torch.cuda.synchronize()
                t.waited += time.perf_counter() - t0
                t.walls[-1] += time.perf_counter() - t0
            bar.update(1)
    finally:
        bar.close()
        if adapter is not None:
            adapter.close()  # finishes the updates already triggered, stops the worker, detaches
    if adapter is not None:
        online_report(method, cell, adapter, config, t.waited, online)
    _fill(cell, t, method, ctx, hardware, device if on_cuda else None)
    return t.rows


def fill_computed(cell, rows, stats) -> None:
    """Fill a computed (untimed) cell from its rows and `GenerationStats`: round figures, no timings."""
    t = _Timings()
    t.rows, t.merged = rows, stats
    cell.new_tokens = sum(len(r) for r in rows)
    _fill_rounds(cell, t)
    cell.draft_time_s = cell.verify_time_s = None


def _fill(cell, t: _Timings, method, ctx, hardware, cuda_device) -> None:
    cell.new_tokens = sum(len(r) for r in t.rows)
    cell.wall_time_s = sum(t.walls)
    cell.tokens_per_s = cell.new_tokens / cell.wall_time_s if cell.wall_time_s > 0 else None
    cell.ttft_s = sum(t.ttfts) / len(t.ttfts) if t.ttfts else None
    cell.tpot_s = sum(t.tpots) / len(t.tpots) if t.tpots else None
    cell.peak_memory_bytes = torch.cuda.max_memory_allocated(cuda_device) if cuda_device is not None else None
    cell.settings = t.settings
    _fill_rounds(cell, t)
    if method.name == "adaptive" and ctx.drafter is not None and not getattr(ctx.drafter.config, "length_head_trained", True):
        cell.notes.append("length head not trained (config.length_head_trained is False)")
    if hardware["floor_ms_per_token"] is not None and cell.concurrency == 1 and cell.tokens_per_s:
        cell.floor_ms_per_token = hardware["floor_ms_per_token"]
        cell.floor_share = cell.tokens_per_s / hardware["floor_tokens_per_s"]


def _fill_rounds(cell, t: _Timings) -> None:
    """tau, rounds, verify lengths and acceptance: from per-round stats, else estimated from forwards."""
    merged = t.merged
    if merged is not None:
        cell.rounds = merged.rounds
        cell.tau = merged.tau
        cell.mean_verify_length = merged.mean_verify_length
        cell.position_acceptance = merged.position_acceptance
        cell.tau_histogram = {str(n): sum(1 for a in merged.accepted if a + 1 == n) for n in range(1, merged.block_size + 1)}
        cell.draft_time_s = merged.draft_time_s
        cell.verify_time_s = merged.verify_time_s
    elif t.rounds_est:
        cell.rounds = t.rounds_est
        cell.tau = tau_from_totals(cell.new_tokens, len(t.rows), t.rounds_est)
        cell.tau_estimated = True
        cell.notes.append("tau from totals: (new tokens - 1 per prompt) / target forwards after the prefill; no per-round stats")


def online_report(method, cell, adapter, config, waited, online) -> None:
    """Cell notes on the adapter, and its tau per weights version into `online` (a stream that
    triggered no update gives no records)."""
    stats, c = adapter.stats, adapter.config
    policy = adaflash_policy(adapter.drafter) if method.name == "adaflash" else "fixed"
    why = {
        "adaflash": " (the drafter's length head is trained)" if policy == "adaptive"
        else " (the drafter has no trained length head, so the verify length is not adapted)",
    }.get(method.name, "")  # fmt: skip
    cell.notes.append(f"online adapter method {adapter.config.method!r}, verify-length policy {policy}{why}")
    cell.notes.append(
        f"{stats['updates']} online update(s) from {stats['rounds_seen']} rounds "
        f"(samples: {c.sample_unit}s, samples_per_update {c.samples_per_update}, epochs {c.epochs}, lr {c.lr:g})"
    )
    if config.online_wait:
        cell.notes.append(f"wall time includes {waited:.3f} s waiting for triggered updates (--online-wait); TPOT excludes it")
    else:
        cell.notes.append("updates overlap serving (--no-online-wait); updates still running when the stream ended are not timed")
    if stats["failures"]:
        cell.notes.append(f"{stats['failures']} online update(s) FAILED (weights kept): {stats['last_error']}")
        print(f"warning: {cell.method} on {cell.dataset}: {stats['failures']} online update(s) failed: {stats['last_error']}", file=sys.stderr)
    if stats["swaps_refused"] or stats["rollbacks"]:
        cell.notes.append(f"online guard: {stats['swaps_refused']} update(s) refused, {stats['rollbacks']} rolled back")
    # Served weights only, one per update: refused updates never served, a rollback's tau_before is the undone update's.
    served = [h for h in stats["history"] if h["swapped"] and h["rollback_of"] is None]
    if online is None or not served:
        return
    points = [(h["update"] - 1, h["tau_before"], h["rounds_before"]) for h in served]
    last = served[-1]
    points.append((last["update"], last["tau_after"], last["rounds_after"]))
    for update, tau, rounds in points:
        if tau is not None and rounds:
            online.append(
                dict(method=cell.method, dataset=cell.dataset, concurrency=cell.concurrency, update=update, tau=tau, rounds=rounds)
            )


def merge_stats(acc, stats):
    """`GenerationStats` of several batches as one (per-round lists concatenated, totals summed)."""
    from ..generation.stats import GenerationStats

    if acc is None:
        acc = GenerationStats(block_size=stats.block_size, policy=stats.policy)
    acc.accepted += list(stats.accepted)
    acc.verify_lengths += list(stats.verify_lengths)
    acc.rows += list(stats.rows)
    acc.fallback_rounds += stats.fallback_rounds
    acc.prefill_forwards += stats.prefill_forwards
    acc.new_tokens += stats.new_tokens
    acc.draft_time_s += stats.draft_time_s
    acc.verify_time_s += stats.verify_time_s
    return acc
