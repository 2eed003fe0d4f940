"""flashlite.flash_attention against float64 attention, through the Triton interpreter.

Tiles are forced small (``TILES_16``: 16 x 16) so that lengths of 17 to 130
cross many query and key tiles: full tiles, the causal diagonal, ragged last
tiles on both sides. FlashAttention's tolerance rule throughout
(``assert_attention_close``): at most twice PyTorch's own error in the input
dtype, plus a floor.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from flashlite import flash_attention
from flashlite.attention import api, forward, plan, tuning
from flashlite.attention.tuning import AttentionConfig
from flashlite.core.online_softmax import empty_state, merge_accumulators, normalize
from flashlite.core.runtime import launch
from flashlite.core.tiles import load_tile, tma_usable

from .utils import assert_attention_close, attention_ref, randn

TILES_16 = AttentionConfig(16, 16, 4, 1)
TILES_16_TMA = AttentionConfig(16, 16, 4, 1, use_tma=True)  # K/V/Q/O through tensor descriptors
TILES_16_PERSISTENT = AttentionConfig(16, 16, 4, 1, persistent=True)  # 4 "SMs" in the interpreter: several tiles a program
TILES_32x16 = AttentionConfig(32, 16, 4, 1)  # BLOCK_M > BLOCK_N: a causal diagonal spanning three key tiles


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tuning, "INTERPRETER_CONFIG", TILES_16)


def use_tiles(monkeypatch, config: AttentionConfig) -> None:
    monkeypatch.setattr(tuning, "INTERPRETER_CONFIG", config)


def qkv(b, h, lq, lk, d, dtype=torch.bfloat16, h_kv=None, scale=1.0):
    h_kv = h if h_kv is None else h_kv
    return (randn(b, h, lq, d, dtype=dtype, scale=scale), randn(b, h_kv, lk, d, dtype=dtype, scale=scale),
            randn(b, h_kv, lk, d, dtype=dtype))


def check(q, k, v, **kw):
    """flash_attention(q, k, v, **kw) within FlashAttention's tolerance of the float64 reference."""
    out = flash_attention(q, k, v, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = attention_ref(q, k, v, **kw)
    assert_attention_close(out, ref, attention_ref(q, k, v, dtype=q.dtype, **kw), q.dtype)
    return out


# ----------------------------------------------------------------------------- lengths, causal, dtypes


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "lq, lk",
    [
        (1, 1),  # one query, one key: a single ragged tile each way
        (17, 17),  # one full tile + a 1-row tail on both sides
        (65, 65),  # 5 tiles: causal skips the 4 tiles right of the diagonal
        (100, 130),  # Lq < Lk: causal diagonal shifted right by 30, last query sees every key
        (130, 100),  # Lq > Lk: the first 30 queries see no key under causal (zeros)
        (1, 130),  # decoding shape: one query over 9 key tiles
        (130, 17),  # many query tiles, a single ragged key tile
    ],
)
def test_lengths(lq, lk, causal):
    check(*qkv(2, 2, lq, lk, 32), causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_dtypes(dtype, causal):
    # fp32: IEEE dots, so the floor is ATTN_ATOL[float32] = 1e-5 over 2x torch's fp32 error.
    check(*qkv(1, 2, 65, 100, 64, dtype=dtype), causal=causal)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 128])  # 80: padded to a 128-wide tile, masked columns
def test_head_dims(head_dim):
    check(*qkv(1, 2, 33, 40, head_dim), causal=True)


def test_tiles_wider_than_keys(monkeypatch):
    # BLOCK_M 32 over BLOCK_N 16: the diagonal crosses up to three key tiles; causal with Lq > Lk and Lq < Lk.
    use_tiles(monkeypatch, TILES_32x16)
    check(*qkv(1, 2, 70, 45, 32), causal=True)
    check(*qkv(1, 2, 45, 70, 32), causal=True)


def test_default_interpreter_tiles(monkeypatch):
    use_tiles(monkeypatch, AttentionConfig(32, 32, 4, 1))  # flashlite's own interpreter config
    check(*qkv(1, 2, 100, 100, 64), causal=True)


def test_running_max_grows_across_tiles():
    # Scores rise along the keys, so each key tile raises the running maximum and alpha rescales acc and d.
    q, k, v = qkv(1, 1, 20, 80, 32, dtype=torch.float32)
    q = q.abs() + 1.0
    k = (k.abs() + 1.0) * torch.linspace(0.1, 3.0, 80).view(1, 1, 80, 1)
    check(q, k, v, scale=1.0)


def test_scale():
    q, k, v = qkv(1, 2, 17, 33, 32, scale=2.0)
    check(q, k, v, scale=0.3)
    torch.testing.assert_close(flash_attention(q, k, v), flash_attention(q, k, v, scale=1 / math.sqrt(32)))


# ----------------------------------------------------------------------------- GQA / MQA, strided inputs


@pytest.mark.parametrize("h_kv", [2, 1])  # GQA (2 queries per K/V head) and MQA
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query(h_kv, causal):
    check(*qkv(2, 4, 33, 50, 32, h_kv=h_kv), causal=causal)


def test_packed_qkv_views():
    # Views of one (B, L, 3, H, D) projection: stride 3·H·D between rows, no copy in the kernel.
    b, l, h, d = 2, 40, 3, 32
    qkv_packed = randn(b, l, 3, h, d)
    q, k, v = (qkv_packed[:, :, i].transpose(1, 2) for i in range(3))
    assert q.stride(2) == 3 * h * d and q.stride(3) == 1
    out = check(q, k, v, causal=True)
    # The output is laid out like q's dense order: (B, L, H, D) memory under a (B, H, L, D) view.
    assert out.transpose(1, 2).is_contiguous()


def test_blhd_and_non_unit_head_stride():
    b, l, h, d = 1, 30, 2, 32
    q, k, v = (randn(b, l, h, d).transpose(1, 2) for _ in range(3))  # (B, L, H, D) transposed
    check(q, k, v)
    q_t = randn(b, h, d, l).transpose(2, 3)  # head dim with stride L: copied once
    check(q_t, k, v)


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_mask(causal):
    # (B, 1, 1, Lk) bool: stride 0 on the query dim, so each key tile's mask is read as one row.
    q, k, v = qkv(2, 2, 40, 50, 32)
    lengths = torch.tensor([50, 23])
    mask = (torch.arange(50)[None, :] < lengths[:, None]).view(2, 1, 1, 50)
    assert api.check_inputs(q, k, v, mask)[0].stride(2) == 0  # what MASK_PER_KEY keys on
    check(q, k, v, attn_mask=mask, causal=causal)


def test_mask_key_stride_past_2_31():
    # A (1, 1, Lq, Lk) bool mask whose keys lie 2^30 bytes apart (the pages between are never touched):
    # key index x key stride passes 2^31 and must not wrap.
    q, k, v = qkv(1, 1, 2, 5, 16)
    keep = torch.rand(2, 5) < 0.7
    keep[:, 0] = True
    stride = 2**30
    buf = torch.empty(4 * stride + 2, dtype=torch.bool)
    mask = buf.as_strided((1, 1, 2, 5), (0, 0, 1, stride))
    mask.copy_(keep)
    check(q, k, v, attn_mask=mask)


def test_key_padding_bias():
    q, k, v = qkv(2, 2, 17, 40, 32)
    bias = randn(2, 1, 1, 40, scale=2.0)  # additive, per key
    check(q, k, v, attn_mask=bias)


@pytest.mark.parametrize("causal", [False, True])
def test_full_bool_mask(causal):
    q, k, v = qkv(2, 2, 33, 40, 32)
    mask = torch.rand(2, 2, 33, 40) > 0.3
    check(q, k, v, attn_mask=mask, causal=causal)


def test_broadcast_additive_mask():
    q, k, v = qkv(2, 2, 33, 40, 32, dtype=torch.float16)
    bias = randn(33, 40, dtype=torch.float16, scale=3.0)  # (Lq, Lk): stride 0 on batch and heads
    check(q, k, v, attn_mask=bias, causal=True)


def test_fully_masked_rows():
    q, k, v = qkv(1, 2, 33, 40, 32)
    mask = torch.rand(1, 2, 33, 40) > 0.5
    mask[:, :, 5] = False  # one row sees nothing
    mask[:, 1, 16:32] = False  # a whole query tile of head 1 sees nothing
    bias = torch.zeros(1, 2, 33, 40)
    bias[:, :, 7] = float("-inf")  # additive -inf everywhere on a row
    for m in (mask, bias):
        out, lse = flash_attention(q, k, v, attn_mask=m, return_lse=True)
        assert torch.isfinite(out).all()
        empty = torch.isinf(attention_ref(q, k, v, attn_mask=m, return_lse=True)[1])
        assert empty.any()
        assert (out[empty] == 0).all() and (lse[empty] == float("-inf")).all()
        check(q, k, v, attn_mask=m)


def test_mask_errors():
    q, k, v = qkv(2, 2, 5, 7, 16)
    with pytest.raises(ValueError, match="attn_mask"):
        flash_attention(q, k, v, attn_mask=torch.ones(2, 2, 5, 6, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask"):
        flash_attention(q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.int32))


# ----------------------------------------------------------------------------- LSE


@pytest.mark.parametrize("causal", [False, True])
def test_lse(causal):
    q, k, v = qkv(1, 2, 50, 40, 32, dtype=torch.float32)  # Lq > Lk: causal leaves 10 empty rows
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 50)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)  # -inf rows must match -inf
    assert_attention_close(out, ref, attention_ref(q, k, v, causal=causal, dtype=q.dtype), q.dtype)


def test_lse_low_precision():
    q, k, v = qkv(1, 2, 33, 65, 64)
    _, lse = flash_attention(q, k, v, return_lse=True)
    _, ref_lse = attention_ref(q, k, v, return_lse=True)
    # Scores carry the bf16 rounding of q·scale·log2(e): well under 1e-2 in log units.
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-2, rtol=0)


# ----------------------------------------------------------------------------- launch variants


@pytest.mark.parametrize("config", [TILES_16_TMA, TILES_16_PERSISTENT], ids=["tma", "persistent"])
@pytest.mark.parametrize("causal", [False, True])
def test_launch_variants(monkeypatch, config, causal):
    use_tiles(monkeypatch, config)
    q, k, v = qkv(2, 2, 33, 50, 80, h_kv=1)  # ragged lengths, padded head dim, MQA
    assert tma_usable(q, k, v)  # 160-byte rows: the descriptor path when asked for
    check(q, k, v, causal=causal)
    mask = torch.rand(2, 1, 1, 50) > 0.3
    check(*qkv(2, 2, 33, 50, 32), attn_mask=mask, causal=causal)


def test_default_tiles():
    # The fixed table's rules (read on CUDA only; the interpreter has its own tiles).
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    short = tuning.SHORT_WORK_CONFIGS[64]
    assert plan.default_config(64, bf16, cuda, causal=True, seqlen_k=tuning.SHORT_SEQLEN_K_CAUSAL) == short
    assert plan.default_config(64, bf16, cuda, causal=True, seqlen_k=8192) == tuning.FORWARD_CONFIGS[64]
    assert plan.default_config(40, bf16, cuda, causal=False, seqlen_k=tuning.SHORT_SEQLEN_K) == short
    assert plan.default_config(64, bf16, cuda, causal=False, seqlen_k=2048) == tuning.FORWARD_CONFIGS[64]
    assert plan.default_config(64, bf16, cuda, True, 512, has_mask=True) == tuning.FORWARD_CONFIGS[64]  # masks: 64 x 128
    assert plan.default_config(128, bf16, cuda, True, 512) == tuning.FORWARD_CONFIGS[128]
    assert plan.default_config(64, torch.float32, cuda, True, 512) == tuning.FP32_CONFIGS[64]
    for hd in (16, 32, 64, 128, 256):  # no default config is ruled out for masks
        assert plan.tma_safe(True, plan.default_config(hd, bf16, cuda, True, 512, has_mask=True).block_n, hd)


def test_tma_safe():
    assert not plan.tma_safe(True, 64, 64)
    assert plan.tma_safe(True, 128, 64) and plan.tma_safe(False, 64, 64)


@pytest.mark.parametrize("mask_kind", ["full", "per_key"])
def test_square_tma_boxes_with_a_mask_take_pointers(monkeypatch, mask_kind):
    # TILES_16_TMA at D = 16 has square K/V boxes (BLOCK_N = HEAD_DIM_PADDED = 16): with a mask the
    # launcher must not build descriptors (tma_safe); without one it does.
    use_tiles(monkeypatch, TILES_16_TMA)
    built = []
    real = forward.tensor_descriptor
    monkeypatch.setattr(forward, "tensor_descriptor", lambda *a: built.append(a) or real(*a))
    q, k, v = qkv(1, 2, 40, 40, 16)
    check(q, k, v)
    assert built
    built.clear()
    mask = torch.rand(1, 2, 40, 40) > 0.3 if mask_kind == "full" else torch.rand(1, 1, 1, 40) > 0.3
    check(q, k, v, attn_mask=mask)
    assert not built


def test_tma_needs_aligned_rows(monkeypatch):
    # D = 20 in fp16: 40-byte rows are not 16-byte aligned, so the launcher falls back to pointers.
    use_tiles(monkeypatch, TILES_16_TMA)
    q, k, v = qkv(1, 2, 20, 20, 20, dtype=torch.float16)
    assert not tma_usable(q, k, v)
    check(q, k, v)


@triton.jit
def _key_range(q, q_idx, qk_scale, k_ptr, v_ptr, lo, hi, seqlen_q, seqlen_k,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    m, d = empty_state(BLOCK_M)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    return forward.attend_kv_tiles(
        acc, m, d, q, q_idx, qk_scale, k_ptr, v_ptr, D, D, lo, hi, (seqlen_q, seqlen_k, D, D), (k_ptr, 0, 0),
        (1.0, 0.0, 0, 0), None, TILE=(BLOCK_N, D, D, True, True), MASKING=(True, False, False, False), UNITS=1.0,
        MASKED=True, USE_TMA=False, DOTS=("ieee", False), MODS=(False, False, False, False),
    )


@triton.jit
def _two_ranges_kernel(q_ptr, k_ptr, v_ptr, o_ptr, seqlen_q, seqlen_k, split, qk_scale,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    # What a split-K/V kernel does: the loop helper on two key ranges, states merged with the core's merge.
    q = load_tile(q_ptr, 0, seqlen_q, D, D, BLOCK_M, D, True, True, False)
    q_idx = tl.cast(tl.arange(0, BLOCK_M), tl.int64)
    acc_a, m_a, d_a = _key_range(q, q_idx, qk_scale, k_ptr, v_ptr, 0, split, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, D)
    acc_b, m_b, d_b = _key_range(q, q_idx, qk_scale, k_ptr, v_ptr, split, seqlen_k, seqlen_q, seqlen_k,
                                 BLOCK_M, BLOCK_N, D)
    m, d, acc = merge_accumulators(m_a, d_a, acc_a, m_b, d_b, acc_b, 1.0)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    tl.store(o_ptr + rows[:, None] * D + dims[None, :], normalize(acc, d, True), mask=(rows < seqlen_q)[:, None])


@pytest.mark.parametrize("split", [0, 16, 48])  # empty first part, causal diagonal in the second, both
def test_kv_loop_on_sub_ranges(split):
    # The K/V loop helper takes a key range and the running state: a split-K/V kernel's building block.
    q, k, v = (t[0, 0].contiguous() for t in qkv(1, 1, 12, 50, 32, dtype=torch.float32))
    o = torch.empty_like(q)
    qk_scale = math.log2(math.e) / math.sqrt(32)  # base-2 units, as the attention kernel scales its scores
    launch(_two_ranges_kernel, (1,), (q, k, v, o, 12, 50, split, qk_scale), BLOCK_M=16, BLOCK_N=16, D=32)
    ref = attention_ref(q[None, None], k[None, None], v[None, None], causal=True)[0, 0]
    torch.testing.assert_close(o.double(), ref, atol=1e-5, rtol=1e-5)


def test_autotune_candidates():
    # FLASHLITE_AUTOTUNE=1 compiles at most six configs per head dim on first use, and none that
    # tma_safe rules out for the call's mask layout.
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in tuning.TUNE_SPACE]
    for hd in (16, 32, 64, 128, 256):
        assert 1 <= len(plan.prune_tune_space(configs, {}, DIMS=(hd, hd, True, True))) <= 6
        for layout in (plan.MASK_LAYOUT_PER_KEY, plan.MASK_LAYOUT_FULL):
            masked = plan.prune_tune_space(configs, {"tune_mask_layout": layout}, DIMS=(hd, hd, True, True))
            assert masked and all(c.kwargs["BLOCK_N"] != hd for c in masked)
    unmasked = plan.prune_tune_space(configs, {"tune_mask_layout": plan.MASK_LAYOUT_NONE}, DIMS=(64, 64, True, True))
    assert any(c.kwargs["BLOCK_N"] == 64 for c in unmasked)  # only masked calls lose them


# ----------------------------------------------------------------------------- the link to masked_softmax


@pytest.mark.parametrize("causal", [False, True])
def test_equals_masked_softmax_times_v(causal):
    # One core, two ops: attention is flashlite's own masked softmax of q kᵀ, times v.
    from flashlite.masked_softmax import masked_softmax

    q, k, v = qkv(2, 2, 33, 40, 32, dtype=torch.float32)
    mask = torch.rand(2, 1, 33, 40) > 0.2
    mask[0, 0, 3] = False  # an empty row: zeros from both
    scale = 0.2
    expected = masked_softmax(q @ k.transpose(-1, -2), mask, scale=scale, causal=causal) @ v
    out = flash_attention(q, k, v, attn_mask=mask, scale=scale, causal=causal)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- edges, errors, CPU path


def test_empty_sequences():
    q, k, v = qkv(1, 2, 5, 0, 16)
    out, lse = flash_attention(q, k, v, return_lse=True)  # no keys: every row is empty
    assert (out == 0).all() and (lse == float("-inf")).all()
    q, k, v = qkv(1, 2, 0, 5, 16)
    assert flash_attention(q, k, v).shape == (1, 2, 0, 16)


def test_input_errors():
    q, k, v = qkv(1, 4, 5, 7, 32, h_kv=2)
    with pytest.raises(ValueError, match="head dims differ"):
        flash_attention(q, k[..., :16], v)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        flash_attention(q, *qkv(1, 3, 5, 7, 32)[1:])
    with pytest.raises(TypeError, match="v has dtype"):
        flash_attention(q, k, v.half())
    with pytest.raises(ValueError, match="head dim 8 is not supported"):
        flash_attention(q[..., :8], k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="head dim 320 is not supported"):
        flash_attention(*(torch.zeros(1, 1, 2, 320) for _ in range(3)))
    with pytest.raises(ValueError, match="k is on meta"):
        flash_attention(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="q must be 4-D"):
        flash_attention(q[0], k, v)


@pytest.mark.parametrize("causal", [False, True])
def test_pytorch_path(monkeypatch, causal):
    # CPU tensors without the interpreter: plain PyTorch, same answers (GQA, mask, empty rows, LSE).
    monkeypatch.setattr(api, "runs_kernels", lambda t: False)
    q, k, v = qkv(1, 4, 30, 20, 32, h_kv=2, dtype=torch.float32)
    mask = torch.rand(1, 1, 30, 20) > 0.3
    out, lse = flash_attention(q, k, v, causal=causal, attn_mask=mask, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, attn_mask=mask, return_lse=True)
    assert_attention_close(out, ref, attention_ref(q, k, v, causal=causal, attn_mask=mask, dtype=q.dtype), q.dtype)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_repeated_calls_replay_their_route(monkeypatch):
    """A repeated call is checked and planned once: its route (forward, and backward per layout of dO) is built
    at the first call of its signature and replayed; another signature plans its own."""
    from flashlite.attention import backward, route

    routes, backwards = [], []
    monkeypatch.setattr(api, "Route", lambda *a, **kw: routes.append(1) or route.Route(*a, **kw))
    monkeypatch.setattr(route, "BackwardLaunch",
                        lambda *a, **kw: backwards.append(1) or backward.BackwardLaunch(*a, **kw))
    q, k, v = (randn(1, 2, 20, 16, requires_grad=True) for _ in range(3))
    for _ in range(3):
        o = flash_attention(q, k, v, causal=True)
        torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    assert (len(routes), len(backwards)) == (1, 1)
    with torch.no_grad():  # an inference call: a signature of its own
        flash_attention(q, k, v, causal=True)
        flash_attention(q, k, v, causal=True)
    flash_attention(q, k, v, causal=False)
    assert len(routes) == 3
    torch.testing.assert_close(o.double(), attention_ref(q, k, v, causal=True), atol=1e-5, rtol=1e-5)
