"""Two GPUs on one host: the drafter trained data-parallel, and the online trainer beside the server on its own GPU.

``train``: for each seed, the reference target's answers are regenerated once (one process, ``--regen-only``), then the
same recipe trains a drafter for ``--minutes`` on one GPU (``CUDA_VISIBLE_DEVICES=0``) and on two
(``accelerate launch --num_processes 2``, ``--batch-size`` per process); each run's ``train_summary.json`` gives its
samples per second (every process's samples) and its held-out acceptance proxy (mean ``accepted + 1`` per block over
the target's greedy answers to the eval prompts of the seed: the teacher-forced tau). Passes when two GPUs reach at
least ``--min-speedup`` times one GPU's samples/s and their mean held-out tau lies within the seeds' spread of one
GPU's (the larger of the two runs' standard deviations across seeds, at least 1% of tau).

``serve``: the server ``adaflash serve`` builds (``cli.serve``'s own service, here in-process to read the adapter),
greedy, fp32, on GPU 0: plain (``--plain``, the reference answers), learning off, and ``--online --trainer-device
cuda:1``; the same stream of chat requests is sent in chunks at concurrency 1 and 32. Online, the chunks during which
an update trained (at their start and end) are compared with the same chunks served with learning off: tok/s ratio
(passes at ``--min-ratio``), and every answer must equal plain decoding's. GPU 0's and GPU 1's memory in use (all
processes) is reported for each run: the trainer's copy of the target and its updates live on GPU 1.

Usage (a host with two GPUs; install as examples/reference_pair/gpu_drafters.sh does, data in $ADAFLASH_DATA):
    python examples/two_gpu/run.py train --seeds 0 --out $OUT/two_gpu      # ~5 min a seed at --minutes 2
    python examples/two_gpu/run.py serve --out $OUT/two_gpu                 # ~5 min
Results are merged into ``--out``/two_gpu.json (one seed per call is fine); exit status 0 when what ran passed, 1 when
it did not, 2 on a host with fewer than two GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

TRAIN_RECIPE = ["--domains", "chat,prose", "--num-prompts", "6144", "--prompts-per-sample", "4", "--max-new-tokens",
                "160", "--gen-batch-size", "4096", "--eval-per-domain", "16", "--eval-domains", "chat,prose",
                "--no-progress"]  # fmt: skip
CONCURRENCIES = (1, 32)
LAUNCH_TWO = ["-m", "accelerate.commands.launch", "--num_processes", "2", "--multi_gpu", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no"]  # the recipe's bf16 autocast is its own


def two_gpus_or_exit() -> None:
    """Stop with status 2, saying why, on a host where this process sees fewer than two CUDA devices."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        print(f"two_gpu/run.py: needs two CUDA devices; this process sees {n}{shown}: run it on a two-GPU host",
              file=sys.stderr)
        raise SystemExit(2)


def merge(out: Path, key: str, value) -> dict:
    """``value`` under ``key`` of ``out``/two_gpu.json (kept across calls), written atomically."""
    path = out / "two_gpu.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    if isinstance(value, dict) and isinstance(result.get(key), dict):
        result[key].update(value)
    else:
        result[key] = value
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)
    return result


# ------------------------------------------------------------------------------ training


def _run(cmd: list[str], log: Path, env: dict | None = None) -> None:
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}).returncode
    if rc != 0:
        sys.stdout.write(log.read_text()[-4000:])
        raise SystemExit(f"failed (exit {rc}): {' '.join(cmd)}")
    print(f"  done in {time.time() - t0:.0f} s (log {log})", flush=True)


def held_out_tau(summary: dict) -> float:
    """The acceptance proxy over every held-out block of every eval domain."""
    per = summary["eval_accept_proxy"].values()
    return sum(d["accept_len"] * d["blocks"] for d in per) / sum(d["blocks"] for d in per)


def train_seed(args, seed: int, out: Path) -> dict:
    """Regenerate once, train on one GPU and on two: the two summaries' figures."""
    from adaflash_hf.reference import REFERENCE_DIR

    target = os.path.join(REFERENCE_DIR, "target")
    module = ["-m", "adaflash_hf.training.train_drafter"]
    common = ["--target", target, *TRAIN_RECIPE, "--seed", str(seed), "--regen-cache", str(out / f"regen_{seed}.jsonl"),
              "--batch-size", str(args.batch_size), "--minutes", str(args.minutes)]  # fmt: skip
    if not (out / f"regen_{seed}.jsonl").is_file():
        _run([sys.executable, *module, *common, "--out", str(out / f"regen_{seed}"), "--regen-only"],
             out / f"regen_{seed}.log", {"CUDA_VISIBLE_DEVICES": "0"})  # fmt: skip
    runs = {"one_gpu": ([sys.executable, *module], {"CUDA_VISIBLE_DEVICES": "0"}),
            "two_gpus": ([sys.executable, *LAUNCH_TWO, *module], {})}
    row = {}
    for name, (launcher, env) in runs.items():
        folder = out / f"{name}_seed{seed}"
        _run([*launcher, *common, "--out", str(folder)], out / f"{name}_seed{seed}.log", env)
        summary = json.loads((folder / "train_summary.json").read_text())
        row[name] = {"samples_per_s": summary["timings"]["train_samples_per_s"], "held_out_tau": held_out_tau(summary),
                     "steps": summary["steps"], "samples_per_step": summary["samples_per_step"],
                     "processes": summary["processes"], "train_s": summary["timings"]["train_s"]}  # fmt: skip
        print(f"  seed {seed} {name}: {row[name]}", flush=True)
    return row


def train_verdict(rows: dict, min_speedup: float) -> dict:
    """Speed-up of the mean samples/s and the held-out tau difference against the seeds' spread."""
    def values(run, key):
        return [r[run][key] for r in rows.values()]

    one, two = values("one_gpu", "held_out_tau"), values("two_gpus", "held_out_tau")
    speedup = statistics.mean(values("two_gpus", "samples_per_s")) / statistics.mean(values("one_gpu", "samples_per_s"))
    spread = max([statistics.stdev(x) for x in (one, two) if len(x) > 1] + [0.01 * statistics.mean(one)])
    diff = statistics.mean(two) - statistics.mean(one)
    return {"seeds": sorted(rows), "speedup": round(speedup, 3), "one_gpu_tau": round(statistics.mean(one), 4),
            "two_gpus_tau": round(statistics.mean(two), 4), "tau_difference": round(diff, 4),
            "tau_spread": round(spread, 4), "speedup_passed": speedup >= min_speedup,
            "tau_passed": abs(diff) <= spread}  # fmt: skip


# ------------------------------------------------------------------------------ serving


def chat_prompts(n: int) -> list[str]:
    """``n`` chat prompts from the package's built-in sets (cycled, numbered past the end)."""
    from adaflash_hf.training.data import builtin_prompts

    base = [r["messages"][0]["content"] for name in ("chat", "math", "code") for r in builtin_prompts(name)]
    return [base[i % len(base)] + ("" if i < len(base) else f" (variant {i // len(base)})") for i in range(n)]


def memory_in_use() -> list[float]:
    """GiB in use on each GPU, every process's (a trainer child's too)."""
    return [round((lambda free, total: (total - free) / 2**30)(*torch.cuda.mem_get_info(i)), 2) for i in range(2)]


async def serve_chunk(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[list[str], int]:
    """Every prompt answered greedily, at most ``concurrency`` in flight: (answers, completion tokens)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def ask(prompt):
        async with gate:
            r = await client.chat.completions.create(model="adaflash-reference", max_tokens=max_tokens, temperature=0,
                                                     messages=[{"role": "user", "content": prompt}])  # fmt: skip
            return r.choices[0].message.content, r.usage.completion_tokens

    try:
        got = await asyncio.gather(*(ask(p) for p in prompts))
    finally:
        await client.close()
    return [g[0] for g in got], sum(g[1] for g in got)


def chunk_size(args, concurrency: int) -> int:
    """Requests per timed chunk: ``--chunk``, else twice the concurrency (at least 8)."""
    return args.chunk or max(8, 2 * concurrency)


def serve_run(kind: str, args, stream: list[str], concurrency: int) -> dict:
    """``stream`` served in chunks by the server ``adaflash serve`` builds with ``kind``'s flags (plain, off,
    online); per chunk: seconds, tokens, whether an update trained at its start and end."""
    from adaflash_hf.cli import build_parser
    from adaflash_hf.cli.serve import _check_models, _service
    from adaflash_hf.serve.server import OpenAIServer, ServeSettings

    flags = {"plain": ["--plain"], "off": [],
             "online": ["--online", "--trainer-device", args.trainer_device, "--output-dir", str(args.out / f"versions_c{concurrency}"),
                        "--fresh", "--samples-per-update", str(args.samples_per_update or chunk_size(args, concurrency)),
                        *args.online_flags.split()]}[kind]
    sargs = build_parser(only=("serve",)).parse_args(["serve", "--reference", "--device", args.serve_device, "--dtype", "fp32",
                                                       "--max-slots", "32", "--port", "0", *flags])  # fmt: skip
    need_drafter = _check_models(sargs)
    server = OpenAIServer(("127.0.0.1", 0), settings=ServeSettings(max_concurrent_requests=512))
    server.service, adapter, _ = _service(sargs, need_drafter)
    server.start()
    chunks, answers = [], []
    try:
        if adapter is not None:  # the trainer and its copy of the target on the trainer's device
            assert adapter.worker.device == torch.device(args.trainer_device), adapter.worker.device
            assert next(adapter.worker.target.parameters()).device == torch.device(args.trainer_device)
        step = chunk_size(args, concurrency)
        for start in range(0, len(stream), step):
            busy = adapter is not None and adapter.busy
            t0 = time.perf_counter()
            texts, tokens = asyncio.run(serve_chunk(server.url, stream[start : start + step], concurrency,
                                                    args.max_tokens))  # fmt: skip
            chunks.append({"seconds": time.perf_counter() - t0, "tokens": tokens, "memory_gib": memory_in_use(),
                           "training": busy and adapter.busy, "updates": adapter.updates if adapter else 0})
            answers += texts
        return {"chunks": chunks, "answers": answers,
                "stats": {k: v for k, v in adapter.stats.items() if k != "history"} if adapter else None}
    finally:
        server.close()
        if adapter is not None:
            adapter.close(abandon=True, timeout=60)


def serve_verdict(runs: dict, min_ratio: float) -> dict:
    """tok/s of the online run's training chunks against the same chunks with learning off; answers against plain."""
    online, off = runs["online"]["chunks"], runs["off"]["chunks"]
    during = [i for i, c in enumerate(online) if c["training"]]

    def tok_s(chunks, idx):
        return sum(chunks[i]["tokens"] for i in idx) / sum(chunks[i]["seconds"] for i in idx) if idx else None

    ratio = tok_s(online, during) / tok_s(off, during) if during else None
    equal = {k: sum(a == b for a, b in zip(runs[k]["answers"], runs["plain"]["answers"])) for k in ("off", "online")}
    n = len(runs["plain"]["answers"])
    return {"chunks_during_updates": len(during), "chunks": len(online), "online_tok_s": tok_s(online, during),
            "off_tok_s": tok_s(off, during), "ratio": ratio, "ratio_passed": ratio is not None and ratio >= min_ratio,
            "answers": n, "equal_to_plain": equal, "answers_passed": all(v == n for v in equal.values()),
            "updates": runs["online"]["chunks"][-1]["updates"]}  # fmt: skip


def serve_all(args) -> dict:
    results = {}
    for c in CONCURRENCIES:
        stream = chat_prompts(chunk_size(args, c) * args.chunks)
        runs = {}
        for kind in ("plain", "off", "online"):
            runs[kind] = serve_run(kind, args, stream, c)
            print(f"  c={c} {kind}: {sum(x['tokens'] for x in runs[kind]['chunks'])} tokens in "
                  f"{sum(x['seconds'] for x in runs[kind]['chunks']):.1f} s", flush=True)
        results[f"c{c}"] = {**serve_verdict(runs, args.min_ratio),
                            "memory_gib": {k: runs[k]["chunks"][-1]["memory_gib"] for k in runs},
                            "online_stats": runs["online"]["stats"]}  # fmt: skip
        print(f"  c={c}: {results[f'c{c}']}", flush=True)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=("train", "serve", "all"))
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "two_gpu")
    p.add_argument("--seeds", default="0,1,2", help="training seeds (one regeneration each)")
    p.add_argument("--minutes", type=float, default=2.0, help="training budget of each run")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--min-speedup", type=float, default=1.7)
    p.add_argument("--chunk", type=int, default=None, help="requests per timed chunk (default: 2 x concurrency, >= 8)")
    p.add_argument("--chunks", type=int, default=12, help="chunks per run")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--samples-per-update", type=int, default=None,
                   help="requests per update (default: a chunk's, so that updates train from the second chunk on)")
    p.add_argument("--online-flags", default="", help="more `adaflash serve` flags for the online run ('--train-share 1')")
    p.add_argument("--min-ratio", type=float, default=0.98)
    p.add_argument("--serve-device", default="cuda:0")
    p.add_argument("--trainer-device", default="cuda:1")
    args = p.parse_args(argv)
    two_gpus_or_exit()
    args.out.mkdir(parents=True, exist_ok=True)
    merge(args.out, "hardware", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
    passed = True
    if args.part in ("train", "all"):
        rows = merge(args.out, "train_runs", {str(s): train_seed(args, int(s), args.out) for s in args.seeds.split(",")})
        verdict = train_verdict(rows["train_runs"], args.min_speedup)
        merge(args.out, "train", verdict)
        print(f"training: {verdict}", flush=True)
        passed &= verdict["speedup_passed"] and verdict["tau_passed"]
    if args.part in ("serve", "all"):
        verdict = serve_all(args)
        merge(args.out, "serve", verdict)
        passed &= all(v["ratio_passed"] and v["answers_passed"] for v in verdict.values())
    print(f"passed: {passed} (results in {args.out / 'two_gpu.json'})")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
