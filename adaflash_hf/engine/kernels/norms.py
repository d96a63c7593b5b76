"""The fused layers' elementwise math as hand-written Triton kernels: RMSNorm (with the residual add),
q/k norm + RoPE, and SiLU(gate) * up.

:class:`~.fused.FusedTarget` ran these as ``torch.compile``d torch functions (:func:`.elementwise.rms_norm` and
the rest). The kernels are alike, but every new process paid Dynamo and Inductor for them, each shape class again:
most of a second process's time to its first token; a Triton kernel is read from
Triton's own disk cache in milliseconds. The rounding follows the HF modules' (and the
torch functions'): statistics in float32, each product and sum rounded to the model dtype as the eager ops do
(``tests/test_engine_triton.py`` compares each kernel with its torch function, in Triton's interpreter).

Needs Triton (see :mod:`.decode_attention`); :class:`~.fused.FusedTarget` imports it only when it runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_rms_norm_triton", "disagreements", "elementwise_cases", "norm_rope_head", "norm_rope_triton",
           "qk_norm_rope_triton", "rms_norm_triton", "silu_mul_triton", "unsupported", "written"]

_ACT_BLOCK = 1024  # SiLU * up: columns per program


def unsupported(head_dim: int) -> str | None:
    """Why the RoPE kernels cannot take heads of ``head_dim`` (``None``: they can)."""
    half = head_dim // 2
    if head_dim % 2 or half < 1 or half & (half - 1):
        return f"head_dim {head_dim} is not twice a power of two"
    return None


@triton.jit
def norm_rope_head(src, wgt, cos, sin, d, eps, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """One head of ``HALF * 2`` values at ``src``: RMSNorm with weight ``wgt`` (when ``HAS_NORM``), then
    RoPE with ``cos``/``sin`` (pointers to this token's row). Returns the two rotated halves."""
    x1 = tl.load(src + d)
    x2 = tl.load(src + HALF + d)
    dt = x1.dtype
    if HAS_NORM:  # rms_norm: float32 statistics, weight * normalised.to(dtype)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        r = tl.rsqrt((tl.sum(a1 * a1, 0) + tl.sum(a2 * a2, 0)) / (2 * HALF) + eps)
        x1 = (tl.load(wgt + d) * (a1 * r).to(dt)).to(dt)
        x2 = (tl.load(wgt + HALF + d) * (a2 * r).to(dt)).to(dt)
    c1, c2 = tl.load(cos + d), tl.load(cos + HALF + d)
    s1, s2 = tl.load(sin + d), tl.load(sin + HALF + d)
    o1 = ((x1 * c1).to(dt) + (-x2 * s1).to(dt)).to(dt)  # x * cos + rotate_half(x) * sin
    o2 = ((x2 * c2).to(dt) + (x1 * s2).to(dt)).to(dt)
    return o1, o2


@triton.jit
def _rms_norm_kernel(H, D, W, HO, XO, sh, sd, sho, sxo, n, eps, BLOCK: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    keep = cols < n
    h = tl.load(H + row * sh + cols, mask=keep, other=0.0)
    if ADD:  # the residual add in the model dtype, as the HF layer does
        h = (h.to(tl.float32) + tl.load(D + row * sd + cols, mask=keep, other=0.0).to(tl.float32)).to(h.dtype)
        tl.store(HO + row * sho + cols, h, mask=keep)
    a = h.to(tl.float32)
    r = tl.rsqrt(tl.sum(a * a, 0) / n + eps)
    w = tl.load(W + cols, mask=keep, other=0.0)
    out = w.to(tl.float32) * (a * r).to(h.dtype).to(tl.float32)
    tl.store(XO + row * sxo + cols, out.to(XO.dtype.element_ty), mask=keep)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, features]`` with a contiguous last dimension (a view when it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    n = h.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm_triton: weight of shape {tuple(weight.shape)} for rows of {n}")
    h2, d2 = _rows(h), _rows(delta) if delta is not None else None
    out = torch.empty(h2.shape, dtype=torch.promote_types(weight.dtype, h.dtype), device=h.device)
    h_out = torch.empty_like(h2) if delta is not None else h2
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(h2.shape[0],)](
        h2, d2 if d2 is not None else h2, weight.contiguous(), h_out, out, h2.stride(0),
        d2.stride(0) if d2 is not None else 0, h_out.stride(0), out.stride(0), n, eps,
        BLOCK=block, ADD=delta is not None, num_warps=min(16, max(1, block // 256)))
    return h_out.view(h.shape), out.view(h.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`.elementwise.rms_norm` over the last dimension of ``x`` (``weight [features]``), one program per row.

    Example:
        >>> y = rms_norm_triton(h, layer.input_layernorm.weight, 1e-6)  # doctest: +SKIP
    """
    return _norm(x, None, weight, eps)[1]


def add_rms_norm_triton(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.elementwise.add_rms_norm`: ``(h + delta, rms_norm(h + delta))`` in one kernel.

    Example:
        >>> h, x = add_rms_norm_triton(h, attn_out, layer.post_attention_layernorm.weight, 1e-6)  # doctest: +SKIP
    """
    if delta.shape != h.shape:
        raise ValueError(f"add_rms_norm_triton: delta {tuple(delta.shape)} and h {tuple(h.shape)} differ")
    return _norm(h, delta, weight, eps)


@triton.jit
def _silu_mul_kernel(GU, O, sgu, so, n, BLOCK: tl.constexpr):
    row, blk = tl.program_id(0), tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    keep = cols < n
    gate = tl.load(GU + row * sgu + cols, mask=keep, other=0.0)
    up = tl.load(GU + row * sgu + n + cols, mask=keep, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu: float32 math, rounded to the dtype
    tl.store(O + row * so + cols, (act.to(tl.float32) * up.to(tl.float32)).to(O.dtype.element_ty), mask=keep)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused ``[..., 2 * I]`` gate/up projection (gate first), as the HF MLP computes it.

    Example:
        >>> h = silu_mul_triton(x @ gate_up_weight.T)  # doctest: +SKIP
    """
    x = _rows(gate_up)
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    _silu_mul_kernel[(x.shape[0], triton.cdiv(n, _ACT_BLOCK))](x, out, x.stride(0), out.stride(0), n,
                                                                BLOCK=_ACT_BLOCK, num_warps=4)
    return out.view(*gate_up.shape[:-1], n)


@triton.jit
def _norm_rope_kernel(Q, K, QW, KW, COS, SIN, QO, KO, sq_t, sq_h, sk_t, sk_h, sc_t, sqo_h, sqo_t, sko_t, sko_h, eps,
                      HQ: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    t, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, HALF)
    if h < HQ:  # a q head, to the [heads, T, d] layout attention takes
        src = Q + t * sq_t + h * sq_h
        wgt = QW
        dst = QO + h * sqo_h + t * sqo_t
    else:
        src = K + t * sk_t + (h - HQ) * sk_h
        wgt = KW
        dst = KO + t * sko_t + (h - HQ) * sko_h
    o1, o2 = norm_rope_head(src, wgt, COS + t * sc_t, SIN + t * sc_t, d, eps, HALF, HAS_NORM)
    tl.store(dst + d, o1.to(dst.dtype.element_ty))
    tl.store(dst + HALF + d, o2.to(dst.dtype.element_ty))


def _check_heads(name: str, d: int, *xs: torch.Tensor) -> None:
    why = unsupported(d)
    if why is not None:
        raise ValueError(f"{name}: {why}")
    if any(x.stride(-1) != 1 for x in xs):
        raise ValueError(f"{name}: every input needs a contiguous last dimension")


def qk_norm_rope_triton(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                        eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.elementwise.qk_norm_rope` in one kernel: ``q [T, heads, d]``, ``k [T, kv_heads, d]`` (views with a contiguous
    last dimension), per-head norm weights ``[d]`` (or ``None``: no norm, as for Llama), ``cos, sin [T, d]``.
    Returns ``q [heads, T, d]`` and ``k [T, kv_heads, d]``.

    Example:
        >>> q, k = qk_norm_rope_triton(q, k, attn.q_norm.weight, attn.k_norm.weight, 1e-6, cos, sin)  # doctest: +SKIP
    """
    T, HQ, d = q.shape
    _check_heads("qk_norm_rope_triton", d, q, k, cos, sin)
    has_norm = q_weight is not None
    q_out = torch.empty(HQ, T, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _norm_rope_kernel[(T, HQ + k.shape[1])](
        q, k, q_weight if has_norm else q, k_weight if has_norm else k, cos, sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), q_out.stride(0), q_out.stride(1),
        k_out.stride(0), k_out.stride(1), eps, HQ=HQ, HALF=d // 2, HAS_NORM=has_norm, num_warps=1)
    return q_out, k_out


def norm_rope_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`.elementwise.norm_rope` of ``x [T, heads, d]`` with a per-head weight ``[d]`` (or ``None``): the keys alone,
    e.g. the drafter's context keys.

    Example:
        >>> k = norm_rope_triton(k, attn.k_norm.weight, 1e-6, cos, sin)  # doctest: +SKIP
    """
    if weight is not None and weight.dim() != 1:
        raise ValueError(f"norm_rope_triton: a per-head weight of shape [d], got {tuple(weight.shape)}")
    _check_heads("norm_rope_triton", x.shape[-1], x, cos, sin)
    return qk_norm_rope_triton(x[:, :0], x, weight, weight, eps, cos, sin)[1]


# ------------------------------------------------------------------ the check before the kernels serve
def elementwise_cases(fused) -> dict:
    """Per elementwise function of :class:`~.fused.FusedTarget` ``fused``, a maker of fresh random arguments of its
    model's shapes (3 tokens)."""
    from .elementwise import SlotStore

    layer = fused.model.model.layers[0]
    attn, p = layer.self_attn, fused.layers[0].qkv
    d, (nq, nk, _) = attn.head_dim, fused.layers[0].splits
    gen = torch.Generator(device=p.device).manual_seed(0)
    T, hidden = 3, p.shape[1]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=p.device, dtype=p.dtype)

    qkv, h, delta, gate_up = randn(T, nq + 2 * nk), randn(T, hidden), randn(T, hidden), randn(T, fused.layers[0].gate_up.shape[0])
    q, k, v = (t.view(T, -1, d) for t in qkv.split([nq, nk, nk], dim=-1))
    positions = torch.arange(T, device=p.device) * 5
    cos, sin = (t[0] for t in fused.model.model.rotary_emb(q[None], positions[None]))
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    norms = (qn.weight, kn.weight, qn.variance_epsilon) if qn is not None else (None, None, 0.0)
    ln = layer.input_layernorm

    def store():
        kc = torch.zeros(1, T, nk // d, 16, d, device=p.device, dtype=p.dtype)
        q_out = torch.zeros(T, nq // d, 1, d, device=p.device, dtype=p.dtype)
        idx = torch.arange(T, device=p.device)
        return (q, k, v, *norms, cos, sin, *SlotStore(kc, kc.clone(), idx[:1] * 0, idx, positions, q_out, idx, idx * 0))

    return {"rms_norm": lambda: (h, ln.weight, ln.variance_epsilon),
            "add_rms_norm": lambda: (h, delta, ln.weight, ln.variance_epsilon),
            "qk_norm_rope": lambda: (q, k, *norms, cos, sin),
            "qk_norm_rope_store": store,
            "act_mul": lambda: (gate_up,),
            "norm_rope": lambda: (k, norms[1], norms[2], cos, sin)}


def written(name: str, fn, args: tuple) -> list[torch.Tensor]:
    """What elementwise function ``name`` produced from ``args``: its outputs, and for the store the K/V caches."""
    out = fn(*args)
    out = list(out) if isinstance(out, tuple) else [out]
    return out + list(args[-8:-6]) if name == "qk_norm_rope_store" else out


def disagreements(fused) -> list[str]:
    """The elementwise functions ``fused`` serves that differ from the eager torch functions on random inputs of its
    model's shapes (a bfloat16-sized tolerance: they round alike, but reduce in another order)."""
    from .elementwise import elementwise_functions

    eager = elementwise_functions(fused.model.model.layers[0].mlp.act_fn)
    bad = []
    for name, make in elementwise_cases(fused).items():
        ref, got = written(name, eager[name], make()), written(name, getattr(fused, name), make())
        if len(ref) != len(got) or not all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=0.05, rtol=0.02)
                                           for a, b in zip(ref, got)):
            bad.append(name)
    return bad
