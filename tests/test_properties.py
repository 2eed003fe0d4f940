"""Property-based tests: every public op on inputs drawn by hypothesis, against float64 references, on both paths.

Strategies draw what a user can hand flashlite: shapes with sizes 0, 1, primes
and powers of two; any dim; fp32/fp16/bf16; layouts (contiguous, transposed,
stepped, offset by one element, broadcast with stride 0, rows padded); masks of
every broadcastable shape, boolean or additive; flags; and special values
(+-inf, NaN, rows of -inf, +-1e4). Each example is compared with its float64
reference through the Triton kernels (the interpreter) and through the PyTorch
fallback. Profiles (tests/conftest.py): ``ci`` by default, ``long`` on demand.
"""

from __future__ import annotations

import contextlib
import math

import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import flashlite
from flashlite.core.runtime import pytorch_path

from .test_paths import _mha_ref
from .utils import TOL, assert_attention_close, attention_grads_ref, attention_ref, masked_softmax_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = st.sampled_from([0, 1, 2, 3, 5, 7, 8, 13, 16, 31, 32, 37, 64, 67, 100])
# The interpreter runs each program in numpy: shapes stay under this many elements (a 100^3 tensor took minutes).
MAX_ELEMENTS = 6000


def _shapes(min_dims: int, max_dims: int, nonempty: bool = False):
    sizes = SIZES.filter(bool) if nonempty else SIZES
    return st.lists(sizes, min_size=min_dims, max_size=max_dims).filter(lambda s: math.prod(s) <= MAX_ELEMENTS)
LAYOUTS = ["contiguous", "transposed", "stepped", "offset", "broadcast", "padded_rows"]
SPECIALS = ["none", "inf", "-inf", "nan", "-inf_row", "large"]
PATHS = ("kernels", "pytorch")


def _heavier(fraction: float) -> int:
    """A share of the profile's examples, for the slow ops (attention runs several interpreted kernels)."""
    return max(5, int(settings().max_examples * fraction))


def _path(path: str):
    return pytorch_path() if path == "pytorch" else contextlib.nullcontext()


@st.composite
def tensors(draw, shape, dtype=None, allow_specials=True):
    """A tensor of ``shape`` in a drawn dtype and layout, from a drawn seed, with special values sometimes."""
    dtype = dtype or draw(st.sampled_from(DTYPES))
    layout = draw(st.sampled_from(LAYOUTS))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = tuple(shape)

    def fresh(s):
        return (torch.randn(s, generator=gen, dtype=torch.float64) * 2).to(dtype)

    if layout == "transposed" and len(shape) >= 2:
        x = fresh((*shape[:-2], shape[-1], shape[-2])).transpose(-1, -2)
    elif layout == "stepped" and len(shape) >= 1:
        x = fresh((*shape[:-1], 2 * shape[-1]))[..., ::2]
    elif layout == "offset":
        n = math.prod(shape)
        x = fresh((n + 1,))[1:].view(shape)
    elif layout == "broadcast" and len(shape) >= 1 and shape[0] > 1:
        x = fresh((1, *shape[1:])).expand(shape)
    elif layout == "padded_rows" and len(shape) >= 1:
        x = fresh((*shape[:-1], shape[-1] + 3))[..., :shape[-1]]
    else:
        x = fresh(shape)
    special = draw(st.sampled_from(SPECIALS)) if allow_specials else "none"
    if special != "none" and x.numel():
        x = x.clone()  # its own memory (a broadcast view would repeat the value), in the same layout
        at = draw(st.lists(st.integers(0, x.numel() - 1), min_size=1, max_size=3))
        value = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "large": 1e4, "-inf_row": -math.inf}[special]
        if special == "-inf_row" and x.dim() >= 2:  # a whole row along the last dim
            x[..., draw(st.integers(0, x.shape[-2] - 1)), :] = value
        elif special == "-inf_row":
            x.fill_(value)
        else:
            for i in at:
                x[torch.unravel_index(torch.tensor(i), x.shape)] = value * (-1 if special == "large" and i % 2 else 1)
    note(f"{tuple(x.shape)} {dtype} {layout} strides {x.stride()} special {special}")
    return x


# fp32 rounds a logit s (x * scale + bias) by up to 2^-24 |s|: a weight e^(s - m) then moves by that much,
# relative. The computation in fp32 cannot do better whatever the implementation (PyTorch's neither).
FP32_EPS = 2.0**-24


def _assert_softmax_like(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, logits: float = 0.0) -> None:
    """Within the tolerance of ``dtype`` (widened by the fp32 rounding of logits as large as ``logits``), NaN where
    the reference is NaN, infinities exactly."""
    assert out.shape == ref.shape
    finite = torch.isfinite(ref)
    assert (out.isnan() == ref.isnan()).all(), "NaN pattern differs"
    assert (out[~finite & ~ref.isnan()].double() == ref[~finite & ~ref.isnan()]).all(), "infinities differ"
    tol = {name: value + 4 * FP32_EPS * logits for name, value in TOL[dtype].items()}
    torch.testing.assert_close(out.double()[finite], ref[finite], check_dtype=False, **tol)


def _largest_finite(*tensors) -> float:
    """The largest finite magnitude among ``tensors`` (None skipped): how large the logits can get."""
    values = [t.double().abs()[torch.isfinite(t)].max().item() for t in tensors if t is not None and t.numel()
              and torch.isfinite(t).any()]
    return max(values, default=0.0)


# ----------------------------------------------------------------------------- softmax and logsumexp


@given(data=st.data())
def test_softmax_and_logsumexp(data):
    shape = data.draw(_shapes(0, 3), label="shape")
    x = data.draw(tensors(shape), label="x")
    ndim = max(x.dim(), 1)
    dim = data.draw(st.integers(-ndim, ndim - 1), label="dim")
    algorithm = data.draw(st.sampled_from(["auto", "fused", "online"]), label="algorithm")
    out_dtype = data.draw(st.sampled_from([None, *DTYPES]), label="dtype")
    ref = torch.softmax(x.double(), dim)
    ref_lse = torch.logsumexp(x.double(), dim)
    for path in PATHS:
        with _path(path):
            y = flashlite.softmax(x, dim, algorithm=algorithm, dtype=out_dtype)
            lse = flashlite.logsumexp(x, dim)
        assert y.dtype == (out_dtype or x.dtype) and lse.dtype == x.dtype, path
        _assert_softmax_like(y, ref, y.dtype)
        # The LSE in x's dtype: one rounding of a value as large as the row's (1e4 in fp16: 8 units).
        tol = TOL[x.dtype]
        _assert_softmax_like(lse, ref_lse, x.dtype) if not x.numel() else torch.testing.assert_close(
            lse.double(), ref_lse, equal_nan=True, atol=tol["atol"] * 10, rtol=tol["rtol"] * 2)


@given(data=st.data())
def test_softmax_gradient(data):
    shape = data.draw(_shapes(1, 2, nonempty=True), label="shape")
    x = data.draw(tensors(shape, dtype=torch.float32, allow_specials=False), label="x").requires_grad_()
    dim = data.draw(st.integers(-x.dim(), x.dim() - 1), label="dim")
    dy = torch.randn(x.shape, dtype=torch.float64)
    x64 = x.detach().double().requires_grad_()
    ref = torch.autograd.grad(torch.softmax(x64, dim), x64, dy)[0]
    ref_lse = torch.autograd.grad(torch.logsumexp(x64, dim).sum(), x64)[0]
    for path in PATHS:
        with _path(path):
            (grad,) = torch.autograd.grad(flashlite.softmax(x, dim), x, dy.float())
            (grad_lse,) = torch.autograd.grad(flashlite.logsumexp(x, dim).sum(), x)
        torch.testing.assert_close(grad.double(), ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(grad_lse.double(), ref_lse, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- masked softmax


@st.composite
def masks_for(draw, shape, allow_float=True):
    """None, or a boolean / additive mask of a shape that broadcasts to ``shape`` (dims dropped or made 1)."""
    kind = draw(st.sampled_from(["none", "bool", "float"] if allow_float else ["none", "bool"]))
    if kind == "none":
        return None
    n_drop = draw(st.integers(0, len(shape)))
    mshape = [1 if draw(st.booleans()) else s for s in shape[n_drop:]]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if kind == "bool":
        return torch.rand(mshape, generator=gen) > draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    bias = torch.randn(mshape, generator=gen, dtype=torch.float64).to(draw(st.sampled_from(DTYPES)))
    if bias.numel() and draw(st.booleans()):
        bias.view(-1)[::3] = draw(st.sampled_from([-math.inf, -1e4]))
    return bias


@given(data=st.data())
def test_masked_softmax(data):
    lead = data.draw(st.lists(st.sampled_from([1, 2, 3]), min_size=0, max_size=2), label="lead")
    lq, lk = data.draw(SIZES.filter(bool), label="lq"), data.draw(SIZES.filter(bool), label="lk")
    shape = (*lead, lq, lk)
    x = data.draw(tensors(shape), label="x")
    causal = data.draw(st.booleans(), label="causal")
    mask = data.draw(masks_for(shape), label="mask")
    scale = data.draw(st.sampled_from([None, 0.5, -1.3, 2.0]), label="scale")
    dim = -1 if causal or x.dim() < 2 else data.draw(st.sampled_from([-1, -2]), label="dim")
    algorithm = data.draw(st.sampled_from(["auto", "fused", "online"]), label="algorithm")
    # The reference works on the last dim: move the softmax's dim (and the broadcast mask) there.
    mask_b = None if mask is None else torch.broadcast_to(mask, shape)
    ref = masked_softmax_ref(x.movedim(dim, -1), None if mask_b is None else mask_b.movedim(dim, -1),
                             scale, causal).movedim(-1, dim)
    logits = _largest_finite(x) * abs(scale or 1.0) + _largest_finite(mask) if mask is None or mask.dtype != torch.bool \
        else _largest_finite(x) * abs(scale or 1.0)
    for path in PATHS:
        with _path(path):
            y = flashlite.masked_softmax(x, mask, scale=scale, causal=causal, dim=dim, algorithm=algorithm)
        assert y.dtype == x.dtype, path
        _assert_softmax_like(y, ref, x.dtype, logits)


@given(data=st.data())
def test_masked_softmax_gradient(data):
    shape = (data.draw(st.sampled_from([1, 2])), data.draw(SIZES.filter(bool)), data.draw(SIZES.filter(bool)))
    x = data.draw(tensors(shape, dtype=torch.float32, allow_specials=False), label="x").requires_grad_()
    causal = data.draw(st.booleans(), label="causal")
    mask = data.draw(masks_for(shape), label="mask")
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float().requires_grad_()
    inputs = [x] + ([mask] if mask is not None and mask.requires_grad else [])
    dy = torch.randn(shape, dtype=torch.float64)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref_mask = ref_inputs[1] if len(inputs) == 2 else mask
    ref = torch.autograd.grad(masked_softmax_ref(ref_inputs[0], ref_mask, 0.8, causal), ref_inputs, dy)
    # As the forward's tolerance: fp32 rounds logits as large as a -1e4 bias by 2^-24 of their size.
    logits = 0.8 * _largest_finite(x) + (_largest_finite(mask) if mask is not None and mask.dtype != torch.bool else 0)
    tol = dict(atol=1e-5 + 8 * FP32_EPS * logits, rtol=1e-4 + 8 * FP32_EPS * logits)
    for path in PATHS:
        with _path(path):
            grads = torch.autograd.grad(flashlite.masked_softmax(x, mask, scale=0.8, causal=causal), inputs, dy.float())
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g.double(), r, **tol)


# ----------------------------------------------------------------------------- flash attention


@st.composite
def attention_inputs(draw, for_gradients=False):
    b = draw(st.sampled_from([1, 2]))
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 2, 3]))
    lq, lk = draw(SIZES), draw(SIZES)
    d = draw(st.sampled_from([16, 24, 32, 40, 64, 80, 96, 128, 160, 256]))
    dtype = draw(st.sampled_from(DTYPES))
    blhd = draw(st.booleans())  # a (B, L, H, D) tensor seen as (B, H, L, D)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    # 16-bit gradients at unit spread only (test_flash_attention_gradients says why).
    spread = 1.0 if for_gradients and dtype != torch.float32 else draw(st.sampled_from([1.0, 3.0]))

    def make(heads, length):
        t = (torch.randn(b, length, heads, d, generator=gen, dtype=torch.float64) * spread).to(dtype)
        return t.transpose(1, 2) if blhd else t.transpose(1, 2).contiguous()

    q, k, v = make(h, lq), make(h_kv, lk), make(h_kv, lk)
    note(f"q {tuple(q.shape)} k {tuple(k.shape)} {dtype} blhd={blhd} spread={spread}")
    return q, k, v, spread**2  # how much larger than unit variance products of two inputs are


def logit_size(spread_squared: float, scale: float | None, head_dim: int) -> float:
    """How many times larger than at FlashAttention's test distribution (unit normal inputs, the default scale)
    the logits ``scale · q·k`` are: their fp32 rounding, which a sharp softmax passes on to the output, grows
    with them (D = 256, spread 3, scale 0.3: logits ~60, rounded by ~6e-5 in any fp32 implementation)."""
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    return spread_squared * max(1.0, abs(scale) * math.sqrt(head_dim))


@given(data=st.data())
@settings(max_examples=_heavier(0.75))
def test_flash_attention(data):
    q, k, v, magnitude = data.draw(attention_inputs(), label="qkv")
    b, h, lq, d = q.shape
    lk = k.shape[2]
    causal = data.draw(st.booleans(), label="causal")
    scale = data.draw(st.sampled_from([None, 0.05, 0.5, -0.3]), label="scale")
    mask = data.draw(masks_for((b, h, lq, lk)), label="attn_mask")
    magnitude = logit_size(magnitude, scale, d)
    decode = data.draw(st.sampled_from(["none", "splits", "cache"]), label="decode") if lq <= 16 else "none"
    extra, lens = {}, torch.full((b,), lk)
    if decode == "splits":
        extra = dict(num_splits=data.draw(st.sampled_from([1, 2, 5]), label="num_splits"))
    if decode == "cache":  # batch element i attends its first lens[i] keys (causal aligned to that length)
        lens = torch.tensor([data.draw(st.integers(0, lk), label="len") for _ in range(b)])
        extra = dict(cache_seqlens=lens, num_splits=data.draw(st.sampled_from([None, 1, 3]), label="splits"))
    full_mask = None if mask is None else torch.broadcast_to(mask, (b, h, lq, lk))
    for path in PATHS:
        with _path(path):
            out, lse = flashlite.flash_attention(q, k, v, causal=causal, scale=scale, attn_mask=mask,
                                                 return_lse=True, **extra)
        assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, h, lq), path
        if lq == 0:
            continue
        for i, n in enumerate(lens.tolist()):  # element by element: each its own key count
            if n == 0:
                assert (out[i] == 0).all() and (lse[i] == -math.inf).all(), path
                continue
            args = (q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n])
            kw = dict(causal=causal, scale=scale, attn_mask=None if mask is None else full_mask[i:i + 1, ..., :n])
            ref, ref_lse = attention_ref(*args, return_lse=True, **kw)
            assert_attention_close(out[i:i + 1], ref, attention_ref(*args, dtype=q.dtype, **kw), q.dtype, magnitude)
            finite = torch.isfinite(ref_lse)
            assert (lse[i:i + 1][~finite] == ref_lse[~finite]).all(), path
            torch.testing.assert_close(lse[i:i + 1].double()[finite], ref_lse[finite], atol=1e-4, rtol=1e-4)


@given(data=st.data())
@settings(max_examples=_heavier(0.5))
def test_flash_attention_gradients(data):
    # FlashAttention's rule is stated on unit-normal inputs. Its backward (flashlite's, FA2/3's) takes
    # δ = rowsum(dO ⊙ O) from O rounded to the input dtype, an error of |dO| |O| ulp that grows as the square
    # of the inputs' spread, where PyTorch's autograd in bf16 has no such term: 16-bit inputs are drawn at
    # spread 1 (at 3, bf16 dK missed the rule by up to 1.4x under the interpreter's truncation), fp32 at both.
    q, k, v, magnitude = data.draw(attention_inputs(for_gradients=True), label="qkv")
    if q.shape[2] == 0 or k.shape[2] == 0:
        return
    b, h, lq, d = q.shape
    lk = k.shape[2]
    causal = data.draw(st.booleans(), label="causal")
    scale = data.draw(st.sampled_from([None, 0.3, -0.5]), label="scale")
    mask = data.draw(masks_for((b, h, lq, lk)), label="attn_mask")
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    if mask is not None and mask.dtype != torch.bool and data.draw(st.booleans(), label="mask_grad"):
        mask = mask.detach().requires_grad_()
        inputs.append(mask)
    kw = dict(causal=causal, scale=scale, attn_mask=mask)
    magnitude = logit_size(magnitude, scale, d)
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        # δ = rowsum(dO ⊙ O) sums D products with O truncated by the interpreter (O = v (1 - 1e-7) becomes the
        # bf16 value below v, where rounding gives v back): an error growing as sqrt(D) that the GPU has not.
        magnitude *= math.sqrt(d / 16)
    do = torch.randn(q.shape, dtype=torch.float64).to(q.dtype)
    ref = attention_grads_ref(*inputs[:3], do, **kw)
    low = attention_grads_ref(*inputs[:3], do, dtype=q.dtype, **kw)
    for path in PATHS:
        with _path(path):
            grads = torch.autograd.grad(flashlite.flash_attention(*inputs[:3], **kw), inputs, do)
        for name, g, r, t, x in zip(("dq", "dk", "dv", "dmask"), grads, ref, low, inputs):
            assert g.shape == x.shape and g.dtype == x.dtype, (path, name)
            if name == "dmask":  # the mask's own dtype; its reference in fp64
                torch.testing.assert_close(g.double(), r, atol=ATTN_MASK_ATOL[x.dtype], rtol=0)
            else:
                assert_attention_close(g, r, t, q.dtype, magnitude)


# The bias gradient is dS in the mask's dtype, summed over its broadcast dims (up to ~100 terms here).
ATTN_MASK_ATOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}


# ----------------------------------------------------------------------------- the layer


@given(data=st.data())
@settings(max_examples=_heavier(0.25))
def test_multihead_attention_layer(data):
    h_kv = data.draw(st.sampled_from([1, 2]))
    h = h_kv * data.draw(st.sampled_from([1, 2]))
    d = data.draw(st.sampled_from([16, 32]))
    causal = data.draw(st.booleans())
    torch.manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    layer = flashlite.nn.MultiheadAttention(h * d, h, num_kv_heads=h_kv, causal=causal)
    b, length = data.draw(st.sampled_from([1, 2])), data.draw(SIZES.filter(bool))
    x = torch.randn(b, length, h * d)
    keep = torch.rand(b, length) > data.draw(st.sampled_from([0.0, 0.5]))
    keep[:, 0] = True
    ref = _mha_ref(layer, x, keep)
    for path in PATHS:
        with _path(path):
            out = layer(x, key_padding_mask=keep)
        torch.testing.assert_close(out.double(), ref, atol=5e-5, rtol=1e-4)
