"""lm-evaluation-harness against `adaflash serve --reference`, compared with lm-eval's own `hf` model on the plain
reference target (float32, CPU): the same per-sample answers and accuracy, loglikelihoods within 1e-4.

Two tasks from local files (tasks/): gsm8k's test problems (generate-until, through `local-completions` and, with
the chat template, `local-chat-completions`) and MathQA (multiple choice by loglikelihood: `echo` + `logprobs` with
one new token, through `local-completions`). Needs lm-eval (`pip install -e ".[lmeval]"`); about 20 minutes on two
loaded CPU cores with the defaults, most of it lm-eval's `hf` model generating.

    python examples/lm_eval/compare.py                       # 20 gsm8k problems, 40 MathQA problems
    python examples/lm_eval/compare.py --gsm8k 100 --mathqa 200

Prints one line per comparison and `all equal: True|False` (exit status 1 when not).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

TASKS = Path(__file__).resolve().parent / "tasks"
TOL = 1e-4


def start_server(max_len: int) -> tuple[subprocess.Popen, str]:
    """`adaflash serve --reference` on a free port; (process, base URL) once it listens."""
    cmd = [sys.executable, "-m", "adaflash_hf.cli", "serve", "--reference", "--port", "0", "--max-len", str(max_len),
           "--max-slots", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        m = re.search(r"at (http://\S+)/v1 ", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError(f"adaflash serve exited ({proc.wait()}) before listening")


def evaluate(model: str, model_args: str, task: str, limit: int, chat: bool = False, batch_size: int = 1) -> list[dict]:
    """lm-eval's `simple_evaluate` on one task; its logged samples, by document."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], limit=limit, log_samples=True,
                                  task_manager=TaskManager(include_path=str(TASKS)), batch_size=batch_size,
                                  apply_chat_template=chat)
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def same_answers(served: list[dict], plain: list[dict], metric: str) -> tuple[bool, str]:
    """Generate-until: every sample's generated text and score equal."""
    texts = sum(a["resps"] == b["resps"] for a, b in zip(served, plain))
    scores = [s[metric] for s in served], [s[metric] for s in plain]
    ok = texts == len(plain) == len(served) and scores[0] == scores[1]
    chars = sum(len(s["resps"][0][0]) for s in served) / max(len(served), 1)
    return ok, (f"answers equal {texts}/{len(plain)} (mean {chars:.0f} characters), {metric} {sum(scores[0])}/{len(served)} "
                f"vs {sum(scores[1])}/{len(plain)}")


def same_loglikelihoods(served: list[dict], plain: list[dict]) -> tuple[bool, str]:
    """Multiple choice: every choice's loglikelihood within TOL, its is-greedy flag and every sample's acc equal."""
    worst, greedy, acc = 0.0, True, True
    for a, b in zip(served, plain):
        for (ll_a, g_a), (ll_b, g_b) in zip((r[0] for r in a["resps"]), (r[0] for r in b["resps"])):
            worst, greedy = max(worst, abs(ll_a - ll_b)), greedy and g_a == g_b
        acc = acc and a["acc"] == b["acc"] and a["acc_norm"] == b["acc_norm"]
    ok = len(served) == len(plain) and worst < TOL and greedy and acc
    right = sum(s["acc"] for s in served), sum(s["acc"] for s in plain)
    return ok, f"max |loglikelihood diff| {worst:.2e}, is_greedy equal {greedy}, acc {right[0]}/{len(served)} vs {right[1]}/{len(plain)}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gsm8k", type=int, default=20, help="gsm8k test problems (the first N)")
    ap.add_argument("--mathqa", type=int, default=40, help="MathQA problems (the first N)")
    ap.add_argument("--no-chat", action="store_true", help="leave out gsm8k through local-chat-completions")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from adaflash_hf.reference import REFERENCE_DIR

    target = os.path.join(REFERENCE_DIR, "target")
    hf = f"pretrained={target},dtype=float32,device=cpu"
    server, url = start_server(max_len=1024)
    try:
        api = f"model=adaflash-reference,tokenizer={target},tokenizer_backend=huggingface,max_retries=1"
        results = []
        if args.gsm8k:
            served = evaluate("local-completions", f"{api},base_url={url}/v1/completions", "gsm8k_local", args.gsm8k)
            results.append(("gsm8k local-completions",
                            same_answers(served, evaluate("hf", hf, "gsm8k_local", args.gsm8k), "exact_match")))
        if args.gsm8k and not args.no_chat:
            chat = f"{api},base_url={url}/v1/chat/completions,tokenized_requests=False"
            served = evaluate("local-chat-completions", chat, "gsm8k_local", args.gsm8k, chat=True)
            results.append(("gsm8k local-chat-completions",
                            same_answers(served, evaluate("hf", hf, "gsm8k_local", args.gsm8k, chat=True), "exact_match")))
        if args.mathqa:
            served = evaluate("local-completions", f"{api},base_url={url}/v1/completions", "mathqa_local", args.mathqa,
                              batch_size=8)
            results.append(("mathqa local-completions", same_loglikelihoods(served, evaluate("hf", hf, "mathqa_local",
                                                                                               args.mathqa))))
    finally:
        server.terminate()
        server.wait(30)
    for name, (ok, line) in results:
        print(f"{name}: {line} -> {'equal' if ok else 'DIFFERENT'}")
    ok = all(ok for _, (ok, _) in results)
    print(f"all equal: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
