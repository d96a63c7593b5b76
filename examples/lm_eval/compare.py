"""lm-evaluation-harness against `adaflash serve --reference`, compared with lm-eval's own `hf` model on the plain
reference target (float32, CPU): the same per-sample answers and accuracy, loglikelihoods within 1e-4.

Two tasks from local files (tasks/): gsm8k's test problems (generate-until, through `local-completions` and, with
the chat template, `local-chat-completions`) and MathQA (multiple choice by loglikelihood: `echo` + `logprobs` with
no new token, through `local-completions`); `local-completions` sends its prompts in batches of 8 (prompt lists).
Needs lm-eval (`pip install -e ".[lmeval]"`, in `.[dev]` too); about a minute and a half on two loaded CPU cores
with the defaults. One task index (the local folder alone, not lm-eval's thousands of tasks), one `hf` model and one
server serve every comparison, one lm-eval run per model and prompt format; the test suite runs this script on four
problems of each task against its own server (`--url`).

    python examples/lm_eval/compare.py                       # 20 gsm8k problems, 40 MathQA problems
    python examples/lm_eval/compare.py --gsm8k 100 --mathqa 200
    python examples/lm_eval/compare.py --url http://127.0.0.1:8000 --gsm8k 4 --mathqa 4   # a running server

Prints one line per comparison and `all equal: True|False` (exit status 1 when not).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

TASKS = Path(__file__).resolve().parent / "tasks"
TOL = 1e-4


def start_server(max_len: int = 1024, stderr=subprocess.DEVNULL, timeout: float = 300, lifetime: float | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """`adaflash serve --reference` on a free port of 127.0.0.1; (process, base URL) once it listens. A server that
    has not said where it listens within ``timeout`` seconds is stopped (then this raises); with ``lifetime``, the
    server stops after that many seconds whatever becomes of its caller (GNU `timeout`)."""
    cmd = [sys.executable, "-m", "adaflash_hf.cli", "serve", "--reference", "--port", "0", "--max-len", str(max_len),
           "--max-slots", "8"]
    cmd = ["timeout", str(lifetime), *cmd] if lifetime else cmd
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    watchdog = threading.Timer(timeout, proc.terminate)  # SIGTERM: `timeout` passes it on
    watchdog.start()
    try:
        for line in proc.stdout:
            m = re.search(r"at (http://\S+)/v1 ", line)
            if m:
                return proc, m.group(1)
    finally:
        watchdog.cancel()
    raise RuntimeError(f"adaflash serve exited ({proc.wait()}) before listening")


class Harness:
    """lm-eval's side: the local task folder indexed once, its `hf` model on the plain reference target and its two
    API models on the server at ``url``, each built once and reused for every task."""

    def __init__(self, url: str):
        from lm_eval.models.huggingface import HFLM
        from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI
        from lm_eval.tasks import TaskManager

        from adaflash_hf.reference import REFERENCE_DIR

        target = os.path.join(REFERENCE_DIR, "target")
        self.tasks = TaskManager(include_path=str(TASKS), include_defaults=False)
        api = dict(model="adaflash-reference", tokenizer=target, tokenizer_backend="huggingface", max_retries=1)
        self.models = {"hf": HFLM(pretrained=target, dtype="float32", device="cpu", batch_size=1),
                       "local-completions": LocalCompletionsAPI(base_url=f"{url}/v1/completions", batch_size=8, **api),
                       "local-chat-completions": LocalChatCompletion(base_url=f"{url}/v1/chat/completions",
                                                                     tokenized_requests=False, **api)}

    def samples(self, model: str, docs: dict[str, int], chat: bool = False, max_gen_toks: int | None = None
                ) -> dict[str, list[dict]]:
        """lm-eval's `simple_evaluate` of one model on the first ``docs[task]`` documents of each task, in one run
        (``max_gen_toks``: the generate-until task's cap in place of its file's); each task's logged samples, by
        document."""
        import lm_eval

        out = lm_eval.simple_evaluate(model=self.models[model], tasks=list(docs), log_samples=True,
                                      samples={task: list(range(n)) for task, n in docs.items()},
                                      task_manager=self.tasks, apply_chat_template=chat, bootstrap_iters=0,
                                      gen_kwargs={"max_gen_toks": max_gen_toks} if max_gen_toks else None)
        return {task: sorted(out["samples"][task], key=lambda s: s["doc_id"]) for task in docs}


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


def compare(url: str, gsm8k: int, mathqa: int, chat: bool = True, max_gen_toks: int | None = None
            ) -> list[tuple[str, tuple[bool, str]]]:
    """Every comparison against the server at ``url`` (one lm-eval run per model and prompt format, both tasks in
    each): (name, (equal, line)) each."""
    h = Harness(url)
    docs = {task: n for task, n in (("gsm8k_local", gsm8k), ("mathqa_local", mathqa)) if n}
    served, plain = (h.samples(m, docs, max_gen_toks=max_gen_toks) for m in ("local-completions", "hf"))
    results = []
    if gsm8k:
        results.append(("gsm8k local-completions", same_answers(served["gsm8k_local"], plain["gsm8k_local"],
                                                                "exact_match")))
    if gsm8k and chat:
        chat_docs = {"gsm8k_local": gsm8k}
        served_chat, plain_chat = (h.samples(m, chat_docs, True, max_gen_toks)["gsm8k_local"]
                                   for m in ("local-chat-completions", "hf"))
        results.append(("gsm8k local-chat-completions", same_answers(served_chat, plain_chat, "exact_match")))
    if mathqa:
        results.append(("mathqa local-completions", same_loglikelihoods(served["mathqa_local"], plain["mathqa_local"])))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gsm8k", type=int, default=20, help="gsm8k test problems (the first N)")
    ap.add_argument("--mathqa", type=int, default=40, help="MathQA problems (the first N)")
    ap.add_argument("--no-chat", action="store_true", help="leave out gsm8k through local-chat-completions")
    ap.add_argument("--max-gen-toks", type=int, help="gsm8k's cap on new tokens (default: the task file's, 96)")
    ap.add_argument("--url", help="a running `adaflash serve --reference` (e.g. http://127.0.0.1:8000, --max-len 1024 "
                                  "or more); default: start one on a free port")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    server, url = (None, args.url.rstrip("/")) if args.url else start_server()
    try:
        results = compare(url, args.gsm8k, args.mathqa, not args.no_chat, args.max_gen_toks)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    for name, (ok, line) in results:
        print(f"{name}: {line} -> {'equal' if ok else 'DIFFERENT'}")
    ok = all(ok for _, (ok, _) in results)
    print(f"all equal: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
