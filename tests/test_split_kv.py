"""Split-K/V decoding (flashlite.split_kv) through flash_attention's num_splits= and cache_seqlens=, in the interpreter.

Tiles are forced to 16 x 16 (as in test_attention.py), so a cache of 40 to 130
keys is 3 to 9 key tiles: enough for uneven splits, empty splits and ragged
last tiles. Every result is held to FlashAttention's tolerance against the
float64 reference; split and unsplit results are also compared directly.
A cache with per-element lengths is checked against the reference with the
equivalent explicit mask (``cache_mask``).
"""

import pytest
import torch

from flashlite import flash_attention
from flashlite.attention import api, route, tuning
from flashlite.attention import split_kv as sk
from flashlite.attention.tuning import AttentionConfig

from .utils import assert_attention_close, attention_ref, randn

TILES_16 = AttentionConfig(16, 16, 4, 1)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tuning, "INTERPRETER_CONFIG", TILES_16)


def qkv(b, h, lq, lk, d=32, dtype=torch.bfloat16, h_kv=None):
    h_kv = h if h_kv is None else h_kv
    return randn(b, h, lq, d, dtype=dtype), randn(b, h_kv, lk, d, dtype=dtype), randn(b, h_kv, lk, d, dtype=dtype)


def cache_mask(cache_seqlens, seqlen_q, seqlen_k, causal):
    """(B, 1, Lq, Lk) bool: what cache_seqlens means, written as a mask (causal aligned bottom-right to each length)."""
    used = cache_seqlens.long().view(-1, 1, 1, 1)
    key = torch.arange(seqlen_k)
    keep = (key < used).expand(-1, 1, seqlen_q, seqlen_k)
    if causal:
        keep = keep & (key <= torch.arange(seqlen_q)[:, None] + used - seqlen_q)
    return keep


def check(q, k, v, causal=False, attn_mask=None, cache_seqlens=None, **kw):
    """flash_attention(..., **kw) within tolerance of the float64 reference; returns (o, lse, reference lse)."""
    out, lse = flash_attention(q, k, v, causal=causal, attn_mask=attn_mask, cache_seqlens=cache_seqlens,
                               return_lse=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    ref_kw = dict(causal=causal, attn_mask=attn_mask)
    if cache_seqlens is not None:  # the cache's meaning as a mask; causal is then inside the mask
        keep = cache_mask(cache_seqlens, q.shape[2], k.shape[2], causal)
        ref_kw = dict(attn_mask=keep if attn_mask is None else keep & attn_mask)
    ref, ref_lse = attention_ref(q, k, v, return_lse=True, **ref_kw)
    assert_attention_close(out, ref, attention_ref(q, k, v, dtype=q.dtype, **ref_kw), q.dtype)
    return out, lse, ref_lse


def check_split_equals_unsplit(q, k, v, num_splits, **kw):
    split, _, _ = check(q, k, v, num_splits=num_splits, **kw)
    whole, _, _ = check(q, k, v, num_splits=1, **kw)
    # Same products, summed in another order: a bf16 rounding or two apart at most.
    torch.testing.assert_close(split.float(), whole.float(), atol=2e-2, rtol=2e-2)


def spy_split(monkeypatch) -> list:
    """Record the num_splits of each split launch flash_attention plans (to check which path a call takes)."""
    calls = []

    class Spy(sk.SplitLaunch):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            calls.append(args[8])  # (q, k, v, mask, causal, scale, mask_is_bool, write_lse, num_splits, ...)

    api.clear_routes()  # routes planned before the spy would not show
    monkeypatch.setattr(route, "SplitLaunch", Spy)
    return calls


# ----------------------------------------------------------------------------- splits


@pytest.mark.parametrize(
    "lq, lk, causal, num_splits",
    [
        (1, 100, False, 3),  # 7 key tiles in 3, 3, 1: uneven; Lk not a multiple of BLOCK_N
        (1, 130, True, 4),  # decoding under causal: the one query sees every key
        (5, 77, True, 2),  # Lq > 1 causal, bottom-right: queries end on different keys
        (20, 50, True, 3),  # two query tiles; the first tile's causal end is shorter
        (30, 20, True, 2),  # Lq > Lk: the first 10 queries see no key (zeros, lse -inf)
        (1, 40, False, 99),  # more splits than key tiles: clamped to 3
        (1, 300, False, 19),  # more splits than the merge loads at once (MERGE_TILE_PARTS): two blocks of them
        (3, 520, True, 40),  # 33 key tiles in 33 splits: three blocks, the last one split only
    ],
)
def test_split_vs_unsplit(lq, lk, causal, num_splits):
    check_split_equals_unsplit(*qkv(2, 2, lq, lk), num_splits, causal=causal)


def test_single_split_kernel_equals_forward():
    # cache_seqlens = Lk with num_splits = 1: the split kernel on one split, against the forward kernel.
    q, k, v = qkv(2, 2, 3, 45)
    full = torch.tensor([45, 45])
    out, _, _ = check(q, k, v, causal=True, cache_seqlens=full, num_splits=1)
    torch.testing.assert_close(out.float(), flash_attention(q, k, v, causal=True).float(), atol=2e-2, rtol=2e-2)


def test_fp32_split_is_exact_up_to_summation_order():
    q, k, v = qkv(1, 2, 4, 90, 64, dtype=torch.float32)
    split = flash_attention(q, k, v, num_splits=5)
    torch.testing.assert_close(split, flash_attention(q, k, v), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(split.double(), attention_ref(q, k, v), atol=1e-5, rtol=1e-5)


def test_head_dim_padded():
    check_split_equals_unsplit(*qkv(1, 2, 2, 50, 80), 3, causal=True)  # 80 -> 128-wide tiles, masked columns


# ----------------------------------------------------------------------------- GQA / MQA packing


@pytest.mark.parametrize("h_kv", [2, 1])  # GQA (2 query heads per K/V head) and MQA (4)
@pytest.mark.parametrize("lq, causal", [(1, False), (6, True)])  # 6 x 4 = 24 packed rows: a tile spans two heads
def test_grouped_query_packed(h_kv, lq, causal):
    q, k, v = qkv(2, 4, lq, 70, h_kv=h_kv)
    assert sk.heads_per_program(4, h_kv, lq, None) == 4 // h_kv
    check_split_equals_unsplit(q, k, v, 3, causal=causal)


def test_grouped_query_per_head_mask_not_packed():
    # A mask that differs by query head cannot be shared by packed rows: one head per program.
    q, k, v = qkv(1, 4, 3, 50, h_kv=2)
    mask = torch.rand(1, 4, 3, 50) > 0.3
    view, _ = api.check_inputs(q, k, v, mask)
    assert sk.heads_per_program(4, 2, 3, view) == 1
    check_split_equals_unsplit(q, k, v, 2, attn_mask=mask)


# ----------------------------------------------------------------------------- cache_seqlens


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq", [1, 3])
def test_cache_seqlens(lq, causal):
    # Per-element lengths of an 80-key cache: empty, ragged, a tile boundary, full.
    q, k, v = qkv(4, 4, lq, 80, h_kv=2)
    lengths = torch.tensor([0, 37, 64, 80], dtype=torch.int32)
    out, lse, ref_lse = check(q, k, v, causal=causal, cache_seqlens=lengths, num_splits=3)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()  # nothing cached: zeros, lse -inf
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-2, rtol=0)
    check(q, k, v, causal=causal, cache_seqlens=lengths.long())  # int64 lengths, automatic splits (1 here)


def test_cache_seqlens_ignores_keys_past_length():
    # Keys past each length are never read: NaN there must not reach the output.
    q, k, v = qkv(2, 2, 2, 60)
    lengths = torch.tensor([20, 45])
    out, _, _ = check(q, k, v, causal=True, cache_seqlens=lengths, num_splits=2)
    poisoned = []
    for t in (k, v):
        t = t.clone()
        t[0, :, 20:] = float("nan")
        t[1, :, 45:] = float("nan")
        poisoned.append(t)
    assert torch.equal(flash_attention(q, *poisoned, causal=True, cache_seqlens=lengths, num_splits=2), out)


def test_cache_seqlens_with_key_padding_mask():
    q, k, v = qkv(2, 4, 1, 64, h_kv=2)
    mask = torch.rand(2, 1, 1, 64) > 0.3
    check(q, k, v, attn_mask=mask, cache_seqlens=torch.tensor([50, 17]), num_splits=2)


def test_cache_seqlens_strided():
    # A (B,) view with stride 2 is read through its stride.
    q, k, v = qkv(2, 2, 1, 40)
    lengths = torch.tensor([33, 0, 9, 0])[::2]
    check(q, k, v, cache_seqlens=lengths, num_splits=2)


# ----------------------------------------------------------------------------- empty splits, masks, LSE


def test_empty_splits():
    # Element 0 has one key tile of 10 keys: with 4 splits, splits 1..3 see nothing and merge as (-inf, 0).
    # Causal with Lq = 12 > 10: its first two queries see no key at all (zeros, lse -inf).
    q, k, v = qkv(2, 2, 12, 64)
    lengths = torch.tensor([10, 64])
    out, lse, ref_lse = check(q, k, v, causal=True, cache_seqlens=lengths, num_splits=4)
    assert torch.isfinite(out).all()
    assert (out[0, :, :2] == 0).all() and (lse[0, :, :2] == float("-inf")).all()
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-2, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_mask(causal):
    q, k, v = qkv(2, 4, 2, 70, h_kv=1)
    mask = (torch.arange(70)[None, :] < torch.tensor([70, 23])[:, None]).view(2, 1, 1, 70)
    check_split_equals_unsplit(q, k, v, 4, attn_mask=mask, causal=causal)
    check_split_equals_unsplit(q, k, v, 3, attn_mask=randn(2, 1, 1, 70, scale=2.0), causal=causal)  # additive bias


def test_fully_masked_rows_and_splits():
    # Row 1 sees nothing; keys 0..47 are masked for every row, so the first splits are empty for all rows.
    q, k, v = qkv(1, 2, 3, 80)
    mask = torch.rand(1, 2, 3, 80) > 0.4
    mask[..., :48] = False
    mask[:, :, 1] = False
    out, lse, ref_lse = check(q, k, v, attn_mask=mask, num_splits=5)
    assert (out[:, :, 1] == 0).all() and (lse[:, :, 1] == float("-inf")).all()
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-2, rtol=0)


def test_lse_fp32():
    q, k, v = qkv(2, 2, 4, 90, dtype=torch.float32)
    _, lse, ref_lse = check(q, k, v, causal=True, cache_seqlens=torch.tensor([90, 50]), num_splits=3)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_offsets_past_2_31():
    # A cache whose batch elements lie 2^30 elements apart (the pages between are never touched):
    # element 2 starts at 2^31, past what a 32-bit b x stride can hold.
    stride = 2**30
    q = randn(3, 1, 1, 16, dtype=torch.bfloat16)
    k, v = (torch.empty(2 * stride + 40 * 16, dtype=torch.bfloat16).as_strided((3, 1, 40, 16), (stride, 640, 16, 1))
            for _ in range(2))
    k.copy_(randn(3, 1, 40, 16, dtype=torch.bfloat16))
    v.copy_(randn(3, 1, 40, 16, dtype=torch.bfloat16))
    check(q, k, v, cache_seqlens=torch.tensor([40, 5, 31]), num_splits=2)


# ----------------------------------------------------------------------------- which path, the rule


def test_interpreter_keeps_forward_kernel(monkeypatch):
    calls = spy_split(monkeypatch)
    q, k, v = qkv(1, 2, 1, 50)
    flash_attention(q, k, v)  # automatic: 1 off CUDA, the forward kernel
    flash_attention(q, k, v, num_splits=1)
    assert calls == []
    flash_attention(q, k, v, num_splits=2)
    flash_attention(q, k, v, cache_seqlens=torch.tensor([50]))
    assert calls == [2, 1]


def test_automatic_rule():
    sms = 132  # an H200; the expected counts are the fastest ones bench/decode.py --tune measured there
    # Decoding (Lq = 1), B = 1: one wave of about one program per multiprocessor, never past it (17 splits of 8
    # programs made a second wave of 4: 372 us against 254 at 16, bench/results/h200/decode_ceil_rule.md at commit
    # 17242bc; TUNING.md#decode-splits).
    assert sk.splits_for(32, 32, True, 65536, sms) == 4  # 32 K/V heads (best measured: 4)
    assert sk.splits_for(32, 8, True, 65536, sms) == 16  # 8 K/V heads, 4 query heads packed (best: 16)
    assert sk.splits_for(32, 8, True, 4096, sms) == 8  # ... each split at least SPLIT_MIN_KEYS keys (best: 8)
    # Decoding with a full grid still takes the split kernel (it packs GQA groups), with at least 2 splits.
    assert sk.splits_for(256, 64, True, 65536, sms) == 2
    assert sk.splits_for(256, 256, True, 65536, sms) == 2
    # Longer query blocks: the forward kernel once its grid fills the GPU, else split.
    assert sk.splits_for(256, 256, False, 65536, sms) == 1
    assert sk.splits_for(16, 16, False, 65536, sms) == 8
    # Below SPLIT_MIN_SEQLEN_K keys: the forward kernel.
    assert sk.splits_for(32, 32, True, sk.SPLIT_MIN_SEQLEN_K - 1, sms) == 1
    # Each split keeps at least SPLIT_MIN_KEYS keys; at most SPLIT_MAX splits.
    assert sk.splits_for(1, 1, True, 8192, 10_000) == 8192 // sk.SPLIT_MIN_KEYS
    assert sk.splits_for(1, 1, True, 2**20, 10_000) == sk.SPLIT_MAX


# ----------------------------------------------------------------------------- errors, CPU path


def test_argument_errors():
    q, k, v = qkv(2, 2, 1, 10)
    with pytest.raises(ValueError, match="num_splits"):
        flash_attention(q, k, v, num_splits=0)
    with pytest.raises(TypeError, match="num_splits"):
        flash_attention(q, k, v, num_splits=2.0)
    with pytest.raises(TypeError, match="num_splits"):
        flash_attention(q, k, v, num_splits=True)
    with pytest.raises(TypeError, match="cache_seqlens must be int32 or int64"):
        flash_attention(q, k, v, cache_seqlens=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"cache_seqlens must have shape \(B,\) = \(2,\)"):
        flash_attention(q, k, v, cache_seqlens=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="cache_seqlens is on meta"):
        flash_attention(q, k, v, cache_seqlens=torch.tensor([1, 2], device="meta"))
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, Lk\]"):
        flash_attention(q, k, v, cache_seqlens=torch.tensor([1, 11]))
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, Lk\]"):
        flash_attention(q, k, v, cache_seqlens=torch.tensor([-1, 3]))
    with pytest.raises(TypeError, match="cache_seqlens must be a torch.Tensor"):
        flash_attention(q, k, v, cache_seqlens=[1, 2])


@pytest.mark.parametrize("causal", [False, True])
def test_pytorch_path_cache_seqlens(monkeypatch, causal):
    # CPU without the interpreter: the PyTorch path honours cache_seqlens (and ignores num_splits).
    monkeypatch.setattr(api, "runs_kernels", lambda t: False)
    q, k, v = qkv(3, 4, 3, 30, h_kv=2, dtype=torch.float32)
    lengths = torch.tensor([0, 2, 30])
    out, lse, ref_lse = check(q, k, v, causal=causal, cache_seqlens=lengths, num_splits=4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- repeated calls


def test_repeated_calls_replay_the_route(monkeypatch):
    # The second call of a signature skips the checks and the plan (its route is kept) and still gives the answer
    # for its own data; another signature (strides, a cache, return_lse) is planned apart.
    checks = []
    real_check = api.check_inputs
    monkeypatch.setattr(api, "check_inputs", lambda *a: checks.append(1) or real_check(*a))
    calls = spy_split(monkeypatch)
    for _ in range(2):
        check(*qkv(2, 4, 2, 70, h_kv=2), causal=True, num_splits=3)
    assert calls == [3] and len(checks) == 1  # check() passes return_lse=True: one signature
    flash_attention(*qkv(2, 4, 2, 70, h_kv=2), causal=True, num_splits=3)  # return_lse=False: a new route
    assert calls == [3, 3] and len(checks) == 2
    for _ in range(2):  # the same shapes, q's head dim not contiguous: copied each call, the route kept
        q, k, v = qkv(2, 4, 2, 70, h_kv=2)
        check(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, causal=True, num_splits=2)
    assert calls == [3, 3, 2]


def test_repeated_calls_recheck_what_the_key_leaves_out(monkeypatch):
    # Not kept: a CPU cache_seqlens (its values are checked every call), flags of another type (checked again, so
    # the error still comes). Kept: masks and inputs that require grad (their signature is in the key).
    calls = spy_split(monkeypatch)
    q, k, v = qkv(1, 2, 1, 50)
    lengths = torch.tensor([20])
    for _ in range(2):
        check(q, k, v, cache_seqlens=lengths, num_splits=2)
    assert calls == [2, 2]
    with pytest.raises(ValueError, match="cache_seqlens must lie"):
        flash_attention(q, k, v, cache_seqlens=torch.tensor([51]), num_splits=2)
    for _ in range(2):
        flash_attention(q, k, v, num_splits=2)
    with pytest.raises(TypeError, match="causal"):
        flash_attention(q, k, v, num_splits=2, causal="no")
    key = api.call_key(q, k, v, False, None, None, None, None, None, None, False, 2, None, False)
    assert key is not None
    mask = torch.ones(1, 1, 1, 50, dtype=torch.bool)
    assert api.call_key(q, k, v, False, None, mask, None, None, None, None, False, 2, None, False) not in (None, key)
    assert api.call_key(q, k, v, False, None, None, None, None, None, None, False, 2, None, True) != key  # training
    assert api.call_key(q, k, v, False, 1, None, None, None, None, None, False, 2, None, False) is None  # an int
    assert api.call_key(q, k, v, False, None, None, None, None, None, None, False, 2, lengths, False) is None  # CPU
