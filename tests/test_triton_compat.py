"""flashlite.core.triton_compat: each reach into Triton's private API, run on the CPU against the Triton at hand.

A Triton upgrade that moves one of them fails here, on CI, rather than on the GPU.
"""

import pytest
import torch
import triton
import triton.language as tl

from flashlite.core import triton_compat
from flashlite.core.runtime import interpreter_enabled
from flashlite.core.tiles import tensor_descriptor


@triton.jit
def _copy_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets))


def test_is_compiled_kernel_tells_the_interpreter_apart():
    # The tests run the kernels through the interpreter (conftest): its jit functions keep no device caches.
    assert triton_compat.is_compiled_kernel(_copy_kernel) == (not interpreter_enabled())
    assert not triton_compat.is_compiled_kernel(lambda: None)


def test_rebind_descriptor_keeps_everything_but_the_base():
    a, b = torch.randn(2, 3, 64, 32), torch.randn(2, 3, 64, 32)
    template = tensor_descriptor(a, 16, 32)
    rebound = triton_compat.rebind_descriptor(template, b)
    assert type(rebound) is type(template) and rebound.base is b and template.base is a
    for field in ("shape", "strides", "block_shape"):
        assert getattr(rebound, field) == getattr(template, field)
    assert triton_compat.mangle_type(rebound) == triton_compat.mangle_type(template)


def test_descriptor_template_drops_only_the_base():
    a, b = torch.randn(2, 3, 64, 32), torch.randn(2, 3, 64, 32)
    desc = tensor_descriptor(a, 16, 32)
    template = triton_compat.descriptor_template(desc)
    assert template.base is None and desc.base is a
    rebound = triton_compat.rebind_descriptor(template, b)
    assert rebound.base is b and triton_compat.mangle_type(rebound) == triton_compat.mangle_type(desc)


def test_new_descriptor_fills_fields_directly():
    t = torch.randn(4, 16)
    desc = triton_compat.new_descriptor(type(tensor_descriptor(torch.randn(1, 1, 16, 16), 16, 16)), base=t,
                                        shape=[4, 16], strides=[16, 1], block_shape=[4, 16])
    assert desc.base is t and desc.block_shape == [4, 16]


def test_mangle_type_of_pointers_and_ints():
    assert triton_compat.mangle_type(torch.randn(4, dtype=torch.bfloat16)) == "*bf16"
    assert triton_compat.mangle_type(7) == "i32"


def test_launch_hooks_and_stream_are_readable():
    assert triton_compat.launch_hooks_set() in (True, False)
    assert callable(triton_compat.current_stream)


def test_gluon_source_builds_where_gluon_exists():
    pytest.importorskip("triton.experimental.gluon")
    from flashlite.attention.backward_hopper import _attention_bwd_dq_wgmma_kernel

    source = triton_compat.gluon_source(_attention_bwd_dq_wgmma_kernel, {}, {})
    assert source.fn is _attention_bwd_dq_wgmma_kernel


def test_run_compiled_calls_the_compiled_kernels_run(monkeypatch):
    calls = []

    class Compiled:
        function, packed_metadata = object(), object()

        def run(self, *args):
            calls.append(args)

    monkeypatch.setattr(triton_compat, "current_stream", lambda device: "stream")
    monkeypatch.setattr(triton_compat, "launch_hooks_set", lambda: False)
    compiled = Compiled()
    triton_compat.run_compiled(compiled, 0, (3, 1, 1), (1, 2))
    assert calls == [(3, 1, 1, "stream", compiled.function, compiled.packed_metadata, None, None, None, 1, 2)]
    assert triton_compat.is_reusable(compiled) and not triton_compat.is_reusable(object())
    assert triton_compat.load_compiled(compiled) is compiled


def test_gluon_tma_add_exists_where_gluon_does():
    # 3.9's tma.async_atomic_add, or the 3.6 builtin over the IR builder (its lowering is checked by the one-pass
    # backward's sm_90 build: tests/test_attention_backward_wgmma.py counts its cp.reduce.async.bulk.tensor).
    from flashlite.attention import gluon_tiles

    add = triton_compat.gluon_tma_add()
    assert (add is None) == (not gluon_tiles.wgmma_available())
    if add is not None:
        assert callable(add)


def _tma_kernel_stand_in(monkeypatch, metas, scratch: int = 0):
    """A stand-in ``CompiledKernel`` whose launcher is Triton's own ``wrap_handle_tensordesc`` over a recording C
    launcher, for a kernel of parameters (the descriptors of a's and c's first column parts, c's None, of their
    second parts, then x_ptr, n, BLOCK);
    ``make_tensordesc_arg`` replaced by a counting stand-in (the real one needs the CUDA driver)."""
    from triton.backends.nvidia import driver as nvidia

    recorded, encoded = [], []

    def make_arg(desc, meta):  # (Triton 3.6's parameters)
        encoded.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr(), tuple(desc.block_shape), meta), *desc.shape, *desc.strides]

    monkeypatch.setattr(nvidia, "make_tensordesc_arg", make_arg)
    signature = {"a0": "tensordesc<fp32[16, 32]>", "c0": "constexpr", "a1": "tensordesc<fp32[16, 16]>",
                 "c1": "tensordesc<fp32[8, 16]>", "x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    inner = nvidia.wrap_handle_tensordesc(lambda *args: recorded.append(args), signature, metas)

    class Run:
        launch = staticmethod(inner)
        global_scratch_size = profile_scratch_size = scratch
        launch_cooperative_grid, launch_pdl = False, False

    class Compiled:
        function, packed_metadata, run = "function", "metadata", Run()

    monkeypatch.setattr(triton_compat, "current_stream", lambda device: "stream")
    return Compiled(), recorded, encoded


def test_tma_launcher_hands_the_launcher_what_triton_does(monkeypatch):
    from triton.backends.nvidia import driver as nvidia

    as_in_3_6 = triton_compat.launcher_expands_descriptors_as_3_6()
    compiled, recorded, encoded = _tma_kernel_stand_in(monkeypatch, [{"swizzle": 1}, {"swizzle": 2}, {"swizzle": 3}])
    x = torch.randn(4)
    tensors = [(torch.randn(1, 2, 64, 48), torch.randn(1, 2, 40, 48)) for _ in range(2)]
    a, c = tensors[0]
    templates = tuple(None if d is None else triton_compat.descriptor_template(d) for d in (
        tensor_descriptor(a, 16, 32), None, tensor_descriptor(a, 16, 16), tensor_descriptor(c, 8, 16)))
    launch = triton_compat.tma_launcher(compiled, 0, (5, 1, 1), templates, (64,))
    if not as_in_3_6:
        assert launch is None  # a Triton whose launcher is built otherwise (3.9): the caller's own path
        pytest.skip("this Triton's launcher is not 3.6's: tma_launcher declines it (checked), nothing to compare")
    assert launch is not None
    base = (5, 1, 1, "stream", "function", False, False, None, None, "metadata", None, None, None)
    for a, c in tensors + tensors:  # each pair twice: encoded once per address
        launch((a, c), (x, 9))
        bound = [None if t is None else triton_compat.rebind_descriptor(t, u) for t, u in zip(templates, (a, c, a, c))]
        compiled.run.launch(*base, *bound, x, 9, 64)  # Triton's own path, on the same descriptors
        assert recorded[-2] == recorded[-1]
    # Ours: once a descriptor and address (the first launch of each pair, before Triton's path); Triton's: every time.
    assert encoded[:3] == [tensors[0][0].data_ptr(), tensors[0][0].data_ptr(), tensors[0][1].data_ptr()]
    assert len(encoded) == 2 * 3 + 4 * 3
    assert len(nvidia._BASE_ARGS_FORMAT) == len(base)


def test_tma_launcher_declines_what_it_cannot_serve(monkeypatch):
    t = torch.randn(1, 2, 64, 32)
    template = triton_compat.descriptor_template(tensor_descriptor(t, 16, 32))
    templates, metas = (template, None, template, template), [{"swizzle": 1}] * 3
    for metas, scratch, temps in ((metas, 128, templates),  # scratch memory
                                  (None, 0, templates),  # descriptors not lowered to TMA
                                  (metas, 0, (template, template, None, template))):  # not the kernel's slots
        compiled, _, _ = _tma_kernel_stand_in(monkeypatch, metas, scratch)
        assert triton_compat.tma_launcher(compiled, 0, (1, 1, 1), temps, ()) is None

    class Plain:
        function, packed_metadata = "function", "metadata"

        class run:  # noqa: N801 - a launcher without Triton 3.6's descriptor closure
            launch = staticmethod(lambda *args: None)

    assert triton_compat.tma_launcher(Plain(), 0, (1, 1, 1), templates, ()) is None
