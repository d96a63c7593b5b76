"""Loaders for the plain-file datasets in ``shared/data`` (see ``shared/data/README.md``).

Two kinds of record come out of here:

* training samples (``chat_samples``): ``{"messages": [{"role": "user", ...}, {"role": "assistant", ...},
  ...], "domain": d}`` for the chat-style domains (math, code, chat), and ``{"text": ..., "domain":
  "prose"}`` plain-text chunks for prose;
* evaluation prompts (``eval_prompts``): ``{"messages": [{"role": "user", "content": ...}], "dataset":
  name, "reference": str | None, ...}``.

The data folder is ``$ADAFLASH_DATA`` if set, else ``../shared/data`` relative to the repository root
(the folder holding ``pyproject.toml``), else ``../shared/data`` / ``shared/data`` relative to the
current directory. Every function takes an optional ``data_dir`` to override that.

Named eval datasets whose subfolder is not in the data folder (or with no data folder at all, when
none was asked for) load from the Hugging Face Hub through 🤗 ``datasets`` (`hub_datasets`: one
table of Hub id, config, split and field per name). A small built-in sample per domain ships with the
package (`builtin_prompts`) for runs with neither local data nor network; `chat_samples` serves it as
training prompts when the data folder holds no training data (`uses_builtin_samples`).
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Iterable

from .hub_datasets import HUB_DATASETS, HubUnavailable, load_hub_records

ENV_VAR = "ADAFLASH_DATA"

TRAIN_DOMAINS = ("math", "code", "chat", "prose")

# Source files of each training domain, relative to the data folder (for documentation and checks).
TRAIN_SOURCES: dict[str, tuple[str, ...]] = {
    "math": ("gsm8k/train.jsonl", "math_train4500/train.jsonl"),
    "code": ("codealpaca/new_codealpaca.jsonl", "mbpp/mbpp.jsonl"),  # mbpp: task_id 601-974 only
    "chat": ("sharegpt/sharegpt_train.jsonl",),
    "prose": (
        "gutenberg_novels/12_years_a_slave.txt",
        "gutenberg_novels/frankenstein.txt",
        "gutenberg_novels/huckleberry_finn.txt",
        "gutenberg_novels/picture_of_dorian_gray.txt",
        "gutenberg_novels/pride_and_prejudice.txt",
        "gutenberg_novels/sherlock.txt",
        "gutenberg_novels/tom_sawyer.txt",
        "tinyshakespeare/input.txt",
        "us_speeches/us_speeches.jsonl",
    ),
}

# Held-out ("eval" split) samples with full answers, per domain. Prose has no separate file: the
# last PROSE_EVAL_FRACTION of each prose source is held out of the train split.
EVAL_SOURCES: dict[str, tuple[str, ...]] = {
    "math": ("gsm8k/test.jsonl",),
    "code": ("codealpaca/code_alpaca_2k.jsonl",),
    "chat": ("sharegpt/sharegpt_eval500.jsonl",),
    "prose": TRAIN_SOURCES["prose"],
}
PROSE_EVAL_FRACTION = 0.02
PROSE_CHUNK_CHARS = 1500  # target chunk size; chunks are 1k-2k chars, cut at paragraph / line ends

MBPP_TEST_IDS = (11, 510)
MBPP_TRAIN_IDS = (601, 974)

EVAL_DATASETS = (
    "gsm8k",
    "mathqa",
    "math500",
    "aime2025",
    "aime2024",
    "mbpp",
    "humaneval",
    "codealpaca",
    "sharegpt",
    "alpaca_eval",
    "mt_bench",
    "spec_bench",
    "eagle_bench",
    "prose",
    "blend",
)
# Spec-Bench's categories besides its multi-turn one; that one is MT-bench's 80 two-turn questions, the same
# records as `mt_bench` (question ids, categories and turns equal), so a suite names it once, as mt_bench.
SPEC_BENCH_CATEGORIES = ("translation", "summarization", "qa", "math_reasoning", "rag")
SUITES = {"spec_bench_all": ("mt_bench", *(f"spec_bench:{c}" for c in SPEC_BENCH_CATEGORIES))}
PROSE_PROMPT_CHARS = 160  # a held-out prose chunk's opening (~32 tokens, as the drafter's training prompts)
EAGLE_TASKS = ("alpaca", "gsm8k", "humaneval", "qa", "sum")
BLEND_PARTS = ("gsm8k", "mathqa", "codealpaca", "sharegpt")


# --------------------------------------------------------------------------------------- paths


def _repo_root() -> Path | None:
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "adaflash_hf").is_dir():
            return parent
    return None


def data_dir(path: str | os.PathLike | None = None) -> Path:
    """Resolve the data folder: ``path`` > ``$ADAFLASH_DATA`` > ``<repo>/../shared/data``.

    Raises ``FileNotFoundError`` (with a hint) when the folder does not exist.
    """
    if path is not None:
        cand = [Path(path)]
    elif os.environ.get(ENV_VAR):
        cand = [Path(os.environ[ENV_VAR])]
    else:
        cand = []
        root = _repo_root()
        if root is not None:
            cand.append(root.parent / "shared" / "data")
        cand += [Path.cwd().parent / "shared" / "data", Path.cwd() / "shared" / "data"]
        cand = list(dict.fromkeys(c.resolve() for c in cand))
    for c in cand:
        if c.is_dir():
            return c.resolve()
    raise FileNotFoundError(
        f"AdaFlash data folder not found (tried: {', '.join(str(c) for c in cand)}). "
        f"Set the environment variable {ENV_VAR} to the folder holding the datasets "
        f"(shared/data, with gsm8k/, sharegpt/, ...)."
    )


def local_data_dir(path: str | os.PathLike | None = None) -> Path | None:
    """`data_dir`, but None (instead of an error) when no folder was asked for (no ``path``, no
    ``$ADAFLASH_DATA``) and none of the default places exists: named datasets then load from the Hub.
    A folder asked for explicitly that does not exist is still an error."""
    try:
        return data_dir(path)
    except FileNotFoundError:
        if path is not None or os.environ.get(ENV_VAR):
            raise
        return None


def _file(rel: str, data_dir_: str | os.PathLike | None = None) -> Path:
    p = data_dir(data_dir_) / rel
    if not p.is_file():
        raise FileNotFoundError(
            f"data file not found: {p}. Set {ENV_VAR} to the shared/data folder that holds {rel}."
        )
    return p


def load_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSON-lines file (blank lines skipped). Raises FileNotFoundError with a hint."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {p}. Set {ENV_VAR} to the shared/data folder.")
    with open(p, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _jsonl(rel: str, data_dir_=None) -> list[dict]:
    return load_jsonl(_file(rel, data_dir_))


# ------------------------------------------------------------------------------- formatting


_CALC = re.compile(r"<<[^<>]*>>")


def clean_gsm8k_answer(answer: str) -> str:
    """Drop GSM8K's ``<<a*b=c>>`` calculator annotations (the ``#### N`` final line is kept)."""
    return _CALC.sub("", answer)


def gsm8k_final_answer(answer: str) -> str:
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


def _alpaca_user(instruction: str, inp: str | None) -> str:
    instruction = instruction.strip()
    inp = (inp or "").strip()
    return f"{instruction}\n\n{inp}" if inp else instruction


def _mbpp_user(text: str, tests: Iterable[str]) -> str:
    tests = "\n".join(tests)
    return f"{text.strip()}\nYour code should pass these tests:\n\n{tests}"


def _mbpp_code(code: str) -> str:
    return "```python\n" + code.replace("\r\n", "\n").strip("\n") + "\n```"


def _mathqa_user(r: dict) -> str:
    return f"{r['problem'].strip()}\nOptions: {r['options'].strip()}"


def _mathqa_answer(r: dict) -> str:
    rationale = r["rationale"].strip()
    if len(rationale) >= 2 and rationale[0] == rationale[-1] == '"':
        rationale = rationale[1:-1]
    return rationale


def _sharegpt_messages(conv: list[dict]) -> list[dict]:
    """ShareGPT turns -> alternating user/assistant messages starting with user, ending with assistant.

    Empty turns are dropped and consecutive same-role turns merged.
    """
    role_map = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                "bard": "assistant", "assistant": "assistant"}
    msgs: list[dict] = []
    for turn in conv:
        role = role_map.get(turn.get("from", ""))
        text = (turn.get("value") or "").strip()
        if role is None or not text:
            continue
        if msgs and msgs[-1]["role"] == role:
            msgs[-1]["content"] += "\n\n" + text
        else:
            msgs.append({"role": role, "content": text})
    while msgs and msgs[0]["role"] != "user":
        msgs.pop(0)
    while msgs and msgs[-1]["role"] != "assistant":
        msgs.pop()
    return msgs


def _pair(user: str, assistant: str, domain: str) -> dict:
    return {
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}],
        "domain": domain,
    }


def chunk_text(text: str, target: int = PROSE_CHUNK_CHARS) -> list[str]:
    """Split text into chunks of about ``target`` chars (between 2/3 and 4/3 of it), cutting at a
    paragraph break, else a line break, else a space."""
    text = text.replace("\r\n", "\n").strip()
    lo, hi = (2 * target) // 3, (4 * target) // 3
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if n - i <= hi:
            out.append(text[i:].strip())
            break
        window = text[i : i + hi]
        cut = -1
        for sep in ("\n\n", "\n", ". ", " "):
            j = window.rfind(sep, lo)
            if j != -1:
                cut = j + len(sep)
                break
        if cut == -1:
            cut = target
        out.append(text[i : i + cut].strip())
        i += cut
    return [c for c in out if c]


def _prose_documents(data_dir_=None) -> list[tuple[str, str]]:
    """(source name, text) for each prose document, in a fixed order."""
    docs: list[tuple[str, str]] = []
    for rel in TRAIN_SOURCES["prose"]:
        if rel.endswith(".jsonl"):
            for r in _jsonl(rel, data_dir_):
                docs.append((rel, r["text"]))
        else:
            docs.append((rel, _file(rel, data_dir_).read_text(encoding="utf-8")))
    return docs


def _prose_samples(split: str, data_dir_=None) -> list[dict]:
    by_source: dict[str, list[str]] = {}
    for src, text in _prose_documents(data_dir_):
        by_source.setdefault(src, []).extend(chunk_text(text))
    out = []
    for src, chunks in by_source.items():
        n_eval = max(1, round(len(chunks) * PROSE_EVAL_FRACTION))
        part = chunks[:-n_eval] if split == "train" else chunks[-n_eval:]
        out.extend({"text": c, "domain": "prose", "source": src} for c in part)
    return out


def _prose_eval_samples(data_dir_=None) -> list[dict]:
    """Held-out prose chunks: the local prose sources when the data folder holds any of them, else
    the Hub source of ``prose`` (`hub_datasets`), held out the same way (its last chunks)."""
    root = local_data_dir(data_dir_)
    folders = {rel.split("/", 1)[0] for rel in TRAIN_SOURCES["prose"]}
    if root is not None and any((root / f).is_dir() for f in folders):
        return _prose_samples("eval", root)
    out = []
    for r in load_hub_records("prose"):
        chunks = chunk_text(r["text"])
        n_eval = max(1, round(len(chunks) * PROSE_EVAL_FRACTION))
        out.extend({"text": c, "domain": "prose", "source": HUB_DATASETS["prose"].local} for c in chunks[-n_eval:])
    return out


# ----------------------------------------------------------------------------- train samples


def chat_samples(domain: str, split: str = "train", limit: int | None = None, data_dir=None) -> list[dict]:
    """Samples of one training domain.

    ``split="train"``: the training files (TRAIN_SOURCES). ``split="eval"``: held-out samples of the
    same kind with full answers (gsm8k test, code_alpaca_2k, sharegpt eval500, last 2% of each prose
    source). Math/code/chat samples are ``{"messages": [...], "domain": d}``; prose samples are
    ``{"text": chunk, "domain": "prose"}`` (chunks of ~1-2k characters). With no data folder for the
    domain (`uses_builtin_samples`), the built-in sample instead (`builtin_train_samples`: prompts only).
    """
    if domain not in TRAIN_DOMAINS:
        raise ValueError(f"unknown training domain {domain!r}; known: {', '.join(TRAIN_DOMAINS)}")
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r} for domain {domain!r}; use 'train' or 'eval'")
    if uses_builtin_samples(domain, split, data_dir):
        out = builtin_train_samples(domain, split)
        return out[:limit] if limit is not None else out
    out: list[dict] = []
    if domain == "math":
        gsm = "gsm8k/train.jsonl" if split == "train" else "gsm8k/test.jsonl"
        for r in _jsonl(gsm, data_dir):
            out.append(_pair(r["question"].strip(), clean_gsm8k_answer(r["answer"]).strip(), "math"))
        if split == "train":
            for r in _jsonl("math_train4500/train.jsonl", data_dir):
                out.append(_pair(r["problem"].strip(), r["solution"].strip(), "math"))
    elif domain == "code":
        src = "codealpaca/new_codealpaca.jsonl" if split == "train" else "codealpaca/code_alpaca_2k.jsonl"
        for r in _jsonl(src, data_dir):
            out.append(_pair(_alpaca_user(r["instruction"], r.get("input")), r["output"].strip(), "code"))
        if split == "train":
            lo, hi = MBPP_TRAIN_IDS
            for r in _jsonl("mbpp/mbpp.jsonl", data_dir):
                if lo <= int(r["task_id"]) <= hi:
                    out.append(_pair(_mbpp_user(r["text"], r["test_list"]), _mbpp_code(r["code"]), "code"))
    elif domain == "chat":
        src = "sharegpt/sharegpt_train.jsonl" if split == "train" else "sharegpt/sharegpt_eval500.jsonl"
        for r in _jsonl(src, data_dir):
            msgs = _sharegpt_messages(r["conversations"])
            if msgs:
                out.append({"messages": msgs, "domain": "chat"})
    else:
        out = _prose_samples(split, data_dir)
    return out[:limit] if limit is not None else out


BUILTIN_EVAL_PER_DOMAIN = 2  # of the 8 built-in prompts per domain: the last 2 are the "eval" split


def uses_builtin_samples(domain: str, split: str = "train", data_dir=None) -> bool:
    """True when `chat_samples` falls back to the built-in sample for ``domain``: no data folder was
    asked for and none exists, or the data folder holds none of the domain's source subfolders
    (e.g. an empty ``$ADAFLASH_DATA``). A folder passed explicitly that does not exist is an error."""
    root = local_data_dir(data_dir)
    if root is None:
        return True
    sources = TRAIN_SOURCES[domain] if split == "train" else EVAL_SOURCES[domain]
    return not any((root / rel.split("/", 1)[0]).is_dir() for rel in sources)


def builtin_train_samples(domain: str, split: str = "train") -> list[dict]:
    """The built-in prompt sample of ``domain`` as training samples (`chat_samples` records without
    answers: the drafter recipe regenerates the answers with the target anyway). ``split="train"``:
    the first 6 prompts, ``"eval"``: the last `BUILTIN_EVAL_PER_DOMAIN`, so the eval proxy stays held out."""
    rows = builtin_prompts(domain)
    rows = rows[:-BUILTIN_EVAL_PER_DOMAIN] if split == "train" else rows[-BUILTIN_EVAL_PER_DOMAIN:]
    out = []
    for r in rows:
        if "text" in r:
            out.append({"text": r["text"], "domain": domain, "source": r["source"]})
        else:
            out.append({"messages": list(r["messages"]), "domain": domain, "source": r["source"]})
    return out


def all_train_samples(limit_per_domain: int | None = None, data_dir=None) -> dict[str, list[dict]]:
    return {d: chat_samples(d, "train", limit_per_domain, data_dir) for d in TRAIN_DOMAINS}


# ------------------------------------------------------------------------------ eval prompts


def _prompt(user: str, dataset: str, reference: str | None = None, **extra) -> dict:
    rec = {"messages": [{"role": "user", "content": user}], "dataset": dataset, "reference": reference}
    rec.update(extra)
    return rec


def _turns_prompts(rows: list[dict], dataset: str, **extra) -> list[dict]:
    out = []
    for r in rows:
        ref = r.get("reference")
        ref = ref[0] if isinstance(ref, list) and ref else (ref or None)
        out.append(_prompt(r["turns"][0], dataset, ref, category=r.get("category", ""),
                           question_id=r.get("question_id"), turns=list(r["turns"]), **extra))
    return out


def _eval_rows(name: str, rel: str | None, data_dir_=None) -> list[dict]:
    """Records of one eval file: from the local data folder when it holds the file's subfolder,
    else from the Hub (`hub_datasets.HUB_DATASETS[name]`). ``rel=None``: the folder's only .jsonl."""
    folder = (rel or HUB_DATASETS[name].local).split("/", 1)[0]
    root = local_data_dir(data_dir_)
    if root is not None and (root / folder).is_dir():
        return _jsonl(rel or f"{folder}/{_only_jsonl(folder, root)}", root)
    return load_hub_records(name)


def _load_eval(name: str, data_dir_=None) -> list[dict]:
    if name == "gsm8k":
        return [_prompt(r["question"].strip(), name, gsm8k_final_answer(r["answer"]),
                        solution=clean_gsm8k_answer(r["answer"]).strip())
                for r in _eval_rows(name, "gsm8k/test.jsonl", data_dir_)]
    if name == "mathqa":
        return [_prompt(_mathqa_user(r), name, r["correct"], solution=_mathqa_answer(r), category=r.get("type"))
                for r in _eval_rows(name, "mathqa/test_1000.jsonl", data_dir_)]
    if name == "math500":
        return [_prompt(r["problem"].strip(), name, r["answer"], solution=r["solution"], category=r.get("subject"),
                        level=r.get("level")) for r in _eval_rows(name, "math500/test.jsonl", data_dir_)]
    if name in ("aime2025", "aime2024"):
        rel = f"{name}/{name}.jsonl"
        return [_prompt(r["problem"].strip(), name, str(r["answer"]), id=r.get("id"))
                for r in _eval_rows(name, rel, data_dir_)]
    if name == "mbpp":
        lo, hi = MBPP_TEST_IDS
        return [_prompt(_mbpp_user(r["prompt"], r["test_list"]), name, _mbpp_code(r["code"]), task_id=r["task_id"],
                        test_list=r["test_list"], test_imports=r.get("test_imports", []))
                for r in _eval_rows(name, "mbpp/sanitized-mbpp.jsonl", data_dir_) if lo <= int(r["task_id"]) <= hi]
    if name == "humaneval":
        rows = _eval_rows(name, None, data_dir_)
        return [_prompt(r["prompt"], name, r.get("canonical_solution"), task_id=r.get("task_id")) for r in rows]
    if name == "codealpaca":
        return [_prompt(_alpaca_user(r["instruction"], r.get("input")), name, r["output"])
                for r in _eval_rows(name, "codealpaca/code_alpaca_2k.jsonl", data_dir_)]
    if name == "sharegpt":
        out = []
        for r in _eval_rows(name, "sharegpt/sharegpt_eval500.jsonl", data_dir_):
            msgs = _sharegpt_messages(r["conversations"])
            if msgs:
                out.append(_prompt(msgs[0]["content"], name, msgs[1]["content"], id=r["id"]))
        return out
    if name == "alpaca_eval":
        return [_prompt(r["instruction"].strip(), name, r.get("output"), category=r.get("dataset"))
                for r in _eval_rows(name, "alpaca_eval/alpaca_eval.jsonl", data_dir_)]
    if name == "mt_bench":
        return _turns_prompts(_eval_rows(name, "mt_bench/question.jsonl", data_dir_), name)
    if name == "spec_bench" or name.startswith("spec_bench:"):
        rows = _eval_rows("spec_bench", "spec_bench/question.jsonl", data_dir_)
        if name != "spec_bench":
            category = name.split(":", 1)[1]
            known = sorted({r.get("category") for r in rows})
            if category not in known:
                raise ValueError(f"unknown spec_bench category {category!r} in {name!r}; known: {', '.join(known)}")
            rows = [r for r in rows if r.get("category") == category]
        return _turns_prompts(rows, "spec_bench")
    if name == "prose":
        out = []
        for s in _prose_eval_samples(data_dir_):
            cut = s["text"].rfind(" ", 0, PROSE_PROMPT_CHARS)
            # at a word boundary, never inside a run of spaces (Gutenberg's "*       *" separators): no trailing space
            cut = len(s["text"][:cut].rstrip(" ")) if cut > 0 else 0
            cut = cut if cut > 0 else PROSE_PROMPT_CHARS
            out.append({"text": s["text"][:cut], "dataset": name, "reference": s["text"][cut:], "source": s["source"]})
        return out
    if name == "eagle_bench" or name.startswith("eagle_bench:"):
        tasks = EAGLE_TASKS if name == "eagle_bench" else (name.split(":", 1)[1],)
        out = []
        for t in tasks:
            if t not in EAGLE_TASKS:
                raise ValueError(f"unknown eagle_bench task {t!r} in {name!r}; known: {', '.join(EAGLE_TASKS)}")
            out += _turns_prompts(_eval_rows(f"eagle_bench:{t}", f"eagle_bench/{t}.jsonl", data_dir_), "eagle_bench", task=t)
        return out
    raise ValueError(f"unknown eval dataset {name!r}; known: {', '.join(EVAL_DATASETS)} (and eagle_bench:<task>, "
                     "spec_bench:<category>)")


def _only_jsonl(folder: str, data_dir_=None) -> str:
    files = sorted(p.name for p in (data_dir(data_dir_) / folder).glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no .jsonl file in {data_dir(data_dir_) / folder}; set {ENV_VAR}.")
    return files[0]


BUILTIN_DIR = Path(__file__).resolve().parent / "builtin_prompts"
BUILTIN_DOMAINS = ("math", "code", "chat", "prose")


def dataset_domain(dataset_name: str) -> str:
    """The domain of a named eval dataset (math, code, chat, prose), or ``"blend"``."""
    name = dataset_name.strip().lower()
    if name == "blend":
        return "blend"
    if name == "eagle_bench":
        return "chat"
    if name not in HUB_DATASETS:
        raise ValueError(f"unknown eval dataset {dataset_name!r}; known: {', '.join(EVAL_DATASETS)}")
    return HUB_DATASETS[name].domain


def builtin_prompts(domain: str, limit: int | None = None) -> list[dict]:
    """The prompt sample shipped with the package (8 per domain, see builtin_prompts/README.md), as
    `eval_prompts` records with ``"dataset": "builtin:<domain>"``. ``domain`` is math, code, chat,
    prose, or ``blend`` (math, code and chat interleaved) or a dataset name (its domain)."""
    if domain not in BUILTIN_DOMAINS and domain != "blend":
        domain = dataset_domain(domain)
    if domain == "blend":
        parts = [builtin_prompts(d) for d in ("math", "code", "chat")]
        out = [rec for group in zip(*parts) for rec in group]
        return out[:limit] if limit is not None else out
    out = []
    for r in load_jsonl(BUILTIN_DIR / f"{domain}.jsonl"):
        if "text" in r:
            out.append({"text": r["text"], "dataset": f"builtin:{domain}", "reference": r.get("reference"),
                        "source": r["source"]})
        else:
            out.append(_prompt(r["prompt"], f"builtin:{domain}", r.get("reference"), source=r["source"]))
    return out[:limit] if limit is not None else out


def expand_datasets(names: list[str]) -> list[str]:
    """Dataset names with each suite (`SUITES`) replaced by its sets, in order, each name once.

    Example:
        >>> expand_datasets(["gsm8k", "spec_bench_all"])[:3]
        ['gsm8k', 'mt_bench', 'spec_bench:translation']
    """
    out = [n for name in names for n in SUITES.get(name.strip().lower(), (name,))]
    return list(dict.fromkeys(out))


def eval_prompts(dataset_name: str, limit: int | None = None, seed: int = 0, data_dir=None) -> list[dict]:
    """Evaluation prompts of one dataset (first ``limit`` records, in file order).

    Names: gsm8k, mathqa, math500, aime2025, aime2024, mbpp (sanitized test ids 11-510), humaneval,
    codealpaca (code_alpaca_2k), sharegpt (first human turn of eval500), alpaca_eval, mt_bench,
    spec_bench (all categories, or ``spec_bench:<category>``: translation, summarization, qa,
    math_reasoning, rag, and MT-bench's; the suite ``spec_bench_all`` of `expand_datasets` lists mt_bench and
    the five others), eagle_bench (all 5 tasks, or ``eagle_bench:<task>``), and ``blend``: an equal mix of
    gsm8k, mathqa, codealpaca and sharegpt drawn with ``random.Random(seed)`` and interleaved
    round-robin, so any prefix is balanced. Each record: ``{"messages": [{"role": "user", ...}],
    "dataset": name, "reference": str | None, ...}``; blend records also carry ``"source"``.
    Multi-turn sets (mt_bench, spec_bench, eagle_bench) keep all user turns under ``"turns"``.
    A dataset whose subfolder is not in the data folder loads from the Hub with ``datasets``
    (`hub_datasets.HUB_DATASETS`); `HubUnavailable` says when that is not possible either
    (`builtin_prompts` is the offline sample).
    ``prose`` (the held-out end of each prose source) is a continuation task: its records carry a
    raw ``"text"`` prompt (a chunk's opening, no chat template) instead of ``"messages"``.
    """
    if not isinstance(dataset_name, str):
        raise ValueError(f"dataset name must be a string, got {dataset_name!r}")
    name = dataset_name.strip().lower()
    if name == "blend":
        pools = {p: _load_eval(p, data_dir) for p in BLEND_PARTS}
        per = min(len(v) for v in pools.values())
        if limit is not None:
            per = min(per, -(-limit // len(BLEND_PARTS)))
        rng = random.Random(seed)
        picked = {p: rng.sample(pools[p], per) for p in BLEND_PARTS}
        out = []
        for i in range(per):
            for p in BLEND_PARTS:
                rec = dict(picked[p][i])
                rec["source"] = p
                rec["dataset"] = "blend"
                out.append(rec)
        return out[:limit] if limit is not None else out
    rows = _load_eval(name, data_dir)
    return rows[:limit] if limit is not None else rows


__all__ = [
    "ENV_VAR",
    "TRAIN_DOMAINS",
    "TRAIN_SOURCES",
    "EVAL_DATASETS",
    "HUB_DATASETS",
    "HubUnavailable",
    "data_dir",
    "local_data_dir",
    "builtin_prompts",
    "builtin_train_samples",
    "uses_builtin_samples",
    "dataset_domain",
    "load_jsonl",
    "chat_samples",
    "all_train_samples",
    "eval_prompts",
    "expand_datasets",
    "SUITES",
    "SPEC_BENCH_CATEGORIES",
    "chunk_text",
    "gsm8k_final_answer",
    "clean_gsm8k_answer",
]
