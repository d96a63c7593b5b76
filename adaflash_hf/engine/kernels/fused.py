"""The target's decoder layers with fewer, larger kernels: fused projections, fused elementwise math.

At batch 1 a decoder layer reads seven weight matrices and, through the HF modules, launches ~45
tiny elementwise kernels (RMSNorm alone is six). In a CUDA graph each still costs a few
microseconds, which kept the engine's 8B-shape decode far from its bandwidth floor. :class:`FusedTarget` changes two things and nothing else:

* **projections**: each layer's ``q/k/v_proj`` and ``gate/up_proj`` weights (and biases) are
  re-stored as row blocks of one tensor, and the HF modules' parameters become views into it: no
  extra memory, the model's own forward is unchanged, and each group is one GEMM;
* **elementwise math**: residual add + RMSNorm, Qwen3's q/k RMSNorm + RoPE (on the static decode
  path together with the K/V cache writes and the query layout, :class:`~.elementwise.SlotStore`), and ``act(gate) * up``
  are one function each. On CUDA with Triton they are hand-written kernels (:mod:`.norms`; the static path's
  norm + RoPE + stores one kernel, :mod:`.rope_store`): no Dynamo or Inductor, so a new process reads them
  from Triton's disk cache instead of compiling them. Elsewhere the torch functions of :mod:`.elementwise` serve: on CPU
  eagerly, on CUDA compiled with ``torch.compile`` (another activation than SiLU, a head size the kernels do
  not take, or kernels that failed their check). Both do the HF modules' operations
  in the same order and dtypes (``tests/test_engine_fused.py`` checks the torch functions' bit equality on
  CPU, ``tests/test_engine_triton.py`` the kernels against them in Triton's interpreter), and
  :meth:`FusedTarget.check_elementwise` compares the kernels with the functions once per GPU before they serve.
* **few-row projections** (one token: batch-1 decoding; 2-16 tokens: a verify block): cuBLAS picks
  GEMM kernels that read the weights below the GPU's bandwidth at these shapes. Two other kinds of
  kernel compete: Inductor's matrix-vector reduction tuned by ``coordinate_descent_tuning`` (one row,
  as gpt-fast does) and :mod:`.skinny_linear`'s Triton kernels (one row, and 16-row ``tl.dot`` tiles).
  Which serves each projection is measured, not assumed: :meth:`FusedTarget.build` times them on the
  model's own weights (CUDA graphs, every layer's weight in turn, so nothing is served from L2) and
  keeps the fastest (:attr:`FusedTarget.row_kernels` for one row, :attr:`FusedTarget.block_kernels`
  for 2-16 rows; measured once per GPU, shapes, dtype and library versions, then read from the disk
  cache of :mod:`.tuning_cache`). Larger forwards (prefill) always use cuBLAS. (``act(gate) * up`` is not fused into the
  down projection: Inductor then recomputes the activation in every output tile, and the down
  projection got slower in the probe.)

:meth:`FusedTarget.build` returns ``None`` with a reason (the engine then keeps the modules' path)
when a layer is not the stock Qwen3 / Llama math: adapters such as PEFT LoRA on a projection,
module hooks (other than transformers' own output-capturing ones, :func:`.stock_layers.foreign_hooks`), another
norm, MLP or RoPE. Weights are read by address, like the CUDA graphs do: update them in place (``load_state_dict``, ``copy_``), not by assigning new parameters.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...speculation.capture import CAPTURE_MODE, capturing
from .elementwise import elementwise_functions
from .stock_layers import unsupported_layers

_MAX_ROWS = 16  # skinny_linear.MAX_ROWS (that module needs Triton, imported only when used)
_TUNED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its tuning (FusedTarget.build)

__all__ = ["FusedTarget", "LayerWeights", "fuse_layer_weights", "graph_ms"]


# ------------------------------------------------------------------ compiling (the elementwise math: .elementwise)
def allow_shape_recompiles(limit: int = 128) -> None:
    """Raise Dynamo's recompile limit (default 8) to at least ``limit``: the compiled functions here and compiled
    flex attention are specialised per shape (token, slot-row and query buckets: one engine reaches a few dozen),
    and past the limit a ``fullgraph=True`` function fails instead of compiling again."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _gather_linear(out: torch.Tensor, q_slots: torch.Tensor, q_rows: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``o_proj`` of attention output in the slot layout ``[slot rows, heads, q, d]``, each token's row
    gathered at ``(q_slots[t], q_rows[t])`` (compiled for one row: the gather is the reduction's loads)."""
    return F.linear(out[q_slots, :, q_rows].flatten(1), weight, bias)


def _triton_elementwise_refusal(model) -> str | None:
    """Why :mod:`.norms`' kernels cannot do ``model``'s elementwise math (``None``: they can): its head size,
    or an MLP activation other than SiLU (checked on values: the kernel computes SiLU)."""
    from .norms import unsupported

    why = unsupported(model.model.layers[0].self_attn.head_dim)
    if why is not None:
        return why
    probe = torch.linspace(-12, 12, 97)
    if not torch.equal(model.model.layers[0].mlp.act_fn(probe), F.silu(probe)):
        return f"the MLP activation {type(model.model.layers[0].mlp.act_fn).__name__} is not SiLU"
    return None


ROW_PROJECTIONS = ("qkv", "o", "gate_up", "down", "lm_head")
ROW_KINDS = ("cublas", "gemv", "triton")  # one row: cuBLAS, Inductor's tuned reduction, skinny_linear
BLOCK_KINDS = ("cublas", "triton")  # 2-16 rows


def graph_ms(fn: Callable[[], None], reps: int = 10) -> float:
    """Device milliseconds of ``fn`` (a loop of kernel launches), captured as a CUDA graph so that
    launch overhead does not hide the kernels' own time: the mean of ``reps`` replays back to back.

    Example:
        >>> graph_ms(lambda: [F.linear(x, w) for w in weights], reps=20)  # doctest: +SKIP
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with capturing(), torch.cuda.graph(graph, capture_error_mode=CAPTURE_MODE):  # speculation/capture.py
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


# ------------------------------------------------------------------ fused projections
def _fuse_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``[sum out_features, in]`` weight (and bias) whose row blocks the modules' parameters become
    views of. Already fused (an engine built earlier on the same model): the existing storage is reused."""

    def fused(tensors: list[torch.Tensor]) -> torch.Tensor:
        rows = sum(t.shape[0] for t in tensors)
        first = tensors[0]
        step = first[0].numel() if first.dim() == 2 else 1
        offsets = [first.storage_offset() + step * sum(t.shape[0] for t in tensors[:i]) for i in range(len(tensors))]
        if all(t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and t.is_contiguous()
               and t.storage_offset() == o for t, o in zip(tensors, offsets)):
            return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
        with torch.no_grad(), torch.inference_mode(False):  # the model's weights stay normal (updatable) tensors
            out = torch.cat([t.detach() for t in tensors])
            if out.device.type == "cpu" and all(t.is_shared() for t in tensors):
                out.share_memory_()  # a model in shared memory stays there: an online trainer process reads it
            start = 0
            for t in tensors:
                t.data = out[start : start + t.shape[0]]
                start += t.shape[0]
        return out

    weight = fused([m.weight for m in linears])
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return weight, None
    if any(b is None for b in biases):
        raise ValueError("some projections of a group have a bias and others do not")
    return weight, fused(biases)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's fused projections (the modules' parameters are views of these)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    splits: tuple[int, int, int]  # q, k, v output features


def fuse_layer_weights(layers) -> list[LayerWeights]:
    """Fuse each Qwen3-style layer's ``q/k/v_proj`` and ``gate/up_proj`` (a target's, or a drafter's: the
    same attribute names); an earlier fusion of the same layers is reused."""
    out = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up, gate_up_bias = _fuse_rows([mlp.gate_proj, mlp.up_proj])
        out.append(LayerWeights(qkv, qkv_bias, gate_up, gate_up_bias,
                                (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)))
    return out


class FusedTarget:
    """A Qwen3 / Llama target's layers for :func:`.target.decoder_forward`: fused projections and
    fused elementwise kernels (see the module docstring).

    ``row_kernels`` maps each of :data:`ROW_PROJECTIONS` to one of :data:`ROW_KINDS` for forwards of one
    token (``"gemv"``: Inductor's compiled reduction; ``"triton"``: :func:`.skinny_linear.skinny_linear`),
    ``block_kernels`` to one of :data:`BLOCK_KINDS` for 2-16 tokens. :meth:`build` measures both on CUDA;
    elsewhere they are all ``"cublas"`` unless given (the CPU tests give them to run the same dispatch).

    Example:
        >>> fused, why = FusedTarget.build(target)  # doctest: +SKIP
        >>> fused.row_kernels  # doctest: +SKIP
        {'qkv': 'gemv', 'o': 'triton', 'gate_up': 'gemv', 'down': 'triton', 'lm_head': 'gemv'}
        >>> logits, _ = decoder_forward(target, tokens, positions, attend, fused=fused)  # doctest: +SKIP
    """

    def __init__(self, model, compile: bool, row_kernels: dict[str, str] | None = None,
                 block_kernels: dict[str, str] | None = None, elementwise: str | None = None):
        for name, given, kinds in (("row_kernels", row_kernels, ROW_KINDS), ("block_kernels", block_kernels, BLOCK_KINDS)):
            if set(given or {}) - set(ROW_PROJECTIONS) or any(v not in kinds for v in (given or {}).values()):
                raise ValueError(f"{name} maps {', '.join(ROW_PROJECTIONS)} to one of {kinds}; got {given!r}")
        if elementwise not in (None, "torch", "triton"):
            raise ValueError(f"elementwise is 'torch' or 'triton', got {elementwise!r}")
        if elementwise == "triton":
            why = _triton_elementwise_refusal(model)
            if why is not None:
                raise ValueError(f"elementwise='triton': {why}")
        self.model, self.compiled = model, compile
        self.layers = fuse_layer_weights(model.model.layers)
        rows = self._row_eager = {"qkv": _linear, "o": _gather_linear, "gate_up": _linear, "down": _linear, "lm_head": _linear}
        if compile:
            allow_shape_recompiles()
            # One-row products, static shapes: Inductor rewrites them as tuned reductions (its mm decomposition
            # for one row runs only with coordinate descent tuning on). One compiled function per projection,
            # compiled on its first call (only the projections whose measured choice is "gemv" ever are).
            opts = {"emulate_precision_casts": True, "coordinate_descent_tuning": True}
            rows = {k: torch.compile(f, fullgraph=True, dynamic=False, options=opts) for k, f in rows.items()}
        self._row_fns = dict(rows)
        self._torch_fns: dict[str, Callable] | None = None
        self.elementwise, self.elementwise_note = "torch", ""
        self._use_elementwise(elementwise or self._default_elementwise())
        self.row_kernels = {k: (row_kernels or {}).get(k, "cublas") for k in ROW_PROJECTIONS}
        self.block_kernels = {k: (block_kernels or {}).get(k, "cublas") for k in ROW_PROJECTIONS}
        # Triton tile per (projection, rows): 1 or MAX_ROWS. Given kernels get the first candidate that fits.
        self.triton_configs: dict[tuple[str, int], object] = {}
        for role in ROW_PROJECTIONS:
            for rows_, kind in ((1, self.row_kernels[role]), (_MAX_ROWS, self.block_kernels[role])):
                if kind == "triton":
                    fits = self._triton_candidates(role, rows_)
                    if not fits:
                        raise ValueError(f"no Triton tile of skinny_linear fits the {role} projection's weight {tuple(self._weight(role)[0].shape)}")
                    self.triton_configs[(role, rows_)] = fits[0]
        self.row_timings: dict[str, dict[str, float]] = {}  # per projection and rows: device ms per layer of each kernel
        self.row_note = ""

    def _default_elementwise(self) -> str:
        """``"triton"`` (:mod:`.norms` and :mod:`.rope_store`'s kernels) when compiling for CUDA with Triton
        available and a model they take, else ``"torch"`` (the torch functions, compiled or eager)."""
        if not (self.compiled and self.layers[0].qkv.is_cuda):
            return "torch"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "torch" if _triton_elementwise_refusal(self.model) else "triton"

    def _use_elementwise(self, kind: str) -> None:
        """Serve the elementwise math with ``kind``'s functions: ``"triton"``, the hand-written kernels (no
        Dynamo, so a new process starts without compiling them); ``"torch"``, the torch functions above,
        compiled with Inductor when :attr:`compiled` (a compile per function and shape class) and eager otherwise."""
        if kind == "triton":
            from .norms import add_rms_norm_triton, norm_rope_triton, qk_norm_rope_triton, rms_norm_triton, silu_mul_triton
            from .rope_store import qk_norm_rope_store_triton

            fns = {"rms_norm": rms_norm_triton, "add_rms_norm": add_rms_norm_triton, "qk_norm_rope": qk_norm_rope_triton,
                   "qk_norm_rope_store": qk_norm_rope_store_triton, "act_mul": silu_mul_triton, "norm_rope": norm_rope_triton}
        else:
            fns = self._torch_elementwise()
        self.elementwise = kind
        self.rms_norm, self.add_rms_norm, self.qk_norm_rope, self.qk_norm_rope_store, self.act_mul, self.norm_rope = (
            fns["rms_norm"], fns["add_rms_norm"], fns["qk_norm_rope"], fns["qk_norm_rope_store"], fns["act_mul"],
            fns["norm_rope"])

    def _torch_elementwise(self) -> dict[str, Callable]:
        """The torch functions of the elementwise math (compiled when :attr:`compiled`), built once."""
        if self._torch_fns is None:
            fns = elementwise_functions(self.model.model.layers[0].mlp.act_fn)
            if self.compiled:
                # One kernel per function; the first call per shape class compiles (a few seconds), shapes then
                # become dynamic on their own (one more compile), so every token bucket reuses the kernels.
                fns = {k: torch.compile(f, fullgraph=True, options={"emulate_precision_casts": True}) for k, f in fns.items()}
            self._torch_fns = fns
        return self._torch_fns

    # ------------------------------------------------------------------ projections
    def _weight(self, role: str, li: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight, bias)`` of projection ``role`` in layer ``li`` (the LM head for ``"lm_head"``)."""
        if role == "lm_head":
            head = self.model.lm_head
            return head.weight, head.bias
        if role in ("qkv", "gate_up"):
            w = self.layers[li]
            return (w.qkv, w.qkv_bias) if role == "qkv" else (w.gate_up, w.gate_up_bias)
        layer = self.model.model.layers[li]
        lin = layer.self_attn.o_proj if role == "o" else layer.mlp.down_proj
        return lin.weight, lin.bias

    def _triton_candidates(self, role: str, rows: int) -> list:
        """The tiles of :mod:`.skinny_linear` that fit projection ``role`` (empty without Triton)."""
        try:
            from .skinny_linear import BLOCK_CONFIGS, ROW_CONFIGS, fitting
        except ImportError:
            return []
        weight = self._weight(role)[0]
        return fitting(ROW_CONFIGS if rows == 1 else BLOCK_CONFIGS, weight.shape, rows)

    def _project(self, role: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 gather: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Projection ``role`` of rows ``x`` (or of ``x``'s slot-layout rows ``gather``, for ``o``) on the
        kernel chosen for its row count."""
        rows = x.shape[0] if gather is None else gather[0].shape[0]
        kind = self.row_kernels[role] if rows == 1 else self.block_kernels[role] if rows <= _MAX_ROWS else "cublas"
        if kind != "cublas" and weight.shape != self._weight(role)[0].shape:  # a drafter's projection of another
            kind = "cublas"  # shape: the measured choice (and the Triton tile) are the target's
        if kind == "triton":
            from .skinny_linear import skinny_linear

            return skinny_linear(x, weight, bias, self.triton_configs[(role, 1 if rows == 1 else _MAX_ROWS)], gather)
        fn = self._row_fns[role] if kind == "gemv" else self._row_eager[role]
        return fn(x, *gather, weight, bias) if gather is not None else fn(x, weight, bias)

    def qkv(self, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        return self._project("qkv", x, w.qkv, w.qkv_bias)

    def o_proj(self, o: torch.Tensor, attn) -> torch.Tensor:
        """``o_proj`` of attention output ``[T, heads * d]`` (the eager path: always cuBLAS)."""
        return _linear(o, attn.o_proj.weight, attn.o_proj.bias)

    def o_proj_slots(self, out: torch.Tensor, q_slots: torch.Tensor, q_rows: torch.Tensor, attn) -> torch.Tensor:
        """``o_proj`` of the static decode path's attention output (slot layout, see :class:`SlotStore`)."""
        return self._project("o", out, attn.o_proj.weight, attn.o_proj.bias, gather=(q_slots, q_rows))

    def mlp(self, x: torch.Tensor, w: LayerWeights, mlp) -> torch.Tensor:
        """``down_proj(act(gate) * up)`` of the fused gate/up projection."""
        h = self.act_mul(self._project("gate_up", x, w.gate_up, w.gate_up_bias))
        down = mlp.down_proj
        return self._project("down", h, down.weight, down.bias)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        head = self.model.lm_head
        return self._project("lm_head", x, head.weight, head.bias)

    def _kernel_choices(self, role: str, rows: int) -> dict:
        """Every kernel that can run projection ``role`` at ``rows`` rows: name -> ``fn(x, weight, bias,
        gather)`` (names: ``"cublas"``, ``"gemv"``, ``("triton", tile)``)."""
        eager, compiled = self._row_eager[role], self._row_fns[role]

        def call(fn):
            return lambda x, w, b, gather: fn(x, *gather, w, b) if gather is not None else fn(x, w, b)

        out = {"cublas": call(eager)}
        if rows == 1:
            out["gemv"] = call(compiled)
        tiles = self._triton_candidates(role, rows)
        if tiles:
            from .skinny_linear import skinny_linear

            for tile in tiles:
                out[("triton", tile)] = lambda x, w, b, gather, tile=tile: skinny_linear(x, w, b, tile, gather)
        return out

    @torch.no_grad()
    def tune_row_kernels(self, reps: int = 10) -> dict[str, str]:
        """Time every kernel of :data:`ROW_KINDS` at one row and of :data:`BLOCK_KINDS` at 16 rows for each
        of :data:`ROW_PROJECTIONS` on this model's weights (CUDA graphs; every layer's weight in turn, as a
        decode step reads them) and keep the fastest in :attr:`row_kernels` / :attr:`block_kernels` (Triton:
        the fastest tile too); the times go to :attr:`row_timings`. A kernel that fails to compile or run
        is left out, and :attr:`row_note` says why (cuBLAS always remains)."""
        if not (self.compiled and torch.cuda.is_available() and self.layers[0].qkv.is_cuda):
            raise RuntimeError("tune_row_kernels needs the compiled FusedTarget of a model on CUDA")
        p = self.layers[0].qkv
        gen = torch.Generator(device=p.device).manual_seed(0)
        head_dim = self.model.model.layers[0].self_attn.head_dim
        notes = []
        for rows in (1, _MAX_ROWS):
            for role in ROW_PROJECTIONS:
                x = torch.randn(rows, self._weight(role)[0].shape[1], generator=gen, device=p.device, dtype=p.dtype)
                gather = None
                if role == "o":  # one token per slot row in attention's layout, plus the padding row
                    x = torch.cat([x, x[:1]]).view(rows + 1, -1, 1, head_dim)
                    gather = (torch.arange(rows, device=p.device), torch.zeros(rows, dtype=torch.long, device=p.device))
                weights = [self._weight(role, li) for li in range(2 if role == "lm_head" else len(self.layers))]
                times = {}
                for name, fn in self._kernel_choices(role, rows).items():
                    def run(fn=fn):
                        for w, b in weights:
                            fn(x, w, b, gather)

                    try:
                        run()  # compiled (and tuned) outside the timed graphs, without autograd as the engine runs it
                        times[name] = graph_ms(run, reps) / len(weights)
                    except Exception as exc:  # noqa: BLE001 - a compiler failure must not stop serving: cuBLAS remains
                        notes.append(f"{role} x{rows} {name}: {type(exc).__name__}: {str(exc)[:120]}")
                best = min(times, key=times.get)
                if isinstance(best, tuple):
                    self.triton_configs[(role, rows)] = best[1]
                (self.row_kernels if rows == 1 else self.block_kernels)[role] = best[0] if isinstance(best, tuple) else best
                self.row_timings[f"{role} x{rows}"] = {
                    (k if isinstance(k, str) else "triton " + "/".join(map(str, k[1]))): v for k, v in times.items()}
        self.row_note = "; ".join(notes)
        return dict(self.row_kernels)

    @torch.no_grad()
    def check_elementwise(self) -> str:
        """Run each Triton elementwise kernel once against its eager torch function on random inputs of this
        model's shapes; if one fails or disagrees, the torch functions serve instead (:attr:`elementwise_note`
        says why). Returns :attr:`elementwise`."""
        if self.elementwise != "triton":
            return self.elementwise
        try:
            from .norms import disagreements

            bad = disagreements(self)
            why = f"{', '.join(bad)} differ from the torch functions" if bad else ""
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not stop serving: the torch functions remain
            why = f"{type(exc).__name__}: {str(exc)[:200]}"
        if why:
            self._use_elementwise("torch")
            self.elementwise_note = f"Triton elementwise kernels unavailable ({why}); using the torch functions"
        return self.elementwise

    def check_current(self) -> None:
        """Raise a clear ``RuntimeError`` if the model's projections no longer live in the fused
        weights (e.g. ``model.to(...)`` or a parameter assigned anew after the engine was built):
        the fused path would otherwise compute with the old weights."""
        for li, (layer, w) in enumerate(zip(self.model.model.layers, self.layers)):
            if (layer.self_attn.q_proj.weight.data_ptr() != w.qkv.data_ptr()
                    or layer.mlp.gate_proj.weight.data_ptr() != w.gate_up.data_ptr()):
                raise RuntimeError(
                    f"the target's weights were replaced after the engine was built (layer {li}'s projections no "
                    "longer live in the fused weights, e.g. after model.to(...)); build a new Engine, or update "
                    "weights in place (load_state_dict, copy_)")

    @classmethod
    def build(cls, model, compile: bool | None = None) -> tuple["FusedTarget | None", str]:
        """``(FusedTarget, "")``, or ``(None, why)`` when the model's layers are not the stock math.
        ``compile``: compile the elementwise functions (default: when the model is on CUDA); compiled
        on CUDA, the few-row kernels are then chosen (:meth:`load_or_tune`: measured once per GPU, shapes,
        dtype and library versions, then read from the disk cache; later builds on the same model reuse them)."""
        why = unsupported_layers(model)
        if why is not None:
            return None, why
        on_cuda = next(model.parameters()).device.type == "cuda"
        fused = cls(model, on_cuda if compile is None else compile)
        if fused.compiled and on_cuda:
            fused.load_or_tune()
        return fused, ""

    # ------------------------------------------------------------------ tuning: in memory, on disk, measured
    def tuning_shapes(self) -> dict:
        """What of the model a kernel choice depends on besides device and dtype (the disk cache's key)."""
        shapes = {role: [list(self._weight(role)[0].shape), self._weight(role)[1] is not None] for role in ROW_PROJECTIONS}
        return {**shapes, "layers": len(self.layers), "head_dim": self.model.model.layers[0].self_attn.head_dim}

    def tuning_choices(self) -> dict:
        """The measured choices as JSON-able data (:meth:`apply_tuning` takes them back)."""
        return {"row_kernels": dict(self.row_kernels), "block_kernels": dict(self.block_kernels),
                "triton_configs": [[role, rows, list(cfg)] for (role, rows), cfg in self.triton_configs.items()],
                "row_timings": copy.deepcopy(self.row_timings), "row_note": self.row_note,
                "elementwise": self.elementwise, "elementwise_note": self.elementwise_note}

    def apply_tuning(self, choices: dict) -> None:
        """Use ``choices`` (from :meth:`tuning_choices`); a ``ValueError`` if they do not fit this model."""
        rows, blocks = dict(choices["row_kernels"]), dict(choices["block_kernels"])
        if set(rows) != set(ROW_PROJECTIONS) or set(blocks) != set(ROW_PROJECTIONS) or any(
                v not in ROW_KINDS for v in rows.values()) or any(v not in BLOCK_KINDS for v in blocks.values()):
            raise ValueError(f"kernel choices do not name a kernel per projection: {rows} / {blocks}")
        configs = {}
        if any(v == "triton" for v in (*rows.values(), *blocks.values())):
            from .skinny_linear import SkinnyConfig

            configs = {(role, int(n)): SkinnyConfig(*cfg) for role, n, cfg in choices["triton_configs"]}
            for role, n in [(r, 1) for r, k in rows.items() if k == "triton"] + [(r, _MAX_ROWS) for r, k in blocks.items() if k == "triton"]:
                if configs.get((role, n)) not in self._triton_candidates(role, n):
                    raise ValueError(f"no fitting Triton tile saved for the {role} projection at {n} rows")
        if choices["elementwise"] not in ("torch", "triton"):
            raise ValueError(f"unknown elementwise kernels {choices['elementwise']!r}")
        if choices["elementwise"] == "triton" and self.elementwise != "triton":
            raise ValueError("the saved choices use the Triton elementwise kernels, which this process does not have")
        self.row_kernels, self.block_kernels, self.triton_configs = rows, blocks, configs
        self.row_timings, self.row_note = copy.deepcopy(choices["row_timings"]), str(choices["row_note"])
        if choices["elementwise"] != self.elementwise:
            self._use_elementwise(choices["elementwise"])
        self.elementwise_note = str(choices["elementwise_note"])

    def load_or_tune(self) -> str:
        """Set the few-row kernels and the store kernel: from an earlier build on the same model in this
        process (``"memory"``), else from the disk cache (``"disk"``, :mod:`.tuning_cache`), else measured
        now (``"tuned"``: :meth:`tune_row_kernels`, :meth:`check_elementwise`; then saved to disk)."""
        from .tuning_cache import load_tuning, save_tuning, tuning_key

        weight = self.layers[0].qkv
        tuned = _TUNED.get(self.model)
        if tuned is not None and tuned["on"] == (weight.dtype, weight.device):  # not after model.to(dtype)
            self.apply_tuning(tuned["choices"])
            return "memory"
        key = tuning_key(self.tuning_shapes(), weight.dtype, weight.device)
        choices, source = load_tuning(key), "disk"
        if choices is not None:
            try:
                self.apply_tuning(choices)
            except (ValueError, KeyError, TypeError) as exc:
                warnings.warn(f"ignoring saved kernel choices that do not fit this model ({exc}); tuning again",
                              RuntimeWarning, stacklevel=2)
                choices = None
        if choices is None:
            self.tune_row_kernels()
            self.check_elementwise()
            choices, source = self.tuning_choices(), "tuned"
            save_tuning(key, choices)
        _TUNED[self.model] = {"choices": choices, "on": (weight.dtype, weight.device)}
        return source
