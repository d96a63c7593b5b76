"""`adaflash bench --help` tells the truth: every dataset name it lists is accepted by the command's checks and
resolves to prompts, and every method it lists is a method the benchmark runs (and the other way round), the
defaults among them what a user gets by default. Nothing is benchmarked: the run itself is replaced."""

from __future__ import annotations

import re

import pytest

from adaflash_hf import bench
from adaflash_hf.bench.cli_args import DEFAULTS, REFERENCE_DEFAULTS
from adaflash_hf.bench.prompts import load_prompt_set
from adaflash_hf.cli import main
from adaflash_hf.speculation.length.names import default_policy
from adaflash_hf.training import data as D


def _help(capsys) -> str:
    assert main(["bench", "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())  # argparse's line wrapping undone


def _listed(text: str, start: str, end: str) -> list[str]:
    return [n.strip() for n in text.split(start, 1)[1].split(end, 1)[0].split(",")]


@pytest.fixture
def checked(monkeypatch):
    """`adaflash bench ...` run up to the benchmark itself: the arguments it would have run with, or None."""
    seen = {}

    def fake_run(args):
        seen["args"] = args
        return 0

    monkeypatch.setattr(bench, "run_from_args", fake_run)

    def check(*argv):
        seen.clear()
        rc = main(["bench", "--reference", "--no-plots", "--quiet", *argv])
        return rc, seen.get("args")

    return check


def test_every_listed_dataset_is_accepted_and_resolves(capsys, checked):
    names = _listed(_help(capsys), "--datasets DATASETS comma list of:", "; or jsonl:PATH")
    assert "spec_bench_all" in names and "gsm8k" in names and len(names) > 20
    for name in names:
        rc, args = checked("--datasets", name, "--num-prompts", "1")
        assert rc == 0 and args is not None, (name, capsys.readouterr().err)
        for each in D.expand_datasets(args.datasets):
            assert load_prompt_set(each, 1, None).prompts, each
    assert D.expand_datasets(["spec_bench_all"]) == list(D.SUITES["spec_bench_all"])


@pytest.mark.parametrize("name, message", [("nosuchset", "unknown dataset"), ("eagle_bench:nope", "unknown eagle_bench task")])
def test_an_unlisted_dataset_is_one_line(name, message, capsys, checked):
    """The control: the same check refuses a name the help does not list, before any work."""
    rc, args = checked("--datasets", name)
    err = capsys.readouterr().err
    assert rc == 2 and args is None and message in err and len(err.strip().splitlines()) == 1


def test_the_listed_methods_are_the_benchmarks(capsys, checked):
    text = _help(capsys)
    listed = _listed(text, "--methods METHODS comma list from:", " (default:")
    assert sorted(listed) == sorted(bench.METHODS)
    policy = default_policy(bench_reference_drafter_config()).value  # what generate and serve do by default
    assert policy == "cost"
    for defaults in (DEFAULTS["methods"], REFERENCE_DEFAULTS["methods"]):
        assert {policy, f"engine_{policy}", "plain"} <= set(defaults) <= set(bench.METHODS)
    assert re.search(r"with --reference plain, prompt_lookup, fixed, cost", text)
    rc, args = checked("--methods", ",".join(listed))  # every one accepted
    assert rc == 0 and args.methods == listed
    rc, args = checked("--methods", "plain,costt")  # the control: a typo is refused
    assert rc == 2 and args is None and "costt" in capsys.readouterr().err


def bench_reference_drafter_config():
    from adaflash_hf.modeling import AdaFlashConfig
    from adaflash_hf.reference import REFERENCE_DIR

    return AdaFlashConfig.from_pretrained(f"{REFERENCE_DIR}/drafter")
