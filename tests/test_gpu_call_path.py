"""The planned call path on the GPU (``pytest -m gpu``): CUDA-graph capture and torch.compile of training steps.

A route is planned at a signature's first call and replayed afterwards (``flashlite.attention.route``): these
tests replay calls where nothing may touch the host between launches (a ``torch.cuda.graph`` capture of
forward and backward, ``torch.compile(mode="reduce-overhead")``) and compare every replay with an eager call
on the same fresh inputs, and with float64 under FlashAttention's rule.
"""

import pytest
import torch

import flashlite

from .utils import assert_attention_close, attention_grads_ref, attention_ref

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("head_dim, causal", [(64, True), (128, False), (96, True)])
def test_cuda_graph_capture_of_forward_and_backward(head_dim, causal):
    b, h, h_kv, length = 2, 8, 2, 300
    shapes = [(b, h, length, head_dim), (b, h_kv, length, head_dim), (b, h_kv, length, head_dim)]
    static = [torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes]
    static_do = torch.randn(b, h, length, head_dim, device="cuda", dtype=torch.bfloat16)

    def step():
        o = flashlite.flash_attention(*static, causal=causal)
        return (o, *torch.autograd.grad(o, static, static_do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream: compiles and plans before capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for _ in range(2):  # fresh inputs copied in, the graph replayed, checked against eager and float64
        fresh = [torch.randn_like(t) for t in static]
        fresh_do = torch.randn_like(static_do)
        with torch.no_grad():
            for t, f in zip(static, fresh):
                t.copy_(f)
            static_do.copy_(fresh_do)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for got, want in zip(outputs, eager):
            torch.testing.assert_close(got, want, atol=0, rtol=0)  # the same kernels on the same data
        ref = attention_ref(*fresh, causal=causal)
        torch_out = attention_ref(*fresh, causal=causal, dtype=torch.bfloat16)
        assert_attention_close(outputs[0], ref, torch_out, torch.bfloat16)
        ref_grads = attention_grads_ref(*fresh, fresh_do, causal=causal)
        torch_grads = attention_grads_ref(*fresh, fresh_do, dtype=torch.bfloat16, causal=causal)
        for got, ref64, ref16 in zip(outputs[1:], ref_grads, torch_grads):
            assert_attention_close(got, ref64, ref16, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [64, 96])
def test_routes_keep_no_tensor_alive(head_dim):
    # A route outlives its call: holding the tensors it was planned on would keep their memory (and, in a
    # CUDA-graph pool, memory the graph does not account for) alive.
    import gc
    import weakref

    tensors = [torch.randn(1, 4, 256, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3)]
    o = flashlite.flash_attention(*tensors, causal=True)
    grads = torch.autograd.grad(o, tensors, torch.randn_like(o))
    refs = [weakref.ref(t) for t in (*tensors, o, *grads)]
    del tensors, o, grads
    gc.collect()
    assert all(ref() is None for ref in refs)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_training_step_of_the_layer(mode):
    torch.manual_seed(0)
    layer = flashlite.nn.MultiheadAttention(256, 4, num_kv_heads=2, causal=True, device="cuda",
                                            dtype=torch.bfloat16)
    x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16)
    target = torch.randn_like(x)

    def loss_of(x, target):
        return (layer(x).float() - target.float()).pow(2).mean()

    # The step's forward compiled whole; AOTAutograd compiles its backward, which autograd.grad runs (Dynamo does
    # not trace autograd.grad itself).
    compiled = torch.compile(loss_of, fullgraph=True, mode=mode)
    params = list(layer.parameters())
    for _ in range(3):  # reduce-overhead records its CUDA graph after warm-up runs, then replays it
        x, target = torch.randn_like(x), torch.randn_like(target)
        loss = compiled(x, target)
        grads = torch.autograd.grad(loss, params)
        loss_eager = loss_of(x, target)
        grads_eager = torch.autograd.grad(loss_eager, params)
        torch.testing.assert_close(loss, loss_eager, atol=2e-2, rtol=2e-2)
        for g, g_eager in zip(grads, grads_eager):
            torch.testing.assert_close(g.float(), g_eager.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("head_dim", [64, 192])
def test_hopper_launches_keep_their_encoded_descriptors(head_dim, monkeypatch):
    # On Triton 3.6 a Hopper kernel's second call hands the C launcher descriptors encoded once per tensor address
    # (core.runtime.TmaLaunch): calls on tensors at new addresses, then on ones seen before (their encodings reused),
    # and many more addresses than a descriptor parameter keeps (ENCODED_KEPT: older ones dropped), each give the
    # output and gradients of an eager reference under FlashAttention's rule; poisoned gradients, fresh data.
    from flashlite.attention import api, backward_hopper, forward_hopper
    from flashlite.core import runtime, triton_compat

    from .test_gpu_decode import require_hopper

    require_hopper()
    if not triton_compat.launcher_expands_descriptors_as_3_6():
        pytest.skip("this Triton's launcher is not 3.6's: TmaLaunch binds descriptors at every call")
    launches = []
    real_init = runtime.TmaLaunch.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        launches.append(self)

    monkeypatch.setattr(runtime.TmaLaunch, "__init__", spy)
    api.clear_routes()
    b, h, length = 1, 4, 384
    sets = [[torch.randn(b, h, length, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
             for _ in range(4)] for _ in range(3)]
    try:
        order = [0, 1, 2, 0, 1, 0, 2]  # new, new, new, seen, seen, seen, seen
        for turn, which in enumerate(order):
            q, k, v, do = sets[which]
            with torch.no_grad():
                for t in (q, k, v, do):
                    t.copy_(torch.randn_like(t))  # fresh data at the same address
            o = flashlite.flash_attention(q, k, v, causal=True)
            grads = torch.autograd.grad(o, (q, k, v), do)
            ref = attention_ref(q, k, v, causal=True)
            torch_out = attention_ref(q, k, v, causal=True, dtype=torch.bfloat16)
            assert_attention_close(o, ref, torch_out, torch.bfloat16)
            for got, ref64, ref16 in zip(grads, attention_grads_ref(q, k, v, do, causal=True),
                                         attention_grads_ref(q, k, v, do, dtype=torch.bfloat16, causal=True)):
                assert_attention_close(got, ref64, ref16, torch.bfloat16)
        kinds = {launch.kernel for launch in launches}
        assert kinds & {forward_hopper._attention_fwd_wgmma_kernel, forward_hopper._attention_fwd_ws_kernel}
        assert kinds & {backward_hopper._attention_bwd_wgmma_kernel, backward_hopper._attention_bwd_one_pass_kernel}
        direct = [launch._direct is not None for launch in launches]
        assert all(direct), f"a Hopper launch did not take the encoded-descriptor path: {direct}"
        monkeypatch.setattr(triton_compat, "ENCODED_KEPT", 2)  # past it the older half goes: encoded afresh
        for which in (0, 1, 2, 0):
            q, k, v, do = sets[which]
            o = flashlite.flash_attention(q, k, v, causal=True)
            assert_attention_close(o, attention_ref(q, k, v, causal=True),
                                   attention_ref(q, k, v, causal=True, dtype=torch.bfloat16), torch.bfloat16)
    finally:
        api.clear_routes()
