"""The markdown report of ``engine_gpu_check.py``'s JSON results (every section it ran, in run order)."""

from __future__ import annotations

from gpu_common import fmt_phases


def markdown(res: dict) -> str:
    """The report of ``engine_gpu_check.py``'s results: one part per section that ran, then the sections with errors."""
    out = [f"# Engine GPU check ({res['meta']['device']}, {res['meta'].get('gpu', '')})", ""]
    for key in ("a_tiny", "a_ref"):
        if res.get(key):
            out += _equivalence(key, res[key])
    for key, section in (("b_8b", _cost_8b), ("d", _throughput), ("c", _projection)):
        if res.get(key):
            out += section(res[key])
    errs = [k for k, v in res.items() if isinstance(v, dict) and "error" in v]
    out.append(f"sections with errors: {errs or 'none'}; total {res['meta'].get('total_s', 0):.0f}s")
    return "\n".join(out) + "\n"


def _error_block(sec: dict) -> list[str]:
    """A failed section's traceback (its error where none was kept), the last 2000 characters, as a code block."""
    return ["```", sec.get("traceback", sec["error"])[-2000:], "```", ""]


def _equivalence(key: str, sec: dict) -> list[str]:
    """Sections a_tiny and a_ref: graph replay against the eager forward, bucket by bucket and end to end."""
    out = [f"## {key}: graph replay vs eager ({sec.get('model', '')}, {sec.get('dtype', '')})", ""]
    if "error" in sec:
        out += _error_block(sec)
        return out
    out += [f"attention: {sec.get('attention_backend')} {sec.get('attention_note', '')}", "",
            "| bucket (tokens, q) | q_lens | logits rel err | hidden rel err | argmax agree | ok |", "|---|---|---|---|---|---|"]
    for b in sec.get("buckets", []):
        out.append(f"| {tuple(b['bucket'])} | {b['q_lens'][:6]}{'...' if len(b['q_lens']) > 6 else ''} | "
                   f"{b['logits_rel_err']:.1e} | {b['hidden_rel_err']:.1e} | {b['argmax_agree']:.3f} | {b['ok']} |")
    out += ["", "| mode | graph == eager | graph == HF greedy | replays |", "|---|---|---|---|"]
    for m, e in sec.get("engine", {}).items():
        out.append(f"| {m} | {e['graph_equals_eager']}/{e['prompts']} | {e['graph_equals_hf_greedy']}/{e['prompts']} | {e['graph_replays']} |")
    out.append("")
    return out


def _cost_8b(b: dict) -> list[str]:
    """Section b: the 8B shape's bandwidth floor, batch-1 plain decoding and its forward-cost table."""
    out = ["## b: Qwen3-8B shape, random bf16 weights", ""]
    if "error" in b and "table" not in b:
        out += _error_block(b)
    else:
        out.append(f"copy bandwidth {b['copy_bandwidth_TBps']:.2f} TB/s; weights read per token "
                   f"{b['weight_bytes_per_token'] / 1e9:.2f} GB; batch-1 floor {b['floor_ms_per_token']:.2f} ms/token "
                   f"({b['floor_tok_per_s']:.0f} tok/s)")
        for key in ("off_batch1_steps_1", "off_batch1", "off_batch1_steps_16"):
            o = b.get(key, {})
            if "tok_per_s" in o:
                g = o["graph_replay_ms_per_token"]
                out.append(f"\nplain decoding in the engine (off, batch 1, context {o['context']}, decode_steps="
                           f"{o['decode_steps']}): {o['tok_per_s']:.1f} tok/s ({o['ms_per_token']:.2f} ms/token, "
                           f"{100 * o['of_floor']:.0f}% of the floor; graph replay alone {g if g is None else round(g, 2)} ms/token)")
            elif o:
                out += ["", f"{key} failed:", "```", o.get("error", "")[-1500:], "```"]
            if "phases" in o:
                out.append(f"\nper token (profiled, device synced per phase): {fmt_phases(o['phases'])}")
            if o.get("kernel_profile"):
                kp = o["kernel_profile"]
                out += [f"\nkernels of one decode forward (eager, torch.profiler): {kp['kernels']}, {kp['kernel_ms']:.2f} ms; top:", ""]
                out += [f"- {k['us'] / 1e3:.3f} ms x{k['count']} `{k['name']}`" for k in kp["top"]]
        if b.get("row_kernels"):
            out.append(f"\nelementwise kernels: {b.get('elementwise', b.get('store_kernel'))} {b.get('elementwise_note', b.get('store_note', ''))}")
            out.append(f"\none-row kernels chosen at build: {b['row_kernels']}; 2-16 rows: {b.get('block_kernels')} "
                       f"{b.get('row_note', '')}; ms per layer: "
                       + ", ".join(f"{k} " + "/".join(f"{n} {v:.4f}" for n, v in t.items()) for k, t in b.get("row_timings_ms", {}).items()))
        if b.get("off_batch1_modules", {}).get("tok_per_s"):
            out.append(f"\nthe same through the HF modules (fused_kernels=False, decode_steps=1): "
                       f"{b['off_batch1_modules']['tok_per_s']:.1f} tok/s")
        if b.get("slot_rows"):
            out.append("\nbatch-1 decode forward vs cache slots: " + ", ".join(
                f"{r['slots']} slots {r['ms']:.2f} ms" if "ms" in r else f"{r['slots']} slots failed" for r in b["slot_rows"]))
        if "verify_over_decode_batch1" in b:
            out.append(f"\nbatch 1: {b['verify_q']}-token verify forward / 1-token forward = {b['verify_over_decode_batch1']:.2f}")
        out += ["", f"attention: {b.get('attention_backend')} {b.get('attention_note', '')}", "",
                f"ms per forward (CUDA graph), context {b['ctx']}; in brackets SPEC section 6's flex probe:", ""]
        qs = sorted({r["tokens_each"] for r in b["table"]})
        out += ["| requests \\ tokens each | " + " | ".join(map(str, qs)) + " |", "|---" * (len(qs) + 1) + "|"]
        for R in sorted({r["requests"] for r in b["table"]}):
            cells = []
            for q in qs:
                r = next(x for x in b["table"] if x["requests"] == R and x["tokens_each"] == q)
                cells.append(("fail" if "ms" not in r else f"{r['ms']:.1f}") + (f" ({r['spec_flex_ms']})" if r.get("spec_flex_ms") else ""))
            out.append(f"| {R} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def _throughput(d) -> list[str]:
    """Section d: the reference pair's measured throughput by concurrency and mode, and the profiled breakdown."""
    out = ["## d: measured throughput, reference pair, real prompts", ""]
    if isinstance(d, dict) and "error" in d:
        out += _error_block(d)
    else:
        out += ["| concurrency | mode | tok/s (median) | timed runs | tau | mean verify len | steps | capture s |",
                "|---|---|---|---|---|---|---|---|"]
        for r in sorted([r for r in d if "tok_per_s" in r], key=lambda r: (r["concurrency"], r["mode"])):
            runs = " / ".join(f"{x:.0f}" for x in r.get("tok_per_s_runs", []))
            out.append(f"| {r['concurrency']} | {r['mode']} | {r['tok_per_s']:.1f} | {runs} | {r['tau']:.2f} | "
                       f"{r['mean_verify_len']:.2f} | {r['steps']} | {r['capture_s']:.1f} |")
        prof = sorted([r for r in d if "phases" in r], key=lambda r: (r["concurrency"], r["mode"]))
        if prof:
            out += ["", "per-step breakdown (second run with `profile=True`: device synced at phase boundaries):", "",
                    "| concurrency | mode | draft ms | target ms | accept ms | host ms | step ms | reads/step | "
                    "drafts skipped/step | drafter replays/step |", "|---|---|---|---|---|---|---|---|---|---|"]
            for r in prof:
                p = r["phases"]
                out.append(f"| {r['concurrency']} | {r['mode']} | {p.get('draft_ms', 0):.2f} | {p.get('target_ms', 0):.2f} | "
                           f"{p.get('accept_ms', 0):.2f} | {p.get('host_ms', 0):.2f} | {p['step_ms']:.2f} | "
                           f"{p['reads_per_step']:.2f} | {p['drafts_skipped_per_step']:.2f} | "
                           f"{p.get('drafter_replays_per_step', 0):.2f} |")
        for r in d:
            if "error" in r or "skipped" in r:
                out.append(f"\n{r['mode']} c={r['concurrency']}: {r.get('skipped') or r['error'].splitlines()[-1]}")
        out.append("")
    return out


def _projection(c: dict) -> list[str]:
    """Section c: the 8B-scale PROJECTION (labelled as such: not a measurement)."""
    out = ["## c: PROJECTION at 8B scale (not a measurement)", ""]
    if "error" in c:
        out += _error_block(c)
    else:
        out += [c["label"] + ".", "", "| concurrency | mode | tau | verify len | target ms | drafter ms (est) | tok/s | vs off |",
                "|---|---|---|---|---|---|---|---|"]
        for r in c["rows"]:
            sp = "" if r["speedup_vs_off"] is None else f"{r['speedup_vs_off']:.2f}x"
            out.append(f"| {r['concurrency']} | {r['mode']} | {r['tau']:.2f} | {r['mean_verify_len']:.2f} | {r['target_ms']:.1f} | "
                       f"{r['drafter_ms_est']:.1f} | {r['tok_per_s']:.0f} | {sp} |")
        out.append("")
    return out
