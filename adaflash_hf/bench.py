"""`adaflash bench`: every decoding method on the same prompts, side by side, checked for correctness.

One run loads a target, an AdaFlash drafter (and optionally a small autoregressive assistant for
HF's own assisted generation), takes the prompts of each dataset (chat template applied), and for
each concurrency (prompts decoded together in one left-padded batch) times every method:

- ``plain``: ``target.generate`` with the default dynamic cache (the reference for correctness);
- ``plain_static``: ``target.generate(cache_implementation="static")``, compiled on CUDA;
- ``hf_assisted``: HF assisted generation with ``--assistant`` (batch 1 only);
- ``prompt_lookup``: HF prompt-lookup decoding (``prompt_lookup_num_tokens``, an n-gram copy of the
  prompt and the text so far; no drafter, no training; batch 1 only), the baseline a user already has;
- ``dflash_native``: transformers' own DFlash path, ``speculation_type="dflash"`` (batch 1 only);
- ``fixed``, ``adaptive``, ``expected_gain``: our speculative loop with that length policy;
- ``osd``, ``adaflash``: our loop serving the dataset's prompts in order while an
  `adaflash_hf.online.OnlineAdapter` trains a fresh copy of the drafter on the served requests:
  ``osd`` (forward-KL online distillation, fixed policy) and ``adaflash`` (on-policy distillation
  + length head, adaptive policy when the drafter's length head is trained, else fixed). Their
  wall time includes the adapter's cost (with ``--online-wait``, the wait for every triggered
  update); tau per update goes to ``BenchResult.online`` and the ``tau_online.png`` plot;
- ``engine_off``, ``engine_fixed``, ``engine_packed``: the serving engine
  (`adaflash_hf.engine.Engine`, continuous batching over a slotted KV cache, CUDA graphs on GPU)
  in that verify mode, the batch submitted at once.

For greedy runs every method's generated ids are compared, prompt by prompt, with plain decoding
of the same batch layout; a mismatch is a *failure* (``BenchResult.failures``), printed loudly, and
makes the CLI exit non-zero. A method that cannot run in a configuration is reported as skipped,
with the reason, never dropped.

Outputs (``--out DIR``): ``bench.json`` (every figure, the environment, the exact command),
``bench.md`` (tables) and PNG plots (``pip install adaflash-hf[plot]``).

Example:
    >>> from adaflash_hf.bench import BenchConfig, run_bench
    >>> result = run_bench(BenchConfig(reference=True, datasets=["gsm8k"], num_prompts=8))  # doctest: +SKIP
    >>> result.failures, result.cell("fixed", "gsm8k", 1).tokens_per_s  # doctest: +SKIP

CLI: ``adaflash bench --reference --datasets gsm8k,mathqa --num-prompts 32 --out runs/bench``
(also ``python -m adaflash_hf.bench ...``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .generation.prompts import encode_prompt, left_pad

__all__ = [
    "BASELINES",
    "BenchCell",
    "BenchConfig",
    "BenchContext",
    "BenchResult",
    "METHODS",
    "Method",
    "MethodOutput",
    "add_arguments",
    "main",
    "measure_copy_bandwidth",
    "run_bench",
    "run_from_args",
    "target_weight_bytes",
    "write_outputs",
    "write_plots",
]

BASELINES = ("plain", "plain_static")
DEFAULT_METHODS = (
    "plain", "plain_static", "hf_assisted", "prompt_lookup", "dflash_native", "fixed", "adaptive", "expected_gain", "osd", "adaflash",
    "engine_off", "engine_fixed", "engine_packed",
)  # fmt: skip


# ----------------------------------------------------------------------------- configuration
@dataclass
class BenchConfig:
    """What to benchmark. Model fields take a local path, a Hub id, or an already loaded object.

    ``datasets``: names understood by `adaflash_hf.training.data.eval_prompts` (gsm8k, mathqa,
    math500, aime2025, mbpp, codealpaca, sharegpt, alpaca_eval, spec_bench, eagle_bench, blend) or
    ``jsonl:PATH`` (one record a line with a ``"prompt"`` string or a ``"messages"`` list).
    ``concurrency``: batch sizes; N prompts are decoded together in one left-padded batch.
    ``temperature`` 0 means greedy, and only greedy runs are compared token for token.
    ``warmup``: prompts decoded untimed before each (method, concurrency) is first timed.
    ``prompt_lookup_num_tokens``: candidate tokens per round of the ``prompt_lookup`` baseline.
    ``online_*``: the online methods' adapter (``OnlineAdapter``) settings: what a sample is
    (``"request"``: a finished request, or ``"round"``), samples that trigger an
    update, epochs over them, learning rate, and whether each triggered update is waited for
    before the next batch is served (reproducible curves; the wait is counted in the wall time).
    """

    target: Any = None
    drafter: Any = None
    tokenizer: Any = None
    assistant: Any = None
    reference: bool = False
    datasets: list[str] = field(default_factory=lambda: ["gsm8k"])
    num_prompts: int = 8
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    concurrency: list[int] = field(default_factory=lambda: [1])
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    device: str = "auto"
    dtype: str = "auto"
    attn_implementation: str = "sdpa"
    warmup: int = 1
    prompt_lookup_num_tokens: int = 10
    online_sample_unit: str = "request"
    online_samples_per_update: int = 128
    online_epochs: int = 2
    online_lr: float = 3e-4
    online_wait: bool = True
    out: str | None = None
    data_dir: str | None = None
    command: str | None = None
    plots: bool = True
    verbose: bool = True


@dataclass
class BenchContext:
    """What a method's runner sees: the loaded models and the shared generation arguments."""

    target: Any
    drafter: Any
    assistant: Any
    tokenizer: Any
    device: torch.device
    generate_kwargs: dict
    engines: dict = field(default_factory=dict)  # the engine methods' engines, kept across batches
    prompt_lookup_num_tokens: int = 10


@dataclass
class MethodOutput:
    """A runner's answer: the generated sequences (prompt included), and our stats when it has them.

    ``rounds`` is a verify-round count for methods without `GenerationStats` (batch 1; tau is then
    estimated as ``(new_tokens - 1) / rounds``: the prefill's token is not a round's).
    """

    sequences: torch.Tensor
    stats: Any = None
    rounds: int | None = None


@dataclass
class Method:
    """A benchmark method: ``run(ctx, input_ids, attention_mask, streamer)`` returns a `MethodOutput`
    (or just the sequences tensor, or ``(sequences, stats)``). ``skip(ctx, concurrency)`` returns a
    reason when the method cannot run in that configuration, else None. ``online``: an
    ``OnlineAdapter`` method (``"osd"``, ``"opd"``): each cell then runs on a fresh copy of the
    drafter with an adapter attached, fed by every round the cell serves."""

    name: str
    run: Callable
    description: str = ""
    needs_drafter: bool = False
    needs_assistant: bool = False
    batch1_only: bool = False
    skip: Callable | None = None
    online: str | None = None

    def skip_reason(self, ctx: BenchContext, concurrency: int) -> str | None:
        if self.needs_drafter and ctx.drafter is None:
            return "no drafter given (--drafter or --reference)"
        if self.needs_assistant and ctx.assistant is None:
            return "no autoregressive assistant given (--assistant)"
        if self.batch1_only and concurrency > 1:
            return f"{self.description or self.name} supports batch size 1 only (concurrency {concurrency})"
        return self.skip(ctx, concurrency) if self.skip is not None else None


# ----------------------------------------------------------------------------- built-in methods
def _run_plain(ctx, input_ids, attention_mask, streamer):
    return ctx.target.generate(input_ids, attention_mask=attention_mask, streamer=streamer, **ctx.generate_kwargs)


def _run_plain_static(ctx, input_ids, attention_mask, streamer):
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


def _run_hf_assisted(ctx, input_ids, attention_mask, streamer):
    return _counting_target_forwards(ctx, input_ids, attention_mask, streamer, assistant_model=ctx.assistant)


def _run_prompt_lookup(ctx, input_ids, attention_mask, streamer):
    return _counting_target_forwards(
        ctx, input_ids, attention_mask, streamer, prompt_lookup_num_tokens=ctx.prompt_lookup_num_tokens
    )


def _run_dflash_native(ctx, input_ids, attention_mask, streamer):
    return _counting_target_forwards(
        ctx, input_ids, attention_mask, streamer, assistant_model=ctx.drafter, speculation_type="dflash"
    )


def _ours(policy):
    """Our loop with `policy` (a policy name, or a function of the drafter returning one)."""

    def run(ctx, input_ids, attention_mask, streamer):
        from .generation import speculative_generate

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


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def _engine(mode):
    """The serving engine (`adaflash_hf.engine.Engine`) in verify mode `mode`, one request per row.

    The batch is submitted at once (concurrency = batch size). One engine per (mode, batch size) is
    kept in the context, sized with power-of-two headroom so that later batches reuse it (and its
    captured CUDA graphs); the warmup batch builds it outside the timed runs.
    """

    def run(ctx, input_ids, attention_mask, streamer):
        from .engine import Engine, SamplingParams
        from .generation.stats import GenerationStats

        kw = ctx.generate_kwargs
        max_new = int(kw["max_new_tokens"])
        prompts = [row[m.bool()].tolist() for row, m in zip(input_ids, attention_mask)]
        drafter = ctx.drafter if mode != "off" else None
        block = drafter.config.block_size if drafter is not None else 1
        need_len = _pow2_at_least(max(map(len, prompts)) + max_new + block, 256)
        need_budget = _pow2_at_least(max(max(map(len, prompts)), len(prompts) * block), 64)
        eng = ctx.engines.get((mode, len(prompts)))
        if eng is None or eng.max_len < need_len or eng.token_budget < need_budget:
            eng = Engine(ctx.target, drafter, verify_mode=mode, max_slots=len(prompts), max_len=need_len, token_budget=need_budget)
            ctx.engines[(mode, len(prompts))] = eng
        eos = kw.get("eos_token_id", ctx.target.generation_config.eos_token_id)
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else eos
        params = SamplingParams(kw.get("temperature") or 0.0, kw.get("top_k") or None, kw.get("top_p"), None, eos)
        streamer.put(input_ids)  # like generate: the prompt first, then every new token
        handles = [eng.submit(p, max_new, params, on_token=lambda t: streamer.put(t)) for p in prompts]
        outs = [h.result() for h in handles]
        width = max(len(o.token_ids) for o in outs)
        seq = torch.full((len(outs), input_ids.shape[1] + width), int(kw.get("pad_token_id") or 0), dtype=input_ids.dtype)
        seq[:, : input_ids.shape[1]] = input_ids.cpu()
        stats = GenerationStats(block_size=block, policy=f"engine {mode}")
        for i, o in enumerate(outs):
            seq[i, input_ids.shape[1] : input_ids.shape[1] + len(o.token_ids)] = torch.tensor(o.token_ids, dtype=seq.dtype)
            for a, v in zip(o.accepted, o.verify_lengths):
                stats.record(i, v, a)
        stats.new_tokens = sum(len(o.token_ids) for o in outs)
        return MethodOutput(seq.to(input_ids.device), stats=stats)

    return run


def _has_trained_length_head(drafter) -> bool:
    return getattr(drafter, "length_head", None) is not None and bool(getattr(drafter.config, "length_head_trained", False))


def _adaflash_policy(drafter) -> str:
    """``adaflash``'s verify-length policy: adaptive with a trained length head, else fixed."""
    return "adaptive" if _has_trained_length_head(drafter) else "fixed"


def _needs_length_head(ctx, concurrency):
    if getattr(ctx.drafter, "length_head", None) is None:
        return "the drafter has no length head (config.use_length_head is False): adaptive needs one"
    return None


METHODS: dict[str, Method] = {
    "plain": Method("plain", _run_plain, "HF generate, dynamic cache"),
    "plain_static": Method("plain_static", _run_plain_static, "HF generate, static cache (compiled on CUDA)"),
    "hf_assisted": Method("hf_assisted", _run_hf_assisted, "HF assisted generation", needs_assistant=True, batch1_only=True),
    "prompt_lookup": Method(
        "prompt_lookup", _run_prompt_lookup, "HF prompt-lookup decoding (no drafter)", batch1_only=True
    ),
    "dflash_native": Method(
        "dflash_native", _run_dflash_native, "transformers' native DFlash path", needs_drafter=True, batch1_only=True
    ),
    "fixed": Method("fixed", _ours("fixed"), "AdaFlash loop, fixed full-block verify (DFlash)", needs_drafter=True),
    "adaptive": Method(
        "adaptive", _ours("adaptive"), "AdaFlash loop, length-head verify length", needs_drafter=True, skip=_needs_length_head
    ),
    "expected_gain": Method("expected_gain", _ours("expected_gain"), "AdaFlash loop, expected-gain verify length", needs_drafter=True),
    "osd": Method(
        "osd", _ours("fixed"), "AdaFlash loop, fixed verify, online speculative distillation (forward KL)",
        needs_drafter=True, online="osd",
    ),
    "adaflash": Method(
        "adaflash", _ours(_adaflash_policy), "AdaFlash loop, adaptive verify length + online OPD",
        needs_drafter=True, online="opd",
    ),
    "engine_off": Method("engine_off", _engine("off"), "serving engine, plain decoding (continuous batching)"),
    "engine_fixed": Method("engine_fixed", _engine("fixed"), "serving engine, fixed full-block verify", needs_drafter=True),
    "engine_packed": Method(
        "engine_packed", _engine("packed"), "serving engine, per-request verify lengths packed in one forward",
        needs_drafter=True, skip=_needs_length_head,
    ),
}  # fmt: skip


# ----------------------------------------------------------------------------- results
@dataclass
class BenchCell:
    """One (method, dataset, concurrency) measurement. Every field is present; None means n/a."""

    method: str
    dataset: str
    concurrency: int
    skipped: bool = False
    skip_reason: str | None = None
    error: str | None = None
    num_prompts: int = 0
    num_batches: int = 0
    new_tokens: int = 0
    wall_time_s: float | None = None
    tokens_per_s: float | None = None
    speedup: dict = field(default_factory=dict)
    tau: float | None = None
    tau_estimated: bool = False
    tau_histogram: dict | None = None
    rounds: int | None = None
    mean_verify_length: float | None = None
    position_acceptance: list | None = None
    draft_time_s: float | None = None
    verify_time_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    peak_memory_bytes: int | None = None
    floor_ms_per_token: float | None = None
    floor_share: float | None = None
    identical: bool | None = None
    mismatched_prompts: list = field(default_factory=list)
    notes: list = field(default_factory=list)


@dataclass
class BenchResult:
    """Everything one run measured; ``to_dict()`` is what ``bench.json`` holds.

    ``online`` holds one record per (online method, dataset, concurrency, weights version) when the
    cell's stream triggered at least one update: ``{"method", "dataset", "concurrency", "update",
    "tau", "rounds"}``, where ``tau`` is the mean tokens per round served with the weights after
    ``update`` updates (``update`` 0: the drafter as given), i.e. the adapter's ``tau_before`` of
    each update and the last one's ``tau_after``. Plotted as tau over online updates.
    """

    config: dict
    environment: dict
    hardware: dict
    cells: list[BenchCell] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    online: list[dict] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def cell(self, method: str, dataset: str, concurrency: int) -> BenchCell:
        for c in self.cells:
            if (c.method, c.dataset, c.concurrency) == (method, dataset, concurrency):
                return c
        raise KeyError((method, dataset, concurrency))

    def to_dict(self) -> dict:
        return _json_safe(
            {
                "config": self.config,
                "environment": self.environment,
                "hardware": self.hardware,
                "results": [asdict(c) for c in self.cells],
                "failures": self.failures,
                "online": _online_records(self.online),
                "ok": self.ok,
            }
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)

    def to_markdown(self) -> str:
        return _markdown(self)


def _online_records(online) -> list[dict]:
    """``BenchResult.online`` as dicts (bare ``(update, tau)`` pairs are accepted too)."""
    return [dict(r) if isinstance(r, dict) else {"update": r[0], "tau": r[1]} for r in online]


def _json_safe(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, torch.dtype):
        return str(x).replace("torch.", "")
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return repr(x)


# ----------------------------------------------------------------------------- environment & hardware
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _environment(config: BenchConfig, device: torch.device, dtype: torch.dtype) -> dict:
    import transformers

    from . import __version__

    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        hardware = f"{torch.cuda.get_device_name(idx)} (CUDA {torch.version.cuda})"
    else:
        hardware = f"{_cpu_model()}, {os.cpu_count()} cores"
    command = config.command or shlex.join(sys.argv)
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": hardware,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "cpu": f"{_cpu_model()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "adaflash_hf": __version__,
        "command": command,
    }


def target_weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter once, minus the input embedding table
    (a lookup reads one row) unless it is tied to the LM head."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def measure_copy_bandwidth(device, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a large device-to-device copy (read + write bytes)."""
    device = torch.device(device)
    free, _ = torch.cuda.mem_get_info(device)
    nbytes = int(min(nbytes, free // 4))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    stop.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(stop) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds


# ----------------------------------------------------------------------------- loading
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip


def _resolve(config: BenchConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device)
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif config.dtype in _DTYPES:
        dtype = _DTYPES[config.dtype]
    else:
        raise ValueError(f"unknown dtype {config.dtype!r}: choose auto or one of {', '.join(_DTYPES)}")
    return device, dtype


def _load_models(config: BenchConfig, device, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .modeling import AdaFlashDrafter

    tokenizer = config.tokenizer
    if config.reference:
        if isinstance(config.target, str) or isinstance(config.drafter, str):
            raise ValueError("pass either --reference or --target/--drafter, not both")
        from .reference import load_reference_pair

        target, drafter, ref_tok = load_reference_pair(device=device, dtype=dtype, attn_implementation=config.attn_implementation)
        tokenizer = tokenizer if tokenizer is not None else ref_tok
    else:
        if config.target is None:
            raise ValueError("no target: pass --target PATH_OR_HUB_ID (or --reference)")
        target = config.target
        if isinstance(target, (str, os.PathLike)):
            target = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype, attn_implementation=config.attn_implementation)
        target = target.to(device=device, dtype=dtype).eval()
        drafter = config.drafter
        if isinstance(drafter, (str, os.PathLike)):
            drafter = AdaFlashDrafter.from_pretrained(str(drafter), dtype=dtype, attn_implementation=config.attn_implementation)
        if drafter is not None:
            drafter = drafter.to(device=device, dtype=dtype).eval()
            drafter.bind_target(target)
        if tokenizer is None:
            tokenizer = str(config.target) if isinstance(config.target, (str, os.PathLike)) else None
            if tokenizer is None:
                raise ValueError("pass a tokenizer with an in-memory target")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    assistant = config.assistant
    if isinstance(assistant, (str, os.PathLike)):
        assistant = AutoModelForCausalLM.from_pretrained(str(assistant), dtype=dtype, attn_implementation=config.attn_implementation)
    if assistant is not None:
        assistant = assistant.to(device=device, dtype=dtype).eval()
    return target, drafter, assistant, tokenizer


# ----------------------------------------------------------------------------- prompts
def _load_prompts(spec: str, limit: int, data_dir) -> tuple[str, list[list[dict] | str]]:
    """(label, prompts) of a dataset name or ``jsonl:PATH``: chat message lists, or raw strings
    for continuation prompts (records with a ``"text"`` field and no ``"messages"``)."""
    if spec.startswith("jsonl:"):
        path = Path(spec[len("jsonl:") :])
        records = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    records.append(json.loads(line))
        label = path.stem
    else:
        from .training.data import eval_prompts

        records = eval_prompts(spec, limit=limit, data_dir=data_dir)
        label = spec.strip().lower()
    out = []
    for i, rec in enumerate(records[:limit]):
        if isinstance(rec.get("messages"), list):
            out.append(rec["messages"])
        elif isinstance(rec.get("prompt"), str):
            out.append([{"role": "user", "content": rec["prompt"]}])
        elif isinstance(rec.get("text"), str):
            out.append(rec["text"])
        else:
            raise ValueError(f"{spec}: record {i} has no 'prompt' string, 'messages' list or 'text' string")
    if not out:
        raise ValueError(f"{spec}: no prompts")
    return label, out


# ----------------------------------------------------------------------------- timing
class _FirstTokenTimer:
    """A streamer that timestamps the first `put` after the prompt (generate puts the prompt first)."""

    def __init__(self, sync: bool):
        self.sync, self.puts, self.first = sync, 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            if self.sync:
                torch.cuda.synchronize()
            self.first = time.perf_counter()

    def end(self):
        pass


def _trim(generated: torch.Tensor, eos_ids: set[int]) -> list[int]:
    ids = generated.tolist()
    for j, t in enumerate(ids):
        if t in eos_ids:
            return ids[: j + 1]
    return ids


def _as_output(ret) -> MethodOutput:
    if isinstance(ret, MethodOutput):
        return ret
    if isinstance(ret, tuple):
        return MethodOutput(ret[0], stats=ret[1] if len(ret) > 1 else None)
    if hasattr(ret, "sequences"):
        return MethodOutput(ret.sequences)
    return MethodOutput(ret)


def _run_batch(method: Method, ctx, ids, mask, eos_ids, seed, sync):
    torch.manual_seed(seed)
    streamer = _FirstTokenTimer(sync)
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = _as_output(method.run(ctx, ids, mask, streamer))
    if sync:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    p = ids.shape[1]
    rows = [_trim(out.sequences[i, p:], eos_ids) for i in range(ids.shape[0])]
    ttft = (streamer.first - t0) if streamer.first is not None else None
    return out, rows, wall, ttft


# ----------------------------------------------------------------------------- the run
def _log(config, msg):
    if config.verbose:
        print(msg, file=sys.stderr, flush=True)


def _loud(msg):
    print(f"!!! BENCH FAILURE: {msg}", file=sys.stderr, flush=True)


def run_bench(config: BenchConfig) -> BenchResult:
    """Run every (dataset, concurrency, method) of `config`; write outputs when ``config.out`` is set."""
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}: choose from {', '.join(METHODS)}")
    if config.num_prompts < 1 or any(c < 1 for c in config.concurrency):
        raise ValueError("num_prompts and every concurrency must be >= 1")
    device, dtype = _resolve(config)
    target, drafter, assistant, tokenizer = _load_models(config, device, dtype)
    on_cuda = device.type == "cuda"

    greedy = config.temperature <= 0
    gen = dict(max_new_tokens=config.max_new_tokens, do_sample=not greedy)
    if greedy:
        gen.update(temperature=None, top_p=None, top_k=None)
    else:
        gen.update(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad_id = 0 if pad_id is None else pad_id
    gen["pad_token_id"] = pad_id
    eos = target.generation_config.eos_token_id
    if eos is None and tokenizer.eos_token_id is not None:
        eos = tokenizer.eos_token_id
        gen["eos_token_id"] = eos
    eos_ids = set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    ctx = BenchContext(target, drafter, assistant, tokenizer, device, gen, prompt_lookup_num_tokens=config.prompt_lookup_num_tokens)

    cfg_dict = {k: v for k, v in asdict(config).items() if k not in ("target", "drafter", "tokenizer", "assistant")}
    for k in ("target", "drafter", "tokenizer", "assistant"):
        v = getattr(config, k)
        cfg_dict[k] = str(v) if isinstance(v, (str, os.PathLike)) else (None if v is None else type(v).__name__)
    cfg_dict["chat_template"] = bool(getattr(tokenizer, "chat_template", None))
    cfg_dict["greedy"] = greedy
    env = _environment(config, device, dtype)
    hardware = {
        "target_weight_bytes": target_weight_bytes(target),
        "target_params": sum(p.numel() for p in target.parameters()),
        "drafter_params": sum(p.numel() for p in drafter.parameters()) if drafter is not None else None,
        "drafter_block_size": drafter.config.block_size if drafter is not None else None,
        "copy_bandwidth_bytes_per_s": None,
        "floor_ms_per_token": None,
        "floor_tokens_per_s": None,
    }
    if on_cuda:
        bw = measure_copy_bandwidth(device)
        hardware["copy_bandwidth_bytes_per_s"] = bw
        hardware["floor_ms_per_token"] = hardware["target_weight_bytes"] / bw * 1e3
        hardware["floor_tokens_per_s"] = 1e3 / hardware["floor_ms_per_token"]
    result = BenchResult(config=cfg_dict, environment=env, hardware=hardware)

    # Plain first: it is the correctness reference of every other method.
    methods = sorted(dict.fromkeys(config.methods), key=lambda m: m != "plain")
    datasets = [_load_prompts(d, config.num_prompts, config.data_dir) for d in config.datasets]
    encoded = {label: [encode_prompt(tokenizer, m) for m in msgs] for label, msgs in datasets}
    warm_pool = encoded[datasets[0][0]]
    warmed: set[tuple[str, int]] = set()

    for label, _ in datasets:
        prompts = encoded[label]
        for conc in config.concurrency:
            batches = [list(range(i, min(i + conc, len(prompts)))) for i in range(0, len(prompts), conc)]
            layouts = [left_pad([prompts[j] for j in b], pad_id, device) for b in batches]
            reference: list[list[int]] | None = None
            if greedy and "plain" not in methods:
                reference = []
                for bi, (ids, mask) in enumerate(layouts):
                    reference += _run_batch(METHODS["plain"], ctx, ids, mask, eos_ids, config.seed + bi, on_cuda)[1]
            group: list[BenchCell] = []
            for name in methods:
                method = METHODS[name]
                cell = BenchCell(method=name, dataset=label, concurrency=conc, num_prompts=len(prompts), num_batches=len(batches))
                group.append(cell)
                reason = method.skip_reason(ctx, conc)
                if reason is not None:
                    cell.skipped, cell.skip_reason = True, reason
                    _log(config, f"[{label} c={conc}] {name}: skipped ({reason})")
                    continue
                try:
                    rows = _measure(
                        method, ctx, cell, layouts, config, eos_ids, warm_pool, warmed, pad_id, device, on_cuda, hardware,
                        online=result.online,
                    )  # fmt: skip
                except Exception as exc:  # a crash is a failure of the run, reported, not hidden
                    cell.error = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                    result.failures.append(dict(kind="error", method=name, dataset=label, concurrency=conc, prompt_index=None, message=cell.error))
                    _loud(f"{name} on {label} (concurrency {conc}) raised {cell.error}")
                    if on_cuda:
                        torch.cuda.empty_cache()
                    continue
                if name == "plain" and greedy:
                    reference, cell.identical = rows, True
                    cell.notes.append("reference for the correctness check")
                elif not greedy:
                    cell.notes.append("sampling run: outputs are not compared token for token")
                elif reference is None:
                    cell.notes.append("no plain reference (plain failed): not compared")
                else:
                    _compare(cell, rows, reference, result, target, prompts)
                _log(config, _progress(cell))
            _fill_speedups(group)
            result.cells.extend(group)

    if result.failures:
        _loud(f"{len(result.failures)} failure(s); see 'failures' in the result")
    if config.out:
        write_outputs(result, config.out, plots=config.plots)
    return result


def _private_drafter(drafter, target):
    """A copy of `drafter` for one online cell, so its updates never reach the drafter the other methods use."""
    from .online.adapter import copy_drafter

    return copy_drafter(drafter, target).eval()


def _measure(method, ctx, cell, layouts, config, eos_ids, warm_pool, warmed, pad_id, device, on_cuda, hardware, online=None):
    conc = cell.concurrency
    if method.online:  # a fresh copy of the drafter per cell: every cell's curve starts from the given weights
        ctx = BenchContext(ctx.target, _private_drafter(ctx.drafter, ctx.target), ctx.assistant, ctx.tokenizer, ctx.device, ctx.generate_kwargs, prompt_lookup_num_tokens=ctx.prompt_lookup_num_tokens)
    if config.warmup > 0 and (method.name, conc) not in warmed:
        picks = [warm_pool[i % len(warm_pool)] for i in range(max(config.warmup, conc))]
        for i in range(0, len(picks) - conc + 1, conc):
            ids, mask = left_pad(picks[i : i + conc], pad_id, device)
            _run_batch(method, ctx, ids, mask, eos_ids, config.seed, on_cuda)
        warmed.add((method.name, conc))
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    adapter = None
    if method.online:  # attached after the warmup: the adapter learns from the timed stream only
        from .online import OnlineAdapter

        adapter = OnlineAdapter(
            ctx.drafter, ctx.target, method=method.online, sample_unit=config.online_sample_unit,
            samples_per_update=config.online_samples_per_update,
            epochs=config.online_epochs, lr=config.online_lr, seed=config.seed, domain=cell.dataset,
        ).attach()  # fmt: skip
    rows_all, walls, ttfts, tpots, merged, rounds_est, waited = [], [], [], [], None, 0, 0.0
    try:
        for bi, (ids, mask) in enumerate(layouts):
            out, rows, wall, ttft = _run_batch(method, ctx, ids, mask, eos_ids, config.seed + bi, on_cuda)
            rows_all += rows
            longest = max(len(r) for r in rows)
            if ttft is not None:
                ttfts.append(ttft)
                if longest > 1:
                    tpots.append((wall - ttft) / (longest - 1))
            if adapter is not None and config.online_wait:  # the update's cost is the stream's: timed
                t0 = time.perf_counter()
                adapter.wait_for_update()
                if on_cuda:
                    torch.cuda.synchronize()
                waited += time.perf_counter() - t0
                wall += time.perf_counter() - t0
            walls.append(wall)
            if out.stats is not None:
                merged = _merge_stats(merged, out.stats)
            if out.rounds is not None:
                rounds_est += out.rounds
    finally:
        if adapter is not None:
            adapter.close()  # finishes the updates already triggered, stops the worker, detaches
    if adapter is not None:
        _online_report(method, cell, adapter, config, waited, online)
    cell.new_tokens = sum(len(r) for r in rows_all)
    cell.wall_time_s = sum(walls)
    cell.tokens_per_s = cell.new_tokens / cell.wall_time_s if cell.wall_time_s > 0 else None
    cell.ttft_s = sum(ttfts) / len(ttfts) if ttfts else None
    cell.tpot_s = sum(tpots) / len(tpots) if tpots else None
    cell.peak_memory_bytes = torch.cuda.max_memory_allocated(device) if on_cuda else None
    if merged is not None:
        cell.rounds = merged.rounds
        cell.tau = merged.tau
        cell.mean_verify_length = merged.mean_verify_length
        cell.position_acceptance = merged.position_acceptance
        cell.tau_histogram = {str(n): sum(1 for a in merged.accepted if a + 1 == n) for n in range(1, merged.block_size + 1)}
        cell.draft_time_s = merged.draft_time_s
        cell.verify_time_s = merged.verify_time_s
    elif rounds_est:
        cell.rounds = rounds_est
        cell.tau = (cell.new_tokens - len(rows_all)) / rounds_est
        cell.tau_estimated = True
        cell.notes.append("tau estimated as (new tokens - 1 per prompt) / target verify forwards; no per-round stats")
    if method.name == "adaptive" and ctx.drafter is not None and not getattr(ctx.drafter.config, "length_head_trained", True):
        cell.notes.append("length head not trained (config.length_head_trained is False)")
    if hardware["floor_ms_per_token"] is not None and conc == 1 and cell.tokens_per_s:
        cell.floor_ms_per_token = hardware["floor_ms_per_token"]
        cell.floor_share = cell.tokens_per_s / hardware["floor_tokens_per_s"]
    return rows_all


def _online_report(method, cell, adapter, config, waited, online) -> None:
    """Cell notes on the adapter, and its tau per weights version into `online` (a stream that
    triggered no update gives no records)."""
    stats = adapter.stats
    policy = _adaflash_policy(adapter.drafter) if method.name == "adaflash" else "fixed"
    why = {
        "adaflash": " (the drafter's length head is trained)" if policy == "adaptive"
        else " (the drafter has no trained length head, so the verify length is not adapted)",
    }.get(method.name, "")  # fmt: skip
    cell.notes.append(f"online adapter method {adapter.method!r}, verify-length policy {policy}{why}")
    cell.notes.append(
        f"{stats['updates']} online update(s) from {stats['rounds_seen']} rounds "
        f"(samples: {adapter.sample_unit}s, samples_per_update {adapter.samples_per_update}, epochs {adapter.epochs}, lr {adapter.lr:g})"
    )
    if config.online_wait:
        cell.notes.append(f"wall time includes {waited:.3f} s waiting for triggered updates (--online-wait); TPOT excludes it")
    else:
        cell.notes.append("updates overlap serving (--no-online-wait); updates still running when the stream ended are not timed")
    if stats["failures"]:
        cell.notes.append(f"{stats['failures']} online update(s) FAILED (weights kept): {stats['last_error']}")
        print(f"warning: {cell.method} on {cell.dataset}: {stats['failures']} online update(s) failed: {stats['last_error']}", file=sys.stderr)
    if online is None or not stats["history"]:
        return
    points = [(h["update"] - 1, h["tau_before"], h["rounds_before"]) for h in stats["history"]]
    last = stats["history"][-1]
    points.append((last["update"], last["tau_after"], last["rounds_after"]))
    for update, tau, rounds in points:
        if tau is not None and rounds:
            online.append(
                dict(method=cell.method, dataset=cell.dataset, concurrency=cell.concurrency, update=update, tau=tau, rounds=rounds)
            )


def _merge_stats(acc, stats):
    from .generation.stats import GenerationStats

    if acc is None:
        acc = GenerationStats(block_size=stats.block_size, policy=stats.policy)
    acc.accepted += list(stats.accepted)
    acc.verify_lengths += list(stats.verify_lengths)
    acc.rows += list(stats.rows)
    acc.fallback_rounds += stats.fallback_rounds
    acc.new_tokens += stats.new_tokens
    acc.draft_time_s += stats.draft_time_s
    acc.verify_time_s += stats.verify_time_s
    return acc


def _logit_gap(target, prompt: list[int], prefix: list[int], want: int, got: int | None) -> float | None:
    """The target's logit of plain's token minus the method's token, after the common prefix (one
    unpadded row): a gap near zero points at floating-point near-ties, a large one at a real bug."""
    if got is None:
        return None
    ids = torch.tensor([prompt + prefix], device=target.device)
    with torch.inference_mode():
        logits = target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    return float(logits[want] - logits[got])


def _compare(cell, rows, reference, result, target=None, prompts=None):
    bad = []
    for i, (got, want) in enumerate(zip(rows, reference)):
        if got != want:
            first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            bad.append(i)
            gap = None
            if target is not None and prompts is not None and first < len(want):
                gap = _logit_gap(target, prompts[i], want[:first], want[first], got[first] if first < len(got) else None)
            result.failures.append(
                dict(
                    kind="mismatch", method=cell.method, dataset=cell.dataset, concurrency=cell.concurrency,
                    prompt_index=i, first_mismatch=first, expected_len=len(want), got_len=len(got),
                    expected_token=want[first] if first < len(want) else None,
                    got_token=got[first] if first < len(got) else None, logit_gap=gap,
                )
            )  # fmt: skip
            _loud(
                f"{cell.method} on {cell.dataset} (concurrency {cell.concurrency}): prompt {i} differs from plain "
                f"decoding at new token {first} (lengths {len(got)} vs {len(want)}"
                + (f"; target logit gap plain-vs-method {gap:.4g}" if gap is not None else "")
                + ")"
            )
    cell.identical = not bad
    cell.mismatched_prompts = bad


def _fill_speedups(group: list[BenchCell]) -> None:
    base = {c.method: c.tokens_per_s for c in group if c.method in BASELINES and c.tokens_per_s}
    for c in group:
        c.speedup = {b: (c.tokens_per_s / v if c.tokens_per_s else None) for b, v in base.items()}


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _progress(c: BenchCell) -> str:
    tau = f" tau {c.tau:.2f}" if c.tau is not None else ""
    ident = {True: " identical", False: " MISMATCH", None: ""}[c.identical]
    return f"[{c.dataset} c={c.concurrency}] {c.method}: {_fmt(c.tokens_per_s, '.1f')} tok/s{tau}{ident}"


# ----------------------------------------------------------------------------- outputs
def _markdown(result: BenchResult) -> str:
    env, hw = result.environment, result.hardware
    lines = [
        "# adaflash bench",
        "",
        f"- date (UTC): {env['date_utc']}",
        f"- hardware: {env['hardware']} ({env['device']}, {env['dtype']})",
        f"- versions: torch {env['torch']}, transformers {env['transformers']}, adaflash-hf {env['adaflash_hf']}, python {env['python']}",
        f"- command: `{env['command']}`",
    ]
    if hw.get("copy_bandwidth_bytes_per_s"):
        lines.append(
            f"- memory-bandwidth floor: {hw['target_weight_bytes'] / 1e9:.2f} GB of target weights / "
            f"{hw['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s copy bandwidth = {hw['floor_ms_per_token']:.2f} ms/token "
            f"({hw['floor_tokens_per_s']:.0f} tok/s at batch 1)"
        )
    lines += [
        "",
        "| dataset | concurrency | method | tok/s | speedup vs plain | tau | mean verify len | identical? |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in result.cells:
        if c.skipped:
            lines.append(f"| {c.dataset} | {c.concurrency} | {c.method} | skipped: {c.skip_reason} | - | - | - | - |")
            continue
        if c.error:
            lines.append(f"| {c.dataset} | {c.concurrency} | {c.method} | error: {c.error} | - | - | - | FAILED |")
            continue
        sp = c.speedup.get("plain")
        tau = "-" if c.tau is None else (f"~{c.tau:.2f}" if c.tau_estimated else f"{c.tau:.2f}")
        ident = {True: "yes", False: f"**NO** ({len(c.mismatched_prompts)} prompts)", None: "n/a"}[c.identical]
        lines.append(
            f"| {c.dataset} | {c.concurrency} | {c.method} | {_fmt(c.tokens_per_s, '.1f')} | "
            f"{'-' if sp is None else f'{sp:.2f}x'} | {tau} | {_fmt(c.mean_verify_length)} | {ident} |"
        )
    lines += [
        "",
        "## Details",
        "",
        "| dataset | concurrency | method | speedup vs plain_static | TTFT ms | TPOT ms | draft s | verify s | peak mem GB | share of BW floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result.cells:
        if c.skipped or c.error:
            continue
        ss = c.speedup.get("plain_static")
        ms = lambda x: None if x is None else x * 1e3  # noqa: E731
        mem = None if c.peak_memory_bytes is None else c.peak_memory_bytes / 1e9
        lines.append(
            f"| {c.dataset} | {c.concurrency} | {c.method} | {'-' if ss is None else f'{ss:.2f}x'} | {_fmt(ms(c.ttft_s), '.1f')} | "
            f"{_fmt(ms(c.tpot_s), '.2f')} | {_fmt(c.draft_time_s, '.3f')} | {_fmt(c.verify_time_s, '.3f')} | {_fmt(mem)} | "
            f"{_fmt(c.floor_share)} |"
        )
    records = _online_records(result.online)
    if records:
        lines += [
            "",
            "## Online updates",
            "",
            "tau of the rounds served with the weights after N updates (N = 0: the drafter as given).",
            "",
            "| dataset | concurrency | method | tau per update (N: tau, rounds) |",
            "|---|---|---|---|",
        ]
        series: dict[tuple, list] = {}
        for r in records:
            series.setdefault((r.get("dataset"), r.get("concurrency"), r.get("method")), []).append(r)
        for (d, conc, m), rs in series.items():
            pts = ", ".join(f"{r['update']}: {_fmt(r['tau'])} ({r.get('rounds', '-')})" for r in sorted(rs, key=lambda r: r["update"]))
            lines.append(f"| {_fmt(d, '')} | {_fmt(conc, '')} | {_fmt(m, '')} | {pts} |")
    lines += ["", "## Correctness", ""]
    if not result.failures:
        lines.append("No failures." if result.config.get("greedy") else "Sampling run: outputs not compared token for token.")
    for f in result.failures:
        if f["kind"] == "mismatch":
            lines.append(
                f"- **MISMATCH** {f['method']} / {f['dataset']} / concurrency {f['concurrency']}: prompt {f['prompt_index']} "
                f"differs from plain at new token {f['first_mismatch']} (target logit gap {_fmt(f.get('logit_gap'), '.3g')})"
            )
        else:
            lines.append(f"- **ERROR** {f['method']} / {f['dataset']} / concurrency {f['concurrency']}: {f['message']}")
    return "\n".join(lines) + "\n"


def write_plots(result: BenchResult, out_dir) -> list[str]:
    """PNG plots: tau per domain, acceptance by position, tau over online updates (when present)."""
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    files = []
    with_tau = [c for c in result.cells if c.tau is not None]
    if with_tau:
        datasets = list(dict.fromkeys(c.dataset for c in result.cells))
        series = list(dict.fromkeys((c.method, c.concurrency) for c in with_tau))
        multi_c = len({s[1] for s in series}) > 1
        fig = Figure(figsize=(max(6, 1.2 * len(datasets) * max(1, len(series)) / 2), 4))
        ax = fig.add_subplot()
        width = 0.8 / len(series)
        for k, (m, conc) in enumerate(series):
            vals = []
            for d in datasets:
                hit = [c.tau for c in with_tau if (c.method, c.concurrency, c.dataset) == (m, conc, d)]
                vals.append(hit[0] if hit else float("nan"))
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(datasets))]
            ax.bar(xs, vals, width, label=f"{m} (c={conc})" if multi_c else m)
        ax.set_xticks(range(len(datasets)), datasets)
        ax.set_ylabel("mean tokens per round (tau)")
        ax.set_title("Acceptance length per domain")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        path = out_dir / "tau_per_domain.png"
        fig.savefig(path, dpi=120)
        files.append(str(path))

    with_pos = [c for c in result.cells if c.position_acceptance]
    if with_pos:
        datasets = list(dict.fromkeys(c.dataset for c in with_pos))
        multi_c = len({c.concurrency for c in with_pos}) > 1
        fig = Figure(figsize=(5 * len(datasets), 4))
        for i, d in enumerate(datasets):
            ax = fig.add_subplot(1, len(datasets), i + 1)
            for c in (c for c in with_pos if c.dataset == d):
                ys = [float("nan") if v is None else v for v in c.position_acceptance]
                ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"{c.method} (c={c.concurrency})" if multi_c else c.method)
            ax.set_title(d)
            ax.set_xticks(range(1, max(len(c.position_acceptance) for c in with_pos) + 1))
            ax.set_xlabel("draft position")
            ax.set_ylabel("acceptance rate")
            ax.set_ylim(0, 1.05)
            ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / "acceptance_by_position.png"
        fig.savefig(path, dpi=120)
        files.append(str(path))

    records = [r for r in _online_records(result.online) if r.get("tau") is not None]
    if records:
        series: dict[tuple, list] = {}
        for r in records:
            series.setdefault((r.get("method"), r.get("dataset"), r.get("concurrency")), []).append(r)
        multi_c = len({k[2] for k in series}) > 1
        fig = Figure(figsize=(7, 4))
        ax = fig.add_subplot()
        for (m, d, conc), rs in series.items():
            rs = sorted(rs, key=lambda r: r["update"])
            label = " / ".join(str(x) for x in (m, d) if x is not None) or "tau"
            label += f" (c={conc})" if multi_c and conc is not None else ""
            ax.plot([r["update"] for r in rs], [r["tau"] for r in rs], marker="o", label=label)
        ax.set_xlabel("online updates applied")
        ax.set_ylabel("tau since the previous update")
        ax.set_title("Acceptance length over online updates")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        path = out_dir / "tau_online.png"
        fig.savefig(path, dpi=120)
        files.append(str(path))
    return files


def write_outputs(result: BenchResult, out_dir, plots: bool = True) -> list[str]:
    """Write ``bench.json``, ``bench.md`` and (matplotlib permitting) the PNG plots into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [str(out / "bench.json"), str(out / "bench.md")]
    if plots:
        try:
            files += write_plots(result, out)
        except ImportError:
            print("plots skipped: matplotlib is not installed (pip install 'adaflash-hf[plot]')", file=sys.stderr)
    result.files = files
    (out / "bench.md").write_text(result.to_markdown(), encoding="utf-8")
    (out / "bench.json").write_text(result.to_json() + "\n", encoding="utf-8")
    return files


# ----------------------------------------------------------------------------- CLI
def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in _csv(s)]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `adaflash bench` flags to `parser` (a subcommand parser or a fresh one)."""
    g = parser.add_argument_group("models")
    g.add_argument("--target", help="target model: local path or Hub id")
    g.add_argument("--drafter", help="AdaFlash / DFlash drafter: local path or Hub id")
    g.add_argument("--tokenizer", help="tokenizer (default: the target's)")
    g.add_argument("--reference", action="store_true", help="use the embedded reference pair (adaflash_hf.reference)")
    g.add_argument("--assistant", help="small autoregressive assistant for hf_assisted")
    g = parser.add_argument_group("workload")
    g.add_argument("--datasets", type=_csv, default=["gsm8k"], help="comma list of dataset names (blend included) or jsonl:PATH")
    g.add_argument("--data-dir", help="root of the eval datasets (default: the project's shared/data)")
    g.add_argument("--num-prompts", type=int, default=8)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs checked against plain)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--concurrency", type=_ints, default=[1], help="comma list of batch sizes, e.g. 1,4,16")
    g.add_argument(
        "--methods", type=_csv, default=list(DEFAULT_METHODS), help=f"comma list from: {', '.join(DEFAULT_METHODS)} (default: all)"
    )
    g = parser.add_argument_group("runtime")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32")
    g.add_argument("--attn-implementation", default="sdpa")
    g.add_argument("--warmup", type=int, default=1, help="prompts decoded untimed before each method and concurrency")
    g.add_argument("--prompt-lookup-num-tokens", type=int, default=10, help="candidate tokens per round of prompt_lookup")
    g = parser.add_argument_group("online methods (osd, adaflash)")
    g.add_argument("--online-sample-unit", default="request", choices=("request", "round"),
                   help="what one online sample is: a finished request (the paper's unit) or one verified round")
    g.add_argument("--online-samples-per-update", type=int, default=128, help="samples that trigger an update")
    g.add_argument("--online-epochs", type=int, default=2, help="passes over each update's samples")
    g.add_argument("--online-lr", type=float, default=3e-4, help="drafter learning rate of the online updates")
    g.add_argument(
        "--online-wait", action=argparse.BooleanOptionalAction, default=True,
        help="wait for each triggered update before serving the next batch (reproducible curves; the wait is timed)",
    )  # fmt: skip
    g = parser.add_argument_group("output")
    g.add_argument("--out", help="output folder for bench.json, bench.md and the plots")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--quiet", action="store_true")
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    """Run from parsed `add_arguments` flags; 0 when every check passed, 1 on any failure."""
    config = BenchConfig(
        target=args.target, drafter=args.drafter, tokenizer=args.tokenizer, assistant=args.assistant, reference=args.reference,
        datasets=args.datasets, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, concurrency=args.concurrency,
        methods=args.methods, device=args.device, dtype=args.dtype, attn_implementation=args.attn_implementation,
        warmup=args.warmup, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens, online_sample_unit=args.online_sample_unit, online_samples_per_update=args.online_samples_per_update, online_epochs=args.online_epochs,
        online_lr=args.online_lr, online_wait=args.online_wait, out=args.out, data_dir=args.data_dir, command=getattr(args, "command", None),
        plots=not args.no_plots, verbose=not args.quiet,
    )  # fmt: skip
    result = run_bench(config)
    print(result.to_markdown())
    if result.files:
        print("wrote " + ", ".join(result.files), file=sys.stderr)
    if result.failures:
        _loud(f"{len(result.failures)} failure(s): exit status 1")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`adaflash bench ...` / `python -m adaflash_hf.bench ...`."""
    parser = add_arguments(argparse.ArgumentParser(prog="adaflash bench", description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    args.command = shlex.join(sys.argv) if argv is None else shlex.join(["adaflash", "bench", *argv])
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
