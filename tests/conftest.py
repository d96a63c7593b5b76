"""Shared factories for the CPU test suite: tiny seeded targets, drafters, drafter inputs, tokenizers.

Everything is tiny (hidden 32, vocab 128, 4 target layers) so the whole suite runs in seconds on
two cores. The factories are plain functions (importable as `from conftest import ...`) and are
also exposed as fixtures of the same name, so other test files can use whichever reads better:

    def test_something(tiny_target, make_drafter):
        target = tiny_target("llama", seed=3)
        drafter = make_drafter(target, num_layers=2, block_size=8)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The engine's Triton kernels run in Triton's interpreter on this CPU-only suite (read when a kernel
# module is first imported, so before any test imports one).
os.environ.setdefault("TRITON_INTERPRET", "1")

# The research drivers (examples/research: the online protocol and experiment, the reference target's corpus and
# training) live outside the package; their tests import them by module name, as the scripts import each other.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "research"))

# Tiny models: one intra-op thread is faster than two (no OpenMP hand-off per op), and far faster
# when the two cores are shared with other processes (spinning OpenMP workers oversubscribe them).
torch.set_num_threads(1)

FAMILIES = ("qwen3", "llama")

# One place for the tiny sizes, so tests can derive shapes instead of repeating numbers.
TINY = dict(hidden=32, intermediate=64, heads=4, kv_heads=2, vocab=128, layers=4)


def build_tiny_target(
    family: str = "qwen3",
    seed: int = 0,
    vocab: int = TINY["vocab"],
    layers: int = TINY["layers"],
    hidden: int = TINY["hidden"],
    heads: int = TINY["heads"],
    kv_heads: int = TINY["kv_heads"],
    intermediate: int = TINY["intermediate"],
    attn_implementation: str = "sdpa",
    **config_overrides,
):
    """A randomly initialised (seeded) tiny `Qwen3ForCausalLM` or `LlamaForCausalLM`, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    fields = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation=attn_implementation,
    )
    fields.update(config_overrides)
    torch.manual_seed(seed)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**fields))
    elif family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**fields))
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return model.eval()


REMOTE_CODE_SCRIPT = """
import sys
sys.modules["adaflash_hf"] = None  # the library is "not installed"
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel
try:
    import adaflash_hf  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("adaflash_hf should not be importable here")
for path, out in zip(sys.argv[1::2], sys.argv[2::2]):
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    model = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    assert type(model).__name__ == "AdaFlashDrafter", type(model)
    assert not type(model).__module__.startswith("adaflash_hf"), type(model).__module__
    assert "adaflash_hf" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
    torch.manual_seed(0)
    cfg = model.config
    ctx = torch.randn(1, 5, len(cfg.target_layer_ids) * cfg.hidden_size)
    noise = torch.randn(1, cfg.block_size, cfg.hidden_size)
    with torch.no_grad():
        hidden = model(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["__hidden__"] = hidden
    save_file(state, out)
    print(out, type(config).__module__, type(model).__module__, type(model).__name__, cfg.use_length_head)
"""


def remote_code_job(folders: dict, tmp_path):
    """The run of `load_with_remote_code` as a job of tests/script_runner.py (nothing preloaded: a fresh interpreter,
    as `python -c`, started in `tmp_path` with the script there): `(jobs, env, outs)`, `outs` the tensor file of each
    name."""
    import shutil

    from script_runner import Job

    argv, outs = [], {}
    for name, folder in folders.items():
        copy, outs[name] = tmp_path / f"remote_copy_{name}", tmp_path / f"remote_{name}.safetensors"
        shutil.copytree(folder, copy)
        argv += [str(copy), str(outs[name])]
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", PYTHONPATH="", OMP_NUM_THREADS="1")
    (tmp_path / "remote_code_load.py").write_text(REMOTE_CODE_SCRIPT)
    return [Job("remote_code", [tmp_path / "remote_code_load.py", *argv], cwd=tmp_path, timeout=180.0)], env, outs


def remote_code_loads_of(result, outs: dict) -> dict[str, tuple[str, dict]]:
    """What `load_with_remote_code` returns, from its job's result."""
    from safetensors.torch import load_file

    assert result.returncode == 0, f"(timed out: {result.timed_out})\n{result.stderr[-3000:]}"
    lines = {line.split(" ", 1)[0]: line for line in result.stdout.splitlines()}
    loads = {name: (lines[str(out)], load_file(str(out))) for name, out in outs.items()}
    assert all("transformers_modules" in line for line, _ in loads.values())
    return loads


def load_with_remote_code(folders: dict, tmp_path) -> dict[str, tuple[str, dict]]:
    """Load a copy of each folder of `folders` (name -> folder) with `AutoModel.from_pretrained(trust_remote_code=True)`
    in ONE fresh, offline interpreter run from `tmp_path`, where adaflash_hf cannot be imported. Returns, by
    name, its line of stdout and its tensors: the state dict plus `__hidden__`, the block states of a call
    with `torch.manual_seed(0)`, context `randn(1, 5, K*H)`, noise `randn(1, block_size, H)`."""
    from script_runner import run_scripts

    jobs, env, outs = remote_code_job(folders, tmp_path)
    return remote_code_loads_of(run_scripts(jobs, env, preload=(), workdir=tmp_path / "logs")["remote_code"], outs)


def remote_code_folders(root):
    """`distinct_pair()`'s drafter saved by `save_pretrained` ("saved") and exported by
    `export_dflash(dtype=None, remote_code=True)` ("exported") under `root`: `(drafter, folders)`."""
    from adaflash_hf import export_dflash

    _, drafter = distinct_pair()
    folders = {"saved": root / "saved", "exported": root / "exported"}
    drafter.save_pretrained(folders["saved"])
    export_dflash(drafter, str(folders["exported"]), dtype=None, remote_code=True)
    return drafter, folders


@pytest.fixture(scope="session")
def remote_code_loads(tmp_path_factory):
    """`remote_code_folders`' two folders, both loaded by `load_with_remote_code` in one fresh interpreter (one
    interpreter start instead of two): `drafter`, `folders`, `loads`. pytest_collection_finish started that run in
    the background (behind the others); run here when it did not."""
    from script_runner import BACKGROUND

    running = BACKGROUND.get("remote_code")
    if running is None:
        root = tmp_path_factory.mktemp("remote_code")
        drafter, folders = remote_code_folders(root)
        return {"drafter": drafter, "folders": folders, "loads": load_with_remote_code(folders, root)}
    made = running.context
    loads = remote_code_loads_of(running.wait()["remote_code"], made["outs"])
    return {"drafter": made["drafter"], "folders": made["folders"], "loads": loads}


def build_drafter(target, num_layers: int = 2, block_size: int = 8, seed: int = 0, mask_token_id=None, **kw):
    """`AdaFlashDrafter.from_target(target, ...)` with a seeded init; the mask defaults to the last vocab id."""
    from adaflash_hf import AdaFlashDrafter

    if mask_token_id is None and kw.get("tokenizer") is None:
        mask_token_id = target.get_input_embeddings().weight.shape[0] - 1
    torch.manual_seed(seed)
    drafter = AdaFlashDrafter.from_target(
        target, num_layers=num_layers, block_size=block_size, mask_token_id=mask_token_id, **kw
    )
    return drafter.eval()


def distinct_pair(family: str = "qwen3", use_length_head: bool = True, num_layers: int = 2, **kw):
    """A tiny target and a block-8 drafter whose every tensor is distinct, so a mix-up in a checkpoint
    layout shows (norms initialise to ones)."""
    target = build_tiny_target(family)
    drafter = build_drafter(target, num_layers=num_layers, block_size=8, use_length_head=use_length_head,
                            length_head_dim=24, **kw)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return target, drafter


def target_context(drafter, target, input_ids):
    """Raw drafter context features `[b, T, K*H]` of `input_ids` (target layers `target_layer_ids`)."""
    with torch.no_grad():
        out = target(input_ids, output_hidden_states=True)
    return drafter.select_context(out.hidden_states)


def block_embeds(drafter, bonus_ids):
    """Embedded block `[b, B, H]`: the bonus token in slot 0, `mask_token_id` in slots 1..B-1."""
    b = bonus_ids.shape[0]
    masks = torch.full((b, drafter.config.block_size - 1), drafter.config.mask_token_id, dtype=torch.long)
    with torch.no_grad():
        return drafter.embed(torch.cat([bonus_ids.view(b, 1), masks], dim=1))


def drafter_inputs(drafter, target, batch: int = 2, ctx_len: int = 6, seed: int = 0):
    """A ready forward input dict (`noise_embeds`, `context_hidden_states`, `position_ids`) for `drafter`."""
    g = torch.Generator().manual_seed(seed)
    vocab = drafter.config.vocab_size
    ids = torch.randint(0, vocab - 1, (batch, ctx_len + 1), generator=g)
    ctx = target_context(drafter, target, ids[:, :ctx_len])
    noise = block_embeds(drafter, ids[:, ctx_len])
    positions = torch.arange(ctx_len + drafter.config.block_size).unsqueeze(0).expand(batch, -1)
    return dict(noise_embeds=noise, context_hidden_states=ctx, position_ids=positions)


def build_word_tokenizer(num_words: int = 100, mask_token: str | None = None):
    """A tiny `PreTrainedTokenizerFast` (WordLevel, whitespace split) with `num_words` tokens incl. `[UNK]`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, num_words)}}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    kwargs = {"mask_token": mask_token} if mask_token else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", **kwargs)


def spec_dflash_keys(num_layers: int) -> list[str]:
    """SPEC.md section 1's DFlash (z-lab) weight list, written out from the spec text, not from our code."""
    keys = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(num_layers):
        keys += [f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"]
        keys += [f"layers.{i}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        keys += [f"layers.{i}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    return keys


def spec_head_keys(prefix: str) -> list[str]:
    """The length head's six tensors (SPEC section 1, AdaFlash format) under `prefix`."""
    return [f"{prefix}{m}.{t}" for m in ("down", "res.0", "out") for t in ("weight", "bias")]


def spec_shapes(H, inter, n_layers, n_heads, n_kv, head_dim, K, head_dim_len=None, head_prefix=None):
    """Shapes of every SPEC tensor (Qwen3 layer shapes; fc is `[H, K*H]`; head `[d, 2H]`, `[d, d]`, `[1, d]`)."""
    shapes = {"fc.weight": (H, K * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (n_heads * head_dim, H),
                p + "self_attn.k_proj.weight": (n_kv * head_dim, H),
                p + "self_attn.v_proj.weight": (n_kv * head_dim, H),
                p + "self_attn.o_proj.weight": (H, n_heads * head_dim),
                p + "self_attn.q_norm.weight": (head_dim,),
                p + "self_attn.k_norm.weight": (head_dim,),
                p + "mlp.gate_proj.weight": (inter, H),
                p + "mlp.up_proj.weight": (inter, H),
                p + "mlp.down_proj.weight": (H, inter),
            }
        )
    if head_prefix is not None:
        d = head_dim_len
        shapes.update(
            {
                f"{head_prefix}down.weight": (d, 2 * H),
                f"{head_prefix}down.bias": (d,),
                f"{head_prefix}res.0.weight": (d, d),
                f"{head_prefix}res.0.bias": (d,),
                f"{head_prefix}out.weight": (1, d),
                f"{head_prefix}out.bias": (1,),
            }
        )
    return shapes


@pytest.fixture
def tiny_target():
    """Factory fixture: `tiny_target(family="qwen3"|"llama", seed=0, vocab=128, layers=4, ...)`."""
    return build_tiny_target


@pytest.fixture
def make_drafter():
    """Factory fixture: `make_drafter(target, num_layers=2, block_size=8, **from_target_kwargs)`."""
    return build_drafter


@pytest.fixture
def tiny_tokenizer():
    """Factory fixture: `tiny_tokenizer(num_words=100, mask_token=None)`."""
    return build_word_tokenizer


@pytest.fixture(autouse=True)
def _deterministic_cpu():
    """Tests compare tensors; keep kernels deterministic and the global RNG seeded per test."""
    torch.manual_seed(0)
    yield


# Hermetic data: the data loaders (`adaflash_hf.training.data`) read `$ADAFLASH_DATA`; point it at
# the small verbatim excerpt of shared/data in tests/fixtures/data, unless the caller already set it
# (e.g. `ADAFLASH_DATA=../shared/data pytest tests` runs the same tests on the full datasets).
import os as _os
from pathlib import Path as _Path

FIXTURE_DATA = _Path(__file__).resolve().parent / "fixtures" / "data"
_os.environ.setdefault("ADAFLASH_DATA", str(FIXTURE_DATA))


_BACKGROUND_ROOTS: list = []  # temporary folders of the background runs, removed when the session ends


# Subprocess-heavy runs start in the background as soon as the selected tests are known: on the CI's two cores they
# run beside this process's in-process tests, one job at a time, instead of after them, in the order of the first
# test that waits for each: the example smokes, the remote-code load (tests/test_export.py, test_formats.py), the
# fresh checkout's commands, and the runs of the modules whose tests take the `background` fixture. Those tests'
# fixtures wait for them (or start them themselves when this did not).
def pytest_collection_finish(session):
    import tempfile

    from script_runner import BACKGROUND, start_scripts

    if session.config.option.collectonly or hasattr(session.config, "workerinput"):
        return  # nothing to run; or an xdist worker, which may not run these tests: their fixtures start them
    items = session.items
    plans = []  # (index of the first test waiting for it, name, start(after run) -> its run)

    def first(wanted) -> int | None:
        return next((i for i, item in enumerate(items) if wanted(item)), None)

    def root(prefix: str) -> _Path:
        path = _Path(tempfile.mkdtemp(prefix=prefix))
        _BACKGROUND_ROOTS.append(path)
        return path

    smokes = [item for item in items if getattr(item, "originalname", "") == "test_example_smoke"]
    if smokes:
        def start_smokes(after):
            folder = root("adaflash_smokes_")
            jobs, env = smokes[0].module.smoke_jobs({item.callspec.params["script"] for item in smokes}, folder)
            return start_scripts(jobs, env, workdir=folder / "logs", parallel=1, after=after)

        plans.append((items.index(smokes[0]), "examples", start_smokes))
    at = first(lambda item: "remote_code_loads" in getattr(item, "fixturenames", ()))
    if at is not None:
        def start_remote_code(after):
            folder = root("adaflash_remote_code_")
            with torch.random.fork_rng():  # the tests' global generator left as it was
                drafter, folders = remote_code_folders(folder)
            jobs, env, outs = remote_code_job(folders, folder)
            return start_scripts(jobs, env, preload=(), workdir=folder / "logs", after=after,
                                 context={"drafter": drafter, "folders": folders, "outs": outs})

        plans.append((at, "remote_code", start_remote_code))
    at = first(lambda item: getattr(getattr(item, "module", None), "__name__", "").endswith("test_fresh_checkout"))
    if at is not None and items[at].module.can_checkout():  # the copy's commands
        def start_fresh(after, module=items[at].module):
            dest, env = module.make_checkout(root("adaflash_fresh_"))
            return start_scripts(module.fresh_jobs(dest), env, workdir=dest.parent / "runner", parallel=1, after=after,
                                 context={"checkout": (dest, env)})

        plans.append((at, "fresh_checkout", start_fresh))
    for module in dict.fromkeys(item.module for item in items if "background" in getattr(item, "fixturenames", ())):
        def start_module(after, module=module):
            folder = root("adaflash_background_")
            jobs, env, preload = module.background_run(folder)
            return start_scripts(jobs, env, preload=preload, workdir=folder / "logs", parallel=1, after=after)

        at = first(lambda item, module=module: getattr(item, "module", None) is module
                   and "background" in getattr(item, "fixturenames", ()))
        plans.append((at, module.__name__, start_module))
    after = None
    for _, name, start in sorted(plans, key=lambda plan: plan[0]):
        after = BACKGROUND[name] = start(after)


@pytest.fixture(scope="module")
def background(request, tmp_path_factory):
    """The results (by job name, tests/script_runner.py) of the runs the test module's `background_run(root)` returns
    as `(jobs, env, preload)`: runs that need nothing from this process, so they go on the second core while the
    in-process tests run. pytest_collection_finish started them behind the example smokes and the fresh checkout's
    commands; started here when it did not (then two at a time, pytest waiting)."""
    from script_runner import BACKGROUND, start_scripts

    running = BACKGROUND.get(request.module.__name__)
    if running is None:
        root = tmp_path_factory.mktemp("background")
        jobs, env, preload = request.module.background_run(root)
        running = start_scripts(jobs, env, preload=preload, workdir=root / "logs", parallel=2)
    return running.wait()


def pytest_sessionfinish(session):
    import shutil

    from script_runner import BACKGROUND

    for running in BACKGROUND.values():
        running.stop()
    BACKGROUND.clear()
    for root in _BACKGROUND_ROOTS:
        shutil.rmtree(root, ignore_errors=True)
