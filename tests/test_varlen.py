"""``flashlite.flash_attention_varlen``: packed batches of sequences of different lengths, against float64 per
sequence (FlashAttention's rule), on the kernels (the interpreter, 16 x 16 tiles) and the PyTorch path."""

import pytest
import torch

import flashlite
from flashlite.core.runtime import pytorch_path

from .utils import check_attention_varlen, cu_seqlens, randn, varlen_ref

# Lengths with zeros, ones, and lengths that are not multiples of the 16-row tiles; Lq != Lk per sequence.
LENGTHS_Q = [5, 0, 33, 1, 17, 2]
LENGTHS_K = [7, 3, 33, 0, 40, 1]


def packed(lengths_q, lengths_k, heads=4, kv_heads=2, head_dim=32, head_dim_v=None, dtype=torch.float32,
           requires_grad=True):
    q = randn(sum(lengths_q), heads, head_dim, dtype=dtype, requires_grad=requires_grad)
    k = randn(sum(lengths_k), kv_heads, head_dim, dtype=dtype, requires_grad=requires_grad)
    v = randn(sum(lengths_k), kv_heads, head_dim_v or head_dim, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_each_sequence_is_its_own_attention(small_attention_tiles, dtype, causal, kv_heads):
    q, k, v = packed(LENGTHS_Q, LENGTHS_K, kv_heads=kv_heads, dtype=dtype)
    check_attention_varlen(q, k, v, LENGTHS_Q, LENGTHS_K, causal=causal)


@pytest.mark.parametrize("variant", [
    dict(window_size=(6, 3)), dict(window_size=(5, 0), causal=True), dict(softcap=3.0), dict(alibi="heads"),
    dict(alibi="batch", causal=True), dict(sinks=True), dict(sinks=True, causal=True), dict(head_dim_v=16),
    dict(scale=-0.3, causal=True),
])
def test_variants_per_sequence(small_attention_tiles, variant):
    variant = dict(variant)
    q, k, v = packed(LENGTHS_Q, LENGTHS_K, head_dim_v=variant.pop("head_dim_v", None))
    if variant.pop("sinks", False):
        variant["sinks"] = randn(4, requires_grad=True)
    alibi = variant.pop("alibi", None)
    if alibi is not None:
        shape = (4,) if alibi == "heads" else (len(LENGTHS_Q), 4)
        variant["alibi_slopes"] = torch.rand(shape) * 0.5
    check_attention_varlen(q, k, v, LENGTHS_Q, LENGTHS_K, **variant)


@pytest.mark.parametrize("causal", [False, True])
def test_kernels_and_pytorch_path_agree(small_attention_tiles, causal):
    q, k, v = packed(LENGTHS_Q, LENGTHS_K)
    sinks = randn(4, requires_grad=True)
    args = (cu_seqlens(LENGTHS_Q), cu_seqlens(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K))
    do = torch.randn(q.shape[0], 4, 32)
    results = []
    for torch_path in (False, True):
        with pytorch_path() if torch_path else torch.enable_grad():
            o, lse = flashlite.flash_attention_varlen(q, k, v, *args, causal=causal, sinks=sinks, return_lse=True)
            grads = torch.autograd.grad((o, lse), (q, k, v, sinks), (do, torch.ones_like(lse)))
        results.append((o, lse, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_same_as_flash_attention_on_one_sequence(small_attention_tiles):
    # A batch of one sequence is flash_attention on (1, H, L, D): the same kernels, the same answer, bit for bit.
    q, k, v = packed([37], [45], requires_grad=False)
    out = flashlite.flash_attention_varlen(q, k, v, cu_seqlens([37]), cu_seqlens([45]), 37, 45, causal=True)
    dense = flashlite.flash_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), causal=True)
    assert torch.equal(out, dense[0].transpose(0, 1))


def test_views_of_a_packed_projection_are_read_in_place(small_attention_tiles):
    # q, k, v as column slices of one (total, 3·H·D) projection: head dim contiguous, rows 3·H·D apart.
    lengths = [9, 20, 4]
    total, heads, head_dim = sum(lengths), 2, 16
    qkv = randn(total, 3 * heads * head_dim)
    q, k, v = (qkv[:, i * heads * head_dim:(i + 1) * heads * head_dim].view(total, heads, head_dim) for i in range(3))
    cu = cu_seqlens(lengths)
    out = flashlite.flash_attention_varlen(q, k, v, cu, cu, 20, 20, causal=True)
    copied = flashlite.flash_attention_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, 20, 20,
                                              causal=True)
    assert torch.equal(out, copied)
    ref = varlen_ref(q, k, v, lengths, lengths, causal=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_pytorch_stand_in_of_the_backward(small_attention_tiles, monkeypatch):
    # The backward's PyTorch stand-in (CUDA with TRITON_BACKWARD_ON_GPU off) takes each sequence apart too.
    from flashlite.attention import backward

    monkeypatch.setattr(backward, "triton_backward_enabled", lambda q, packed=False: False)
    q, k, v = packed(LENGTHS_Q, LENGTHS_K)
    check_attention_varlen(q, k, v, LENGTHS_Q, LENGTHS_K, causal=True, sinks=randn(4, requires_grad=True))


def test_backward_is_deterministic(small_attention_tiles):
    q, k, v = packed(LENGTHS_Q, LENGTHS_K, dtype=torch.bfloat16)
    args = (cu_seqlens(LENGTHS_Q), cu_seqlens(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K))
    do = torch.randn(q.shape[0], 4, 32, dtype=torch.bfloat16)
    runs = [torch.autograd.grad(flashlite.flash_attention_varlen(q, k, v, *args, causal=True), (q, k, v), do)
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_output_reaches_the_inputs_through_views_only(small_attention_tiles):
    # Between the packed (total, H, D) tensors and the kernels' (1, H, total, D) views only views may stand: a
    # select (o[0]) would give the backward a zero-filled copy of the whole output (10% of an H200's packed step).
    q, k, v = packed(LENGTHS_Q, LENGTHS_K)
    args = (cu_seqlens(LENGTHS_Q), cu_seqlens(LENGTHS_K), max(LENGTHS_Q), max(LENGTHS_K))
    o, lse = flashlite.flash_attention_varlen(q, k, v, *args, causal=True, return_lse=True)
    seen, todo = set(), [o.grad_fn, lse.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo += [next_node for next_node, _ in node.next_functions]
    names = {type(node).__name__ for node in seen}
    assert not {name for name in names if "Select" in name or "Copy" in name}, names
    assert any("Attention" in name for name in names)


def test_no_keys_or_no_queries_at_all():
    q, k, v = packed([0, 0], [3, 4])
    out, lse = flashlite.flash_attention_varlen(q, k, v, cu_seqlens([0, 0]), cu_seqlens([3, 4]), 0, 4,
                                                return_lse=True)
    assert out.shape == (0, 4, 32) and lse.shape == (4, 0)
    q, k, v = packed([3, 2], [0, 0])
    out, lse = flashlite.flash_attention_varlen(q, k, v, cu_seqlens([3, 2]), cu_seqlens([0, 0]), 3, 0,
                                                return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())


def test_max_seqlen_larger_than_needed(small_attention_tiles):
    q, k, v = packed([10, 3], [12, 30], requires_grad=False)
    args = (cu_seqlens([10, 3]), cu_seqlens([12, 30]))
    torch.testing.assert_close(flashlite.flash_attention_varlen(q, k, v, *args, 64, 100),
                               flashlite.flash_attention_varlen(q, k, v, *args, 10, 30), atol=0, rtol=0)


@pytest.mark.parametrize("change, match", [
    (dict(q=lambda q: q.unsqueeze(0)), "q must be 3-D"),
    (dict(cu_seqlens_q=lambda c: c.long()), "cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=lambda c: c.view(1, -1)), "cu_seqlens_k must be 1-D"),
    (dict(cu_seqlens_k=lambda c: c[:-1]), "different batch sizes"),
    (dict(cu_seqlens_q=lambda c: c + 1), "cu_seqlens_q must rise from 0"),
    (dict(cu_seqlens_k=lambda c: torch.tensor([0, 20, 19], dtype=torch.int32)), "cu_seqlens_k must rise"),
    (dict(max_seqlen_q=lambda m: 4), r"max_seqlen_q \(4\) is shorter"),
    (dict(cu_seqlens_q=lambda c: c.repeat_interleave(2).view(-1, 2)[:, 0]), "cu_seqlens_q must be contiguous"),
    (dict(max_seqlen_k=lambda m: 7.0), "max_seqlen_k must be a non-negative int"),
    (dict(max_seqlen_q=lambda m: True), "max_seqlen_q must be a non-negative int"),
    (dict(k=lambda k: k[:, :, :16]), "head dims differ"),
    (dict(v=lambda v: v.to(torch.float64)), "v must be float32, float16 or bfloat16"),
    (dict(v=lambda v: v.to(torch.bfloat16)), "v has dtype torch.bfloat16 but q has"),
])
def test_bad_input_names_the_argument(change, match):
    q, k, v = packed([5, 8], [7, 12], requires_grad=False)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens([5, 8]), cu_seqlens_k=cu_seqlens([7, 12]),
                max_seqlen_q=8, max_seqlen_k=12)
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises((ValueError, TypeError), match=match):
        flashlite.flash_attention_varlen(**args)


def test_alibi_per_sequence_shape_is_checked():
    q, k, v = packed([5, 8], [7, 12], requires_grad=False)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flashlite.flash_attention_varlen(q, k, v, cu_seqlens([5, 8]), cu_seqlens([7, 12]), 8, 12,
                                         alibi_slopes=torch.rand(3, 4))


def test_compiles_as_one_graph(small_attention_tiles):
    q, k, v = packed([6, 11], [6, 11])
    cu = cu_seqlens([6, 11])

    def fn(q, k, v):
        return flashlite.flash_attention_varlen(q, k, v, cu, cu, 11, 11, causal=True)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    do = torch.randn(17, 4, 32)
    eager = (fn(q, k, v), *torch.autograd.grad(fn(q, k, v), (q, k, v), do))
    compiled_fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    compiled = (compiled_fn(q, k, v), *torch.autograd.grad(compiled_fn(q, k, v), (q, k, v), do))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_flattened_schedule_over_many_sequences(small_attention_tiles, monkeypatch, causal):
    # Every kernel numbers a packed batch's tiles by one flattened schedule (core.packed.tile_sequence), whose
    # search reads SEQ_BLOCK sequence starts a load: with 128 a load, 150 sequences take two loads. Lengths that
    # are multiples of the 16-row tiles (where a sequence's first number gains its "+ b"), empty ones, ones, and
    # ragged ones; the longest sequence is not the first.
    from flashlite.attention import api, tuning

    monkeypatch.setattr(tuning, "PACKED_SEQ_BLOCK", 128)
    api.clear_routes()
    generator = torch.Generator().manual_seed(7)
    lengths_q = torch.randint(0, 5, (150,), generator=generator).tolist()
    lengths_q[::7] = [16 * (i % 3) for i in range(len(lengths_q[::7]))]
    lengths_q[100] = 37
    lengths_k = [n + int(m) for n, m in zip(lengths_q, torch.randint(0, 3, (150,), generator=generator))]
    q, k, v = packed(lengths_q, lengths_k, heads=2, kv_heads=1, head_dim=16)
    check_attention_varlen(q, k, v, lengths_q, lengths_k, causal=causal)
    api.clear_routes()
