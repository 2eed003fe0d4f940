"""Attention's forward kernels one by one on the GPU (``pytest -m gpu``): split-K/V decoding, the tl kernel on forced
tiles, the Hopper kernels on each of their configs.

Beyond tests/test_gpu_attention.py's matrix (every call through
``flash_attention``'s default route):

* split-K/V decoding through the public API (``num_splits``, ``cache_seqlens``):
  GQA groups packed into one tile (H_kv 8 and 1) or not (MHA, a per-head mask),
  per-element cache lengths (0, ragged, L_max), causal with Lq > 1, forced
  splits (1, 7, 64) and the automatic choice, a 1M-key cache;
* the ``triton.language`` forward on inputs read through views whose padding
  (past L and past D) is NaN: head dims 16 (in no other GPU test), 80 and 192
  (padded on chip), layouts (B, L, H, D), GQA/MQA, masks (key padding, additive,
  rows that see nothing), fp32; its tiles forced (pointer loads where the call
  takes TMA, the persistent grid, the square boxes ``plan.tma_safe`` routes away
  from); a 128K-token sequence;
* the Hopper (Gluon) kernels, on each tile config of their tables (skipped
  off sm_90), and ``flash_attention``'s route to them.

Errors meet FlashAttention's rule (``tests.utils.assert_attention_close``) against
float64; LSEs are compared relative to their size, rows that see no key must give
``-inf``; outputs are allocated from poisoned memory.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

import flashlite
from flashlite.attention import api, forward_hopper, gluon_tiles, plan, route, tuning
from flashlite.core.runtime import device_info
from flashlite.core.tiles import tma_usable

from .utils import assert_attention_close, attention_ref, need_memory, poison

pytestmark = pytest.mark.gpu

LSE_RTOL = 1e-4  # LSE error relative to max(|LSE|, 1): scores are fp32 dots, LSE fp32


def padded(shape: tuple, dtype: torch.dtype, layout: str = "bhld", pad_rows: int = 5, pad_dim: int = 8) -> torch.Tensor:
    """Fresh normal data of shape (B, H, L, D), as a view into a NaN-filled buffer whose rows go ``pad_rows`` past L
    and ``pad_dim`` past D: any read past either poisons the output. ``blhd``: a (B, L, H, D) buffer, transposed.
    The head dim keeps stride 1."""
    b, h, length, d = shape
    if layout == "blhd":
        buf = torch.full((b, length + pad_rows, h, d + pad_dim), float("nan"), device="cuda", dtype=dtype)
        view = buf[:, :length, :, :d].transpose(1, 2)
    else:
        buf = torch.full((b, h, length + pad_rows, d + pad_dim), float("nan"), device="cuda", dtype=dtype)
        view = buf[:, :, :length, :d]
    view.copy_(torch.randn(shape, device="cuda", dtype=torch.float32))
    return view


def assert_lse_close(lse: torch.Tensor, ref_lse: torch.Tensor) -> None:
    """LSE within LSE_RTOL of float64's, relative to max(|LSE|, 1); exactly -inf where a row sees no key."""
    finite = torch.isfinite(ref_lse)
    assert bool((lse[~finite] == float("-inf")).all()), "a row that sees no key has an LSE other than -inf"
    if finite.any():
        err = ((lse.double() - ref_lse)[finite].abs() / ref_lse[finite].abs().clamp_min(1)).max().item()
        assert err <= LSE_RTOL, f"LSE relative error {err:.1e} > {LSE_RTOL:.0e}"


class Reference:
    """float64 (out, lse) and PyTorch's out in the input dtype of one call, computed once per scale."""

    def __init__(self, q, k, v, **kw):
        self.q, self.k, self.v, self.kw = q, k, v, kw
        self.cache = {}

    def check(self, out: torch.Tensor, lse: torch.Tensor | None, scale: float) -> None:
        if scale not in self.cache:
            ref, ref_lse = attention_ref(self.q, self.k, self.v, scale=scale, return_lse=True, **self.kw)
            low = attention_ref(self.q, self.k, self.v, scale=scale, dtype=self.q.dtype, **self.kw)
            self.cache[scale] = ref, ref_lse, low
        ref, ref_lse, low = self.cache[scale]
        assert_attention_close(out, ref, low, self.q.dtype)
        if lse is not None:
            assert_lse_close(lse, ref_lse)


def run_failures(checks: dict) -> None:
    """Run each ``name -> zero-argument check``; fail once, listing every check that failed."""
    failures = []
    for name, check in checks.items():
        try:
            check()
        except AssertionError as err:
            failures.append(f"{name}: {err}")
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- split-K/V decoding

HEADS, HEAD_DIM = 32, 128


# GQA groups packed into one tile (H_kv 8: 4 heads; H_kv 1: all 32, past a 16-row tile) or not (MHA, a per-head
# mask); Lq > 1 under causal; cache lengths 0, ragged and L_max. Each with the automatic split count and 7 or 64
# splits; two with one split too (the split kernel under cache_seqlens, the forward kernel without).
DECODE_CASES = [
    dict(b=3, h_kv=8, lq=1, lk=9000, causal=False, lens=(0, 4097, 9000), splits=(None, 1, 7)),
    dict(b=2, h_kv=8, lq=4, lk=20001, causal=True, lens=None, splits=(None, 1, 64)),
    dict(b=3, h_kv=1, lq=1, lk=9000, causal=True, lens=(0, 4097, 9000), splits=(None, 7)),
    dict(b=2, h_kv=1, lq=16, lk=20001, causal=False, lens=None, splits=(None, 7)),
    dict(b=3, h_kv=32, lq=4, lk=9000, causal=True, lens=(0, 4097, 9000), splits=(None, 7)),
    dict(b=2, h_kv=32, lq=16, lk=20001, causal=False, lens=None, splits=(None, 7)),
    dict(b=2, h_kv=8, lq=1, lk=5000, causal=False, lens=(5000, 1), mask="key_padding", splits=(None, 7)),  # packed
    dict(b=2, h_kv=8, lq=2, lk=5000, causal=True, lens=(3001, 5000), mask="per_head", splits=(None, 7)),  # not packed
]


def decode_id(case: dict) -> str:
    return (f"B{case['b']}-Hkv{case['h_kv']}-Lq{case['lq']}-Lk{case['lk']}-{'causal' if case['causal'] else 'full'}"
            f"-lens{'' if case['lens'] is None else '_'.join(map(str, case['lens']))}-{case.get('mask')}")


@pytest.mark.parametrize("case", DECODE_CASES, ids=decode_id)
def test_split_kv_decoding(case):
    b, h_kv, lq, lk, causal = (case[key] for key in ("b", "h_kv", "lq", "lk", "causal"))
    q = padded((b, HEADS, lq, HEAD_DIM), torch.bfloat16)
    k, v = (padded((b, h_kv, lk, HEAD_DIM), torch.bfloat16) for _ in range(2))
    lens = None if case["lens"] is None else torch.tensor(case["lens"], dtype=torch.int32, device="cuda")
    mask = {None: None, "key_padding": lambda: torch.rand(b, 1, 1, lk, device="cuda") > 0.3,
            "per_head": lambda: torch.rand(b, HEADS, 1, lk, device="cuda") > 0.3}[case.get("mask")]
    mask = mask() if mask else None
    # The reference: cache lengths and causal (bottom-right to each length) as an explicit mask.
    keep = mask
    if lens is not None:
        key = torch.arange(lk, device="cuda")
        used = lens.long().view(b, 1, 1, 1)
        keep = (key < used).expand(b, 1, lq, lk)
        if causal:
            keep = keep & (key <= torch.arange(lq, device="cuda")[:, None] + used - lq)
        if mask is not None:
            keep = keep & mask
    reference = Reference(q, k, v, attn_mask=keep, causal=causal and lens is None)
    scale = 1 / math.sqrt(HEAD_DIM)

    def check(splits):
        poison()
        out, lse = flashlite.flash_attention(q, k, v, causal=causal, attn_mask=mask, cache_seqlens=lens,
                                             num_splits=splits, return_lse=True)
        reference.check(out, lse, scale)

    run_failures({f"num_splits={splits}": (lambda splits=splits: check(splits)) for splits in case["splits"]})


def test_decoding_a_million_keys():
    # The longest cache: 1M keys, GQA 4:1 over two K/V heads, through cache_seqlens (the last 3 keys unused).
    need_memory(40 << 30)  # the float64 reference repeats K and V to the query heads
    q = torch.randn(1, 8, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 2**20, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    n = 2**20 - 3
    poison()
    out, lse = flashlite.flash_attention(q, k, v, cache_seqlens=torch.tensor([n], device="cuda"), return_lse=True)
    Reference(q, k[:, :, :n], v[:, :, :n]).check(out, lse, 1 / math.sqrt(HEAD_DIM))


# ----------------------------------------------------------------------------- the tl kernel, forced tiles


def forward_variant(name: str, q, k, v, causal: bool, mask: torch.Tensor | None) -> tuple:
    """``(config or None, scale)`` of a run: "default" (flash_attention's own route), "pointers" (the tl kernel on the
    call's tiles, loading by pointers where they take TMA), "persistent" (on a persistent grid), "square boxes" (D = 64
    under a mask: 64 x 64 TMA boxes, which ``plan.tma_safe`` sends to pointer loads), "scale 0.05" (another scale:
    a runtime argument, never the first call's)."""
    head_dim = q.shape[3]
    scale = 1 / math.sqrt(head_dim)
    base = plan.default_config(head_dim, q.dtype, q.device, causal, k.shape[2], mask is not None)  # the call's tiles
    if name == "default":
        return None, scale
    if name == "scale 0.05":
        return None, 0.05
    if name == "pointers":
        assert base.use_tma and tma_usable(q, k, v), "the call's own tiles do not load by TMA: nothing to swap"
        return dataclasses.replace(base, use_tma=False), scale
    if name == "persistent":
        return dataclasses.replace(base, persistent=True), scale
    assert name == "square boxes" and head_dim == 64 and mask is not None
    square = tuning.SHORT_WORK_CONFIGS[64]
    assert square.use_tma and not plan.tma_safe(True, square.block_n, 64)  # the fallback is what runs
    return square, scale


def check_forward(q, k, v, causal: bool, mask: torch.Tensor | None = None, variants=("default",)) -> dict:
    """``variant -> check`` of one call: each variant (``forward_variant``) against float64."""
    reference = Reference(q, k, v, causal=causal, attn_mask=mask)
    mask_view, is_bool = api.check_inputs(q, k, v, mask)

    def check(config, scale):
        poison()
        if config is None:
            out, lse = flashlite.flash_attention(q, k, v, causal=causal, attn_mask=mask, scale=scale, return_lse=True)
        else:  # a config forces the tl kernel and its tiles
            out, lse = api.attention_forward(q, k, v, causal, scale, mask_view, is_bool, True, config)
        reference.check(out, lse, scale)

    return {name: (lambda run=forward_variant(name, q, k, v, causal, mask): check(*run)) for name in variants}


@pytest.mark.parametrize("head_dim", [16, 80, 192])
def test_forward_padded_inputs(head_dim):
    # The smallest head dim and two padded on chip (EVEN_D off), on inputs whose rows and head dim run into NaN
    # padding: one query against 4099 keys, and 2047 x 2049 under causal.
    checks = {}
    for seqlen_q, seqlen_k, causal in ((1, 4099, False), (2047, 2049, True)):
        q = padded((2, 4, seqlen_q, head_dim), torch.bfloat16)
        k, v = (padded((2, 4, seqlen_k, head_dim), torch.bfloat16) for _ in range(2))
        for name, check in check_forward(q, k, v, causal, variants=("default", "scale 0.05")).items():
            checks[f"Lq={seqlen_q} Lk={seqlen_k} causal={causal} {name}"] = check
    run_failures(checks)


def make_mask(kind: str | None, b: int, h: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor | None:
    """A (B, 1, 1, Lk) key-padding prefix, a (B, H, Lq, Lk) float bias, or a boolean mask with rows that see nothing."""
    if kind is None:
        return None
    if kind == "key_padding":  # each sequence keeps a prefix
        lengths = torch.randint(1, seqlen_k + 1, (b,), device="cuda")
        return (torch.arange(seqlen_k, device="cuda")[None, :] < lengths[:, None]).view(b, 1, 1, seqlen_k)
    if kind == "additive":
        return torch.randn(b, h, seqlen_q, seqlen_k, device="cuda") * 2
    mask = torch.rand(b, h, seqlen_q, seqlen_k, device="cuda") > 0.5  # "empty_rows"
    mask[:, :, ::7] = False
    return mask


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (B, H, H_kv, Lq, Lk, D, layout, mask, dtype, causal, variants), inputs in NaN-padded views.
LAYOUT_CASES = [
    (1, 8, 2, 4096, 4096, 128, "bhld", None, BF16, True, ("default", "pointers", "persistent", "scale 0.05")),  # GQA
    (2, 8, 1, 333, 3000, 64, "blhd", None, BF16, False, ("default", "pointers", "scale 0.05")),  # MQA, (B, L, H, D)
    (2, 4, 4, 1500, 1500, 64, "bhld", "key_padding", BF16, True, ("default", "pointers", "square boxes")),
    (2, 4, 4, 700, 900, 128, "bhld", "additive", BF16, False, ("default", "pointers")),
    (1, 4, 4, 500, 600, 64, "bhld", "empty_rows", BF16, True, ("default",)),  # rows that see no key
    (2, 4, 2, 1000, 1000, 128, "bhld", None, FP16, False, ("default", "persistent")),
    (1, 2, 2, 300, 257, 128, "bhld", None, FP32, True, ("default",)),  # IEEE fp32 dots; Lq > Lk
    (1, 2, 1, 129, 400, 80, "bhld", "key_padding", FP32, False, ("default",)),
]


@pytest.mark.parametrize("case", LAYOUT_CASES,
                         ids=[f"D{c[5]}-{c[6]}-{c[7]}-{str(c[8])[6:]}-H{c[1]}_{c[2]}-{'causal' if c[9] else 'full'}"
                              for c in LAYOUT_CASES])
def test_forward_layouts_masks_and_tiles(case):
    b, h, h_kv, seqlen_q, seqlen_k, head_dim, layout, kind, dtype, causal, variants = case
    q = padded((b, h, seqlen_q, head_dim), dtype, layout)
    k, v = (padded((b, h_kv, seqlen_k, head_dim), dtype, layout) for _ in range(2))
    run_failures(check_forward(q, k, v, causal, make_mask(kind, b, h, seqlen_q, seqlen_k), variants))


@pytest.mark.parametrize("causal", [False, True])
def test_forward_128k_tokens(causal):
    # The longest length: 1024 query tiles a head, 1024 to 2048 key tiles a row; a few rows against float64.
    q, k, v = (torch.randn(1, 2, 131072, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    poison()
    out = flashlite.flash_attention(q, k, v, causal=causal)
    for r in (0, 4097, 131071):
        keys = r + 1 if causal else 131072  # under causal, keys up to the row's own index
        args = (q[:, :, r:r + 1], k[:, :, :keys], v[:, :, :keys])
        assert_attention_close(out[:, :, r:r + 1], attention_ref(*args), attention_ref(*args, dtype=torch.bfloat16),
                               torch.bfloat16)


# ----------------------------------------------------------------------------- the Hopper kernels


def require_hopper() -> None:
    if not gluon_tiles.wgmma_available():
        pytest.skip("this Triton has no Gluon Hopper API")
    if device_info(torch.device("cuda")).capability != gluon_tiles.WGMMA_CAPABILITY:
        pytest.skip("the Hopper kernels need sm_90")
    if os.environ.get("FLASHLITE_WGMMA", "1") == "0":
        pytest.skip("FLASHLITE_WGMMA=0 turns the Hopper kernels off")


# Each tile config of the Hopper tables (by padded head dim: the default, the one for causal calls with few keys,
# the causal one) in bf16, and the warp-specialized one in fp16 too; each table's head dim, and one it pads
# (D = 96 and 192: boxes zero-filled past D).
HOPPER_TABLE_CONFIGS = {d: dict.fromkeys(c for c in (tuning.WGMMA_CONFIGS[d], tuning.WGMMA_SHORT_CAUSAL.get(d, (0, None))[1],
                                                     tuning.WGMMA_CAUSAL_CONFIGS.get(d)) if c is not None)
                        for d in sorted(tuning.WGMMA_CONFIGS)}
HOPPER_CASES = [(head_dim, config, dtype) for d, configs in HOPPER_TABLE_CONFIGS.items() for config in configs
                for head_dim in ((d, {128: 96, 256: 192}[d]) if d in (128, 256) else (d,))
                for dtype in ((torch.bfloat16, torch.float16) if config.warp_specialized else (torch.bfloat16,))]


@pytest.mark.parametrize("head_dim,config,dtype", HOPPER_CASES,
                         ids=[f"D{d}-{c.block_m}x{c.block_n}{'-ws' if c.warp_specialized else ''}"
                              f"{'-qreg' if c.q_in_registers else ''}-{str(t)[6:]}" for d, c, t in HOPPER_CASES])
def test_hopper_kernel_configs(head_dim, config, dtype):
    # GQA with odd lengths, causal and not, and Lq > Lk under causal (rows that see no key), with the LSE.
    require_hopper()
    checks = {}
    for b, h, h_kv, seqlen_q, seqlen_k, causal in ((2, 4, 2, 1000, 1777, False), (2, 4, 2, 1000, 1777, True),
                                                   (2, 4, 4, 300, 129, True)):
        q = torch.randn(b, h, seqlen_q, head_dim, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, h_kv, seqlen_k, head_dim, device="cuda", dtype=dtype) for _ in range(2))
        scale = 1 / math.sqrt(head_dim)
        assert forward_hopper.wgmma_eligible(q, k, v, False, scale)
        reference = Reference(q, k, v, causal=causal)

        def check(q=q, k=k, v=v, causal=causal, scale=scale, reference=reference):
            poison()
            out, lse = forward_hopper.attention_forward_hopper(q, k, v, causal, scale, True, config)
            reference.check(out, lse, scale)

        checks[f"B={b} H={h}/{h_kv} Lq={seqlen_q} Lk={seqlen_k} causal={causal}"] = check
    run_failures(checks)


def test_flash_attention_takes_the_hopper_kernel(monkeypatch):
    # flash_attention's own route: D = 40 to 256, 16-bit, no mask, go to the Hopper kernels (test_gpu_attention's
    # matrix relies on it for those head dims; training calls take the same route).
    require_hopper()
    taken = []
    real = route.HopperForwardLaunch

    def spy(*args, **kwargs):
        taken.append(args[0].shape)
        return real(*args, **kwargs)

    api.clear_routes()
    monkeypatch.setattr(route, "HopperForwardLaunch", spy)
    for head_dim in (40, 64, 96, 128, 192, 256):
        for causal in (False, True):
            q, k, v = (torch.randn(2, 4, 512, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flashlite.flash_attention(q, k, v, causal=causal)
    assert len(taken) == 12
