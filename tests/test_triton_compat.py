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
