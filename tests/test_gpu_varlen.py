"""``flash_attention_varlen`` on the GPU (``pytest -m gpu``): FlashAttention's varlen test matrix (the seqlen pairs
and head dims of its ``test_flash_attn_varlen_output``), MHA/GQA/MQA, causal and not, fp16/bf16 (and fp32 on a
few), output, LSE and gradients against float64 per sequence, on poisoned memory; each case on both kernel
families of a packed batch (``packed_kernels``: the Hopper forward and backward, the default on Hopper, and the
``triton.language`` ones that ``FLASHLITE_HOPPER_VARLEN=0`` switches to)."""

import pytest
import torch

import flashlite

from .utils import check_attention_varlen, cu_seqlens, poison

pytestmark = pytest.mark.gpu

SEQLENS = [(1, 147), (113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024),
           (1023, 1024), (1024, 1023), (2048, 2048)]
HEAD_DIMS = [32, 64, 96, 128, 192, 256]


def random_lengths(batch: int, longest: int, generator: torch.Generator) -> list[int]:
    """``batch`` lengths in [0, longest], the first one the longest, one of them 0 when batch > 2."""
    lengths = torch.randint(0, longest + 1, (batch,), generator=generator).tolist()
    lengths[0] = longest
    if batch > 2:
        lengths[-1] = 0
    return lengths


@pytest.fixture(params=["tl", "hopper"])
def packed_kernels(request, monkeypatch):
    """The kernels of a packed batch: the ``triton.language`` forward and backward (``FLASHLITE_HOPPER_VARLEN=0``),
    or the Hopper ones (``=1``, the default, where the call is one they take: fp16/bf16, head dims 33-256 forward and
    16-256 backward (TMA-aligned), on Hopper)."""
    from flashlite.attention import api

    monkeypatch.setenv("FLASHLITE_HOPPER_VARLEN", "1" if request.param == "hopper" else "0")
    api.clear_routes()
    yield request.param
    api.clear_routes()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mha_type", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlen_q, seqlen_k", SEQLENS)
def test_varlen_matrix(seqlen_q, seqlen_k, head_dim, mha_type, causal, dtype, packed_kernels):
    generator = torch.Generator().manual_seed(seqlen_q * 7919 + seqlen_k * 31 + head_dim)
    batch, heads = 4, 6
    kv_heads = {"mha": 6, "gqa": 2, "mqa": 1}[mha_type]
    lengths_q = random_lengths(batch, seqlen_q, generator)
    lengths_k = random_lengths(batch, seqlen_k, generator)
    poison()
    q = torch.randn(sum(lengths_q), heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lengths_k), kv_heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lengths_k), kv_heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    check_attention_varlen(q, k, v, lengths_q, lengths_k, causal=causal)


@pytest.mark.parametrize("variant", [dict(window_size=(64, 16)), dict(softcap=20.0, causal=True),
                                     dict(alibi=True, causal=True), dict(sinks=True, causal=True),
                                     dict(head_dim_v=64), dict(dtype=torch.float32, causal=True)])
def test_varlen_variants(variant, packed_kernels):
    variant = dict(variant)
    dtype = variant.pop("dtype", torch.bfloat16)
    head_dim_v = variant.pop("head_dim_v", 128)
    lengths_q, lengths_k = [300, 0, 77, 512, 1], [310, 5, 77, 600, 0]
    poison()
    q = torch.randn(sum(lengths_q), 8, 128, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lengths_k), 2, 128, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lengths_k), 2, head_dim_v, device="cuda", dtype=dtype, requires_grad=True)
    if variant.pop("sinks", False):
        variant["sinks"] = torch.randn(8, device="cuda", requires_grad=True)
    if variant.pop("alibi", False):
        variant["alibi_slopes"] = torch.rand(8, device="cuda") * 0.3
    check_attention_varlen(q, k, v, lengths_q, lengths_k, **variant)


def test_varlen_graph_capture_replays(packed_kernels):
    # No host reads of the lengths: a CUDA graph replays the call with new lengths written into cu_seqlens.
    lengths = [100, 37, 250]
    q, k, v = (torch.randn(400, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = cu_seqlens(lengths, "cuda")
    flashlite.flash_attention_varlen(q, k, v, cu, cu, 256, 256, causal=True)  # planned and built before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashlite.flash_attention_varlen(q, k, v, cu, cu, 256, 256, causal=True)
    for new in ([200, 200, 0], [1, 255, 144]):
        cu.copy_(cu_seqlens(new, "cuda"))
        graph.replay()
        expected = flashlite.flash_attention_varlen(q, k, v, cu, cu, 256, 256, causal=True)
        assert torch.equal(out, expected)


def test_varlen_runs_on_the_hopper_kernels(monkeypatch):
    # By default (and so in the matrix's "hopper" cases) a packed batch goes through the Hopper forward and backward
    # where they apply (fp16/bf16, head dims 33-256 but 32 forward, on an H100/H200): spies count their packed launches,
    # so that those cases do not pass on the tl kernels alone.
    from flashlite.attention import api, backward_hopper, forward_hopper

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on compute capability 9.0")
    packed_calls = []
    for launch_class in (forward_hopper.HopperForwardLaunch, backward_hopper.HopperBackwardLaunch):
        def spy(launch, *args, call=launch_class.__call__, name=launch_class.__name__):
            packed_calls.append((name, launch.varlen is not None))
            return call(launch, *args)

        monkeypatch.setattr(launch_class, "__call__", spy)
    monkeypatch.delenv("FLASHLITE_HOPPER_VARLEN", raising=False)  # the default
    api.clear_routes()
    lengths = [129, 0, 255, 1, 640]
    poison()
    q, k, v = (torch.randn(sum(lengths), 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    check_attention_varlen(q, k, v, lengths, lengths, causal=True)
    assert {name for name, _ in packed_calls} == {"HopperForwardLaunch", "HopperBackwardLaunch"}
    assert all(packed for _, packed in packed_calls)


@pytest.mark.parametrize("n_seqs", [300, 1500])  # past one thread a sequence start, and past one load of them
def test_varlen_many_short_sequences(n_seqs, packed_kernels):
    # The flattened schedule's search over sequence starts (core.packed.tile_sequence), in one load and in several.
    generator = torch.Generator().manual_seed(n_seqs)
    lengths = torch.randint(0, 40, (n_seqs,), generator=generator).tolist()
    lengths[7] = 300
    poison()
    q = torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lengths), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lengths), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    check_attention_varlen(q, k, v, lengths, lengths, causal=True)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192])
def test_varlen_views_of_a_packed_projection(head_dim, packed_kernels):
    # q, k, v as views of one (total, 3, H, D) projection (strides H·D·3 between tokens), read in place.
    lengths = [200, 3, 517, 64, 0, 130]
    poison()
    qkv = torch.randn(sum(lengths), 3, 6, head_dim, device="cuda", dtype=torch.float16)
    q, k, v = (qkv[:, i].detach().requires_grad_() for i in range(3))
    q_view, k_view, v_view = (qkv[:, i] for i in range(3))
    out = flashlite.flash_attention_varlen(q_view, k_view, v_view, cu_seqlens(lengths, "cuda"),
                                           cu_seqlens(lengths, "cuda"), 517, 517, causal=True)
    expected, _ = check_attention_varlen(q, k, v, lengths, lengths, causal=True)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("variant", [dict(causal=True), dict(causal=False), dict(softcap=20.0, causal=True),
                                     dict(window_size=(300, 40))])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_varlen_sequences_are_isolated_from_their_neighbours_values(head_dim, variant, packed_kernels):
    # A tile cut by a sequence's end reads the next sequence's first rows (the Hopper kernels' TMA boxes): those
    # rows get a weight of exactly 0, and an infinity or NaN there must not reach this sequence (0 · inf is NaN):
    # the other sequences' outputs and gradients are bitwise those of a batch whose middle sequence is finite.
    # Sequences past 1024 keys: the warp-specialized forward (two warpgroups clearing one V slot) under causal too,
    # and D = 192/256's one-slot ring non-causal.
    lengths = [1100, 77, 1230]
    cu = cu_seqlens(lengths, "cuda")
    middle = slice(lengths[0], lengths[0] + lengths[1])
    others = torch.ones(sum(lengths), dtype=torch.bool, device="cuda")
    others[middle] = False
    q, k, v = (torch.randn(sum(lengths), 4, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    results = []
    for spoilt in (False, True):
        leaves = [t.clone() for t in (q, k, v)]
        grad_out = do.clone()
        if spoilt:
            for t, value in zip((*leaves, grad_out), (float("nan"), float("inf"), float("-inf"), float("nan"))):
                t[middle] = value
        leaves = [t.requires_grad_() for t in leaves]
        out = flashlite.flash_attention_varlen(*leaves, cu, cu, max(lengths), max(lengths), **variant)
        results.append((out, *torch.autograd.grad(out, leaves, grad_out)))
    for clean, spoilt in zip(*results):
        assert torch.isfinite(clean).all()
        assert torch.equal(spoilt[others], clean[others])
