"""Helpers the GPU scripts share (engine_gpu_check, fast_generate_gpu, replay_bench, bf16_identity and the
probes): logging and device sync, timing and profiling, the models they build (a tiny random pair, the embedded
reference pair with real prompts, the Qwen3-8B shape with random bf16 weights) and greedy references."""

from __future__ import annotations

import gc
import gzip
import json
import os
import shutil
import statistics
import time
import traceback
from pathlib import Path

import torch

T0 = time.perf_counter()
FALLBACK_QUESTIONS = [  # used only if the shared gsm8k data is not reachable
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. How much more money does she need if her grandparents give her $30?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
    "Mark has a garden with flowers. He planted plants of three different colors in it. Ten of them are yellow. How many flowers are there?",
    "Albert is wondering how much pizza he can eat in one day. He buys 2 large pizzas and 2 small pizzas. How many pieces does he eat?",
    "Ken created a care package to send to his brother, who was away at boarding school. What was the final weight?",
    "Alexis is applying for a new job and bought a new set of business clothes to wear to the interview. How much did she pay for the shoes?",
]


def write_report(out, stem: str, res: dict, lines: list[str]) -> None:
    """A probe's results into ``out``: ``stem.json`` (``res``) and ``stem.md`` (``lines``), also printed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


class Sections:
    """The sections of a GPU check, run one after another into one report (``out_dir/stem.json`` and ``stem.md``,
    ``markdown(results)``), both rewritten after every section: a section is skipped by name (``skip``) or once
    ``budget_s`` has passed since the script started (recorded as an error), and one that raises is recorded
    (``{"error": "Type: message", "traceback": ...}``) while the next still runs. ``results["meta"]`` is ``meta``.

    Example:
        >>> run = Sections(Path("out"), "check", markdown, {"device": "cuda"}, skip={"b"}, budget_s=400)  # doctest: +SKIP
        >>> run.section("a", lambda: {"ok": True})  # doctest: +SKIP
    """

    def __init__(self, out_dir, stem: str, markdown, meta: dict, skip=(), budget_s: float = float("inf")):
        self.out_dir, self.stem, self.markdown = Path(out_dir), stem, markdown
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.skip, self.budget_s = set(skip), budget_s
        self.results = {"meta": meta}

    def save(self) -> None:
        self.results["meta"]["total_s"] = time.perf_counter() - T0
        (self.out_dir / f"{self.stem}.json").write_text(json.dumps(self.results, indent=1, default=str))
        (self.out_dir / f"{self.stem}.md").write_text(self.markdown(self.results))

    def section(self, name: str, fn) -> None:
        """Run ``fn()`` as section ``name`` (its result, or its error, under that key), then save."""
        if name in self.skip:
            return
        if time.perf_counter() - T0 > self.budget_s:
            self.results[name] = {"error": f"skipped: past the {self.budget_s:.0f} s budget"}
            log(f"{name}: skipped (budget)")
        else:
            log(f"== section {name}")
            try:
                self.results[name] = fn()
            except Exception as exc:  # noqa: BLE001 - record it and run the next section
                self.results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                log(f"{name} FAILED\n{self.results[name]['traceback']}")
            free_memory()
        self.save()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, iters: int, warmup: int = 1) -> float:
    """Median milliseconds of ``fn()``: CUDA events on the GPU, wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def phase_breakdown(eng, fn) -> dict:
    """Run ``fn()`` with ``eng.profile`` on: ms per step in each phase (device synced at phase boundaries,
    so the sum is a little above the unprofiled step time), device reads and drafts skipped per step."""
    eng.phase_seconds.clear()
    eng.profiled_steps = 0
    syncs0, skipped0, forwards0 = eng.host_syncs, eng.skipped_drafts, eng.num_steps
    eng.profile = True
    try:
        fn()
    finally:
        eng.profile = False
    steps = max(1, eng.num_steps - forwards0)  # target decode steps: an ``off`` replay may run several
    out = {f"{k}_ms": 1e3 * v / steps for k, v in sorted(eng.phase_seconds.items())}
    out.update(steps=steps, step_ms=sum(out.values()), reads_per_step=(eng.host_syncs - syncs0) / steps,
               drafts_skipped_per_step=(eng.skipped_drafts - skipped0) / steps)
    return out


def step_kind(eng, steps: int, skipped: int) -> str:
    """What one ``Engine.step`` was, from its decode steps and skipped drafter bodies: a plain stretch, a drafting
    round, or a mix."""
    if eng.drafter is None or (steps > 1 and skipped == steps):
        return f"plain x{steps}"
    if skipped and steps == 1:
        return "plain x1 (round)"
    return "drafting" if steps == 1 else f"mixed x{steps}"


def captured(eng) -> float:
    """Seconds the engine's graph runners have spent capturing so far (timed runs subtract it)."""
    runners = (eng.graphs, getattr(eng, "draft_graphs", None))
    return sum(g.capture_seconds for g in runners if g is not None)


def round_timeline(eng, prompts, max_new, device, eos=None, cost=None) -> dict:
    """One closed-batch run of ``prompts`` with every ``Engine.step`` timed (device synchronised before and after; graph
    captures inside it subtracted, as ``capture_ms``) and classified (:func:`step_kind`; ``prefill`` until every
    request has its first token: the rounds that admit requests, with the others' steps). Each row: ``kind``, ``ms``,
    ``tokens`` committed, ``rows`` running before it, ``forward`` tokens per target forward, the planner's state, and,
    given ``cost`` (the engine's :class:`~adaflash_hf.speculation.length.cost.RoundCost`), ``model_ms``: what the
    cost rule priced that step at. Returns ``{"by_kind", "decode_tok_per_s", "rows"}`` (``by_kind``: rounds, ms,
    modelled ms and tokens per kind, prefill apart)."""
    from collections import defaultdict

    handles = [eng.submit(p, max_new, eos_token_id=eos) for p in prompts]
    rows = []
    while not all(h.done for h in handles):
        n, steps0, skipped0, fwd0 = eng.num_running, eng.num_steps, eng.skipped_drafts, len(eng.forward_tokens)
        tokens0 = sum(len(h.token_ids) for h in handles)
        decoding = all(h.token_ids or h.done for h in handles)  # every request past its prefill
        sync(device)
        t, c0 = time.perf_counter(), captured(eng)
        eng.step()
        sync(device)
        capture_ms = 1e3 * (captured(eng) - c0)
        ms = 1e3 * (time.perf_counter() - t) - capture_ms
        steps, skipped = eng.num_steps - steps0, eng.skipped_drafts - skipped0
        fwd = list(eng.forward_tokens[fwd0:])
        kind = step_kind(eng, steps, skipped) if decoding else "prefill"
        p = getattr(eng, "planner", None)
        row = {"kind": kind, "ms": ms, "tokens": sum(len(h.token_ids) for h in handles) - tokens0, "rows": n,
               "forward": fwd, "capture_ms": capture_ms}
        if p is not None and eng.drafter is not None:
            row.update(plain_rounds=p.plain_rounds, plain_limit=p.plain_limit, drafted_plain=p.drafted_plain,
                       traffic=(p.traffic_seen[0] / p.traffic_seen[1]) if p.traffic_seen[1] else None)
        if cost is not None and cost.unit_ms and kind != "prefill" and n:
            plain = kind.startswith("plain") or eng.drafter is None
            units = (sum(cost.verify_time(n, n) + cost.overhead(n, False) for _ in fwd) if plain
                     else cost.round_time(n, fwd[-1], eng.block_size))
            row["model_ms"] = float(units) * cost.unit_ms
        rows.append(row)
    by = defaultdict(lambda: {"n": 0, "ms": 0.0, "model_ms": 0.0, "tokens": 0})
    for r in rows:
        b = by[r["kind"]]
        b["n"], b["ms"], b["tokens"] = b["n"] + 1, b["ms"] + r["ms"], b["tokens"] + r["tokens"]
        b["model_ms"] += r.get("model_ms", 0.0)
    decode = [r for r in rows if r["kind"] != "prefill"]
    tok, ms = sum(r["tokens"] for r in decode), sum(r["ms"] for r in decode)
    return {"by_kind": dict(by), "decode_tok_per_s": 1e3 * tok / ms if ms else None, "rows": rows}


def fmt_phases(ph: dict) -> str:
    keys = [k for k in ("draft_ms", "target_ms", "accept_ms", "host_ms") if k in ph]
    return " + ".join(f"{k[:-3]} {ph[k]:.2f}" for k in keys) + f" = {ph.get('step_ms', 0):.2f} ms/step"


def fmt_kernels(kp: dict, top: int = 8) -> str:
    """One log line of :func:`kernel_profile`: count, kernel time, the ``top`` kernels by time."""
    return (f"{kp['kernels']} kernels, {kp['kernel_ms']:.2f} ms of kernel time; "
            + "; ".join(f"{k['name'][:50]} {k['us'] / 1e3:.2f}ms x{k['count']}" for k in kp["top"][:top]))


def gzip_trace(prof, path: str) -> None:
    raw = path.removesuffix(".gz")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)


def kernel_profile(fn, device, top: int = 12, keep_all: bool = False, trace: str | None = None,
                   device_trace: str | None = None) -> dict:
    """Device kernels of one ``fn()`` (torch.profiler), after one unprofiled ``fn()``: how many, their summed
    time, the ``top`` names by time (``keep_all``: every name, under ``"all"``), and the profiled call's wall
    time. ``trace``: also record the host side and write a gzipped Chrome trace there (where the device
    waits for the host). ``device_trace``: the device-only profile's trace (no host operators recorded, so the
    host runs at nearly its own speed: the device's idle gaps as they are). Kernels replayed from CUDA graphs
    are recorded as well."""
    from torch.profiler import ProfilerActivity, profile

    if torch.device(device).type != "cuda":
        return {}
    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        sync(device)
        wall_ms = 1e3 * (time.perf_counter() - t)
    if device_trace:
        gzip_trace(prof, device_trace)
    if trace:  # a third call, host and device (host ops also carry their kernels' time: kept out of the sums)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as host_prof:
            fn()
            sync(device)
        gzip_trace(host_prof, trace)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((t, e.count, e.key))
    rows.sort(reverse=True)
    return {"kernels": sum(c for _, c, _ in rows), "kernel_ms": sum(t for t, _, _ in rows) / 1e3, "wall_ms": wall_ms,
            "top": [{"us": round(t, 1), "count": c, "name": k[:120]} for t, c, k in rows[:top]],
            **({"all": [{"us": t, "count": c, "name": k} for t, c, k in rows]} if keep_all else {})}


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- models and prompts
def tiny_pair(device, dtype, hidden: int, head_dim: int, vocab: int = 512, block_size: int = 8):
    """A tiny random Qwen3 + AdaFlash drafter (head_dim >= 16: flex_attention's Triton kernels need it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from adaflash_hf import AdaFlashDrafter

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
                      num_attention_heads=hidden // head_dim, num_key_value_heads=max(1, hidden // head_dim // 2),
                      head_dim=head_dim, max_position_embeddings=2048, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None, attn_implementation="sdpa")
    target = Qwen3ForCausalLM(cfg).eval()
    target.generation_config.pad_token_id = target.generation_config.eos_token_id = None
    drafter = AdaFlashDrafter.from_target(target, num_layers=1, block_size=block_size, mask_token_id=vocab - 1).eval()
    target.to(device=device, dtype=dtype)
    drafter.to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab - 2, (int(n),), generator=g).tolist() for n in torch.randint(4, 60, (256,), generator=g)]
    return target, drafter.bind_target(target), prompts, None


def reference_pair(device, dtype, dataset: str, n: int):
    from adaflash_hf import load_reference_pair
    from adaflash_hf.bench.prompts import load_prompts
    from adaflash_hf.generation.prompts import encode_prompt

    target, drafter, tok = load_reference_pair(device=device, dtype=dtype)
    try:
        _, messages = load_prompts(dataset, n, None)
        source = dataset
    except Exception as exc:  # noqa: BLE001 - the data folder may not travel with the checkout
        log(f"prompts: {dataset} not loadable ({type(exc).__name__}: {exc}); using built-in questions")
        messages = [[{"role": "user", "content": FALLBACK_QUESTIONS[i % len(FALLBACK_QUESTIONS)]}] for i in range(n)]
        source = "built-in gsm8k-style questions"
    return target.eval(), drafter.eval(), [encode_prompt(tok, m) for m in messages], tok.eos_token_id, source


def qwen3_8b_shape(device, smoke: bool):
    """Qwen3-8B-shaped target with random bf16 weights, built directly on the device (16 GB)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if smoke:
        dims = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=1024)
    else:
        dims = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936)
    cfg = Qwen3Config(**dims, max_position_embeddings=40960, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model


def greedy_refs(target, prompts, max_new):
    """HF ``generate``'s greedy continuation of each prompt (no EOS stop)."""
    device = next(target.parameters()).device
    refs = []
    for p in prompts:
        out = target.generate(torch.tensor([p], device=device), do_sample=False, max_new_tokens=max_new,
                              eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return refs


def first_diff(a, b):
    """The first index where token lists ``a`` and ``b`` differ (a length difference counts), or ``None``."""
    return next((j for j, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y), None)
