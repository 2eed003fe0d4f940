"""A seeded random sweep of attention calls: shapes, layouts and variants drawn together.

Each case draws batch, heads (MHA, GQA, MQA), query and key lengths, a q/k head dim from 16 to 256 and a v
head dim of its own a quarter of the time, the dtype (fp16, bf16, fp32), the layout ((B, H, L, D) tensors or
(B, L, H, D) ones seen transposed, as a model's projections give them), and any mix of the variants (causal,
a sliding window, a softcap, ALiBi slopes, sinks, a boolean or an additive mask with its gradient, a scale of
its own). ``tests.utils.check_attention`` then holds the output, the LSE and every gradient to FlashAttention's
rule against PyTorch's computation in the same dtype and float64.

On the GPU (``pytest -m gpu``) ``GPU_CASES`` cases of up to 2K positions, outputs allocated from poisoned memory;
through the interpreter ``CPU_CASES`` short ones on 16 x 16 tiles. The sweep is fixed by ``SEED`` so that a
failure reproduces; ``FLASHLITE_SWEEP_SEED=<int>`` draws another one.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from .utils import check_attention, poison

SEED = int(os.environ.get("FLASHLITE_SWEEP_SEED", "20261128"))
GPU_CASES = 96
CPU_CASES = 10
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def draw_case(rng: random.Random, on_gpu: bool) -> dict:
    """One call's shapes and variants, drawn from ``rng``: a dict for ``make_call``."""
    longest = 2048 if on_gpu and rng.random() < 0.2 else (700 if on_gpu else 40)
    kv_heads = rng.choice((1, 2, 3))
    head_dim = rng.randint(16, 256) if on_gpu else rng.choice((16, 24, 40))
    case = {
        "batch": rng.randint(1, 3),
        "heads": kv_heads * rng.choice((1, 2, 4)),
        "kv_heads": kv_heads,
        "seqlen_q": rng.randint(1, longest),
        "seqlen_k": rng.randint(1, longest),
        "head_dim": head_dim,
        "head_dim_v": head_dim if rng.random() < 0.75 else (rng.randint(16, 256) if on_gpu else 32),
        "dtype": rng.choice(DTYPES),
        "transposed": rng.random() < 0.5,  # (B, L, H, D) tensors seen as (B, H, L, D)
        "causal": rng.random() < 0.5,
        "window": (rng.randint(0, 64), rng.choice((-1, 0, rng.randint(0, 64)))) if rng.random() < 0.2 else None,
        "softcap": rng.choice((5.0, 20.0, 50.0)) if rng.random() < 0.15 else None,
        "alibi": rng.random() < 0.15,
        "sinks": rng.random() < 0.15,
        "mask": rng.choice((None, None, None, "bool", "float")),
        "scale": rng.choice((None, None, None, 0.05, 0.3)),
    }
    return case


def make_call(case: dict, device: str):
    """``(q, k, v, kwargs)`` of ``case`` on ``device``: inputs that require grad, the variants as
    ``flashlite.flash_attention`` takes them."""
    b, h, h_kv = case["batch"], case["heads"], case["kv_heads"]
    lq, lk, d, dv, dtype = case["seqlen_q"], case["seqlen_k"], case["head_dim"], case["head_dim_v"], case["dtype"]

    def tensor(heads: int, length: int, dim: int) -> torch.Tensor:
        if case["transposed"]:
            t = torch.randn(b, length, heads, dim, device=device, dtype=dtype).transpose(1, 2)
        else:
            t = torch.randn(b, heads, length, dim, device=device, dtype=dtype)
        return t.requires_grad_()

    q, k, v = tensor(h, lq, d), tensor(h_kv, lk, d), tensor(h_kv, lk, dv)
    kw = {"causal": case["causal"], "scale": case["scale"], "window_size": case["window"], "softcap": case["softcap"]}
    if case["alibi"]:
        kw["alibi_slopes"] = torch.rand(h, device=device, dtype=torch.float32) * 0.5
    if case["sinks"]:
        kw["sinks"] = torch.randn(h, device=device, dtype=torch.float32).requires_grad_()
    if case["mask"] == "bool":
        kw["attn_mask"] = torch.rand(b, 1, lq, lk, device=device) < 0.8
    elif case["mask"] == "float":
        kw["attn_mask"] = torch.randn(1, h, lq, lk, device=device, dtype=dtype).requires_grad_()
    return q, k, v, kw


def test_draws_cover_every_variant():
    # The GPU sweep meets each dtype, layout and variant, head dims across 16-256 and v dims of their own.
    cases = [draw_case(random.Random(SEED * 1000 + i), on_gpu=True) for i in range(GPU_CASES)]
    assert {c["dtype"] for c in cases} == set(DTYPES) and {c["transposed"] for c in cases} == {False, True}
    for key in ("causal", "window", "softcap", "alibi", "sinks", "scale"):
        assert any(c[key] for c in cases) and not all(c[key] for c in cases), key
    assert {c["mask"] for c in cases} == {None, "bool", "float"}
    assert min(c["head_dim"] for c in cases) < 64 and max(c["head_dim"] for c in cases) > 192
    assert any(c["head_dim_v"] != c["head_dim"] for c in cases) and any(c["heads"] != c["kv_heads"] for c in cases)


@pytest.mark.parametrize("index", range(CPU_CASES))
def test_random_sweep_interpreter(index, small_attention_tiles):
    case = draw_case(random.Random(SEED * 1000 + 500 + index), on_gpu=False)
    q, k, v, kw = make_call(case, "cpu")
    check_attention(q, k, v, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(GPU_CASES))
def test_random_sweep(index):
    case = draw_case(random.Random(SEED * 1000 + index), on_gpu=True)
    q, k, v, kw = make_call(case, "cuda")
    poison()
    check_attention(q, k, v, **kw)
