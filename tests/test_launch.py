"""flashlite.core.runtime.launch: compiled kernels reused by launch signature, without Triton's per-call binding.

The reuse is only right if two argument lists with the same signature are ones
Triton compiles to the same kernel. The first test checks that against Triton's
own specialization (its native function, the one its JIT calls); the others run
``launch``'s bookkeeping on a stand-in kernel (the interpreter compiles nothing,
so the real reuse runs on the GPU only: every ``pytest -m gpu`` test goes
through it; kernels wrapped in ``triton.heuristics`` take Triton's path).
"""

import dataclasses
import enum
import itertools
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl

try:
    from triton.backends import BaseBackend
except ImportError:  # older layout
    from triton.backends.compiler import BaseBackend
from triton.tools.tensor_descriptor import TensorDescriptor

from flashlite.core import runtime as _runtime
from flashlite.core import triton_compat
from flashlite.core.online_softmax import LOG2E


def _tritons_specialization(arg):
    """What Triton's JIT keys a compiled kernel on for one argument (specialize and align on, as by default)."""
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def test_signature_is_finer_than_tritons_specialization():
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 16,
            2**32, 2**63 - 16, 2**63, 2**63 + 16, 2**64 - 16]
    base = torch.randn(64)
    tensors = [base, base[1:], base[4:], base[16:], base.to(torch.bfloat16), base.to(torch.bfloat16)[8:],
               base.to(torch.bfloat16)[1:], base.to(torch.float16), torch.arange(8), torch.nn.Parameter(base)]
    matrix = torch.randn(8, 64)
    descriptors = [TensorDescriptor(t, [8, 64], [64, 1], box) for t in (matrix, matrix.to(torch.bfloat16))
                   for box in ([2, 64], [4, 64], [4, 32])]
    # tl.constexpr values are compiled in: a scale passed as one (0.5 * LOG2E) must never reuse another's kernel
    constants = [tl.constexpr(0.5) * LOG2E, tl.constexpr(0.25) * LOG2E, tl.constexpr(16), tl.constexpr(17),
                 tl.constexpr(True), tl.constexpr(1), tl.constexpr(None)]
    tuples = [(16, 17), (17, 16), (1, base), (1, base[1:]), (0.5, None)]
    pool = ints + tensors + descriptors + constants + tuples + [None, True, False, 0.5, -3.0, 0.25]
    keyed = [(_runtime._specialization(a), _tritons_specialization(a)) for a in pool]
    same_key = 0
    for (key_a, spec_a), (key_b, spec_b) in itertools.combinations(keyed, 2):
        if key_a == key_b:
            same_key += 1
            assert spec_a == spec_b, (key_a, spec_a, spec_b)
    assert same_key > 10  # the pool does have arguments that share a signature


def test_unmodeled_arguments_are_not_cached(monkeypatch):
    """Arguments the signature has no rule for (int and float subclasses) launch through Triton every time."""
    _stand_in_device(monkeypatch)
    kernel = _Kernel()
    scale = type("Scale", (float,), {})
    for n in (enum.IntEnum("Size", {"SMALL": 32}).SMALL, scale(0.5)):
        with pytest.raises(_runtime._Unmodeled):
            _runtime._specialization(n)
        for _ in range(2):
            _runtime.launch(kernel, (4,), (torch.randn(64), n, 0.5), BLOCK=16)
    assert [entry[0] for entry in kernel.log] == ["jit"] * 4
    assert not _runtime._COMPILED


class _Compiled:
    """Stands in for a loaded CompiledKernel: records launches made on it directly or through its hooks' path."""

    function, packed_metadata = object(), object()

    def __init__(self, log):
        self.log = log

    def run(self, grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter, exit_, *args):
        assert (stream, function, packed_metadata) == ("stream", self.function, self.packed_metadata)
        assert launch_metadata is enter is exit_ is None  # no hook registered: none called
        self.log.append(("direct", (grid_x, grid_y, grid_z), args))

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("hooked", grid, args))


class _Kernel:
    """Stands in for a JITFunction ``k(x_ptr, n, scale, BLOCK: constexpr, FLAG: constexpr = True)``."""

    device_caches = {}

    def __init__(self):
        self.log = []
        self.params = [SimpleNamespace(name=n, default=d) for n, d in
                       (("x_ptr", None), ("n", None), ("scale", None), ("BLOCK", None), ("FLAG", True))]

    def __getitem__(self, grid):
        def run(*args, **options):
            self.log.append(("jit", grid, args, options))
            return _Compiled(self.log)
        return run


def _stand_in_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton_compat, "current_stream", lambda device: "stream")
    monkeypatch.setattr(_runtime, "_COMPILED", {})


def test_launch_compiles_once_per_signature(monkeypatch):
    _stand_in_device(monkeypatch)
    kernel = _Kernel()
    x = torch.randn(64)
    x_aligned_view = x[16:]
    _runtime.launch(kernel, (4,), (x, 32, 0.5), BLOCK=16, num_warps=4)
    _runtime.launch(kernel, (5, 2), (x_aligned_view, 48, 0.25), BLOCK=16, num_warps=4)  # same signature
    _runtime.launch(kernel, (4,), (x, 33, 0.5), BLOCK=16, num_warps=4)  # 33: not divisible by 16
    _runtime.launch(kernel, (4,), (x, 32, 0.5), BLOCK=32, num_warps=4)  # another constexpr
    _runtime.launch(kernel, (4,), (x, 32, 0.5), BLOCK=16, num_warps=8)  # another launch option
    _runtime.launch(kernel, (4,), (x[1:], 32, 0.5), BLOCK=16, num_warps=4)  # a misaligned pointer
    _runtime.launch(kernel, (4,), (x, 1, 0.5), BLOCK=16, num_warps=4)  # 1: a constant to Triton
    _runtime.launch(kernel, (4,), (x, 64, 0.5), BLOCK=16, FLAG=False, num_warps=4)
    _runtime.launch(kernel, (3,), (x, 80, 0.5), BLOCK=16, FLAG=False, num_warps=4)
    kinds = [entry[0] for entry in kernel.log]
    assert kinds == ["jit", "direct", "jit", "jit", "jit", "jit", "jit", "jit", "direct"]
    # Direct launches: a 3-D grid, the runtime arguments, then every later parameter by name or default.
    _, grid, args = kernel.log[1]
    assert grid == (5, 2, 1) and args[0] is x_aligned_view and args[1:] == (48, 0.25, 16, True)
    _, grid, args = kernel.log[8]
    assert grid == (3, 1, 1) and args[0] is x and args[1:] == (80, 0.5, 16, False)
    assert kernel.log[0] == ("jit", (4,), (x, 32, 0.5), {"BLOCK": 16, "num_warps": 4})


def test_launch_hooks_still_called(monkeypatch):
    """With a launch hook registered (a profiler), reused kernels launch the way Triton does, hooks and all."""
    _stand_in_device(monkeypatch)
    kernel = _Kernel()
    x = torch.randn(64)
    hook = lambda metadata: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(2):
            _runtime.launch(kernel, (4,), (x, 32, 0.5), BLOCK=16)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    _runtime.launch(kernel, (4,), (x, 32, 0.5), BLOCK=16)
    assert [entry[0] for entry in kernel.log] == ["jit", "hooked", "direct"]
    assert kernel.log[1][1:] == ((4, 1, 1), (x, 32, 0.5, 16, True))


def test_interpreter_functions_take_tritons_path():
    calls = []

    class _Interpreted:  # no device_caches: what TRITON_INTERPRET=1 makes of a kernel
        def __getitem__(self, grid):
            return lambda *args, **options: calls.append((grid, args, options)) or "ran"

    interpreted = _Interpreted()
    assert _runtime.launch(interpreted, (2,), (1, 2), BLOCK=4) == "ran"
    assert _runtime.launch(interpreted, (2,), (1, 2), BLOCK=4) == "ran"
    assert calls == [((2,), (1, 2), {"BLOCK": 4})] * 2


def test_occupancy_counts_allocated_registers_and_the_programs_limit():
    # Registers go to a thread 8 at a time, and a multiprocessor holds at most 32 programs (16 on sm_86/87, 24 on
    # sm_89), whatever their size: a cooperative launch sized past what is resident would fail.
    from flashlite.core.runtime import DeviceInfo, occupancy

    class Compiled:
        def __init__(self, n_regs, shared=0):
            self.n_regs, self.metadata = n_regs, type("Metadata", (), {"shared": shared})()

    hopper = DeviceInfo(num_sms=132, regs_per_sm=65536, smem_per_sm=232448, max_warps_per_sm=64, capability=(9, 0))
    assert occupancy(Compiled(41), 4, hopper) == 10  # 48 registers allocated: 65536 // (48 * 128); 41 would give 12
    assert occupancy(Compiled(24), 1, hopper) == 32  # 64 warps would fit; 32 programs at most
    ampere = dataclasses.replace(hopper, capability=(8, 6))
    assert occupancy(Compiled(24), 1, ampere) == 16
    assert occupancy(Compiled(24, shared=100_000), 1, hopper) == 2
