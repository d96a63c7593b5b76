"""`adaflash serve --online --guard-confidence Z` on the reference pair, driven by the official `openai` client (dev CPU):
8 prompts, 24 tokens each, until 3 updates were trained; every answer compared with the target's plain greedy output;
the counters from GET /metrics, each refused update's reason.json printed.

    python docs/logs/guard_confidence_serve_cpu_1205/check.py 50    # output: out_z50.txt; out_z1.txt with 1
"""
import os, re, subprocess, sys, time, json
from concurrent.futures import ThreadPoolExecutor
import httpx, openai, torch
from prometheus_client.parser import text_string_to_metric_families
from adaflash_hf import load_reference_pair
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "2 + 2 =", "The best way to learn", "import numpy as np", "Dear Sir,", "In 1905, Einstein"]
target, _, tok = load_reference_pair()
ids = [tok(p)["input_ids"] for p in PROMPTS]
with torch.inference_mode():
    expected = [tok.decode(target.generate(torch.tensor([x]), max_new_tokens=24, do_sample=False)[0, len(x):], skip_special_tokens=True) for x in ids]
cmd = [sys.executable, "-m", "adaflash_hf.cli", "serve", "--online", "--output-dir", "/tmp/gc_versions", "--port", "0",
       "--samples-per-update", "8", "--guard-samples", "2", "--guard-confidence", sys.argv[1], "--epochs", "1", "--max-slots", "4",
       "--max-len", "128", "--train-share", "1", "--trainer", "thread"]
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open("/tmp/gc_serve.log", "w"), text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
url = re.search(r"at (http://[\d.]+:\d+)/v1", proc.stdout.readline()).group(1)
client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
def metrics():
    return {s.name: s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics").text) for s in f.samples if not s.labels}
def ask(i):
    return i, client.completions.create(model="adaflash-reference", prompt=ids[i], max_tokens=24, temperature=0).choices[0].text
ok = answered = 0
deadline = time.monotonic() + 240
with ThreadPoolExecutor(4) as pool:
    while time.monotonic() < deadline:
        m = metrics()
        if m["adaflash_online_updates_total"] + m["adaflash_online_swaps_refused_total"] >= 3:
            break
        for i, text in pool.map(ask, [(answered + k) % 8 for k in range(8)]):
            ok += text == expected[i]; answered += 1
m = metrics()
print("answered", answered, "equal to plain", ok, "updates", m["adaflash_online_updates_total"], "refused", m["adaflash_online_swaps_refused_total"])
proc.terminate(); print("exit", proc.wait(60))
refused = sorted(os.listdir("/tmp/gc_versions/refused")) if os.path.isdir("/tmp/gc_versions/refused") else []
for r in refused:
    reason = json.load(open(f"/tmp/gc_versions/refused/{r}/reason.json"))
    print(r, reason["reason"], "se", reason.get("gain_standard_error"))
