"""Attention on the GPU (``pytest -m gpu``): FlashAttention's own test matrix, poisoned outputs, special values.

Every case compares flashlite with float64 on fresh random inputs under
FlashAttention's rule (max error <= 2x PyTorch's own error in the input dtype,
plus a floor); outputs are allocated from memory filled with NaN first, so an
element the kernels forget to write fails. The matrix is FlashAttention's
(its ten seqlen pairs, head dims 32..256, powers of two and not, fp16 and bf16),
MHA/GQA/MQA, causal and not, forward and both backward paths (the Hopper kernels
take the head dims and calls they serve, the tl kernels the rest). Head dims of 65 to 96 and 129 to 192 in two
column parts on the Hopper kernels (the default; ``FLASHLITE_HEAD_SPLIT=0`` pads them) have tests of their own
at the end, which also check which kernel and widths ran.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import flashlite
from flashlite.attention import api, plan, route
from flashlite.attention import forward_hopper as fw
from flashlite.nn import alibi_slopes

from .test_gpu_decode import require_hopper
from .utils import assert_attention_close, attention_grads_ref, attention_ref, check_attention, need_memory, poison

pytestmark = pytest.mark.gpu

SEQLENS = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024), (1023, 1024),
           (1024, 1023), (2048, 2048)]
HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
HEADS = [(6, 6), (6, 2), (6, 1)]  # MHA, GQA, MQA
# Every head dim in both dtypes. Building the kernels of one (head dim, dtype, backward path) takes most of a
# case's time: tests/run_gpu.py runs the cases in parallel processes.
MATRIX = [(d, dtype) for d in HEAD_DIMS for dtype in (torch.float16, torch.bfloat16)]


def make(b: int, h: int, length: int, d: int, dtype: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(b, h, length, d, device="cuda", dtype=dtype).requires_grad_(requires_grad)


@pytest.mark.parametrize("head_dim, dtype", MATRIX)
def test_flash_attention_matrix(head_dim, dtype, backward_path):
    """Output, LSE and dq/dk/dv over the seqlen pairs x MHA/GQA/MQA x causal of one head dim and dtype, on
    one backward path."""
    failures = []
    for lq, lk in SEQLENS:
        for h, h_kv in HEADS:
            for causal in (False, True):
                b = 2 if lq * lk <= 512 * 512 else 1
                q, k, v = make(b, h, lq, head_dim, dtype, True), make(b, h_kv, lk, head_dim, dtype, True), \
                    make(b, h_kv, lk, head_dim, dtype, True)
                poison()
                out, lse = flashlite.flash_attention(q, k, v, causal=causal, return_lse=True)
                do = torch.randn_like(out)
                poison()
                grads = torch.autograd.grad(out, (q, k, v), do)
                ref, ref_lse = attention_ref(q, k, v, causal=causal, return_lse=True)
                low = attention_ref(q, k, v, causal=causal, dtype=dtype)
                finite = torch.isfinite(ref_lse)
                name = f"Lq={lq} Lk={lk} H={h}/{h_kv} causal={causal}"
                try:
                    assert_attention_close(out, ref, low, dtype)
                    assert (lse[~finite] == float("-inf")).all()
                    lse_err = ((lse.double() - ref_lse)[finite].abs() / ref_lse[finite].abs().clamp_min(1)).max()
                    assert lse_err <= 1e-4, f"LSE relative error {lse_err:.1e}"
                    for g, r, t in zip(grads, attention_grads_ref(q, k, v, do, causal=causal),
                                       attention_grads_ref(q, k, v, do, causal=causal, dtype=dtype)):
                        assert_attention_close(g, r, t, dtype)
                except AssertionError as err:
                    failures.append(f"{name}: {err}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("scale", [-0.2, 0.0, 1.0])
def test_scales_on_every_kernel(scale, head_dim, dtype):
    # A negative scale (q negated in the kernel), 0 (no Hopper kernel: hidden scores must stay -inf) and 1.0
    # (the example: scores rounded to the input dtype were ~30x PyTorch's error) on the Hopper
    # kernels' head dims, forward and backward.
    for causal in (False, True):
        q, k, v = make(1, 4, 700, head_dim, dtype, True), make(1, 4, 900, head_dim, dtype, True), \
            make(1, 4, 900, head_dim, dtype, True)
        poison()
        out = flashlite.flash_attention(q, k, v, causal=causal, scale=scale)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
        kw = dict(causal=causal, scale=scale)
        assert_attention_close(out, attention_ref(q, k, v, **kw), attention_ref(q, k, v, dtype=dtype, **kw), dtype)
        for g, r, t in zip(grads, attention_grads_ref(q, k, v, do, **kw),
                           attention_grads_ref(q, k, v, do, dtype=dtype, **kw)):
            assert_attention_close(g, r, t, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decoding_scores_in_fp32(dtype):
    # The split-K/V kernel at D = 160, scale 1.0 (the example), with a ragged cache: LSE to fp32 rounding.
    q, k, v = make(2, 8, 1, 160, dtype), make(2, 2, 5000, 160, dtype), make(2, 2, 5000, 160, dtype)
    lens = torch.tensor([5000, 1234], device="cuda")
    out, lse = flashlite.flash_attention(q, k, v, scale=1.0, cache_seqlens=lens, return_lse=True)
    for i, n in enumerate(lens.tolist()):
        args = (q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n])
        ref, ref_lse = attention_ref(*args, scale=1.0, return_lse=True)
        assert_attention_close(out[i:i + 1], ref, attention_ref(*args, scale=1.0, dtype=dtype), dtype)
        assert ((lse[i:i + 1].double() - ref_lse).abs() <= 1e-4 * ref_lse.abs().clamp_min(1)).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rows_hidden_by_finfo_min(dtype):
    # A row whose every key carries finfo(dtype).min: SDPA (math, fp32) averages its values; flashlite does too,
    # and its gradients agree with SDPA's math backend (the rows' (m, log d) are kept apart for the backward).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = make(2, 4, 300, 64, dtype, True), make(2, 4, 400, 64, dtype, True), make(2, 4, 400, 64, dtype, True)
    bias = torch.randn(2, 1, 300, 400, device="cuda", dtype=dtype)
    bias[:, :, ::9] = torch.finfo(dtype).min
    out = flashlite.flash_attention(q, k, v, attn_mask=bias)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref, low = [], []
    for target, sink in ((torch.float32, ref), (dtype, low)):
        inputs = [t.detach().to(target).requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.MATH):
            o = F.scaled_dot_product_attention(*inputs, attn_mask=bias.to(target) if target == torch.float32 else bias)
        sink.extend([o, *torch.autograd.grad(o, inputs, do.to(target))])
    for mine, r, t in zip((out, *grads), ref, low):
        assert_attention_close(mine, r.double(), t, dtype)


def test_row_broadcast_bias_gradient_against_memory_efficient():
    # A (B, 1, Lq, 1) bias has gradient 0 in exact arithmetic. flashlite: to fp32 rounding (δ from its own P,
    # summed in fp32); SDPA's memory-efficient backend on the same inputs, for the record, is no better.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = make(2, 8, 1024, 64, torch.bfloat16), make(2, 8, 1024, 64, torch.bfloat16), \
        make(2, 8, 1024, 64, torch.bfloat16)
    bias = torch.randn(2, 1, 1024, 1, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn_like(q)
    (mine,) = torch.autograd.grad(flashlite.flash_attention(q, k, v, attn_mask=bias), bias, do)
    assert mine.abs().max() <= 1e-4
    try:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # its mask needs a unit last stride: materialised
            mask = bias.expand(2, 8, 1024, 1024).contiguous()
            (theirs,) = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), bias, do)
    except RuntimeError as err:  # torch 2.11's backend refuses this call ("LSE is not correctly aligned")
        print(f"row-broadcast bias gradient, max |.|: flashlite {mine.abs().max().item():.2e}; SDPA "
              f"memory-efficient: {err}")
        return
    print(f"row-broadcast bias gradient, max |.|: flashlite {mine.abs().max().item():.2e}, "
          f"SDPA memory-efficient {theirs.abs().max().item():.2e}")


def test_softmax_special_rows_on_the_gpu():
    # logsumexp of +inf rows is +inf with torch's gradient; softmax of such rows NaN (every regime the GPU has:
    # fused tiles, read twice, shared rows, online).
    for n_cols in (300, 5000, 65536, 200000):
        x = torch.randn(8, n_cols, device="cuda", requires_grad=True)
        with torch.no_grad():
            x[1, 7] = math.inf
            x[2] = -math.inf
            x[3, 11] = math.nan
        x_ref = x.detach().clone().requires_grad_()
        lse = flashlite.logsumexp(x, -1)
        ref = torch.logsumexp(x_ref, -1)
        torch.testing.assert_close(lse, ref, equal_nan=True, atol=1e-5, rtol=1e-5)
        lse.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, equal_nan=True, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(flashlite.softmax(x.detach(), -1), torch.softmax(x.detach(), -1), equal_nan=True)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_sinks_on_the_gpu(head_dim):
    # Attention sinks merged into the Hopper kernel's final states (and the split-K/V merge's, for a decoding
    # shape): output, LSE and the gradients of q, k, v and the sinks under FlashAttention's rule.
    dtype = torch.bfloat16
    q = make(2, 8, 700, head_dim, dtype, True)
    k, v = make(2, 2, 900, head_dim, dtype, True), make(2, 2, 900, head_dim, dtype, True)
    sinks = torch.randn(8, device="cuda", requires_grad=True)
    for causal in (False, True):
        poison()
        out, lse = flashlite.flash_attention(q, k, v, causal=causal, sinks=sinks, return_lse=True)
        ref, ref_lse = attention_ref(q, k, v, causal=causal, sinks=sinks.detach(), return_lse=True)
        assert_attention_close(out, ref, attention_ref(q, k, v, causal=causal, sinks=sinks.detach(), dtype=dtype), dtype)
        assert ((lse.double() - ref_lse).abs() <= 1e-4 * ref_lse.abs().clamp_min(1)).all()
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, sinks), do)
        for g, r, t in zip(grads, attention_grads_ref(q, k, v, do, causal=causal, sinks=sinks),
                           attention_grads_ref(q, k, v, do, causal=causal, sinks=sinks, dtype=dtype)):
            assert_attention_close(g, r, t, dtype)
    q1 = make(2, 8, 1, head_dim, dtype)
    out = flashlite.flash_attention(q1, k.detach(), v.detach(), sinks=sinks.detach(), num_splits=4)
    args = (q1, k.detach(), v.detach())
    assert_attention_close(out, attention_ref(*args, sinks=sinks.detach()),
                           attention_ref(*args, sinks=sinks.detach(), dtype=dtype), dtype)


def check_output_and_grads(q, k, v, dtype: torch.dtype, **kw) -> None:
    """flash_attention(q, k, v, **kw) and its dq/dk/dv, outputs poisoned first, under FlashAttention's rule."""
    poison()
    out = flashlite.flash_attention(q, k, v, **kw)
    assert_attention_close(out, attention_ref(q, k, v, **kw), attention_ref(q, k, v, dtype=dtype, **kw), dtype)
    do = torch.randn_like(out)
    poison()
    grads = torch.autograd.grad(out, (q, k, v), do)
    for g, r, t in zip(grads, attention_grads_ref(q, k, v, do, **kw),
                       attention_grads_ref(q, k, v, do, dtype=dtype, **kw)):
        assert_attention_close(g, r, t, dtype)


def ragged_decoding_failures(head_dim: int, dtype: torch.dtype, head_dim_v: int | None = None, **kw) -> list[str]:
    """One decoding step (Lq = 1, 8 query heads on 2 K/V heads) over a cache of 5000 positions filled to ragged
    lengths (5000, 1234, 7): the split-K/V path, output poisoned first, each batch element against float64 under
    FlashAttention's rule. ``kw``: flash_attention's variants (B = 3, H = 8)."""
    q1 = make(3, 8, 1, head_dim, dtype)
    k1, v1 = make(3, 2, 5000, head_dim, dtype), make(3, 2, 5000, head_dim_v or head_dim, dtype)
    lens = torch.tensor([5000, 1234, 7], device="cuda", dtype=torch.int32)
    poison()
    out = flashlite.flash_attention(q1, k1, v1, cache_seqlens=lens, **kw)
    failures = []
    if out.shape != (3, 8, 1, head_dim_v or head_dim):
        failures.append(f"decoding: output shape {tuple(out.shape)}")
    for b, n in enumerate(lens.tolist()):
        element = dict(kw)
        if element.get("alibi_slopes") is not None and element["alibi_slopes"].dim() == 2:
            element["alibi_slopes"] = element["alibi_slopes"][b:b + 1]
        args = (q1[b:b + 1], k1[b:b + 1, :, :n], v1[b:b + 1, :, :n])
        try:
            assert_attention_close(out[b:b + 1], attention_ref(*args, **element),
                                   attention_ref(*args, dtype=dtype, **element), dtype)
        except AssertionError as err:
            failures.append(f"decoding b={b} {sorted(kw)}: {err}")
    return failures


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_softcap_on_the_gpu(head_dim):
    # Logit softcapping on the GPU: the tl forward, both backward paths' kernels (the default two passes here),
    # and the split-K/V path, under FlashAttention's rule; scores of several units against a cap of 5.
    dtype = torch.bfloat16
    q = (make(2, 8, 700, head_dim, dtype) * 2).requires_grad_()
    k, v = (make(2, 2, 900, head_dim, dtype) * 2).requires_grad_(), make(2, 2, 900, head_dim, dtype, True)
    for causal in (False, True):
        check_output_and_grads(q, k, v, dtype, causal=causal, softcap=5.0)
    q1 = make(2, 8, 1, head_dim, dtype) * 2
    args = (q1, k.detach(), v.detach())
    out = flashlite.flash_attention(*args, softcap=5.0, num_splits=4)
    assert_attention_close(out, attention_ref(*args, softcap=5.0), attention_ref(*args, softcap=5.0, dtype=dtype), dtype)


WINDOWS = [(True, (256, 0)), (True, (100, 0)), (False, (300, 77)), (False, (-1, 40)), (True, (16, 0))]


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_on_the_gpu(head_dim, dtype, backward_path):
    # Sliding windows on the Hopper forward (its window-skipping K/V loop), the tl forward (under a softcap),
    # both backward paths and the split-K/V path; windows narrower than a tile, one-sided, Lq != Lk both ways.
    failures = []
    for lq, lk in [(1000, 1000), (513, 1100), (1100, 513)]:
        q = make(2, 6, lq, head_dim, dtype, True)
        k, v = make(2, 2, lk, head_dim, dtype, True), make(2, 2, lk, head_dim, dtype, True)
        for causal, window in WINDOWS:
            for softcap in (None, 20.0):
                kw = dict(causal=causal, window_size=window, softcap=softcap)
                try:
                    check_output_and_grads(q, k, v, dtype, **kw)
                except AssertionError as err:
                    failures.append(f"Lq={lq} Lk={lk} {kw}: {err}")
    failures += ragged_decoding_failures(head_dim, dtype, causal=True, window_size=(1000, 0))
    assert not failures, "\n".join(failures)


def test_window_at_128k_allocates_only_its_output():
    # A causal sliding-window call at L = 128K: peak memory beyond the inputs is the output and the LSE.
    need_memory(8 << 30)
    q, k, v = (make(1, 8, 131072, 128, torch.bfloat16) for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, lse = flashlite.flash_attention(q, k, v, causal=True, window_size=(4096, 0), return_lse=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= out.numel() * out.element_size() + lse.numel() * 4 + (1 << 20), extra
    # Spot-check the last rows against float64.
    rows = slice(131072 - 64, 131072)
    keys = slice(131072 - 64 - 4096, 131072)
    args = (q[:, :, rows], k[:, :, keys], v[:, :, keys])
    kw = dict(causal=True, window_size=(4096, 0))
    assert_attention_close(out[:, :, rows], attention_ref(*args, **kw), attention_ref(*args, dtype=q.dtype, **kw),
                           q.dtype)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_alibi_on_the_gpu(head_dim, backward_path):
    # ALiBi on every tile of the Hopper forward, of the tl forward (under a boolean mask), of both backward paths'
    # kernels and of the split-K/V kernel (packed GQA rows, each with its head's slope; ragged cache lengths).
    dtype = torch.bfloat16
    failures = []
    for lq, lk in [(700, 900), (900, 700)]:
        q = make(2, 8, lq, head_dim, dtype, True)
        k, v = make(2, 2, lk, head_dim, dtype, True), make(2, 2, lk, head_dim, dtype, True)
        keep = torch.rand(2, 1, lq, lk, device="cuda") > 0.2
        for causal in (False, True):
            # (Negative slopes too: scores that grow with the distance, which once overflowed the P of a ragged
            # query tile's rows past Lq into NaN in dK and dV.)
            for slopes in (alibi_slopes(8).cuda(), torch.rand(2, 8, device="cuda") * 0.05,
                           torch.full((8,), -0.125, device="cuda")):
                for mask in (None, keep):
                    kw = dict(causal=causal, alibi_slopes=slopes, attn_mask=mask)
                    try:
                        check_output_and_grads(q, k, v, dtype, **kw)
                    except AssertionError as err:
                        failures.append(f"Lq={lq} Lk={lk} causal={causal} slopes {tuple(slopes.shape)} "
                                        f"mask={mask is not None}: {err}")
    failures += ragged_decoding_failures(head_dim, dtype, causal=True,
                                         alibi_slopes=torch.rand(3, 8, device="cuda") * 0.01)
    assert not failures, "\n".join(failures)


# (D, Dv): MLA's 192/128, narrower and wider V, and head dims padded apart.
HEAD_DIMS_V = [(192, 128), (128, 64), (64, 128), (96, 64), (256, 128), (40, 72)]


@pytest.mark.parametrize("head_dim, head_dim_v", HEAD_DIMS_V)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dim_v_on_the_gpu(head_dim, head_dim_v, dtype, backward_path):
    # A V head dim of its own on the Hopper forward (O through its own shared-memory buffer), the tl forward
    # (a boolean mask), both backward paths and the split-K/V path; with every variant at once too.
    failures = []
    for lq, lk in [(700, 900), (1000, 1000)]:
        q = make(2, 6, lq, head_dim, dtype, True)
        k, v = make(2, 2, lk, head_dim, dtype, True), make(2, 2, lk, head_dim_v, dtype, True)
        keep = torch.rand(2, 1, lq, lk, device="cuda") > 0.2
        cases = [dict(causal=False), dict(causal=True), dict(attn_mask=keep),
                 dict(causal=True, window_size=(300, 0), softcap=20.0, alibi_slopes=alibi_slopes(6).cuda() / 16,
                      sinks=torch.randn(6, device="cuda"))]
        for kw in cases:
            try:
                check_output_and_grads(q, k, v, dtype, **kw)
            except AssertionError as err:
                failures.append(f"Lq={lq} Lk={lk} {sorted(kw)}: {err}")
    failures += ragged_decoding_failures(head_dim, dtype, head_dim_v)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- head dims in column parts (issue 44)

# (D, Dv) that the Hopper forward loads in two column parts (the default, ``plan.head_dim_parts``):
# 160 = 128 + 32 and 192 = 128 + 64 (the kernel that is not warp-specialized), 80 = 64 + 16 and 96 = 64 + 32 (the
# warp-specialized kernel; the other one for causal calls of up to 1024 keys), q/k's head dim and v's each on its
# own (Dv = 64 or 128: one part).
SPLIT_HEAD_DIMS = ([(d, dv) for d in (160, 192) for dv in (128, 160, 192)]
                   + [(d, dv) for d in (80, 96) for dv in (64, 96, 128)])


@pytest.fixture
def head_split(monkeypatch):
    """FLASHLITE_HEAD_SPLIT=1 for one test (the Hopper kernels required), routes planned without it forgotten first
    and those planned with it afterwards. Yields the list of ``(HEAD_DIM, HEAD_DIM_V, warp-specialized)`` of every
    Hopper forward planned meanwhile: the widths on chip (the split kernel's: the parts' sums) and whether the
    warp-specialized kernel ran it."""
    require_hopper()
    planned = []
    real = route.HopperForwardLaunch

    def spy(*args, **kwargs):
        launch = real(*args, **kwargs)
        kernel = launch.kernel
        planned.append((kernel.options["HEAD_DIM"], kernel.options["HEAD_DIM_V"],
                        kernel.kernel is fw._attention_fwd_ws_kernel))
        return launch

    monkeypatch.setenv("FLASHLITE_HEAD_SPLIT", "1")
    monkeypatch.setattr(route, "HopperForwardLaunch", spy)
    api.clear_routes()
    yield planned
    api.clear_routes()


def split_failures(head_dim: int, head_dim_v: int, dtype: torch.dtype, lengths: list) -> list[str]:
    """``check_attention`` (output, LSE and gradients against float64, outputs poisoned first) over ``lengths``'
    (Lq, Lk) pairs, MHA and GQA, causal and not: one line per failing case."""
    failures = []
    for lq, lk in lengths:
        for h, h_kv in [(6, 6), (6, 2)]:
            for causal in (False, True):
                b = 2 if lq * lk <= 512 * 512 else 1
                q = make(b, h, lq, head_dim, dtype, True)
                k, v = make(b, h_kv, lk, head_dim, dtype, True), make(b, h_kv, lk, head_dim_v, dtype, True)
                poison()
                try:
                    check_attention(q, k, v, causal=causal)
                except AssertionError as err:
                    failures.append(f"Lq={lq} Lk={lk} H={h}/{h_kv} causal={causal}: {err}")
    return failures


def variant_failures(q, k, v, cases: list[dict]) -> list[str]:
    """``check_attention`` of q, k, v under each of ``cases`` (``flash_attention``'s keywords, ``causal`` among
    them), outputs poisoned first: one line per failing case."""
    failures = []
    for kw in cases:
        poison()
        try:
            check_attention(q, k, v, **kw)
        except AssertionError as err:
            failures.append(f"{sorted(kw)} causal={kw['causal']}: {err}")
    return failures


def split_widths(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """The widths on chip of a split call: the sums of its head dims' column parts."""
    return sum(plan.head_dim_parts(head_dim)), sum(plan.head_dim_parts(head_dim_v))


def assert_split_ran(planned: list, head_dim: int, head_dim_v: int):
    """Every Hopper forward of ``planned`` (``head_split``'s) ran the split widths of (D, Dv); at padded D = 128 both
    kernels did (the warp-specialized one, and the other for short causal calls)."""
    assert planned and {p[:2] for p in planned} == {split_widths(head_dim, head_dim_v)}, planned
    if plan.head_dim_padded(max(head_dim, head_dim_v)) == 128:
        assert {p[2] for p in planned} == {True, False}, planned


@pytest.mark.parametrize("head_dim, head_dim_v", SPLIT_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dim_split_on_the_gpu(head_dim, head_dim_v, dtype, head_split):
    # The Hopper forward with its head dims in column parts: output (poisoned first), LSE and dq/dk/dv against
    # float64 under FlashAttention's rule, over odd lengths, Lq != Lk both ways (rows that see no key under causal),
    # MHA and GQA, causal and not; every call must have run the split kernel.
    failures = split_failures(head_dim, head_dim_v, dtype,
                              [(113, 203), (1000, 1777), (1023, 1024), (2048, 2048), (1024, 300)])
    assert_split_ran(head_split, head_dim, head_dim_v)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 128), (192, 192), (96, 64), (96, 96)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dim_split_variants_on_the_gpu(head_dim, head_dim_v, dtype, head_split):
    # D = 192 and 96 in column parts under each score modifier, sinks, and all at once (GQA, Lq != Lk; 1500 keys:
    # D = 96 takes the warp-specialized kernel, causal or not).
    q = make(2, 6, 700, head_dim, dtype, True)
    k, v = make(2, 2, 1500, head_dim, dtype, True), make(2, 2, 1500, head_dim_v, dtype, True)
    slopes, sinks = alibi_slopes(6).cuda() / 16, torch.randn(6, device="cuda")
    cases = [dict(causal=False, softcap=20.0), dict(causal=True, alibi_slopes=slopes),
             dict(causal=True, window_size=(300, 0)), dict(causal=False, window_size=(200, 77)),
             dict(causal=False, sinks=sinks),
             dict(causal=True, window_size=(300, 0), softcap=20.0, alibi_slopes=slopes, sinks=sinks)]
    failures = variant_failures(q, k, v, cases)
    assert head_split and {p[:2] for p in head_split} == {split_widths(head_dim, head_dim_v)}, head_split
    assert not failures, "\n".join(failures)


# The Hopper backward (two passes: the dK/dV and dQ kernels) loads the same head dims in column parts (the
# default; issue 44): Dv = 128 is one part, 160 and 192 two.
SPLIT_BACKWARD_HEAD_DIMS = [(d, dv) for d in (160, 192) for dv in (128, 192)]


@pytest.fixture
def backward_split(head_split, monkeypatch):
    """``head_split`` (FLASHLITE_HEAD_SPLIT=1, routes cleared before and after), and the list of ``parts`` (``(q's
    column parts, v's)``) of every Hopper backward planned meanwhile."""
    from flashlite.attention import backward

    planned = []
    real = backward.HopperBackwardLaunch

    def spy(*args, **kwargs):
        launch = real(*args, **kwargs)
        planned.append(launch.parts)
        return launch

    monkeypatch.setattr(backward, "HopperBackwardLaunch", spy)
    yield planned


@pytest.mark.parametrize("head_dim, head_dim_v", SPLIT_BACKWARD_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dim_split_backward_on_the_gpu(head_dim, head_dim_v, dtype, backward_split):
    # The Hopper backward with its head dims in column parts: dq/dk/dv (and output, LSE) against float64 under
    # FlashAttention's rule, gradients poisoned first, over odd lengths and Lq != Lk both ways, MHA and GQA, causal
    # and not; every backward must have run the split kernels (the parts of plan.head_dim_parts).
    failures = split_failures(head_dim, head_dim_v, dtype, [(113, 203), (1000, 1777), (2048, 2048), (1024, 300)])
    parts = (plan.head_dim_parts(head_dim), plan.head_dim_parts(head_dim_v))
    assert backward_split and set(backward_split) == {parts}, backward_split
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dim_split_backward_variants_on_the_gpu(dtype, backward_split):
    # D = Dv = 192 in column parts through the backward under each score modifier and all at once (GQA, Lq != Lk).
    q = make(2, 6, 700, 192, dtype, True)
    k, v = make(2, 2, 900, 192, dtype, True), make(2, 2, 900, 192, dtype, True)
    slopes = alibi_slopes(6).cuda() / 16
    cases = [dict(causal=False, softcap=20.0), dict(causal=True, alibi_slopes=slopes),
             dict(causal=False, window_size=(200, 77)),
             dict(causal=True, window_size=(300, 0), softcap=20.0, alibi_slopes=slopes)]
    failures = variant_failures(q, k, v, cases)
    assert backward_split and set(backward_split) == {((128, 64), (128, 64))}, backward_split
    assert not failures, "\n".join(failures)
