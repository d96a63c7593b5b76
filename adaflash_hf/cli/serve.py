"""`adaflash serve`: an OpenAI-compatible HTTP server over the continuous-batching engine."""

from __future__ import annotations

import ipaddress
import os
import sys

from ..loading import UsageError, check_drafter_path, check_target_path, one_line
from ..speculation.length.names import ENGINE_POLICIES
from .common import PROG, add_model_args, check_either_reference, load_models_from_args, number, positive_int
from .online_args import SERVE_TRAIN_SHARE, SERVE_TRAINER, add_online_args, check_online_args, online_adapter, online_flags_given

seconds = number(float, lambda v: v >= 0, "a number of seconds >= 0")
API_KEY_ENV = "ADAFLASH_API_KEY"  # as vLLM reads VLLM_API_KEY

HELP = "OpenAI-compatible HTTP server (completions, chat, streaming) over the continuous-batching engine"
DESCRIPTION = (
    "Serve a target + drafter (default: the embedded reference pair) over HTTP with OpenAI's API:\n"
    "POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template), GET /v1/models,\n"
    "GET /health. Concurrent requests are decoded together by the continuous-batching engine; fields:\n"
    "max_tokens, temperature (default 1.0, as OpenAI; 0 = greedy), top_p, top_k, seed, n, stop, stream\n"
    "(server-sent events), usage counts, logprobs / top_logprobs, echo, a list of prompts,\n"
    "presence_penalty / frequency_penalty, response_format (json_object, json_schema; needs xgrammar:\n"
    "pip install 'adaflash-hf[grammar]'), tools / tool_choice (hermes tool calls as OpenAI tool_calls);\n"
    "a field the server cannot honour gets a 400 naming it. One log line per request on stderr (no prompt text).\n"
    "FastAPI on uvicorn (pip install 'adaflash-hf[serve]'); put a reverse proxy in front for TLS.\n"
    "--api-key (or $ADAFLASH_API_KEY): every route but /health needs 'Authorization: Bearer KEY' (else a 401).\n"
    "A client that disconnects cancels its request; past --max-concurrent-requests a request gets a 429;\n"
    "headers not complete --header-timeout s after their first byte get a 408; past --max-connections open\n"
    "connections a new one gets a 503 at once.\n"
    "SIGTERM / Ctrl-C drains: new requests get a 503 with Retry-After, those in flight run for up to\n"
    "--drain-timeout s, the rest are cancelled with a 503; a second signal cancels them at once.\n"
    "exit status: 0 stopped (Ctrl-C / SIGTERM), 2 usage error (nothing loaded), 3 the engine failed (/health\n"
    "answered 503 for --exit-after-failure seconds first): a supervisor should restart the server.\n"
    "GET /metrics: Prometheus counters (requests, tokens, rounds, tau, acceptance per draft position,\n"
    "verify length; with --online the served version, updates, losses, buffer). --online distils the\n"
    "drafter from the served traffic and swaps each update in between rounds (answers unchanged); SIGTERM\n"
    "abandons an update in progress and leaves the newest version in --output-dir loadable. A restart with\n"
    "the same --output-dir resumes from its newest version that checks out (--fresh: from --drafter).\n"
    "Operations (supervisors, exit statuses, versions, metrics): docs/operations.md.\n\n"
    "example:\n  adaflash serve --port 8000\n"
    "  adaflash serve --online --output-dir runs/online --samples-per-update 128\n"
    "  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\\n"
    "       -d '{\"prompt\": \"Hello\", \"max_tokens\": 16, \"temperature\": 0}'"
)


def add_arguments(p) -> None:
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=number(int, lambda v: 0 <= v <= 65535, "a port in [0, 65535]"), default=8000,
                   help="TCP port (0: any free port)")
    g.add_argument("--model-name", help="model id reported by /v1/models (default: the --target path, or adaflash-reference); "
                                        "a request may leave `model` out, or must name this one")
    g.add_argument("--default-max-tokens", type=positive_int, default=256, help="max_tokens of a request that gives none (capped at what fits after its prompt)")
    g.add_argument("--max-concurrent-requests", type=positive_int, default=256,
                   help="completion requests in flight (generating or queued); one more gets a 429 with Retry-After")
    g.add_argument("--timeout-keep-alive", type=seconds, default=5.0, help="seconds an idle keep-alive connection stays open")
    g.add_argument("--body-timeout", type=seconds, default=30.0,
                   help="seconds to wait for the next piece of a request body (a 408 after)")
    g.add_argument("--header-timeout", type=seconds, default=10.0,
                   help="seconds from a request's first byte to the end of its headers (a 408 and the connection closed after)")
    g.add_argument("--max-connections", type=positive_int, default=1024,
                   help="open connections at once; one more gets a 503 and is closed at once")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV} if set; "
                        "the variable keeps the key out of the process list)")
    g.add_argument("--exit-after-failure", type=seconds, default=2.0,
                   help="after an engine failure, answer /health with 503 this long, then exit with status 3")
    g.add_argument("--drain-timeout", type=seconds, default=20.0,
                   help="on SIGTERM / Ctrl-C, seconds the requests in flight may still run before the rest are "
                        "cancelled (new requests get a 503 meanwhile)")
    g = p.add_argument_group("engine")
    g.add_argument("--length-policy", choices=ENGINE_POLICIES, default=None,
                   help="cost: each request verifies the length head's k_hat, chosen against what a verify costs at "
                        "the round's batch (plain decoding where drafting does not pay); adaptive: the paper's floor rule "
                        "on the head; fixed: the full block (default: cost when the drafter's length head is trained, else fixed)")
    g.add_argument("--plain", action="store_true", help="serve the target alone (plain decoding, no drafter)")
    g.add_argument("--max-slots", type=positive_int, default=16, help="requests decoded concurrently (KV slots)")
    g.add_argument("--max-len", type=number(int, lambda v: v >= 2, "an integer >= 2"), default=None,
                   help="positions per request, prompt + completion (default: min(2048, the target's max positions))")
    g.add_argument("--token-budget", type=positive_int, default=None,
                   help="most tokens in one target forward; also the longest prompt (default: --max-len)")
    g.add_argument("--decode-steps", type=positive_int, default=8,
                   help="--plain on CUDA: greedy decode steps per graph replay while no request waits "
                        "(streaming then arrives in groups of up to this many tokens; 1: one at a time)")
    g.add_argument("--spec-rounds", type=positive_int, default=1,
                   help="--length-policy fixed on CUDA: draft-verify rounds queued per device read while no request "
                        "waits and every request is greedy (streaming then arrives in groups of up to this many "
                        "rounds; the prompt n-gram rule sits the queued rounds out; 1, the default: one read a round)")
    g = p.add_argument_group("online adaptation (--online)")
    g.add_argument("--online", action="store_true",
                   help="distil the drafter from the target's verification of the traffic while serving: updates train "
                        "in a child process on CUDA, a thread on the CPU (--trainer), are swapped in between rounds and "
                        "published as numbered versions (--output-dir); answers stay the target's own")
    add_online_args(g, method_flag="--online-method", output_required=False, train_share=SERVE_TRAIN_SHARE,
                    trainer=SERVE_TRAINER)
    g.add_argument("--fresh", action="store_true",
                   help="start from --drafter's weights even when --output-dir holds versions (default: resume from "
                        "its newest version that checks out); new versions are numbered after those on disk")


def _check_models(args) -> bool:
    """Checks the model flags; whether a drafter is needed. No flags at all: the reference pair."""
    check_either_reference(args)
    if args.drafter and not args.target:
        raise UsageError("--drafter given without --target", "pass --target PATH_OR_HUB_ID (the model the drafter is for)")
    if not args.target:
        args.reference = True  # the embedded reference pair
    need_drafter = not args.plain
    if args.plain and (args.drafter or args.length_policy):
        raise UsageError("--plain serves the target alone", "leave out --drafter / --length-policy, or --plain")
    if args.spec_rounds > 1 and args.length_policy != "fixed":
        raise UsageError(f"--spec-rounds {args.spec_rounds} queues fixed rounds", "add --length-policy fixed, or leave "
                         "--spec-rounds out")
    if args.spec_rounds > 1 and args.online:
        raise UsageError("--spec-rounds queues rounds the online adapter would not see", "leave --spec-rounds out")
    if args.target and need_drafter and not args.drafter:
        raise UsageError("no drafter given", "pass --drafter PATH_OR_HUB_ID, or --plain to serve the target alone")
    if args.target:
        check_target_path(args.target)
        if args.drafter:
            check_drafter_path(args.drafter)
            _check_version(args.drafter)
    if args.fresh and not args.online:
        raise UsageError("--fresh given without --online", "add --online, or leave --fresh out")
    if args.online:
        if args.plain:
            raise UsageError("--online adapts the drafter; --plain serves none", "leave out --plain, or --online")
        check_online_args(args)
    elif online_flags_given(args):
        raise UsageError(f"online adaptation flags given without --online: {', '.join(online_flags_given(args))}",
                         "add --online, or leave them out")
    return need_drafter


def _check_version(path: str) -> None:
    """A drafter folder written as an online version must still match its checksums (a damaged one fails here,
    in one line, instead of in a loader's traceback)."""
    from ..online.versions import METADATA_FILE, verify_version

    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        reason = verify_version(path)
        if reason is not None:
            raise UsageError(f"--drafter {path} is a damaged online version: {reason}",
                             "pass an older vNNNNN of its folder, or serve --online --output-dir FOLDER, which "
                             "resumes from the newest version that checks out")


def _api_key(args) -> str | None:
    """The key from --api-key, else $ADAFLASH_API_KEY; an empty or whitespace one is a usage error (an unset
    variable expanded into --api-key would otherwise leave the server open)."""
    key, source = (args.api_key, "--api-key") if args.api_key is not None else (os.environ.get(API_KEY_ENV), f"${API_KEY_ENV}")
    if key is not None and (not key.strip() or key != key.strip()):
        raise UsageError(f"{source} is {'empty' if not key.strip() else 'padded with whitespace'}",
                         f"give the key itself, or leave out --api-key and unset {API_KEY_ENV} to serve without one")
    return key


def _service(args, need_drafter: bool):
    """Load the models and build the engine and the completion service; (service, description line)."""
    from ..engine import Engine, EngineConfig
    from ..serve.server import CompletionService

    target, drafter, tok = load_models_from_args(args, need_drafter=need_drafter)
    adapter = online_adapter(args, drafter, target) if args.online else None
    cfg = target.config.get_text_config(decoder=True)
    max_len = args.max_len or min(2048, getattr(cfg, "max_position_embeddings", None) or 2048)
    token_budget = args.token_budget or max_len
    try:
        config = EngineConfig(length_policy=args.length_policy if need_drafter else None, max_slots=args.max_slots,
                              max_len=max_len, token_budget=token_budget, decode_steps=args.decode_steps,
                              spec_rounds=args.spec_rounds, round_sink=adapter)
        engine = Engine(target, drafter if need_drafter else None, config)
    except ValueError as e:
        raise UsageError(f"cannot serve this model: {one_line(e)}", "the engine drives Qwen3 / Llama-family targets") from None
    engine.warmup(concurrency=args.max_slots)  # capture the decode rounds' graphs before the first request
    name = args.model_name or ("adaflash-reference" if args.reference else args.target.rstrip("/"))
    service = CompletionService(engine, tok, name, min(args.default_max_tokens, max_len - 1))
    online = ""
    if adapter is not None:
        service.metrics.online_stats = lambda: adapter.stats
        c = adapter.config
        online = (f"; online {c.method}: an update every {c.samples_per_update} requests"
                  + (f", versions in {c.output_dir}" if c.output_dir else "") + (f", pushed to {c.hub_repo}" if c.hub_repo else ""))
    return service, adapter, (f"model {name!r}", f"(verify: {engine.layout}, {args.max_slots} slots, "
                                                 f"max_len {max_len}, token budget {token_budget}{online})")


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def run(args) -> int:
    import logging
    import signal
    import threading

    need_drafter = _check_models(args)
    api_key = _api_key(args)
    try:
        from ..serve.server import OpenAIServer, ServeSettings, require_serve_extra

        require_serve_extra()
    except ImportError as e:
        raise UsageError(f"the HTTP server needs the `serve` extra ({e.name} is missing)",
                         "pip install 'adaflash-hf[serve]'") from None
    settings = ServeSettings(max_concurrent_requests=args.max_concurrent_requests,
                             timeout_keep_alive_s=args.timeout_keep_alive, body_timeout_s=args.body_timeout,
                             header_timeout_s=args.header_timeout, max_connections=args.max_connections,
                             exit_after_failure_s=args.exit_after_failure, drain_timeout_s=args.drain_timeout,
                             api_key=api_key)
    if args.online and not args.output_dir:
        print(f"{PROG} serve: warning: --online without --output-dir: the updates serve from memory only and nothing "
              "is kept; they are lost when the server stops (pass --output-dir DIR to keep every version)",
              file=sys.stderr)
    if settings.api_key is None and not _is_loopback(args.host):
        print(f"{PROG} serve: warning: listening on {args.host} without an API key: anyone who reaches this port can "
              f"use the model (set ${API_KEY_ENV} or --api-key)", file=sys.stderr)
    try:  # bind first: a port in use fails at once, before models load
        server = OpenAIServer((args.host, args.port), settings=settings)
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror or one_line(e)}",
                         "pick another --port (0 picks a free one) or --host") from None

    def on_sigterm(signum, frame):  # stop like Ctrl-C (containers and process managers send SIGTERM)
        raise KeyboardInterrupt

    old_sigterm = None
    if threading.current_thread() is threading.main_thread():
        old_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
    loggers = [logging.getLogger("adaflash_hf.server"), logging.getLogger("adaflash_hf.online")]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    levels = [lg.level for lg in loggers]
    adapter = None
    try:
        for lg in loggers:  # the online adapter's lines (resume, updates, failures) from its start on
            lg.addHandler(handler)
            lg.setLevel(logging.INFO)
        server.service, adapter, (model, settings_line) = _service(args, need_drafter)
        print(f"{PROG} serve: {model} at {server.url}/v1 {settings_line}; endpoints /v1/completions, /v1/chat/completions, "
              f"/v1/models, /health, /metrics; Ctrl-C stops", flush=True)
        server.serve_forever()  # uvicorn stops on SIGINT / SIGTERM, then re-raises it: KeyboardInterrupt
    except KeyboardInterrupt:
        print(f"{PROG} serve: stopping", file=sys.stderr)
    finally:
        server.close()
        if adapter is not None:  # an update in progress is abandoned; the versions on disk are whole (atomic writes)
            adapter.close(abandon=True, timeout=args.exit_after_failure + 30)
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)
    if server.exit_code:
        print(f"{PROG} serve: the engine failed; exit status {server.exit_code} (restart the server)", file=sys.stderr)
    return server.exit_code
