"""Load test of the OpenAI-compatible server on 127.0.0.1 with the official `openai` client (issues 19, 34).

Serves the embedded reference pair (the continuous-batching engine, packed verify) with ``make_server``,
asks every chat prompt once alone (the reference answer), then sends ``--clients`` concurrent requests
(half of them streamed) for ``--rounds`` rounds, greedy, and checks that every one is answered and equals
its request run alone. With ``--slow-clients N`` the rounds run again beside N misbehaving connections
(loopback only, at most 512; a third each: part of the headers trickled a byte a second, a body trickled a
byte a second, a socket that sends nothing), each reconnecting whenever the server drops it; p99 latency
is recorded with and without them. Afterwards the engine must hold nothing (no request or slot lost) and
``/health`` must answer 200. Prints a summary; writes ``server_load_test.json`` and ``server_load_test.md``
into ``--out``.

Usage:
    python examples/server_load_test.py --clients 64 --rounds 3 --out $OUT   # one H200, about 1-2 minutes
    python examples/server_load_test.py --clients 64 --rounds 1 --slow-clients 200 --out $OUT
    python examples/server_load_test.py --smoke       # CPU, 4 clients x 1 round, then again beside 6 slow clients
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from importlib import resources
from pathlib import Path

import torch


def prompts(n: int) -> list[str]:
    """``n`` distinct chat prompts from the package's built-in prompt sets (cycled, numbered past the end)."""
    base = []
    for name in ("chat.jsonl", "math.jsonl", "code.jsonl"):
        text = resources.files("adaflash_hf.training").joinpath("builtin_prompts", name).read_text()
        base += [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    return [base[i % len(base)] + ("" if i < len(base) else f" (variant {i // len(base)})") for i in range(n)]


async def ask(client, prompt: str, max_tokens: int, stream: bool) -> tuple[str, float]:
    t0 = time.perf_counter()
    messages = [{"role": "user", "content": prompt}]
    if stream:
        chunks = await client.chat.completions.create(model="adaflash-reference", messages=messages, max_tokens=max_tokens,
                                                      temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    else:
        out = await client.chat.completions.create(model="adaflash-reference", messages=messages, max_tokens=max_tokens,
                                                   temperature=0)
        text = out.choices[0].message.content
    return text, time.perf_counter() - t0


SLOW_KINDS = ("partial_headers", "slow_body", "idle")
MAX_SLOW_CLIENTS = 512  # both ends of every connection live in this process: well under its file limit


async def slow_client(kind: str, port: int, stop: asyncio.Event, tally: dict) -> None:
    """One misbehaving connection to 127.0.0.1:``port`` of ``kind``, reopened whenever the server drops it,
    until ``stop``; counts how each connection ended (the status the server answered, or "closed")."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as e:
            tally[f"{kind}: connect failed ({e.strerror})"] += 1
            await asyncio.sleep(1.0)
            continue
        if kind == "partial_headers":
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        elif kind == "slow_body":
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n{")
        ended = "stopped"
        try:
            while not stop.is_set():
                try:
                    reply = await asyncio.wait_for(reader.read(65536), timeout=1.0)
                except asyncio.TimeoutError:  # still open: one more byte, never finishing the headers or body
                    writer.write({"partial_headers": b"X", "slow_body": b" "}.get(kind, b""))
                    await writer.drain()
                    continue
                ended = reply[9:12].decode() if reply.startswith(b"HTTP/1.1 ") else "closed"
                break
        except OSError:
            ended = "reset"
        finally:
            writer.close()
        tally[f"{kind}: {ended}"] += 1


def p99(lat: list[float]) -> float | None:
    """The nearest-rank 99th percentile (the slowest request below 100 requests)."""
    return round(sorted(lat)[math.ceil(0.99 * len(lat)) - 1], 3) if lat else None


def new_client(url: str):
    import openai

    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


async def rounds(url: str, args, ps: list[str], alone: list[str], slow: int) -> list[dict]:
    """``--rounds`` rounds of every prompt at once (odd ones streamed); each answer compared with ``alone``.
    Each round opens fresh connections: one kept from an earlier round may be closed by the server (its
    keep-alive timeout) just as a request is sent on it, a client-side race that max_retries=0 would count."""
    out = []
    for r in range(args.rounds):
        client = new_client(url)
        t0 = time.perf_counter()
        try:
            got = await asyncio.gather(*(ask(client, p, args.max_tokens, i % 2 == 1) for i, p in enumerate(ps)),
                                       return_exceptions=True)
        finally:
            await client.close()
        wall = time.perf_counter() - t0
        errors = [f"{type(g).__name__}: {g}" for g in got if isinstance(g, BaseException)]
        ok = [g for g in got if not isinstance(g, BaseException)]
        equal = sum(1 for g, ref in zip(got, alone) if not isinstance(g, BaseException) and g[0] == ref)
        lat = sorted(g[1] for g in ok)
        out.append({"round": len(out) + 1, "slow_clients": slow, "answered": len(ok), "equal_to_alone": equal,
                    "errors": errors[:5], "wall_s": round(wall, 3),
                    "p50_s": round(statistics.median(lat), 3) if lat else None, "p99_s": p99(lat),
                    "max_s": round(lat[-1], 3) if lat else None})
        print(f"round {r + 1} beside {slow} slow clients: answered {len(ok)}/{len(ps)}, equal to alone {equal}/{len(ps)}, "
              f"wall {wall:.2f} s, p99 {p99(lat)} s", flush=True)
    return out


async def load(url: str, args, ps: list[str]) -> dict:
    client = new_client(url)
    try:
        alone = [(await ask(client, p, args.max_tokens, False))[0] for p in ps]  # the reference: one at a time
    finally:
        await client.close()
    result = {"rounds": await rounds(url, args, ps, alone, 0), "alone_chars": sum(map(len, alone))}
    if args.slow_clients:
        stop, tally = asyncio.Event(), collections.Counter()
        port = int(url.rsplit(":", 1)[1])
        slow = [asyncio.create_task(slow_client(SLOW_KINDS[i % len(SLOW_KINDS)], port, stop, tally))
                for i in range(args.slow_clients)]
        await asyncio.sleep(2.0)  # every slow connection open and stalling before the requests start
        result["rounds"] += await rounds(url, args, ps, alone, args.slow_clients)
        stop.set()
        await asyncio.gather(*slow)
        result["slow_connections"] = dict(sorted(tally.items()))
        print(f"slow connections, by how they ended: {result['slow_connections']}", flush=True)
    return result


def markdown(summary: dict) -> str:
    """The summary as the markdown table BENCHMARKS.md quotes."""
    n = summary["clients"]
    lines = [f"# server load test ({summary['date_utc']} UTC, {summary['hardware']})", "", f"`{summary['command']}`", "",
             "| round | slow clients | answered | equal to alone | wall s | p50 s | p99 s | max s |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['round']} | {r['slow_clients']} | {r['answered']}/{n} | {r['equal_to_alone']}/{n} | "
              f"{r['wall_s']} | {r['p50_s']} | {r['p99_s']} | {r['max_s']} |" for r in summary["rounds"]]
    if "slow_connections" in summary:
        lines += ["", f"slow connections, by how they ended: {summary['slow_connections']}"]
    lines += ["", f"engine idle after: {summary['engine_idle_after']}; /health after: {summary['health_after']}; "
                  f"versions: {summary['versions']}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=64, help="concurrent requests per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-slots", type=int, default=32, help="engine KV slots (requests decoded together)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON and markdown results")
    p.add_argument("--slow-clients", type=int, default=0,
                   help=f"run the rounds again beside this many slow connections (at most {MAX_SLOW_CLIENTS})")
    p.add_argument("--smoke", action="store_true", help="CPU-sized run: 4 clients, 1 round, 4 tokens, 6 slow clients")
    args = p.parse_args(argv)
    if args.smoke:
        args.clients, args.rounds, args.max_tokens, args.max_slots, args.slow_clients = 4, 1, 4, 4, 6
    if not 0 <= args.slow_clients <= MAX_SLOW_CLIENTS:
        p.error(f"--slow-clients must lie in [0, {MAX_SLOW_CLIENTS}]")
    import fastapi
    import openai
    import transformers
    import uvicorn

    from adaflash_hf import load_reference_pair
    from adaflash_hf.engine import Engine
    from adaflash_hf.serve.server import ServeSettings, make_server

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, drafter, tok = load_reference_pair(device=device, dtype=getattr(torch, args.dtype))
    engine = Engine(target, drafter, length_policy="adaptive", max_slots=args.max_slots, max_len=1024, token_budget=1024)
    settings = ServeSettings(max_concurrent_requests=max(256, args.clients))
    if args.smoke:  # short guards, so that the smoke's slow clients meet them within its few seconds
        settings = dataclasses.replace(settings, header_timeout_s=1.0, timeout_keep_alive_s=1.0)
    server = make_server(engine, tok, port=0, model_name="adaflash-reference", settings=settings).start()
    t0 = time.perf_counter()
    try:
        result = asyncio.run(load(server.url, args, prompts(args.clients)))
        aengine = server.service.engine
        end = time.monotonic() + 10
        while (aengine.num_pending or engine.cache.num_free != engine.cache.num_slots) and time.monotonic() < end:
            time.sleep(0.01)
        status, health = server.service.health()
        result.update(engine_idle_after=aengine.num_pending == 0 and engine.cache.num_free == engine.cache.num_slots,
                      health_after=status)
    finally:
        server.close()
    n = args.clients * len(result["rounds"])
    answered = sum(r["answered"] for r in result["rounds"])
    equal = sum(r["equal_to_alone"] for r in result["rounds"])
    ok = answered == equal == n and result["engine_idle_after"] and result["health_after"] == 200
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else f"CPU, {os.cpu_count()} cores ({platform.machine()})"
    summary = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "hardware": gpu, "device": device,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "fastapi": fastapi.__version__,
                     "uvicorn": uvicorn.__version__, "openai": openai.__version__, "python": platform.python_version()},
        "clients": args.clients, "rounds_n": args.rounds, "slow_clients": args.slow_clients,
        "max_tokens": args.max_tokens, "max_slots": args.max_slots,
        "dtype": args.dtype, "answered": answered, "equal_to_alone": equal, "requests": n, "passed": ok,
        "total_s": round(time.perf_counter() - t0, 1), **result,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "server_load_test.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "server_load_test.md").write_text(markdown(summary))
    print(f"answered {answered}/{n}, equal to alone {equal}/{n}, engine idle after: {result['engine_idle_after']}, "
          f"/health after: {result['health_after']}; passed: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
