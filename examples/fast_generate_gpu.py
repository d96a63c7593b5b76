"""GPU record for issue 17: ``generate(assistant_model=drafter)`` on the engine's fast path, at the Qwen3-8B shape.

One command, one H200 (random bf16 weights, 5-layer drafter from ``from_target``, block 16, 512-token
prompt, 128 new tokens). Sections, in order; each is timed against ``--budget-s`` (what would start
after it is skipped) and its error, if any, is recorded and the next one still runs:

  start     build time of the first process (a fresh kernel-tuning cache): first ``generate`` call up to its
            first token (engine build, kernel tuning, compiles), then ``fast_path.warmup``; then a SECOND
            PROCESS (this script with ``--child``) that loads the models and times to its first token
            (kernel choices from the disk cache; Inductor's and Triton's own caches warm);
  identity  tiny float32 Qwen3: our generate on the engine == the eager loop == plain greedy (batch 1 and a
            padded batch of 3); at the 8B shape in bf16 the same three, with the first differing token if any
            (bf16 kernels may round differently, random weights make near-ties likely);
  methods   ms per round and tok/s at tau 1 (random weights accept almost nothing) and projected at the
            published tau 6.4 (1000 * 6.4 / ms per round) for: plain eager ``generate``, static-cache compiled
            ``generate``, transformers' native DFlash, our ``generate`` through the engine (batch 1 and 8) and
            through the eager loop (batch 1), ``speculative_generate`` batch 32, and the engine ``off`` /
            ``fixed`` / ``packed`` at concurrency 1. A round's time is (run - prefill-only run) / rounds;
  profile   the engine's ``fixed`` round by phase, and one drafter step alone (graphs; eager, with its kernels).

Writes ``fast_generate_gpu.json`` and ``fast_generate_gpu.md`` into ``--out`` (default ``$OUT``).

Usage:
    python examples/fast_generate_gpu.py --out $OUT              # H200, about 5-7 minutes
    python examples/fast_generate_gpu.py --out $OUT --skip start,identity   # the methods alone
    python examples/fast_generate_gpu.py --smoke --out /tmp/fgg  # CPU, tiny sizes, every section
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
from transformers.generation.stopping_criteria import StoppingCriteria

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import free_memory, log, qwen3_8b_shape, sync, tiny_pair  # noqa: E402

PUBLISHED_TAU = 6.4


def build(device, smoke: bool):
    """The 8B-shaped target and a 5-layer drafter (block 16), both built on the device."""
    from adaflash_hf import AdaFlashDrafter

    target = qwen3_8b_shape(device, smoke)
    vocab = target.get_input_embeddings().weight.shape[0]
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            torch.manual_seed(1)
            drafter = AdaFlashDrafter.from_target(target, num_layers=1 if smoke else 5, block_size=16,
                                                  mask_token_id=vocab - 1).eval()
    finally:
        torch.set_default_dtype(old)
    return target, drafter


def prompt_ids(vocab: int, batch: int, length: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 2, (batch, length), generator=g).to(device)


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t


def record_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, sorted({f"{w.category.__name__}: {w.message}" for w in caught
                        if issubclass(w.category, RuntimeWarning) or "fast" in str(w.message)})


# ----------------------------------------------------------------------------- start-up
def child_main(args) -> None:
    """A second process: load the models, time to the first generated token (the disk caches are warm)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target, drafter = build(device, args.smoke)
    ids = prompt_ids(target.config.vocab_size, 1, args.prompt_len, device)
    sync(device)
    first = lambda: target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=1,  # noqa: E731
                                    length_policy="fixed", fast_path=True)
    prof = None
    if args.cprofile:  # where a second process's start goes (slower under the profiler: not the timed figure)
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
    _, ttft = timed(first, device)
    out = {"ttft_s": ttft, "cprofile": bool(prof)}
    if prof is not None:
        prof.disable()
        text = __import__("io").StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(r"adaflash_hf|_dynamo/eval_frame|_inductor/(codecache|compile_fx)|triton/runtime", 45)
        out["cprofile_top"] = text.getvalue().splitlines()[-60:]
    else:
        from torch._dynamo.utils import compile_times
        out["compile_times"] = compile_times(repr="str", aggregate=True)[-4000:]
        out["warmup_s"] = __import__("adaflash_hf.generation.fast_path", fromlist=["warmup"]).warmup(
            target, drafter, 1, args.prompt_len, args.max_new, length_policy="fixed")
    print("CHILD_RESULT " + json.dumps(out), flush=True)


def start_up(res, target, drafter, device, args):
    from adaflash_hf.generation import fast_path

    ids = prompt_ids(target.config.vocab_size, 1, args.prompt_len, device)
    (_, ttft), notes = record_warnings(lambda: timed(lambda: target.generate(
        ids, assistant_model=drafter, do_sample=False, max_new_tokens=1, length_policy="fixed", fast_path=True), device))
    warm = fast_path.warmup(target, drafter, 1, args.prompt_len, args.max_new, length_policy="fixed")
    (cached,) = [c for c in fast_path._ENGINES.values()]
    eng = cached.engine
    res["first_process"] = {"ttft_s": ttft, "warmup_s": warm, "warnings": notes, "fusion_note": eng.fusion_note,
                            "row_kernels": getattr(eng.fused, "row_kernels", None),
                            "block_kernels": getattr(eng.fused, "block_kernels", None),
                            "elementwise": getattr(eng.fused, "elementwise", None),
                            "elementwise_note": getattr(eng.fused, "elementwise_note", None)}
    log(f"start: first process: first token after {ttft:.1f}s (engine build, tuning, compiles), warmup {warm:.1f}s; "
        f"fusion note {eng.fusion_note!r}; warnings {notes}")
    cmd = [sys.executable, __file__, "--child", "--prompt-len", str(args.prompt_len), "--max-new", str(args.max_new)]
    cmd += ["--smoke"] if args.smoke else []
    cmd += ["--device", args.device] if args.device else []
    t = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout, env=dict(os.environ))
    line = next((x for x in run.stdout.splitlines() if x.startswith("CHILD_RESULT ")), None)
    if line is None:
        raise RuntimeError(f"child failed (rc {run.returncode}): {run.stderr[-3000:]}")
    res["second_process"] = {**json.loads(line[len("CHILD_RESULT "):]), "wall_s": time.perf_counter() - t}
    log(f"start: second process: first token {res['second_process']['ttft_s']:.1f}s after loading the models, "
        f"warmup {res['second_process']['warmup_s']:.1f}s")
    if args.cprofile_child:  # a third process, under cProfile: where the start goes
        run = subprocess.run(cmd + ["--cprofile"], capture_output=True, text=True, timeout=args.child_timeout, env=dict(os.environ))
        line = next((x for x in run.stdout.splitlines() if x.startswith("CHILD_RESULT ")), None)
        res["third_process_cprofile"] = json.loads(line[len("CHILD_RESULT "):]) if line else {"error": run.stderr[-3000:]}
        log("start: third process under cProfile:\n" + "\n".join(res["third_process_cprofile"].get("cprofile_top", [])))


# ----------------------------------------------------------------------------- identity
def first_diff(a: torch.Tensor, b: torch.Tensor):
    if a.shape == b.shape and torch.equal(a, b):
        return None
    n = min(a.shape[-1], b.shape[-1])
    diff = (a[..., :n] != b[..., :n]).nonzero()
    return int(diff[:, -1].min()) if len(diff) else n


def identity_of(target, drafter, ids, mask, max_new):
    pad = target.config.vocab_size - 2  # never in the prompts (prompt_ids, tiny_pair draw below it)
    kw = dict(do_sample=False, max_new_tokens=max_new, pad_token_id=pad, attention_mask=mask)
    plain = target.generate(ids, **kw)
    fast, notes = record_warnings(lambda: target.generate(ids, assistant_model=drafter, fast_path=True, **kw))
    eager = target.generate(ids, assistant_model=drafter, fast_path=False, **kw)
    return {"fast_vs_plain_first_diff": first_diff(fast, plain), "fast_vs_eager_first_diff": first_diff(fast, eager),
            "eager_vs_plain_first_diff": first_diff(eager, plain), "identical": bool(torch.equal(fast, plain) and torch.equal(fast, eager)),
            "warnings": notes}


def identity(res, target, drafter, device, args):
    tiny_t, tiny_d, prompts, _ = tiny_pair(device, torch.float32, hidden=64, head_dim=16)
    ids = torch.tensor([prompts[0][:12]], device=device)
    res["tiny_f32_batch1"] = identity_of(tiny_t, tiny_d, ids, None, 24)
    rows = [prompts[i][:n] for i, n in zip(range(1, 4), (9, 4, 12))]
    width = max(map(len, rows))
    pad = tiny_t.config.vocab_size - 2
    padded = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    res["tiny_f32_batch3_padded"] = identity_of(tiny_t, tiny_d, padded, mask, 24)
    del tiny_t, tiny_d
    ids = prompt_ids(target.config.vocab_size, 1, args.prompt_len, device, seed=7)
    res["8b_bf16_batch1"] = identity_of(target, drafter, ids, None, 32)
    for k in ("tiny_f32_batch1", "tiny_f32_batch3_padded", "8b_bf16_batch1"):
        log(f"identity {k}: {res[k]}")


# ----------------------------------------------------------------------------- methods
def per_round(run, device, rounds_of, reps: int = 3):
    """(ms per round, rounds): ``run(n)`` generates ``n`` new tokens; prefill is the ``n = 1`` run. The median
    of ``reps`` timings of each."""
    run(args_max_new[0])  # untimed: compiles, captures
    pre = statistics.median(timed(lambda: run(1), device)[1] for _ in range(reps))
    outs = [timed(lambda: run(args_max_new[0]), device) for _ in range(reps)]
    rounds = rounds_of(outs[0][0])
    return 1e3 * (statistics.median(t for _, t in outs) - pre) / max(rounds, 1), rounds


args_max_new = [128]


def methods(res, target, drafter, device, args, deadline):
    from adaflash_hf import speculative_generate
    from adaflash_hf.engine import Engine

    vocab = target.config.vocab_size
    one = prompt_ids(vocab, 1, args.prompt_len, device, seed=3)
    gen = dict(do_sample=False, pad_token_id=vocab - 2)  # never in the prompts: no mask is inferred from it

    def spec(ids, fast, policy="fixed"):
        def run(n):
            return target.generate(ids, assistant_model=drafter, max_new_tokens=n, return_stats=True,
                                   length_policy=policy, fast_path=fast, **gen)
        return run

    def plain(**kw):  # a fixed max_length (a static cache keeps its shapes) and a criterion that stops after n tokens
        return lambda n: target.generate(one, max_new_tokens=args.max_new, stopping_criteria=[_StopAt(one.shape[1] + n)],
                                         **kw, **gen)

    def engine_case(mode):
        return (f"engine_{mode}_c1", lambda: _engine_runner(Engine, target, drafter, mode, one[0].tolist(), args),
                lambda o: len(o.verify_lengths) or args.max_new - 1, 1)

    cases = [  # most wanted first: what the time budget leaves out comes last
        ("ours_generate_b1", lambda: spec(one, True), lambda o: o[1].rounds, 1),
        engine_case("fixed"),
        ("ours_generate_b8", lambda: spec(prompt_ids(vocab, 8, args.prompt_len, device, 4), True), lambda o: o[1].rounds / 8, 8),
        ("speculative_generate_b32", lambda: (lambda n: speculative_generate(
            target, drafter, prompt_ids(vocab, 32, args.prompt_len, device, 5), max_new_tokens=n, return_stats=True,
            length_policy="fixed", fast_path=True, **gen)), lambda o: o[1].rounds / 32, 32),
        engine_case("off"),
        engine_case("packed"),
        ("plain_eager_generate", lambda: plain(), lambda o: args.max_new - 1, 1),
        # rounds of transformers' loop are not reported: taken as one per token (random weights accept ~nothing)
        ("native_dflash", lambda: (lambda n: target.generate(one, assistant_model=drafter, speculation_type="dflash",
                                                             max_new_tokens=n, **gen)), lambda o: args.max_new - 1, 1),
        ("ours_eager_loop_b1", lambda: spec(one, False), lambda o: o[1].rounds, 1),
        ("static_compiled_generate", lambda: plain(cache_implementation="static"), lambda o: args.max_new - 1, 1),
    ]
    for name, make, rounds_of, batch in cases:
        needs = 120.0 if name == "static_compiled_generate" else 0.0  # its compile alone takes a minute or two
        why = ("--skip" if name in args.skip else "time budget" if time.perf_counter() > deadline - needs
               else "--smoke (compiles for minutes on CPU)" if args.smoke and name == "static_compiled_generate" else None)
        if why:
            res[name] = {"skipped": why}
            log(f"methods: {name} skipped ({res[name]['skipped']})")
            continue
        try:
            (ms, rounds), notes = record_warnings(lambda: per_round(make(), device, rounds_of))
            speculative = name not in ("plain_eager_generate", "static_compiled_generate", "engine_off_c1")
            res[name] = {"batch": batch, "ms_per_round": ms, "rounds_per_row": rounds,
                         "tok_per_s_tau1": 1e3 / ms * batch,
                         "tok_per_s_projected": 1e3 / ms * batch * (PUBLISHED_TAU if speculative else 1.0),
                         "warnings": notes}
            log(f"methods: {name}: {ms:.2f} ms per round ({rounds:.0f} rounds/row), {res[name]['tok_per_s_tau1']:.1f} tok/s "
                f"at tau 1, {res[name]['tok_per_s_projected']:.1f} projected; warnings {notes}")
        except Exception:  # noqa: BLE001 - record and go on
            res[name] = {"error": traceback.format_exc()}
            log(f"methods: {name} FAILED\n{res[name]['error']}")
        free_memory()
        args.save()
    fixed, ours = res.get("engine_fixed_c1", {}), res.get("ours_generate_b1", {})
    if "ms_per_round" in fixed and "ms_per_round" in ours:
        res["ours_b1_over_engine_fixed"] = ours["ms_per_round"] / fixed["ms_per_round"]
    if "ms_per_round" in ours and "ms_per_round" in res.get("ours_generate_b8", {}):
        res["b8_over_b1_round"] = res["ours_generate_b8"]["ms_per_round"] / ours["ms_per_round"]


def profile(res, target, drafter, device, args):
    """Where a batch-1 ``fixed`` round goes: the engine's phases (device synced at phase boundaries) and one
    drafter step alone (body over a 1-token context + full-width head, as a round after prefill runs it):
    ms per step graph-replayed, and the device kernels of the same step run eagerly."""
    from gpu_common import kernel_profile, phase_breakdown

    from adaflash_hf.engine import Engine, layout_args
    from adaflash_hf.engine.kernels.fused import FusedTarget
    from adaflash_hf.engine.drafter import DraftGraphs, make_drafter_cache
    from adaflash_hf.generation import fast_path

    prompt = prompt_ids(target.config.vocab_size, 1, args.prompt_len, device, seed=3)[0].tolist()
    eng = Engine(target, **layout_args(drafter, "fixed"), max_slots=1, max_len=len(prompt) + args.max_new + 32,
                 token_budget=max(64, len(prompt)))
    eng.warmup(concurrency=1, prompt_lens=[len(prompt)])
    eng.generate([prompt], max_new_tokens=args.max_new)
    res["engine_fixed_phases"] = phase_breakdown(eng, lambda: eng.generate([prompt], max_new_tokens=args.max_new))
    log(f"profile: engine fixed c1 phases {res['engine_fixed_phases']}")
    res["engine_fixed_sizes"] = {"max_len": eng.max_len, "token_budget": eng.token_budget}
    if device == "cuda":  # where the GPU waits for the host in a round: with host operators recorded (the host
        # slower: a guide to which ops) and device-only (the gaps nearly as they are)
        sys.path.insert(0, str(Path(__file__).parent / "engine_probes"))
        from trace_gaps import gaps_and_ops

        trace = Path(args.out) / "trace_engine_fixed_c1.json.gz"
        device_trace = Path(args.out) / "trace_engine_fixed_c1_device.json.gz"
        rounds = 32
        kernel_profile(lambda: eng.generate([prompt], max_new_tokens=rounds), device, trace=str(trace),
                       device_trace=str(device_trace))
        for key, path in (("engine_fixed_gaps", trace), ("engine_fixed_gaps_device_only", device_trace)):
            with gzip.open(path, "rt") as f:
                span, gaps, ops, longest = gaps_and_ops(json.load(f)["traceEvents"], 20.0)
            gap_ms = sum(e - b for b, e in gaps) / 1e3
            res[key] = {"rounds": rounds, "kernel_span_ms": span / 1e3, "gaps_over_20us": len(gaps), "gap_ms": gap_ms,
                        "gap_ms_per_round": gap_ms / rounds, "busy_ms_per_round": (span / 1e3 - gap_ms) / rounds,
                        **({"host_ops_in_gaps_ms": {k: v / 1e3 for k, v in ops.most_common(12)}} if ops else {})}
            log(f"profile: {key} {res[key]}")
    del eng
    free_memory()
    # the same phases for the engine our generate builds and caches (its round is slower than the engine's own)
    one = torch.tensor([prompt], device=device)
    gen = dict(assistant_model=drafter, max_new_tokens=args.max_new, do_sample=False, length_policy="fixed",
               fast_path=True, pad_token_id=target.config.vocab_size - 2)
    target.generate(one, **gen)
    cached = [c.engine for c in fast_path._ENGINES.values() if c.target() is target]
    if cached:
        res["ours_generate_b1_phases"] = phase_breakdown(cached[-1], lambda: target.generate(one, **gen))
        res["ours_generate_b1_sizes"] = {"max_len": cached[-1].max_len, "token_budget": cached[-1].token_budget}
        log(f"profile: our generate b1 phases {res['ours_generate_b1_phases']} {res['ours_generate_b1_sizes']}")
    cfg = drafter.config
    feats = torch.randn(1, len(cfg.target_layer_ids) * cfg.hidden_size, dtype=torch.bfloat16, device=device)
    fused, _ = FusedTarget.build(target)
    cases = [(True, True), (True, False), (False, True)] if device == "cuda" else [(False, True), (False, False)]
    for graphs, fuse in cases:  # (CUDA graphs, the drafter on the target's fused kernels)
        cache = make_drafter_cache(drafter, 1, args.prompt_len + 64, spare_slots=1)
        dg = DraftGraphs(drafter, cache, max_rows=1, max_ctx=64, use_graphs=graphs, fused=fused if fuse else None)
        slot = cache.alloc()
        cache.advance(slot, args.prompt_len)

        def step():
            dg.run_body([slot], [feats], [5])
            dg.run_head([cfg.block_size - 1])
            cache.rollback(slot, args.prompt_len)

        for _ in range(3):
            step()
        _, secs = timed(lambda: [step() for _ in range(50)], device)
        key = f"drafter_step_{'graphs' if graphs else 'eager'}_{'fused' if dg.fused is not None else 'modules'}"
        res[key] = {"ms": 1e3 * secs / 50, **({} if graphs else {"kernels": kernel_profile(step, device, top=16)})}
        log(f"profile: {key} {res[key]}")
        del dg, cache
        free_memory()


class _StopAt(StoppingCriteria):
    """Stop once a row holds ``length`` tokens (prompt included)."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool, device=input_ids.device)


def _engine_runner(Engine, target, drafter, mode, prompt, args):
    from adaflash_hf.engine import layout_args

    eng = Engine(target, **layout_args(drafter, mode), max_slots=1,
                 max_len=len(prompt) + args.max_new + 32, token_budget=max(64, len(prompt)))
    eng.warmup(concurrency=1, prompt_lens=[len(prompt)])
    return lambda n: eng.generate([prompt], max_new_tokens=n)[0]


# ----------------------------------------------------------------------------- report
def markdown(res) -> str:
    lines = ["# generate(assistant_model=drafter) on the engine: Qwen3-8B shape", "",
             f"device: {res.get('device')}; prompt {res.get('prompt_len')} tokens, {res.get('max_new')} new; "
             f"projected = at the published tau {PUBLISHED_TAU}", "",
             "| method | batch | ms per round | tok/s at tau 1 | tok/s projected |", "|---|---|---|---|---|"]
    for k, v in res.get("methods", {}).items():
        if isinstance(v, dict) and "ms_per_round" in v:
            lines.append(f"| {k} | {v['batch']} | {v['ms_per_round']:.2f} | {v['tok_per_s_tau1']:.1f} | {v['tok_per_s_projected']:.1f} |")
        elif isinstance(v, dict):
            lines.append(f"| {k} | | {'skipped' if 'skipped' in v else 'ERROR'} | | |")
    m = res.get("methods", {})
    lines += ["", f"ours b1 / engine fixed round: {m.get('ours_b1_over_engine_fixed')}; b8 / b1 round: {m.get('b8_over_b1_round')}", ""]
    s = res.get("start", {})
    lines += ["## start-up", "", f"first process: {s.get('first_process')}", "", f"second process: {s.get('second_process')}", ""]
    if s.get("third_process_cprofile"):
        lines += ["third process, under cProfile (cumulative seconds):", "", "```", *s["third_process_cprofile"].get("cprofile_top", []), "```", ""]
    lines += ["## identity", ""] + [f"- {k}: {v}" for k, v in res.get("identity", {}).items()]
    errors = [k for k, v in res.items() if isinstance(v, dict) and "error" in v]
    return "\n".join(lines + ["", f"section errors: {errors}"]) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "fast_generate_gpu_out"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, every section")
    ap.add_argument("--device", default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-new", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip what would start after this many seconds")
    ap.add_argument("--child-timeout", type=float, default=150.0)
    ap.add_argument("--skip", default="", help="comma-separated sections (start, identity, methods, profile) or method names")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cprofile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cprofile-child", action="store_true", help="a third process, under cProfile, shows where the start goes")
    args = ap.parse_args(argv)
    args.prompt_len = args.prompt_len or (16 if args.smoke else 512)
    args.max_new = args.max_new or (8 if args.smoke else 128)
    args.skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    args_max_new[0] = args.max_new
    if args.child:
        return child_main(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if "ADAFLASH_HF_CACHE" not in os.environ:  # a fresh tuning cache for this run and its children, removed at exit
        args.kernel_cache = tempfile.TemporaryDirectory(prefix="adaflash_kcache_")
        os.environ["ADAFLASH_HF_CACHE"] = args.kernel_cache.name
    deadline = time.perf_counter() + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else device, "prompt_len": args.prompt_len,
           "max_new": args.max_new, "torch": torch.__version__}

    def save():
        (out / "fast_generate_gpu.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "fast_generate_gpu.md").write_text(markdown(res))

    args.save = save
    t = time.perf_counter()
    target, drafter = build(device, args.smoke)
    sync(device)
    res["build_models_s"] = time.perf_counter() - t
    log(f"models built in {res['build_models_s']:.1f}s")
    for name, fn in (("start", start_up), ("identity", identity), ("methods", methods), ("profile", profile)):
        res[name] = {}
        if name in args.skip or time.perf_counter() > deadline:
            res[name] = {"skipped": "--skip" if name in args.skip else "time budget"}
            continue
        try:
            extra = (deadline,) if name == "methods" else ()
            fn(res[name], target, drafter, device, args, *extra)
        except Exception:  # noqa: BLE001 - record and go on
            res[name]["error"] = traceback.format_exc()
            log(f"{name} FAILED\n{res[name]['error']}")
        save()
    print(markdown(res))


if __name__ == "__main__":
    main()
