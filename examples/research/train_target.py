"""Pretrain the small reference *target* LM (Qwen3 architecture) on the pretokenized corpus.

    python examples/research/train_target.py --data DIR --out OUTDIR [--minutes 6] [--device cuda]
    python examples/research/train_target.py --data DIR --out OUTDIR --device cpu --steps 20 --tiny

``DIR`` is the output of ``python examples/research/pretokenize.py --out DIR``. The run is a plain
PyTorch loop: random contiguous ``--seq-len`` windows of ``train_tokens.npy``, bf16 autocast on CUDA,
fused AdamW (betas 0.9/0.95, weight decay on matrices only), cosine LR with linear warmup, grad clip,
optional ``torch.compile`` (default on for CUDA).

Time budget: ``--minutes`` is the wall clock of the *whole command* (from interpreter start to the end
of saving). Training stops ``--reserve-s`` seconds before it, leaving time for the final eval, the
save and the sample generations. The LR schedule is defined over an estimated step count: after a few
compile / warm-up steps the step time is measured (plus the cost of the periodic held-out eval) and
the total number of steps is fixed from the remaining budget. The run is also capped at ``--epochs``
passes over the corpus (default 10: on a GPU the reference corpus, not the time, is the limit, and
more passes overfit). ``--steps N`` fixes the total instead (the time
budget still applies as a safety stop).

Writes ``OUTDIR/train_log.jsonl`` (one line per log step: step, tokens, loss, lr, elapsed, tok_per_s;
eval lines carry ``eval_loss``), ``OUTDIR/train_summary.json``, and ``OUTDIR/target/``: the model in
bf16 (safetensors shards of <= 15 MB), the tokenizer, and a generation config whose eos ids are
``[<|im_end|>, <|endoftext|>]``.
"""

from __future__ import annotations

import time

_T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from target_corpus import WindowSampler, eval_batches, load_corpus, sample_prompts  # noqa: E402, F401

# Passes over the training corpus the CLI caps a run at: on the reference corpus the held-out loss
# is lowest near here and more passes overfit.
DEFAULT_EPOCHS = 10.0

# Model sizes. "reference" is the ~12.5M-parameter target of the reference pair.
REFERENCE_DIMS = dict(
    hidden_size=384,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1024,
)
TINY_DIMS = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
)


# ------------------------------------------------------------------------------------ model


def build_config(tok, dims: dict | None = None, vocab_size: int | None = None, **overrides):
    """``Qwen3Config`` for the target: vocab from the tokenizer (rounded up to a multiple of 64),
    eos / pad / bos ids from the tokenizer (bos = eos, as Qwen does), sdpa attention."""
    from transformers import Qwen3Config

    if vocab_size is None:
        vocab_size = len(tok)
        vocab_size = (vocab_size + 63) // 64 * 64
    eos = tok.eos_token_id
    bos = tok.bos_token_id if tok.bos_token_id is not None else eos
    kw = dict(REFERENCE_DIMS if dims is None else dims)
    kw.update(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        attention_dropout=0.0,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=tok.pad_token_id,
        use_cache=True,
    )
    kw.update(overrides)
    cfg = Qwen3Config(**kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(config):
    from transformers import Qwen3ForCausalLM

    try:
        model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa")
    except TypeError:  # older signature
        model = Qwen3ForCausalLM(config)
    return model


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class _LMLoss(nn.Module):
    """model + next-token cross-entropy in one module (what gets compiled)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


# ---------------------------------------------------------------------------------- schedule


def lr_at(step: int, total: int, warmup: int, peak: float, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


# ------------------------------------------------------------------------------------- train


def _autocast(device: torch.device, enabled: bool):
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if enabled and device.type == "cpu":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


@torch.no_grad()
def evaluate(model, batches: dict, device, bf16: bool, batch_size: int) -> dict:
    was = model.training
    model.eval()
    res = {}
    for d, w in batches.items():
        tot, n = 0.0, 0
        for i in range(0, len(w), batch_size):
            b = w[i : i + batch_size].to(device)
            with _autocast(device, bf16):
                logits = model(input_ids=b[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), b[:, 1:].reshape(-1), reduction="sum")
            tot += float(loss)
            n += b[:, 1:].numel()
        res[d] = round(tot / max(1, n), 4)
    if res:
        res["mean"] = round(sum(res.values()) / len(res), 4)
    model.train(was)
    return res


def generate_samples(model, tok, prompts, device, max_new_tokens: int = 64) -> list[dict]:
    from adaflash_hf.training.tokenizer import stop_token_ids

    stops = stop_token_ids(tok)
    res = []
    model.eval()
    for d, ids in prompts:
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=stops, pad_token_id=tok.pad_token_id,
            )
        gen = y[0, len(ids):].tolist()
        res.append({"domain": d, "prompt": tok.decode(ids), "completion": tok.decode(gen)})
    return res


def save_target(model, tok, out_dir: Path, max_shard_size: str = "15MB") -> Path:
    from transformers import GenerationConfig

    from adaflash_hf.training.tokenizer import stop_token_ids

    target = out_dir / "target"
    target.mkdir(parents=True, exist_ok=True)
    model = model.to(dtype=torch.bfloat16)
    model.config.dtype = torch.bfloat16
    stops = stop_token_ids(tok)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=stops,
        pad_token_id=tok.pad_token_id,
        do_sample=False,
    )
    try:
        model.save_pretrained(target, max_shard_size=max_shard_size, safe_serialization=True)
    except TypeError:  # transformers versions without the (always-on) safe_serialization flag
        model.save_pretrained(target, max_shard_size=max_shard_size)
    tok.save_pretrained(target)
    return target


@dataclass
class TargetRecipe:
    """How to train the target (the flags of ``python examples/research/train_target.py``).

    ``data``: a folder written by ``pretokenize --out``; ``out``: the output folder. ``minutes`` is
    the wall-clock budget counted from ``t_start`` (default: when :func:`train` starts; the CLI
    passes the interpreter start), of which ``reserve_s`` is kept for the final eval, samples and
    save. ``steps`` fixes the step count; ``epochs`` caps the passes over the corpus. ``device``,
    ``batch_size``, ``compile`` and ``bf16`` default by device (CUDA: 128, compiled, bf16; CPU: 8,
    eager, fp32). ``tiny`` selects the test-size dims; ``model_overrides`` changes single dims.
    """

    data: str | Path
    out: str | Path
    minutes: float = 6.0
    steps: int | None = None
    epochs: float | None = None
    device: str | None = None
    batch_size: int | None = None
    seq_len: int = 512
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_frac: float = 0.02
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    compile: bool | None = None
    bf16: bool | None = None
    tiny: bool = False
    model_overrides: dict | None = None
    log_every: int = 10
    eval_every: int | None = None
    eval_windows: int = 64
    reserve_s: float = 30.0
    fixed_batch: bool = False
    seed: int = 0
    sample_tokens: int = 64
    save: bool = True
    quiet: bool = False
    t_start: float | None = None


class _Schedule:
    """The step budget: fixed by ``steps`` (capped by ``epochs``), or, without ``steps``, set once
    from the measured step time (plus the periodic eval's cost) and the time left before the deadline."""

    def __init__(self, r: TargetRecipe, dev: torch.device, n_tokens: int, batch_size: int, compile: bool):
        self.r, self.dev = r, dev
        self.measure_warm = 5 if compile else 2
        self.measure_n = 20 if dev.type == "cuda" else 3
        self.epoch_steps = None
        if r.epochs is not None:
            self.epoch_steps = max(1, math.ceil(r.epochs * n_tokens / (batch_size * r.seq_len)))
        if r.steps is not None:
            self.total = r.steps if self.epoch_steps is None else min(r.steps, self.epoch_steps)
            self.fixed = True
        else:  # provisional, replaced once the step time is measured (min of time- and epoch-based totals)
            self.total = self.epoch_steps if self.epoch_steps is not None else 10_000
            self.fixed = False
        self.warmup = max(1, int(round(r.warmup_frac * self.total)))
        self.eval_every = r.eval_every
        if self.eval_every is None:
            self.eval_every = 250 if dev.type == "cuda" else max(1, self.total // 2 if self.fixed else 50)
        self.t_measure = None

    def lr(self, step: int) -> float:
        return lr_at(step, self.total, self.warmup, self.r.lr, self.r.min_lr_ratio)

    def _sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def after_step(self, step: int, deadline: float, eval_cost, tokens_per_step: int, n_tokens: int, say) -> None:
        """Measure the step time over steps ``measure_warm..measure_warm + measure_n`` and fix the total.
        ``eval_cost``: a callable timing one warm eval (or returning the step-0 eval's cost)."""
        if self.fixed:
            return
        if step == self.measure_warm:
            self._sync()
            self.t_measure = time.time()
        elif step == self.measure_warm + self.measure_n:
            self._sync()
            step_t = (time.time() - self.t_measure) / self.measure_n
            cost = eval_cost()
            now = time.time()
            per_step = step_t + cost / max(1, self.eval_every)
            time_total = step + max(1, int((deadline - now) / per_step * 0.98))
            self.total = time_total if self.epoch_steps is None else min(time_total, self.epoch_steps)
            self.warmup = max(1, int(round(self.r.warmup_frac * self.total)))
            self.fixed = True
            ep = "" if self.epoch_steps is None else f", {self.r.epochs:g} epochs = {self.epoch_steps}"
            say(f"[train_target] step time {step_t * 1000:.1f} ms ({tokens_per_step / step_t:,.0f} tok/s), "
                f"eval {cost:.2f}s -> total {self.total} steps (time allows {time_total}{ep}), warmup {self.warmup}, "
                f"~{self.total * tokens_per_step / 1e6:.0f}M tokens ({self.total * tokens_per_step / n_tokens:.1f} epochs)")


class _TargetRun:
    """One training run of :func:`train`: the model, optimizer, data and logs, and the loop."""

    def __init__(self, r: TargetRecipe):
        from transformers import AutoTokenizer

        self.r = r
        self.t_start = time.time() if r.t_start is None else r.t_start
        self.deadline = self.t_start + r.minutes * 60.0 - r.reserve_s
        self.say = (lambda *a: None) if r.quiet else (lambda *a: print(*a, flush=True))
        dev = self.dev = torch.device(r.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.compile = dev.type == "cuda" if r.compile is None else r.compile
        self.bf16 = dev.type == "cuda" if r.bf16 is None else r.bf16
        self.batch_size = r.batch_size if r.batch_size is not None else (128 if dev.type == "cuda" else 8)
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(r.seed)
        self.out = Path(r.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.tokens, self.ev, meta = load_corpus(r.data)
        self.tok = AutoTokenizer.from_pretrained(Path(r.data) / "tokenizer")
        self.domains = meta.get("domains", ["math", "code", "chat", "prose"])
        self._build_model()
        self.sampler = WindowSampler(self.tokens, r.seq_len, self.batch_size, dev, r.seed)
        self.fixed_xy = self.sampler() if r.fixed_batch else None
        self.ev_batches = eval_batches(self.ev, self.domains, r.seq_len, r.eval_windows)
        self.eval_bs = max(1, min(self.batch_size, 64))
        self.sched = _Schedule(r, dev, len(self.tokens), self.batch_size, self.compile)
        self.log_f = open(self.out / "train_log.jsonl", "w")

    def _build_model(self) -> None:
        r, dev = self.r, self.dev
        dims = dict(TINY_DIMS if r.tiny else REFERENCE_DIMS)
        dims.update(r.model_overrides or {})
        self.config = build_config(self.tok, dims)
        self.model = build_model(self.config).to(dev)
        self.model.train()
        self.n_params = count_params(self.model)
        self.say(f"[train_target] Qwen3ForCausalLM {self.n_params / 1e6:.2f}M params (vocab {self.config.vocab_size}, "
                 f"hidden {self.config.hidden_size}, layers {self.config.num_hidden_layers}); corpus {len(self.tokens):,} "
                 f"tokens; device {dev}, batch {self.batch_size}x{r.seq_len}, bf16 {self.bf16}, compile {self.compile}")
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        opt_kw = dict(lr=r.lr, betas=(0.9, 0.95), eps=1e-8)
        if dev.type == "cuda":
            opt_kw["fused"] = True
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": r.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], **opt_kw
        )
        self.step_fn = _LMLoss(self.model)
        if self.compile:
            self.step_fn = torch.compile(self.step_fn)

    def log(self, rec: dict) -> None:
        self.log_f.write(json.dumps(rec) + "\n")
        self.log_f.flush()

    def evaluate(self) -> dict:
        return evaluate(self.model, self.ev_batches, self.dev, self.bf16, self.eval_bs) if self.ev_batches else {}

    def elapsed(self) -> float:
        return round(time.time() - self.t_start, 2)

    def _timed_eval(self) -> float:
        t = time.time()
        self.evaluate()
        return time.time() - t

    def _step(self) -> torch.Tensor:
        x, y = self.fixed_xy if self.fixed_xy is not None else self.sampler()
        with _autocast(self.dev, self.bf16):
            loss = self.step_fn(x, y)
        loss.backward()
        if self.r.grad_clip and self.r.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.r.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def loop(self) -> tuple[int, list, str, float]:
        """Train until the step budget or the deadline: ``(steps, [(step, loss)], stopped_by)``."""
        r, sched = self.r, self.sched
        t0 = time.time()
        ev_res = self.evaluate()
        eval_cost = time.time() - t0
        if ev_res:
            self.log({"step": 0, "tokens": 0, "eval_loss": ev_res, "elapsed": self.elapsed()})
            self.say(f"[train_target] step 0 eval {ev_res}")
        self.t_train0 = time.time()
        self.say(f"[train_target] setup took {self.t_train0 - self.t_start:.1f}s; training until "
                 f"{'step ' + str(sched.total) if sched.fixed else 'the time budget'} (deadline in {self.deadline - self.t_train0:.0f}s)")
        loss_acc, n_acc, losses, step, stopped_by = torch.zeros((), device=self.dev), 0, [], 0, "steps"
        t_log, tok_log, tps = time.time(), 0, self.batch_size * r.seq_len
        while step < sched.total:
            if time.time() >= self.deadline:
                stopped_by = "time"
                break
            cur_lr = sched.lr(step)
            for g in self.opt.param_groups:
                g["lr"] = cur_lr
            loss_acc += self._step()
            n_acc, step, tok_log = n_acc + 1, step + 1, tok_log + tps
            sched.after_step(step, self.deadline, (self._timed_eval if self.ev_batches else lambda: eval_cost), tps,
                             len(self.tokens), self.say)  # fmt: skip
            if step % r.log_every == 0 or step == sched.total:
                losses.append((step, self._log_train(step, float(loss_acc) / max(1, n_acc), cur_lr, tok_log, t_log)))
                loss_acc.zero_()
                n_acc, t_log, tok_log = 0, time.time(), 0
            if self.ev_batches and sched.eval_every and step % sched.eval_every == 0 and step < sched.total:
                res = self.evaluate()
                self.log({"step": step, "tokens": step * tps, "eval_loss": res, "elapsed": self.elapsed()})
                self.say(f"[train_target] step {step} eval {res}")
        if n_acc:
            losses.append((step, float(loss_acc) / n_acc))
            self.log({"step": step, "tokens": step * tps, "loss": round(losses[-1][1], 4),
                      "lr": sched.lr(max(0, step - 1)), "elapsed": self.elapsed(), "tok_per_s": None})
        return step, losses, stopped_by

    def _log_train(self, step: int, mean_loss: float, cur_lr: float, tok_log: int, t_log: float) -> float:
        now = time.time()
        rec = {"step": step, "tokens": step * self.batch_size * self.r.seq_len, "loss": round(mean_loss, 4), "lr": cur_lr,
               "elapsed": round(now - self.t_start, 2), "tok_per_s": round(tok_log / max(1e-9, now - t_log))}
        self.log(rec)
        le = self.r.log_every
        if not self.r.quiet and (step % (le * 10) == 0 or step <= le or step == self.sched.total):
            self.say(f"[train_target] step {step}/{self.sched.total} loss {mean_loss:.4f} lr {cur_lr:.2e} "
                     f"{rec['tok_per_s']:,} tok/s elapsed {rec['elapsed']:.0f}s")
        return mean_loss

    def finish(self, step: int, losses: list, stopped_by: str) -> dict:
        """Final eval, sample generations, save; the summary (also written to ``train_summary.json``)."""
        r = self.r
        train_s = time.time() - self.t_train0
        final_eval = self.evaluate()
        if final_eval:
            self.log({"step": step, "tokens": step * self.batch_size * r.seq_len, "eval_loss": final_eval,
                      "elapsed": self.elapsed()})
        self.say(f"[train_target] done: {step} steps in {train_s:.0f}s (stopped by {stopped_by}), "
                 f"final train loss {losses[-1][1] if losses else float('nan'):.4f}, eval {final_eval}")
        samples = self._samples() if r.sample_tokens > 0 else []
        target = None
        if r.save:
            target = save_target(self.model, self.tok, self.out)
            size = sum(p.stat().st_size for p in target.iterdir())
            self.say(f"[train_target] saved {target} ({size / 1e6:.1f} MB)")
        seen = step * self.batch_size * r.seq_len
        summary = {
            "params": self.n_params,
            "config": {k: getattr(self.config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                            "num_attention_heads", "num_key_value_heads", "head_dim",
                                                            "intermediate_size")},
            "device": str(self.dev), "batch_size": self.batch_size, "seq_len": r.seq_len, "steps": step,
            "planned_steps": self.sched.total, "warmup_steps": self.sched.warmup, "tokens_seen": seen,
            "epochs": seen / len(self.tokens), "stopped_by": stopped_by, "train_seconds": round(train_s, 1),
            "total_seconds": round(time.time() - self.t_start, 1),
            "first_loss": losses[0][1] if losses else None, "final_loss": losses[-1][1] if losses else None,
            "losses": losses, "eval_loss": final_eval, "samples": samples, "target_dir": str(target) if target else None,
        }  # fmt: skip
        (self.out / "train_summary.json").write_text(json.dumps(summary, indent=2))
        self.log_f.close()
        return summary

    def _samples(self) -> list[dict]:
        samples = []
        try:
            prompts = sample_prompts(self.ev, self.domains, self.tok)
            samples = generate_samples(self.model, self.tok, prompts, self.dev, self.r.sample_tokens)
        except Exception as e:  # never lose the checkpoint over a sampling problem
            self.say(f"[train_target] sample generation failed: {e!r}")
        for s in samples:
            self.say(f"\n--- [{s['domain']}] prompt: {s['prompt'][-300:]!r}\n--> {s['completion']!r}")
        return samples


def train(recipe: TargetRecipe) -> dict:
    """Train the target as ``recipe`` says; returns a summary dict (also written to
    ``out/train_summary.json``)."""
    run = _TargetRun(recipe)
    step, losses, stopped_by = run.loop()
    return run.finish(step, losses, stopped_by)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="pretokenized folder (pretokenize --out)")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--minutes", type=float, default=6.0, help="wall-clock budget of the whole command")
    ap.add_argument("--reserve-s", type=float, default=30.0, help="seconds kept for final eval/samples/save")
    ap.add_argument("--steps", type=int, default=None, help="fixed number of steps (smoke tests)")
    ap.add_argument("--epochs", type=float, default=DEFAULT_EPOCHS,
                    help="cap the run at this many passes over train_tokens; the LR schedule then spans them "
                         f"(default {DEFAULT_EPOCHS:g}: best held-out loss on the reference corpus; 0 = no cap, "
                         "train for the whole time budget)")
    ap.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 128 on cuda, 8 on cpu")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05, help="final LR as a fraction of the peak")
    ap.add_argument("--warmup-frac", type=float, default=0.02)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--compile", dest="compile", action="store_true", default=None)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny model dims (tests)")
    ap.add_argument("--hidden-size", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out windows per domain")
    ap.add_argument("--fixed-batch", action="store_true", help="reuse one batch (overfit check)")
    ap.add_argument("--sample-tokens", type=int, default=64, help="greedy tokens per sample prompt (0: none)")
    ap.add_argument("--no-save", dest="save", action="store_false")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    overrides = {}
    if a.hidden_size:
        overrides["hidden_size"] = a.hidden_size
    if a.layers:
        overrides["num_hidden_layers"] = a.layers
    train(TargetRecipe(
        a.data, a.out, minutes=a.minutes, steps=a.steps, epochs=a.epochs or None, device=a.device, batch_size=a.batch_size,
        seq_len=a.seq_len, lr=a.lr, min_lr_ratio=a.min_lr_ratio, warmup_frac=a.warmup_frac,
        weight_decay=a.weight_decay, grad_clip=a.grad_clip, compile=a.compile, bf16=a.bf16, tiny=a.tiny,
        model_overrides=overrides, log_every=a.log_every, eval_every=a.eval_every, eval_windows=a.eval_windows,
        reserve_s=a.reserve_s, fixed_batch=a.fixed_batch, seed=a.seed, sample_tokens=a.sample_tokens, save=a.save,
        t_start=_T_START,
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
