"""torch.compile(fullgraph=True) over flashlite's public ops (each one torch.library custom op, torch.ops.flashlite.*).

On CPU the ops' implementations run the Triton kernels through the interpreter
(conftest), or flashlite's PyTorch path under TRITON_INTERPRET=0. Compiled
results are compared with the same calls made eagerly: both run the same
kernels, so they agree to rounding. Most tests use the ``aot_eager`` backend
(Dynamo + AOTAutograd, the parts that see the custom ops, in well under a
second); one runs inductor, whose first C++ build takes ~15 s on a cold cache.
"""

from __future__ import annotations

import pytest
import torch

import flashlite
from flashlite.core.runtime import runs_kernels
from flashlite.nn import MultiheadAttention

from .utils import randn

pytestmark = pytest.mark.skipif(not hasattr(torch.library, "custom_op"), reason="custom ops need torch >= 2.4")


def grads_of(fn, inputs: list[torch.Tensor], seed_grad: torch.Tensor | None = None):
    """``fn(*inputs)`` and the gradients of ``sum(out * seed_grad)`` with respect to ``inputs``."""
    out = fn(*inputs)
    seed_grad = torch.ones_like(out) if seed_grad is None else seed_grad
    return out, torch.autograd.grad(out, inputs, seed_grad)


def check_compiled(fn, inputs: list[torch.Tensor], backend: str = "aot_eager", atol: float = 1e-5,
                   rtol: float = 1e-4) -> None:
    """``fn`` compiled with fullgraph=True gives the eager output and gradients; Dynamo reports no graph break."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    seed_grad = torch.randn_like(fn(*inputs))
    out, grads = grads_of(torch.compile(fn, fullgraph=True, backend=backend), inputs, seed_grad)
    ref, ref_grads = grads_of(fn, inputs, seed_grad)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        torch.testing.assert_close(g, r, atol=atol, rtol=rtol, msg=lambda m: f"gradient of input {i}: {m}")


def softmaxes(x, scores, bias):
    """Every softmax op in one graph: softmax over a strided dim, log-sum-exp, causal masked softmax with a
    boolean and a differentiable float mask."""
    keep = torch.arange(scores.shape[-1], device=x.device) % 5 != 3  # (Lk,): drops every fifth key
    y = flashlite.softmax(x.transpose(0, 1), dim=0)  # a non-contiguous view, softmax dim not last
    p = flashlite.masked_softmax(scores, keep, scale=0.5, causal=True)
    q = flashlite.masked_softmax(scores, bias, scale=0.3)
    return y.sum(1) + flashlite.logsumexp(x, dim=0) + (p * q).sum((0, 1, 2))  # (Lk,)


def softmax_inputs() -> list[torch.Tensor]:
    return [
        randn(37, 19, requires_grad=True),  # odd sizes: ragged tiles
        randn(2, 3, 7, 19, requires_grad=True),  # (B, H, Lq, Lk), Lq < Lk: causal offset 12
        randn(1, 3, 1, 19, requires_grad=True),  # a per-head additive bias over keys, broadcast over B and Lq
    ]


def test_softmaxes_compile():
    check_compiled(softmaxes, softmax_inputs())


def layer_and_inputs(causal: bool) -> tuple[MultiheadAttention, torch.Tensor, torch.Tensor]:
    layer = MultiheadAttention(64, 4, num_kv_heads=2, causal=causal)  # GQA, head dim 16
    x = randn(2, 9, 64, requires_grad=True)
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[1, :3] = False  # left padding in the second sequence
    return layer, x, padding


def test_attention_layer_compile():
    """Forward and backward of a small model on flashlite.nn.MultiheadAttention: input and weight gradients."""
    layer, x, padding = layer_and_inputs(causal=True)
    params = list(layer.parameters())

    def model(x, *params):
        return torch.tanh(layer(x, key_padding_mask=padding))

    check_compiled(model, [x, *params])


def test_flash_attention_mask_and_lse_compile():
    """flash_attention directly: Lq != Lk, a float mask that takes a gradient, the gradient through lse."""
    q = randn(1, 2, 5, 32, requires_grad=True)
    k, v = randn(1, 2, 11, 32, requires_grad=True), randn(1, 2, 11, 32, requires_grad=True)
    bias = randn(1, 1, 5, 11, requires_grad=True)  # broadcast over heads: its gradient sums them

    def attend(q, k, v, bias):
        o, lse = flashlite.flash_attention(q, k, v, causal=True, attn_mask=bias, return_lse=True)
        return o.sum(-1) + lse

    check_compiled(attend, [q, k, v, bias])


def test_inductor():
    """The inductor backend: its C++ wrapper calls the custom ops (which run the interpreted kernels)."""
    layer, x, padding = layer_and_inputs(causal=False)

    def model(x, *params):
        return flashlite.softmax(layer(x, key_padding_mask=padding), dim=-1)

    check_compiled(model, [x, *layer.parameters()], backend="inductor")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cuda(backend):
    """On the GPU: a bf16 layer (causal GQA, key padding) and fp32 softmaxes, forward and backward."""
    layer = MultiheadAttention(128, 4, num_kv_heads=2, causal=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    padding = torch.ones(2, 300, dtype=torch.bool, device="cuda")
    padding[1, :70] = False

    def model(x, *params):
        return layer(x, key_padding_mask=padding)

    # Compiled and eager differ only by how inductor rounds the projections' bf16 results.
    check_compiled(model, [x, *layer.parameters()], backend=backend, atol=5e-2, rtol=5e-2)
    inputs = [t.cuda().detach().requires_grad_() for t in softmax_inputs()]
    check_compiled(lambda x, s, b: softmaxes(x, s, b.to(x.dtype)), inputs, backend=backend)


def test_pytorch_path(monkeypatch):
    """Without the interpreter the ops run flashlite's PyTorch path (and its explicit backward, which needs no autograd
    inside the op)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read per call
    check_compiled(softmaxes, softmax_inputs())
    layer, x, padding = layer_and_inputs(causal=True)
    check_compiled(lambda x, *p: layer(x, key_padding_mask=padding), [x, *layer.parameters()])
    test_flash_attention_mask_and_lse_compile()  # the gradients of a float mask and of lse


def test_eager_calls_stay_off_the_ops():
    """Eager calls run the ops' implementations under autograd Functions that apply the ops' own autograd rules
    (the dispatcher's host cost is what they save); the custom ops are what compiled graphs call."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = randn(4, 8).to(device).requires_grad_()
    if not runs_kernels(x):
        pytest.skip("CPU tensors take the PyTorch path without TRITON_INTERPRET=1")
    assert type(flashlite.softmax(x).grad_fn).__name__ == "_SoftmaxBackward"
    q = randn(1, 1, 4, 16).to(device).requires_grad_()
    assert type(flashlite.flash_attention(q, q, q).grad_fn).__name__ == "_AttentionBackward"


def test_split_kv_compiles_without_grad():
    """The split-K/V path (no backward) is reachable from a compiled graph under no_grad."""
    q, k = randn(2, 4, 1, 16), randn(2, 2, 40, 16)
    lens = torch.tensor([40, 17])

    def decode(q, k):
        return flashlite.flash_attention(q, k, k, num_splits=3)

    with torch.no_grad():
        out = torch.compile(decode, fullgraph=True, backend="aot_eager")(q, k)
        torch.testing.assert_close(out, decode(q, k), atol=1e-5, rtol=1e-4)
        ref = flashlite.flash_attention(q, k, k, cache_seqlens=lens)
        got = torch.ops.flashlite.flash_attention(q, k, k, None, lens, None, None, False, 0.25, None, None, None, False,
                                                  False)[0]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


# opcheck: schema, fake (shapes, dtypes and strides against the real op), autograd registration and
# AOT dispatch with dynamic shapes (forward and backward), each op on small inputs.
OPCHECK_CASES = {
    "softmax": lambda: (torch.ops.flashlite.softmax, (randn(6, 5, 3, requires_grad=True), 1, "auto", torch.float32)),
    "softmax_fp16_out": lambda: (torch.ops.flashlite.softmax, (randn(5, 9).t(), 0, "online", torch.float16)),
    "logsumexp": lambda: (torch.ops.flashlite.logsumexp, (randn(3, 10, requires_grad=True), 1)),
    "masked_softmax": lambda: (
        torch.ops.flashlite.masked_softmax,
        (randn(2, 5, 7, requires_grad=True), randn(5, 1, requires_grad=True), 0.7, True, 2, "auto"),
    ),
    "flash_attention": lambda: (
        torch.ops.flashlite.flash_attention,
        (randn(1, 2, 5, 16, requires_grad=True), randn(1, 1, 7, 16, requires_grad=True),
         randn(1, 1, 7, 16, requires_grad=True), torch.rand(1, 1, 5, 7) > 0.3, None, None, None, True, 0.25, None,
         None, None, False, True),
    ),
    # An additive mask that wants its gradient: the op also returns each row's (m, log d).
    "flash_attention_additive": lambda: (
        torch.ops.flashlite.flash_attention,
        (randn(1, 2, 5, 16, requires_grad=True), randn(1, 1, 7, 16, requires_grad=True),
         randn(1, 1, 7, 16, requires_grad=True), randn(1, 2, 5, 7, requires_grad=True), None, None, None, False,
         0.25, None, None, None, False, True),
    ),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck(case):
    op, args = OPCHECK_CASES[case]()
    torch.library.opcheck(op, args)
