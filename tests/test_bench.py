"""`adaflash bench` harness on tiny random models (CPU): fields, tables, correctness flagging, skips, plots,
online methods (osd, adaflash) with tau per update."""

import argparse
import dataclasses
import json

import pytest
import torch
from conftest import build_drafter, build_tiny_target

from adaflash_hf import bench
from adaflash_hf.bench import METHODS, BenchCell, BenchConfig, Method, MethodOutput, run_bench
from adaflash_hf.bench.cli_args import config_from_args
from adaflash_hf.bench.prompts import load_prompts
from adaflash_hf.bench.report import markdown

VOCAB = 128
SPECIALS = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MAX_NEW = 10


def make_tokenizer():
    """A WordLevel tokenizer over w5..w126 plus specials, with a chat template; id 127 is the mask."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), VOCAB - 1)})
    vocab["<|mask|>"] = VOCAB - 1
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>", mask_token="<|mask|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_prompts(path, n, seed, use_messages):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n):
            length = 2 + (i * 3) % 7  # varied lengths: left padding is exercised at concurrency > 1
            words = " ".join(f"w{int(t)}" for t in torch.randint(len(SPECIALS), VOCAB - 1, (length,), generator=g))
            rec = {"messages": [{"role": "user", "content": words}]} if use_messages else {"prompt": words}
            f.write(json.dumps(rec) + "\n")
    return f"jsonl:{path}"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is faster, and immune to a loaded machine's thread stalls."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def setup(_one_thread, tmp_path_factory):
    d = tmp_path_factory.mktemp("bench_data")
    target = build_tiny_target("qwen3", seed=1)
    drafter = build_drafter(target, num_layers=1, block_size=4, seed=2)
    assistant = build_tiny_target("qwen3", seed=3, layers=1)
    datasets = [write_prompts(d / "alpha.jsonl", 3, 0, False), write_prompts(d / "beta.jsonl", 3, 1, True)]
    return dict(target=target, drafter=drafter, assistant=assistant, tokenizer=make_tokenizer(), datasets=datasets)


def _config(setup, out, **kw):
    base = dict(
        target=setup["target"], drafter=setup["drafter"], tokenizer=setup["tokenizer"], assistant=setup["assistant"],
        datasets=setup["datasets"], num_prompts=3, max_new_tokens=MAX_NEW, concurrency=[1, 2], warmup=1,
        device="cpu", out=str(out), verbose=False, command="pytest",
    )  # fmt: skip
    base.update(kw)
    return BenchConfig(**base)


ONLINE_SPU = 1  # tiny: every finished request of an online cell triggers an update


@pytest.fixture(scope="module")
def full_run(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_out")
    return run_bench(_config(setup, out, online_samples_per_update=ONLINE_SPU, online_epochs=1)), out


ONLINE = ("osd", "adaflash")
SPECULATIVE = ("fixed", "adaptive", "expected_gain", *ONLINE)


def test_json_has_every_field_for_each_method(full_run):
    result, out = full_run
    data = json.loads((out / "bench.json").read_text())
    assert data["ok"] is True and data["failures"] == []
    fields = {f.name for f in dataclasses.fields(BenchCell)}
    env = data["environment"]
    for key in ("date_utc", "hardware", "torch", "transformers", "adaflash_hf", "command"):
        assert env[key], key
    assert env["command"] == "pytest" and "cores" in env["hardware"]
    assert data["hardware"]["target_weight_bytes"] > 0
    assert data["hardware"]["copy_bandwidth_bytes_per_s"] is None  # CPU: no bandwidth floor
    cells = {(r["method"], r["dataset"], r["concurrency"]): r for r in data["results"]}
    for m in bench.DEFAULT_METHODS:
        for ds in ("alpha", "beta"):
            for c in (1, 2):
                r = cells[(m, ds, c)]
                assert set(r) == fields, (m, ds, c)
                if r["skipped"]:
                    continue
                assert r["error"] is None
                assert r["new_tokens"] == 3 * MAX_NEW or r["new_tokens"] > 0
                if m == "prompt_lookup_exact":  # computed from plain's rows: round figures, no timings
                    assert r["tokens_per_s"] is None and r["wall_time_s"] is None and r["identical"] is None
                    assert r["tau"] >= 1 and r["rounds"] > 0 and r["new_tokens"] == cells[("plain", ds, c)]["new_tokens"]
                    continue
                assert r["tokens_per_s"] > 0 and r["wall_time_s"] > 0
                assert r["ttft_s"] > 0 and r["tpot_s"] > 0
                assert r["peak_memory_bytes"] is None and r["floor_share"] is None
                assert r["identical"] is True, (m, ds, c)
                assert set(r["speedup"]) == {"plain", "plain_static"}
                if m in SPECULATIVE:
                    assert r["tau"] >= 1 and r["rounds"] > 0
                    assert 1 <= r["mean_verify_length"] <= 4
                    assert len(r["position_acceptance"]) == 3
                    hist = r["tau_histogram"]
                    assert set(hist) == {"1", "2", "3", "4"} and sum(hist.values()) == r["rounds"]
                    assert r["draft_time_s"] > 0 and r["verify_time_s"] > 0
    assert cells[("plain", "alpha", 1)]["speedup"]["plain"] == pytest.approx(1.0)
    for m in ("dflash_native", "hf_assisted"):  # tau estimated from target verify forwards
        est = cells[(m, "alpha", 1)]
        assert not est["skipped"] and est["tau_estimated"] and est["tau"] >= 1 and est["rounds"] > 0
    for ds in ("alpha", "beta"):  # prompt lookup's recorded rounds, and the same rounds computed from plain's rows
        real, computed = cells[("prompt_lookup", ds, 1)], cells[("prompt_lookup_exact", ds, 1)]
        # the histogram counts every target forward, each prompt's prefill too; `rounds` leaves the prefill out
        hist_forwards = sum(real["tau_histogram"].values())
        assert not real["tau_estimated"] and real["rounds"] > 0 and hist_forwards == real["rounds"] + real["num_prompts"]
        for key in ("rounds", "tau", "mean_verify_length", "tau_histogram", "position_acceptance"):
            assert computed[key] == real[key], (ds, key)
        assert any("cross-checked" in n for n in computed["notes"])
    for ds in ("alpha", "beta"):  # the serving engine, per length policy, with its per-round stats
        for c in (1, 2):
            off, fixed, adaptive = (cells[(f"engine_{m}", ds, c)] for m in ("off", "fixed", "adaptive"))
            assert not any(x["skipped"] for x in (off, fixed, adaptive)), (ds, c)
            assert off["tau"] == 1.0 and off["mean_verify_length"] == 1.0
            assert fixed["tau"] >= 1 and fixed["mean_verify_length"] > 1 and adaptive["rounds"] > 0
            assert fixed["tau"] == pytest.approx(cells[("fixed", ds, c)]["tau"])  # same drafter, same rule


def test_skipped_methods_carry_a_reason(full_run, setup, tmp_path):
    result, _ = full_run
    for m in ("hf_assisted", "dflash_native", "prompt_lookup"):
        assert not result.cell(m, "alpha", 1).skipped
        cell = result.cell(m, "alpha", 2)
        assert cell.skipped and "batch size 1" in cell.skip_reason and cell.tokens_per_s is None
    # No length head -> adaptive skipped; no assistant -> hf_assisted skipped; both reported, not dropped.
    drafter = build_drafter(setup["target"], num_layers=1, block_size=4, seed=2, use_length_head=False)
    res = run_bench(
        _config(setup, tmp_path, drafter=drafter, assistant=None, concurrency=[1], datasets=setup["datasets"][:1],
                methods=["plain", "adaptive", "hf_assisted", "fixed"], num_prompts=2, plots=False)
    )  # fmt: skip
    assert "length head" in res.cell("adaptive", "alpha", 1).skip_reason
    assert "--assistant" in res.cell("hf_assisted", "alpha", 1).skip_reason
    assert res.cell("fixed", "alpha", 1).identical is True and res.ok
    md = (tmp_path / "bench.md").read_text()
    assert "skipped: the drafter has no length head" in md


def test_markdown_has_a_row_per_cell(full_run):
    result, out = full_run
    md = (out / "bench.md").read_text()
    assert md == markdown(result)
    table = md.split("| dataset | concurrency | method | tok/s |")[1].split("\n\n")[0]
    rows = [line.split("|")[1:4] for line in table.strip().splitlines()[2:]]
    keys = [(d.strip(), int(c), m.strip()) for d, c, m in rows]
    expected = {(ds, c, m) for ds in ("alpha", "beta") for c in (1, 2) for m in bench.DEFAULT_METHODS}
    assert sorted(keys) == sorted(expected)
    assert "command: `pytest`" in md


def test_plots_written(full_run, tmp_path):
    result, out = full_run
    for name in ("tau_per_domain.png", "acceptance_by_position.png", "tau_online.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(out / name) in result.files
    saved = result.online
    try:
        result.online = []  # no online data -> no placeholder plot
        assert not any(f.endswith("tau_online.png") for f in bench.write_plots(result, tmp_path))
        assert not (tmp_path / "tau_online.png").exists()
        result.online = [(0, 1.5), (1, 1.8), (2, 2.2)]  # bare (update, tau) pairs still plot
        files = bench.write_plots(result, tmp_path)
        assert str(tmp_path / "tau_online.png") in files
        assert (tmp_path / "tau_online.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        result.online = saved


def test_online_methods_record_tau_per_update(full_run, setup):
    result, out = full_run
    data = json.loads((out / "bench.json").read_text())
    records = data["online"]
    assert records == [dict(r) for r in result.online]
    for m in ONLINE:
        for ds in ("alpha", "beta"):
            for c in (1, 2):
                cell = result.cell(m, ds, c)
                assert not cell.skipped and cell.error is None and cell.identical is True, (m, ds, c)
                notes = " ".join(cell.notes)
                assert ("'osd'" if m == "osd" else "'opd'") in notes and "verify-length policy fixed" in notes
                if m == "adaflash":  # the test drafter's length head is untrained
                    assert "no trained length head" in notes
                assert "waiting for triggered updates" in notes and "FAILED" not in notes
                mine = sorted(
                    (r for r in records if (r["method"], r["dataset"], r["concurrency"]) == (m, ds, c)), key=lambda r: r["update"]
                )
                updates = int(notes.split(" online update(s) from ")[0].rsplit(" ", 1)[-1])
                assert updates >= 1, (m, ds, c)
                # One record per weights version (0 = as given) that served rounds; with --online-wait the
                # stream's rounds are split exactly between them. Two requests finishing together can trigger
                # two updates back to back (one sample each), and a version that served no round has no record.
                versions = [r["update"] for r in mine]
                assert versions[0] == 0 and versions == sorted(set(versions)) and len(mine) >= 2
                assert versions[-1] <= updates
                assert all(r["tau"] >= 1 and r["rounds"] > 0 for r in mine)
                assert sum(r["rounds"] for r in mine) == cell.rounds
    # The online copies trained; the drafter every other method uses did not change.
    assert getattr(setup["drafter"], "_round_sink", None) is None and getattr(setup["drafter"], "_weights_lock", None) is None
    md = (out / "bench.md").read_text()
    assert "## Online updates" in md and "| alpha | 1 | osd | 0: " in md


def test_adaflash_uses_the_cost_policy_with_a_trained_head(setup, tmp_path):
    drafter = build_drafter(setup["target"], num_layers=1, block_size=4, seed=2)
    drafter.config.length_head_trained = True
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    res = run_bench(
        _config(setup, tmp_path, drafter=drafter, methods=["plain", "adaflash"], concurrency=[2],
                datasets=setup["datasets"][:1], num_prompts=3, warmup=0, plots=False,
                online_samples_per_update=ONLINE_SPU, online_epochs=1, online_wait=False)
    )  # fmt: skip
    cell = res.cell("adaflash", "alpha", 2)
    assert res.ok and cell.identical is True
    notes = " ".join(cell.notes)
    assert "verify-length policy cost" in notes and "--no-online-wait" in notes
    assert all(torch.equal(v, before[k]) for k, v in drafter.state_dict().items())  # a private copy trained


@pytest.mark.parametrize("fast_path,engine_calls", [(True, 1), (False, 0)])
def test_fast_path_takes_our_loop_through_the_engine_off_cuda(setup, tmp_path, monkeypatch, fast_path, engine_calls):
    """``--fast-path``: our loop's methods run through the engine on the CPU, as on CUDA (one engine call per batch);
    without it (the control) the eager loop. Output equal to plain either way."""
    import adaflash_hf.generation.decoding as decoding

    calls, real = [], decoding.engine_decoding
    monkeypatch.setattr(decoding, "engine_decoding", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    res = run_bench(_config(setup, tmp_path, methods=["plain", "cost"], concurrency=[1], datasets=setup["datasets"][:1],
                            num_prompts=2, warmup=0, plots=False, fast_path=fast_path))
    assert res.ok and res.cell("cost", "alpha", 1).identical is True
    assert len(calls) == 2 * engine_calls  # two prompts, one at a time
    args = bench.add_arguments(argparse.ArgumentParser()).parse_args(["--fast-path"] if fast_path else [])
    assert config_from_args(args).fast_path is fast_path


def test_online_flags():
    args = bench.add_arguments(argparse.ArgumentParser()).parse_args([])
    assert (args.online_samples_per_update, args.online_epochs, args.online_lr, args.online_wait) == (128, 2, 3e-4, True)
    assert args.online_sample_unit == "request"
    args = bench.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--online-samples-per-update", "8", "--online-epochs", "1", "--online-lr", "1e-3", "--no-online-wait",
         "--online-sample-unit", "round"]
    )
    assert (args.online_samples_per_update, args.online_epochs, args.online_lr, args.online_wait) == (8, 1, 1e-3, False)
    assert args.online_sample_unit == "round"
    with pytest.raises(SystemExit):
        bench.add_arguments(argparse.ArgumentParser()).parse_args(["--online-sample-unit", "token"])


def _lossy(ctx, input_ids, attention_mask, streamer):
    out = ctx.target.generate(input_ids, attention_mask=attention_mask, streamer=streamer, **ctx.generate_kwargs)
    out = out.clone()
    p = input_ids.shape[1]
    out[0, p + 2] = (out[0, p + 2] + 1) % 100 + 5  # one wrong token in the first prompt of each batch
    return MethodOutput(out)


def test_lossy_method_flagged_and_cli_fails(setup, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(METHODS, "lossy", Method("lossy", _lossy, "test-only lossy decoding"))
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    setup["target"].save_pretrained(target_dir)
    setup["tokenizer"].save_pretrained(target_dir)
    setup["drafter"].save_pretrained(drafter_dir)
    out = tmp_path / "out"
    argv = [
        "--target", str(target_dir), "--drafter", str(drafter_dir), "--datasets", setup["datasets"][0],
        "--num-prompts", "3", "--max-new-tokens", str(MAX_NEW), "--concurrency", "1,2", "--methods", "plain,lossy,fixed",
        "--device", "cpu", "--warmup", "0", "--out", str(out), "--no-plots", "--quiet",
    ]  # fmt: skip
    rc = bench.main(argv)
    assert rc != 0
    captured = capsys.readouterr()
    assert "BENCH FAILURE" in captured.err and "lossy" in captured.err
    data = json.loads((out / "bench.json").read_text())
    assert data["ok"] is False
    bad = [f for f in data["failures"]]
    assert bad and all(f["method"] == "lossy" and f["kind"] == "mismatch" for f in bad)
    # Concurrency 1: three batches, each one's first prompt is perturbed; concurrency 2: prompts 0 and 2.
    assert sorted((f["concurrency"], f["prompt_index"]) for f in bad) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 2)]
    assert all(f["dataset"] == "alpha" and f["first_mismatch"] == 2 for f in bad)
    # Diagnostic: the target prefers plain's token over the perturbed one (a real difference, not a near-tie).
    assert all(f["logit_gap"] > 0 and f["got_token"] != f["expected_token"] for f in bad)
    cells = {(r["method"], r["concurrency"]): r for r in data["results"]}
    assert cells[("fixed", 2)]["identical"] is True and cells[("lossy", 2)]["identical"] is False
    assert data["environment"]["command"].startswith("adaflash bench --target")
    assert "**NO**" in (out / "bench.md").read_text()


def test_reference_computed_when_plain_not_requested_and_sampling_not_compared(setup, tmp_path, monkeypatch):
    monkeypatch.setitem(METHODS, "lossy", Method("lossy", _lossy))
    monkeypatch.setitem(METHODS, "broken", Method("broken", None, from_plain=lambda *a: 1 / 0))  # a computed method that raises
    res = run_bench(
        _config(setup, tmp_path, methods=["lossy", "broken", "fixed", "prompt_lookup_exact"], concurrency=[2],
                datasets=setup["datasets"][1:], num_prompts=2, plots=False, warmup=0)
    )  # fmt: skip
    assert [f["method"] for f in res.failures] == ["lossy", "broken"] and res.cell("fixed", "beta", 2).identical is True
    assert "ZeroDivisionError" in res.cell("broken", "beta", 2).error
    assert res.cell("prompt_lookup_exact", "beta", 2).rounds > 0  # computed from the untimed plain reference
    res = run_bench(
        _config(setup, tmp_path, methods=["plain", "fixed", "prompt_lookup_exact"], concurrency=[2],
                datasets=setup["datasets"][1:], num_prompts=2, temperature=0.8, plots=False, warmup=0)
    )  # fmt: skip
    assert res.ok and res.cell("fixed", "beta", 2).identical is None and res.cell("fixed", "beta", 2).tau >= 1
    computed = res.cell("prompt_lookup_exact", "beta", 2)  # computed from plain's sampled rows, not compared
    assert not computed.skipped and computed.rounds > 0 and computed.identical is None


@pytest.mark.parametrize("size, batches", [(None, [1, 1, 1]), (2, [2, 1]), (1, [1, 1, 1])])
def test_reference_decoded_at_its_own_concurrency(setup, tmp_path, monkeypatch, size, batches):
    seen = []
    plain = METHODS["plain"]

    def counted(ctx, ids, mask, streamer):
        seen.append(ids.shape[0])
        return plain.run(ctx, ids, mask, streamer)

    monkeypatch.setitem(METHODS, "plain", dataclasses.replace(plain, run=counted))
    monkeypatch.setitem(METHODS, "lossy", Method("lossy", _lossy))  # the control: a wrong token is still caught
    res = run_bench(_config(setup, tmp_path, methods=["fixed", "lossy"], concurrency=[1], datasets=setup["datasets"][1:],
                            num_prompts=3, plots=False, warmup=0, reference_concurrency=size))
    assert seen == batches
    assert res.cell("fixed", "beta", 1).identical is True
    assert sorted(f["prompt_index"] for f in res.failures) == [0, 1, 2] and res.cell("lossy", "beta", 1).identical is False


def test_bad_reference_concurrency_refused_before_loading():
    with pytest.raises(ValueError, match="reference_concurrency must be >= 1"):
        run_bench(BenchConfig(methods=["fixed"], reference_concurrency=0))


SAMPLED = ("plain", "hf_assisted", "prompt_lookup", "fixed", "adaptive", "engine_fixed", "engine_adaptive")


def test_sampling_run_decodes_every_method_and_says_so(setup, tmp_path):
    """Under sampling every method really runs (prompt lookup too, beside its computed twin), its tau is
    counted, nothing is compared token for token, and the report states the settings and the seed."""
    res = run_bench(_config(setup, tmp_path, methods=list(SAMPLED), concurrency=[1], datasets=setup["datasets"][1:],
                            temperature=0.7, top_p=0.95, seed=5, plots=False, warmup=0))  # fmt: skip
    assert res.ok and res.config["greedy"] is False and res.config["seed"] == 5
    for m in SAMPLED:
        cell = res.cell(m, "beta", 1)
        assert not cell.skipped and cell.error is None and cell.identical is None, (m, cell.skip_reason, cell.error)
        if m != "plain":
            assert cell.rounds > 0 and cell.tau >= 1, m
    md = (tmp_path / "bench.md").read_text()
    assert "sampling, temperature 0.7, top-p 0.95, top-k off; seed 5" in md and "not compared token for token" in md
    run_bench(_config(setup, tmp_path / "g", methods=["plain"], concurrency=[1], datasets=setup["datasets"][1:],
                               num_prompts=1, plots=False, warmup=0))  # fmt: skip
    assert "- decoding: greedy; every method's outputs compared" in (tmp_path / "g" / "bench.md").read_text()


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(temperature=float("nan"))])
def test_bad_sampling_settings_refused_before_loading(bad):
    with pytest.raises(ValueError, match="temperature >= 0"):
        run_bench(BenchConfig(methods=["plain"], **bad))  # no models given: the error must come first


def test_cli_mounts_as_subcommand():
    parser = argparse.ArgumentParser(prog="adaflash")
    sub = parser.add_subparsers(dest="cmd")
    bench.add_arguments(sub.add_parser("bench"))
    args = parser.parse_args(["bench", "--reference", "--datasets", "gsm8k,blend", "--concurrency", "1,4", "--methods", "plain,fixed"])
    assert args.datasets == ["gsm8k", "blend"] and args.concurrency == [1, 4] and args.methods == ["plain", "fixed"]
    assert args.reference and args.temperature == 0.0
    with pytest.raises(ValueError, match="unknown method"):
        run_bench(BenchConfig(methods=["nope"]))


def test_continuation_prompts_skip_the_chat_template(tmp_path):
    """`prose` (and jsonl records with a "text" field) are raw continuations: no chat template."""
    import os

    from transformers import AutoTokenizer

    from adaflash_hf.generation.prompts import encode_prompt
    from adaflash_hf.reference import REFERENCE_DIR

    tok = AutoTokenizer.from_pretrained(os.path.join(REFERENCE_DIR, "target"))
    label, prompts = load_prompts("prose", 3, None)
    assert label == "prose" and len(prompts) == 3 and all(isinstance(p, str) for p in prompts)
    ids = encode_prompt(tok, prompts[0])
    assert ids == tok(prompts[0], add_special_tokens=False)["input_ids"]
    assert "<|im_start|>" not in tok.decode(ids)
    chat = encode_prompt(tok, [{"role": "user", "content": prompts[0]}])
    assert "<|im_start|>" in tok.decode(chat) and len(chat) > len(ids)
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"text": "Once upon"}\n{"prompt": "hi"}\n{"other": 1}\n')
    with pytest.raises(ValueError, match="record 2"):
        load_prompts(f"jsonl:{path}", 5, None)


@pytest.mark.parametrize(
    "warmup, conc, datasets, expected_batches",
    [
        (1, 1, ["a", "a"], [[[9, 9, 9]]]),  # once per (method, concurrency, set), on the set's longest prompt
        (2, 1, ["a"], [[[9, 9, 9]], [[5, 5]]]),
        (1, 2, ["a", "b"], [[[9, 9, 9], [5, 5]], [[9, 9, 9], [5, 5]]]),  # a later set warms again: its own engine
        (0, 1, ["a"], []),
    ],
)
def test_warm_up_runs_each_sets_longest_prompts_once(monkeypatch, warmup, conc, datasets, expected_batches):
    """A set whose prompts are longer than the last one's may need a bigger engine (cache, graph buckets): its
    warm-up must build it, on its own longest prompts, so that no timed batch does."""
    from types import SimpleNamespace

    from adaflash_hf.bench import measure

    seen = []
    monkeypatch.setattr(measure, "run_batch", lambda method, ctx, ids, mask, *a: seen.append(
        [row[m.bool()].tolist() for row, m in zip(ids, mask)]))
    pool = sorted([[5, 5], [9, 9, 9], [1]], key=len, reverse=True)  # as the runner passes it
    warmed, config = set(), SimpleNamespace(warmup=warmup, seed=0)
    for name in datasets:
        cell = SimpleNamespace(concurrency=conc, dataset=name)
        measure._warm_up(SimpleNamespace(name="fixed"), None, cell, config, (), pool, warmed, 0, "cpu", False)
    assert seen == expected_batches
