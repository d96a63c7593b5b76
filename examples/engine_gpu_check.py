"""GPU check of the continuous-batching engine's CUDA-graph decode path (issue 6): one command, one H200.

Sections, in run order (each in its own try/except: an error is recorded in the JSON, the next
section still runs, and the JSON + markdown are rewritten after every section):

  a_tiny  equivalence on a tiny random Qwen3 (float32): graph replay (fused layers, compiled
          kernels) == the eager forward through the HF modules per bucket (logits allclose) and end to end (greedy outputs of every verify mode identical to the
          eager engine and to HF ``generate``);
  b_8b    Qwen3-8B shape, random bf16 weights built on the GPU: copy bandwidth and the batch-1
          floor (weight bytes / bandwidth), plain decoding in the engine (no drafter) at
          batch 1 and context ~1024 with ``decode_steps`` 1, 8 (the default) and 16, after an untimed
          request of the same length (also through the HF modules, ``fused_kernels=False``), the
          one-row kernels the fused layers chose at build and their timings, a per-token breakdown
          (target graph replay, acceptance read, host bookkeeping; ``Engine(profile=True)``), the
          kernels of one decode forward (torch.profiler), the batch-1 decode forward against the
          cache's slot rows (1 / 16 / 128 slots: attention runs over every slot row), the
          forward-cost table (requests x tokens each, context 1024, ms per graph replay; kernel
          profile of the batch-1 rows) and the 16-token / 1-token verify ratio at batch 1;
  a_ref   the same equivalence checks for the reference pair (``--check-dtype``, float32 default);
  d       measured throughput of off / fixed / packed at each concurrency with the reference pair
          on real prompts: one untimed run of the workload, then the median of 2 (``--quick``) or 3
          timed runs, every run listed (also records the acceptance traces: accepted drafts and verify lengths),
          then a second, profiled run per row: ms per step in the drafter (body + length head + LM
          head + its reads), the target forward, acceptance + its read, host bookkeeping; device
          reads, skipped drafter LM heads and drafter graph buckets per step;
  c       a PROJECTION, not a measurement: the 8B-scale throughput those traces imply under the
          cost table of b (plus an estimated drafter cost), per mode and concurrency.

Writes ``engine_gpu_check.json`` and ``engine_gpu_check.md`` into ``--out``.

Usage:
    python examples/engine_gpu_check.py --out $OUT                 # H200, about 5-7 minutes
    python examples/engine_gpu_check.py --out $OUT --quick         # fewer prompts / tokens / iterations
    python examples/engine_gpu_check.py --smoke --tiny --out /tmp/egc   # CPU, tiny models, ~10 s
    python examples/engine_gpu_check.py --smoke --out /tmp/egc          # CPU, reference pair, ~15 s

On CPU (``--smoke``) ``cuda_graphs=True`` runs the same static, padded bucket forwards eagerly with
SDPA, so every section runs end to end at tiny sizes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import torch

from adaflash_hf.speculation.rounds import mean_tokens_per_round

from engine_gpu_report import markdown  # noqa: E402
from gpu_common import (  # noqa: E402
    T0, Sections, first_diff, fmt_kernels, fmt_phases, free_memory, greedy_refs, kernel_profile, log, phase_breakdown,
    qwen3_8b_shape, reference_pair, sync, time_ms, tiny_pair,
)

SPEC_FLEX_MS = {  # SPEC.md section 6, flex_attention column (gpu_attn_probe.py), for side-by-side reading
    1: {1: 6.0, 2: 6.1, 4: 6.6, 8: 6.8, 16: 7.1},
    16: {1: 7.4, 2: 7.6, 4: 7.8, 8: 8.5, 16: 11.3},
    32: {1: 8.4, 2: 8.6, 4: 9.2, 8: 11.5, 16: 18.8},
    64: {1: 9.2, 2: 9.9, 4: 11.9, 8: 18.4, 16: 33.6},
    128: {1: 12.3, 2: 14.3, 4: 20.4, 8: 34.3, 16: 66.7},
}


# ----------------------------------------------------------------------------- a: equivalence
def equivalence(target, drafter, prompts, *, slots: int, max_len: int, budget: int, max_new: int, tol: float):
    """Per bucket: graph replay (fused layers, compiled kernels) logits / features vs the eager packed
    forward through the HF modules on the same cache. End to end: every verify mode, graphs on vs off
    vs HF greedy ``generate``."""
    from adaflash_hf.engine import Engine, layout_args
    from adaflash_hf.engine.graphs import DecodeGraphs
    from adaflash_hf.engine.kernels.fused import FusedTarget
    from adaflash_hf.engine.target import PackedLayout, make_target_cache, target_forward
    from adaflash_hf.engine.kernels.attention import BLOCK

    device = next(target.parameters()).device
    B = drafter.config.block_size
    layers = list(drafter.config.target_layer_ids)
    report = {"tolerance_rel": tol, "buckets": [], "engine": {}}

    cache = make_target_cache(target, slots, max_len, spare_slots=1, len_multiple=BLOCK)
    fused, report["fusion_note"] = FusedTarget.build(target)
    graphs = DecodeGraphs(target, cache, layers, max_tokens=min(budget, slots * B), max_q=B, fused=fused)
    R = min(slots, 8, len(prompts))
    pre = [p[:48] for p in prompts[:R]]
    used = [cache.alloc() for _ in pre]
    lay = PackedLayout.from_cache(cache, used, [len(p) for p in pre])
    target_forward(target, cache, torch.tensor(sum(pre, []), device=device), lay.token_slots(device),
                   lay.positions(device), lay)
    for s, p in zip(used, pre):
        cache.advance(s, len(p))
    g = torch.Generator().manual_seed(1)
    patterns = [[1], [B], [1] * R, [B] * R, [1, B // 2 + 1, 3][: R], torch.randint(1, B + 1, (R,), generator=g).tolist(),
                [2] * R]
    vocab = target.get_input_embeddings().weight.shape[0]
    for q_lens in patterns:
        lay = PackedLayout.from_cache(cache, used[: len(q_lens)], q_lens)
        toks = torch.randint(0, vocab, (lay.num_tokens,), generator=g)
        ref_logits, ref_hidden = target_forward(target, cache, toks.to(device), lay.token_slots(device),
                                                lay.positions(device), lay, layers)
        logits, hidden = graphs.run(toks.tolist(), lay)
        rel = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        hrel = ((hidden.float() - ref_hidden.float()).norm() / ref_hidden.float().norm()).item()
        row = {"q_lens": q_lens, "bucket": list(graphs.bucket(lay.num_tokens, max(q_lens))), "tokens": lay.num_tokens,
               "logits_rel_err": rel, "logits_max_abs": (logits - ref_logits).abs().max().item(),
               "hidden_rel_err": hrel, "argmax_agree": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()}
        row["ok"] = rel < tol and hrel < tol
        report["buckets"].append(row)
        log(f"  bucket {row['bucket']} q_lens={q_lens[:8]}{'...' if len(q_lens) > 8 else ''} rel_err {rel:.2e} "
            f"hidden {hrel:.2e} argmax {row['argmax_agree']:.3f} {'ok' if row['ok'] else 'FAIL'}")
    report["attention_backend"] = graphs.attention.backend
    report["attention_note"] = graphs.attention_note
    del graphs, cache
    free_memory()

    check = prompts[: min(8, len(prompts))]
    refs = greedy_refs(target, check, max_new)
    for mode in ("off", "fixed", "packed", "rectangular"):
        outs = {}
        for graphs_on in (True, False):
            eng = Engine(target, **layout_args(drafter, mode), max_slots=slots, max_len=max_len,
                         token_budget=budget, cuda_graphs=graphs_on)
            outs[graphs_on] = [o.token_ids for o in eng.generate(check, max_new_tokens=max_new)]
            if graphs_on:
                replays = sum(eng.graphs.replays.values())
        g_vs_e = [i for i, (a, b) in enumerate(zip(outs[True], outs[False])) if a != b]
        g_vs_hf = [{"prompt": i, "first_diff": first_diff(a, r)} for i, (a, r) in enumerate(zip(outs[True], refs)) if a != r]
        report["engine"][mode] = {"prompts": len(check), "graph_equals_eager": len(check) - len(g_vs_e),
                                  "graph_equals_hf_greedy": len(check) - len(g_vs_hf), "mismatch_vs_hf": g_vs_hf,
                                  "graph_replays": replays}
        log(f"  engine {mode:12s} graph==eager {len(check) - len(g_vs_e)}/{len(check)}  "
            f"graph==HF greedy {len(check) - len(g_vs_hf)}/{len(check)}  ({replays} replays)")
    report["ok"] = all(r["ok"] for r in report["buckets"]) and all(
        e["graph_equals_eager"] == e["prompts"] for e in report["engine"].values())
    return report


# ----------------------------------------------------------------------------- b: 8B-shape cost
def cost_8b(device, smoke: bool, quick: bool):
    from adaflash_hf.engine.kernels.fused import FusedTarget

    rep = {}
    ctx = 64 if smoke else 1024
    iters = 3 if (smoke or quick) else 6
    log("b: building the 8B-shaped model")
    t = time.perf_counter()
    model = qwen3_8b_shape(device, smoke)
    sync(device)
    build_s = time.perf_counter() - t
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    weight_bytes = params - embed.numel() * embed.element_size()  # the embedding is looked up, not read
    rep.update(ctx=ctx, param_bytes=params, weight_bytes_per_token=weight_bytes, build_s=build_s,
               param_dtype=str(embed.dtype))
    rep.update(bandwidth_floor(device, smoke, weight_bytes))
    new = 16 if smoke else (48 if quick else 96)
    decode = batch1_decode(device, ctx, new, embed.shape[0])
    plain_decode_8b(rep, model, device, ctx, new, iters, decode)
    fused, _ = FusedTarget.build(model)
    rep["slot_rows"] = [slot_rows_cost(model, fused, device, ctx, S, iters) for S in ([1, 4] if smoke else [1, 16, 128])]
    rep.update(forward_cost_table(model, fused, device, smoke, ctx, iters))
    del model
    free_memory()
    return rep


def bandwidth_floor(device, smoke: bool, weight_bytes: int) -> dict:
    """The device's copy bandwidth (read + write, 2 GiB of bf16) and the batch-1 floor it sets: weight bytes over it."""
    n = (1 << 22) if smoke else (1 << 30)  # elements (bf16): 2 GiB
    src, dst = torch.empty(n, dtype=torch.bfloat16, device=device), torch.empty(n, dtype=torch.bfloat16, device=device)
    ms = time_ms(lambda: dst.copy_(src), device, iters=5)
    out = {"copy_bandwidth_TBps": 2 * n * 2 / (ms * 1e-3) / 1e12}
    out["floor_ms_per_token"] = weight_bytes / (out["copy_bandwidth_TBps"] * 1e12) * 1e3
    out["floor_tok_per_s"] = 1e3 / out["floor_ms_per_token"]
    del src, dst
    log(f"b: copy bandwidth {out['copy_bandwidth_TBps']:.2f} TB/s, weights {weight_bytes / 1e9:.2f} GB, "
        f"batch-1 floor {out['floor_ms_per_token']:.2f} ms/token ({out['floor_tok_per_s']:.0f} tok/s)")
    return out


def batch1_decode(device, ctx: int, new: int, vocab: int):
    """``decode(eng, seed)``: batch-1 plain decoding of ``new`` tokens after a ~ctx-token prompt, (tokens timed,
    seconds). A first request of the same length captures every decode bucket it meets (untimed); the second is
    timed."""
    def decode(eng, seed):
        for s in (seed + 1000, seed):
            h = eng.submit(torch.randint(0, vocab, (ctx - 8,), generator=torch.Generator().manual_seed(s)).tolist(), new)
            eng.step()  # prefill (eager) + first token
            sync(device)
            t, done0 = time.perf_counter(), len(h.token_ids)
            while not h.done:
                eng.step()
            sync(device)
        return len(h.token_ids) - done0, time.perf_counter() - t

    return decode


def plain_decode_8b(rep: dict, model, device, ctx: int, new: int, iters: int, decode) -> None:
    """Plain decoding in the engine at batch 1, context ~ctx: through the HF modules (one step per replay: the old
    path), then the fused layers with 1, 8 (the default) and 16 greedy steps per replay; into ``rep``."""
    from adaflash_hf.engine import Engine

    try:
        eng = Engine(model, None, max_slots=1, max_len=ctx + new + 8, token_budget=ctx + 8,
                     cuda_graphs=True, fused_kernels=False, decode_steps=1)
        steps, dt = decode(eng, 0)
        rep["off_batch1_modules"] = {"tok_per_s": steps / dt, "steps_timed": steps}
        log(f"b: off, batch 1, HF modules (fused_kernels=False, decode_steps=1): {steps / dt:.1f} tok/s")
        del eng
        free_memory()
    except Exception:  # noqa: BLE001
        rep["off_batch1_modules"] = {"error": traceback.format_exc()}
        log("b: off batch-1 (modules) FAILED\n" + rep["off_batch1_modules"]["error"])
    for k in (1, 8, 16):
        key = "off_batch1" if k == 8 else f"off_batch1_steps_{k}"
        try:
            t = time.perf_counter()
            eng = Engine(model, None, max_slots=1, max_len=ctx + new + 8, token_budget=ctx + 8,
                         cuda_graphs=True, decode_steps=k)
            rep["fuse_s"], rep["fusion_note"] = time.perf_counter() - t, eng.fusion_note
            _record_fusion(rep, eng)
            rep[key] = _decode_steps_row(rep, eng, model, device, ctx, new, iters, k, decode)
            del eng
            free_memory()
        except Exception:  # noqa: BLE001
            rep[key] = {"error": traceback.format_exc()}
            log(f"b: off batch-1 decode_steps={k} FAILED\n" + rep[key]["error"])


def _record_fusion(rep: dict, eng) -> None:
    """The kernels the fused layers chose at build and their timings, into ``rep``, and logged."""
    if eng.fused is not None:
        rep.update(row_kernels=eng.fused.row_kernels, block_kernels=eng.fused.block_kernels,
                   triton_tiles={f"{r} x{n}": list(t) for (r, n), t in eng.fused.triton_configs.items()},
                   row_timings_ms=eng.fused.row_timings, row_note=eng.fused.row_note,
                   elementwise=eng.fused.elementwise, elementwise_note=eng.fused.elementwise_note)
    log(f"b: engine built in {rep['fuse_s']:.1f}s, fused layers: {eng.fused is not None} {eng.fusion_note}; "
        f"one-row kernels {rep.get('row_kernels')}, 16-row kernels {rep.get('block_kernels')}, Triton tiles "
        f"{rep.get('triton_tiles')} {rep.get('row_note', '')}; elementwise kernels: {rep.get('elementwise')} "
        f"{rep.get('elementwise_note', '')}; ms per layer {rep.get('row_timings_ms')}")


def _decode_steps_row(rep: dict, eng, model, device, ctx: int, new: int, iters: int, k: int, decode) -> dict:
    """One ``decode_steps=k`` engine's batch-1 row: tok/s, the graph replay alone, and (profiled) where a step's time
    goes; at k=8 the kernels of one decode forward."""
    steps, dt = decode(eng, 0)
    bucket = max(eng.graphs.replays, key=eng.graphs.replays.get)  # the most replayed decode bucket

    def replay_steps(g=eng.graphs, graph=eng.graphs.graphs.get(bucket), state=eng.graphs._input_state()):
        g._restore_inputs(state)  # a greedy step graph advances its own inputs (run_greedy's prepare resets them)
        g.step_index.zero_()
        for _ in range(k):
            graph.replay()

    replay_ms = time_ms(replay_steps, device, iters) / k if eng.graphs.use_graphs else None
    r = {"fused": eng.fused is not None, "decode_steps": k, "tok_per_s": steps / dt,
         "ms_per_token": 1e3 * dt / steps, "graph_replay_ms_per_token": replay_ms, "steps_timed": steps,
         "context": ctx, "of_floor": (steps / dt) / rep["floor_tok_per_s"]}
    log(f"b: off, batch 1, decode_steps={k}: {steps / dt:.1f} tok/s ({1e3 * dt / steps:.2f} ms/token; graph alone "
        f"{replay_ms if replay_ms is None else round(replay_ms, 2)} ms/token; floor {rep['floor_ms_per_token']:.2f} ms)")
    try:  # the same decode with profile=True: where a step's time goes
        vocab = model.get_input_embeddings().weight.shape[0]
        h2 = eng.submit(torch.randint(0, vocab, (ctx - 8,), generator=torch.Generator().manual_seed(1)).tolist(), new)
        eng.step()  # prefill
        r["phases"] = ph = phase_breakdown(eng, lambda: h2.result())
        log(f"b: off, batch 1, decode_steps={k}, per token: {fmt_phases(ph)}")
        if k == 8:
            kp = r["kernel_profile"] = kernel_profile(lambda: eng.graphs._forward(*bucket[:3]), device)
            if kp:
                log(f"b: off decode forward (eager, flex), {kp['kernels'] / len(model.model.layers):.0f} kernels per layer: "
                    + fmt_kernels(kp, 10))
    except Exception:  # noqa: BLE001
        r["phases_error"] = traceback.format_exc()
        log("b: off batch-1 breakdown FAILED\n" + r["phases_error"])
    return r


def slot_rows_cost(model, fused, device, ctx: int, S: int, iters: int) -> dict:
    """Batch-1 decode forward with ``S`` cache slot rows (attention and its query scatter run over every slot row, used
    or not): the cost of a large max_slots at low load."""
    from adaflash_hf.engine.graphs import DecodeGraphs
    from adaflash_hf.engine.kernels.attention import BLOCK
    from adaflash_hf.engine.target import PackedLayout, make_target_cache

    row = {"slots": S}
    try:
        c1 = make_target_cache(model, S, ctx + 8, spare_slots=1, len_multiple=BLOCK)
        g1 = DecodeGraphs(model, c1, None, max_tokens=1, max_q=1, fused=fused)
        s1 = c1.alloc()
        c1.advance(s1, ctx)
        b1 = g1.prepare([1], PackedLayout.from_cache(c1, [s1], [1]))
        g1.replay(b1)
        sync(device)
        row["ms"] = time_ms((lambda: g1.graphs[b1].replay()) if g1.use_graphs else (lambda: g1.replay(b1)), device, iters)
        log(f"b: batch-1 decode forward with {S:4d} slots: {row['ms']:.2f} ms")
        del g1, c1
        free_memory()
    except Exception:  # noqa: BLE001
        row["error"] = traceback.format_exc()
        log(f"b: slot rows {S} FAILED\n{row['error']}")
    return row


def forward_cost_table(model, fused, device, smoke: bool, ctx: int, iters: int) -> dict:
    """The forward-cost table through one DecodeGraphs, slots filled to ctx (values do not matter for timing): ms per
    graph replay by requests x tokens each, kernel profiles of the batch-1 rows, and the 16-token / 1-token verify
    ratio at batch 1."""
    from adaflash_hf.engine.graphs import DecodeGraphs
    from adaflash_hf.engine.kernels.attention import BLOCK
    from adaflash_hf.engine.target import PackedLayout, make_target_cache

    requests = [1, 2, 4] if smoke else [1, 16, 32, 64, 128]
    tokens_each = [1, 2, 4] if smoke else [1, 2, 4, 8, 16]
    vocab = model.get_input_embeddings().weight.shape[0]
    slots = max(requests)
    cache = make_target_cache(model, slots, ctx + max(tokens_each), spare_slots=1, len_multiple=BLOCK)
    graphs = DecodeGraphs(model, cache, None, max_tokens=slots * max(tokens_each), max_q=max(tokens_each), fused=fused)
    used = [cache.alloc() for _ in range(slots)]
    for s in used:
        cache.advance(s, ctx)
    table, g = [], torch.Generator().manual_seed(1)
    for R in requests:
        for q in tokens_each:
            row = {"requests": R, "tokens_each": q}
            try:
                lay = PackedLayout.from_cache(cache, used[:R], [q] * R)
                bucket = graphs.prepare(torch.randint(0, vocab, (R * q,), generator=g).tolist(), lay)
                t = time.perf_counter()
                graphs.replay(bucket)  # first use: captures (and compiles flex for a new q bucket)
                sync(device)
                row["first_call_s"] = time.perf_counter() - t
                fn = (lambda: graphs.graphs[bucket].replay()) if graphs.use_graphs else (lambda: graphs.replay(bucket))
                row["ms"] = time_ms(fn, device, iters)
                row["us_per_token"] = 1e3 * row["ms"] / (R * q)
                row["spec_flex_ms"] = SPEC_FLEX_MS.get(R, {}).get(q)
                if R == 1 and q in (1, max(tokens_each)):  # where the time goes, kernel by kernel
                    row["kernel_profile"] = kernel_profile(lambda: graphs._forward(*bucket), device)
                    if row["kernel_profile"]:
                        log(f"b: R=1 q={q} eager forward: {fmt_kernels(row['kernel_profile'])}")
                log(f"b: R={R:4d} q={q:3d} {row['ms']:7.2f} ms  (SPEC flex {row['spec_flex_ms']})  "
                    f"first call {row['first_call_s']:.1f}s")
            except Exception:  # noqa: BLE001
                row["error"] = traceback.format_exc()
                log(f"b: R={R} q={q} FAILED\n{row['error']}")
            table.append(row)
    out = {"table": table, "attention_backend": graphs.attention.backend, "attention_note": graphs.attention_note,
           "capture_s_total": graphs.capture_seconds}
    cost = {(r["requests"], r["tokens_each"]): r["ms"] for r in table if "ms" in r}
    if (1, max(tokens_each)) in cost and (1, 1) in cost:
        out["verify_q"] = max(tokens_each)
        out["verify_over_decode_batch1"] = cost[(1, max(tokens_each))] / cost[(1, 1)]
        log(f"b: batch 1, {max(tokens_each)}-token verify / 1-token forward = {out['verify_over_decode_batch1']:.2f}")
    del graphs, cache
    free_memory()
    return out


# ----------------------------------------------------------------------------- d: measured throughput
def throughput(target, drafter, prompts, eos, *, concurrency, modes, max_new, max_len, budget, deadline, reps=3):
    """One engine per mode (max_slots = largest concurrency, graphs captured once and reused);
    per concurrency c: c prompts, one untimed run of the same workload, then ``reps`` timed runs (the
    median tok/s is reported, every run kept). Capture time is reported and subtracted. Each row
    carries the acceptance trace summary the projection uses."""
    from adaflash_hf.engine import Engine, layout_args

    device = next(target.parameters()).device
    rows = []
    for mode in modes:
        eng = Engine(target, **layout_args(drafter, mode), max_slots=max(concurrency),
                     max_len=max_len, token_budget=budget, cuda_graphs=True)
        for c in concurrency:
            if time.perf_counter() > deadline:
                rows.append({"mode": mode, "concurrency": c, "skipped": "time budget"})
                log(f"d: {mode} c={c} skipped (time budget)")
                continue
            row = {"mode": mode, "concurrency": c}
            try:
                batch = [prompts[i % len(prompts)] for i in range(c)]
                # Warm-up: the timed workload itself, so every graph bucket and compiled shape it meets exists.
                # Timed windows are short (tenths of a second) and host-bound on this small pair: the median
                # of `reps` runs, with the spread, is what the table reports.
                eng.generate(batch, max_new_tokens=max_new, eos_token_id=eos)
                dgr = getattr(eng, "draft_graphs", None)
                rates, caps = [], []
                for _ in range(reps):
                    cap0 = (eng.graphs.capture_seconds if eng.graphs is not None else 0.0) + (dgr.capture_seconds if dgr is not None else 0.0)
                    fwd0, steps0 = len(eng.forward_tokens), eng.num_steps
                    sync(device)
                    t = time.perf_counter()
                    outs = eng.generate(batch, max_new_tokens=max_new, eos_token_id=eos)
                    sync(device)
                    wall = time.perf_counter() - t
                    caps.append((eng.graphs.capture_seconds if eng.graphs is not None else 0.0)
                                + (dgr.capture_seconds if dgr is not None else 0.0) - cap0)
                    rates.append(sum(len(o.token_ids) for o in outs) / max(wall - caps[-1], 1e-9))
                cap = sum(caps)
                toks = sum(len(o.token_ids) for o in outs)
                acc = [a for o in outs for a in o.accepted]
                vl = [v for o in outs for v in o.verify_lengths]
                fwd = eng.forward_tokens[fwd0:]
                row.update(tokens=toks, wall_s=wall, capture_s=cap, tok_per_s=statistics.median(rates),
                           tok_per_s_runs=rates, steps=eng.num_steps - steps0,
                           mean_forward_tokens=sum(fwd) / max(1, len(fwd)), rounds=len(acc),
                           tau=mean_tokens_per_round(acc), mean_verify_len=sum(vl) / max(1, len(vl)),
                           verify_len_hist={str(k): vl.count(k) for k in sorted(set(vl))},
                           accepted_hist={str(k): acc.count(k) for k in sorted(set(acc))})
                log(f"d: {mode:7s} c={c:4d} {row['tok_per_s']:9.1f} tok/s (runs {min(rates):.0f}-{max(rates):.0f})  tau {row['tau']:.2f}  verify len "
                    f"{row['mean_verify_len']:.2f}  steps {row['steps']}  capture {cap:.1f}s")
                dg = getattr(eng, "draft_graphs", None)
                d_replays0 = sum(dg.replays.values()) if dg is not None else 0
                # The timed workload again (warmed up: no capture or compile inside the profile).
                ph = phase_breakdown(eng, lambda: eng.generate(batch, max_new_tokens=max_new, eos_token_id=eos))
                if dg is not None:
                    ph["drafter_replays_per_step"] = (sum(dg.replays.values()) - d_replays0) / max(1, ph["steps"])
                    ph["drafter_buckets"] = len(dg.graphs) if dg.use_graphs else len(dg.replays)
                    ph["drafter_capture_s"] = dg.capture_seconds
                row["phases"] = ph
                log(f"d: {mode:7s} c={c:4d} per step (profiled): {fmt_phases(ph)}; device reads {ph['reads_per_step']:.2f}, "
                    f"drafts skipped {ph['drafts_skipped_per_step']:.2f} per step")
            except Exception:  # noqa: BLE001
                row["error"] = traceback.format_exc()
                log(f"d: {mode} c={c} FAILED\n{row['error']}")
            rows.append(row)
        if eng.graphs is not None:
            dg = getattr(eng, "draft_graphs", None)
            rows.append({"mode": mode, "graph_buckets": len(eng.graphs.graphs), "attention_backend": eng.graphs.attention.backend,
                         "attention_note": eng.graphs.attention_note, "padded_tokens": eng.graphs.padded_tokens,
                         "drafter_graph_buckets": len(dg.graphs) if dg is not None else 0,
                         "drafter_attention_backend": dg.attention.backend if dg is not None else None,
                         "drafter_attention_note": dg.attention_note if dg is not None else "",
                         "drafter_padded_tokens": dg.padded_tokens if dg is not None else 0})
        del eng
        free_memory()
    return rows


# ----------------------------------------------------------------------------- c: projection
def interp_cost(table_ms: dict, R: float, q: float) -> float:
    """Bilinear interpolation of the measured cost table in (requests, tokens each), clamped to its range."""
    rs, qs = sorted({r for r, _ in table_ms}), sorted({t for _, t in table_ms})

    def bracket(xs, x):
        x = min(max(x, xs[0]), xs[-1])
        hi = next(i for i, v in enumerate(xs) if v >= x)
        lo = max(hi - 1, 0)
        w = 0.0 if xs[hi] == xs[lo] else (x - xs[lo]) / (xs[hi] - xs[lo])
        return xs[lo], xs[hi], w

    r0, r1, wr = bracket(rs, R)
    q0, q1, wq = bracket(qs, q)
    at = lambda r, t: table_ms[(r, t)]  # noqa: E731
    return ((1 - wr) * ((1 - wq) * at(r0, q0) + wq * at(r0, q1)) + wr * ((1 - wq) * at(r1, q0) + wq * at(r1, q1)))


def projection(cost_rep: dict, measured: list, drafter_layers: int, target_layers: int):
    """Steady state at concurrency c: one round costs the target forward of c requests at the mode's mean
    verify length (interpolated in the cost table) plus, for speculative modes, an estimated drafter
    forward ((drafter_layers / target_layers) of a c x 16-token target forward); it commits c * tau tokens."""
    table_ms = {(r["requests"], r["tokens_each"]): r["ms"] for r in cost_rep["table"] if "ms" in r}
    if not table_ms:
        raise RuntimeError("no cost table from section b")
    qmax = max(t for _, t in table_ms)
    traces = {(r["mode"], r["concurrency"]): r for r in measured if "tau" in r}
    rows = []
    for (mode, c), tr in sorted(traces.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        vlen = 1.0 if mode == "off" else tr["mean_verify_len"]
        tau = 1.0 if mode == "off" else tr["tau"]
        target_ms = interp_cost(table_ms, c, vlen)
        draft_ms = 0.0 if mode == "off" else drafter_layers / target_layers * interp_cost(table_ms, c, qmax)
        rows.append({"mode": mode, "concurrency": c, "tau": tau, "mean_verify_len": vlen, "target_ms": target_ms,
                     "drafter_ms_est": draft_ms, "tok_per_s": c * tau / ((target_ms + draft_ms) * 1e-3),
                     "tok_per_s_target_only": c * tau / (target_ms * 1e-3)})
    off = {r["concurrency"]: r["tok_per_s"] for r in rows if r["mode"] == "off"}
    for r in rows:
        r["speedup_vs_off"] = r["tok_per_s"] / off[r["concurrency"]] if r["concurrency"] in off else None
    return {"label": "PROJECTION (model, not a measurement): reference-pair acceptance traces x measured 8B-shape "
                     "forward costs; drafter cost estimated as a fraction of a target forward",
            "drafter_layers": drafter_layers, "target_layers": target_layers, "rows": rows}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="engine_gpu_check_out", help="output directory (JSON + markdown)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, every section")
    ap.add_argument("--tiny", action="store_true", help="with --smoke: tiny random pair instead of the reference pair")
    ap.add_argument("--quick", action="store_true", help="fewer prompts, tokens and timing iterations")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="section d")
    ap.add_argument("--check-dtype", default="float32", choices=["bfloat16", "float16", "float32"], help="section a_ref")
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--concurrency", default="1,32,64,128")
    ap.add_argument("--modes", default="off,fixed,packed")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=400.0, help="skip what would start after this many seconds")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip (a_tiny,b_8b,a_ref,d,c)")
    return ap.parse_args(argv)


class Check:
    """The sections (module doc) under ``args``, run through :class:`gpu_common.Sections` (each in its own try/except,
    the JSON and the markdown rewritten after every one of them into ``args.out``)."""

    def __init__(self, args: argparse.Namespace):
        self.args, smoke = args, args.smoke
        self.device = args.device or ("cpu" if smoke else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch.float32 if smoke else getattr(torch, args.dtype)
        self.check_dtype = torch.float32 if smoke else getattr(torch, args.check_dtype)
        self.concurrency = [1, 2, 4] if smoke else [int(c) for c in args.concurrency.split(",")]
        self.max_new = args.max_new_tokens or (8 if smoke else (48 if args.quick else 96))
        self.deadline = T0 + args.budget_s
        meta = {"device": self.device, "smoke": smoke, "quick": args.quick, "dtype": str(self.dtype),
                "gpu": torch.cuda.get_device_name() if self.device.startswith("cuda") else "",
                "torch": torch.__version__, "check_dtype": str(self.check_dtype),
                "concurrency": self.concurrency, "max_new_tokens": self.max_new}
        self.sections = Sections(args.out, "engine_gpu_check", markdown, meta, filter(None, args.skip.split(",")),
                                 args.budget_s)
        self.res = self.sections.results

    def pair(self, dt, n):
        if self.args.smoke and self.args.tiny:
            target, drafter, prompts, eos = tiny_pair(self.device, dt, hidden=64, head_dim=16)
            return target, drafter, prompts, eos, "tiny random pair (--tiny)"
        return reference_pair(self.device, dt, self.args.dataset, n)

    def a_tiny(self):
        # head_dim 32: flex's Triton kernels need head_dim >= 16 (the CPU tests' models use 8 and SDPA)
        target, drafter, prompts, _ = tiny_pair(self.device, torch.float32, hidden=128, head_dim=32)
        rep = equivalence(target, drafter, prompts, slots=max(self.concurrency), max_len=256, budget=1024, max_new=24,
                          tol=1e-3)
        return {"model": "tiny random Qwen3 (3 layers, hidden 128)", "dtype": "float32", **rep}

    def a_ref(self):
        target, drafter, prompts, _, source = self.pair(self.check_dtype, 8)
        tol = 1e-3 if self.check_dtype == torch.float32 else 3e-2
        smoke = self.args.smoke
        rep = equivalence(target, drafter, prompts, slots=max(self.concurrency), max_len=1024 if not smoke else 512,
                          budget=4096, max_new=32 if not smoke else 8, tol=tol)
        return {"model": "reference pair" if "tiny" not in source else source, "prompts": source,
                "dtype": str(self.check_dtype), **rep}

    def d(self):
        smoke, quick = self.args.smoke, self.args.quick
        target, drafter, prompts, eos, source = self.pair(self.dtype, 4 if smoke else (64 if quick else 128))
        self.res["meta"]["prompts_d"] = source
        longest = max(len(p) for p in prompts)
        budget = max(4096, longest + max(self.concurrency) * drafter.config.block_size)
        return throughput(target, drafter, prompts, eos, concurrency=self.concurrency, modes=self.args.modes.split(","),
                          max_new=self.max_new, max_len=longest + self.max_new + 8, budget=budget,
                          deadline=self.deadline + 60, reps=2 if (smoke or quick) else 3)

    def c(self):
        if "table" not in self.res.get("b_8b", {}):
            raise RuntimeError("section b_8b has no cost table")
        if not isinstance(self.res.get("d"), list):
            raise RuntimeError("section d recorded no traces")
        # The 8B target's DFlash drafter has 5 layers of the target's shape (SPEC section 6).
        return projection(self.res["b_8b"], self.res["d"], drafter_layers=5, target_layers=36)


def main(argv=None):
    run = Check(parse_args(argv))
    section = run.sections.section
    section("a_tiny", run.a_tiny)
    section("b_8b", lambda: cost_8b(run.device, run.args.smoke, run.args.quick))
    section("a_ref", run.a_ref)
    section("d", run.d)
    section("c", run.c)
    res = run.res
    errs = [k for k, v in res.items() if isinstance(v, dict) and "error" in v]
    bad = [k for k in ("a_tiny", "a_ref") if isinstance(res.get(k), dict) and res[k].get("ok") is False]
    exact = all(e["graph_equals_hf_greedy"] == e["prompts"] for k in ("a_tiny", "a_ref")
                for e in res.get(k, {}).get("engine", {}).values())
    log(f"done: errors in {errs or 'no section'}; equivalence failures in {bad or 'none'}; wrote {run.args.out}")
    print("correctness:", "all exact" if exact and not bad and not errs else "MISMATCHES or errors (see the report)")
    return 1 if errs or bad else 0


if __name__ == "__main__":
    sys.exit(main())
