"""Where kernels run, what the device offers, and how a kernel is launched; read lazily, cached, never at import.

flashlite runs its Triton kernels on CUDA tensors. CPU tensors run the same
kernels through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
``triton`` built them (that is how the tests run on machines without a GPU);
otherwise each public op falls back to a plain PyTorch computation for them.
``launch`` starts a kernel at less host cost than Triton's own path once a
signature has compiled; ``launch_persistent`` sizes a resident grid from the
compiled kernel.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import triton

from .triton_compat import (
    is_compiled_kernel, is_reusable, launch_hooks_set, load_compiled, rebind_descriptor, run_compiled, tma_launcher,
)


@triton.jit
def _interpreter_probe():
    # Built like every kernel of flashlite, when its module is imported: Triton decides then, from
    # TRITON_INTERPRET, whether a jit function runs compiled or through its CPU interpreter.
    pass


def interpreter_enabled() -> bool:
    """True when flashlite's kernels run through Triton's CPU interpreter: ``TRITON_INTERPRET=1`` was set when
    flashlite was imported (Triton reads it as each kernel is defined; setting it later changes nothing)."""
    return not is_compiled_kernel(_interpreter_probe)


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=1)
def _warn_interpreter_too_late() -> None:
    warnings.warn(
        "TRITON_INTERPRET=1 was set after flashlite was imported: its kernels were already built for the GPU, so "
        "CPU tensors take flashlite's PyTorch path. Set TRITON_INTERPRET=1 before importing flashlite (or triton) "
        "to run the Triton kernels on the CPU.", RuntimeWarning, stacklevel=3)


# True while torch.compile traces (torch >= 2.3): the public ops then hand their checked arguments to
# custom ops (torch.ops.flashlite.*). The bare torch function, so the eager check costs one call.
is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


_FORCE_PYTORCH_PATH = threading.local()


@contextlib.contextmanager
def pytorch_path():
    """Within this block CPU tensors take flashlite's PyTorch path even where the interpreter could run the
    kernels: the tests compare the two paths on the same inputs with it."""
    before = getattr(_FORCE_PYTORCH_PATH, "on", False)
    _FORCE_PYTORCH_PATH.on = True
    try:
        yield
    finally:
        _FORCE_PYTORCH_PATH.on = before


def runs_kernels(x: torch.Tensor) -> bool:
    """True if flashlite's Triton kernels handle tensor ``x``: CUDA, or CPU when the kernels were built for
    Triton's interpreter (``interpreter_enabled``); other CPU tensors take each op's PyTorch path."""
    if x.is_cuda:
        return True
    if x.device.type != "cpu" or getattr(_FORCE_PYTORCH_PATH, "on", False):
        return False
    if interpreter_enabled():
        return True
    if _interpreter_requested():
        _warn_interpreter_too_late()
    return False


@dataclass(frozen=True)
class DeviceInfo:
    """The few device properties the launchers size their grids from."""

    num_sms: int
    regs_per_sm: int  # 32-bit registers in one multiprocessor's register file
    smem_per_sm: int  # bytes of shared memory a multiprocessor can give its programs
    max_warps_per_sm: int
    capability: tuple[int, int] = (0, 0)  # compute capability, e.g. (9, 0) for Hopper; (0, 0) in the interpreter
    l2_bytes: int = 0  # L2 cache size; 0 where unknown (the interpreter)


# Stand-in for the interpreter: small, so that persistent loops take several turns in tests.
_INTERPRETER_DEVICE = DeviceInfo(num_sms=4, regs_per_sm=65536, smem_per_sm=232448, max_warps_per_sm=64)


@functools.lru_cache(maxsize=None)
def _cuda_device_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    smem = getattr(props, "shared_memory_per_multiprocessor", 232448)
    threads = getattr(props, "max_threads_per_multi_processor", 2048)
    l2_bytes = getattr(props, "L2_cache_size", 0)
    return DeviceInfo(props.multi_processor_count, regs, smem, threads // 32, (props.major, props.minor), l2_bytes)


def device_info(device: torch.device) -> DeviceInfo:
    """Properties of ``device`` (cached per device); fixed small values for the interpreter."""
    if device.type != "cuda":
        return _INTERPRETER_DEVICE
    return _cuda_device_info(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def cooperative_launch_supported() -> bool:
    """True if this Triton launches CUDA grids cooperatively (``launch_cooperative_grid``: all programs resident)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # no CUDA backend in this Triton
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


# ----------------------------------------------------------------------------- launches


# Programs per multiprocessor of each compiled persistent kernel, read off its registers and shared memory.
_PROGRAMS_PER_SM: dict = {}


loaded = load_compiled  # (bench scripts read registers through this name)


# Resident programs (thread blocks) a multiprocessor holds at most, whatever their size, by compute capability
# (CUDA's "maximum number of resident blocks per SM"): 32 unless listed.
MAX_PROGRAMS_PER_SM = {(7, 5): 16, (8, 6): 16, (8, 7): 16, (8, 9): 24}
# Registers are given to a thread in steps of this many (256 a warp).
REGISTER_STEP = 8


def max_programs_per_sm(capability: tuple[int, int]) -> int:
    """Resident programs a multiprocessor of ``capability`` holds at most (``MAX_PROGRAMS_PER_SM``)."""
    return MAX_PROGRAMS_PER_SM.get(tuple(capability), 32)


def occupancy(compiled, num_warps: int, info: DeviceInfo) -> int | None:
    """Programs of ``compiled`` that fit on one multiprocessor, or None if Triton does not say."""
    try:
        n_regs = int(loaded(compiled).n_regs)
        shared = int(compiled.metadata.shared)
    except Exception:  # interpreter, or an API this Triton does not have
        return None
    fits = min(info.max_warps_per_sm // num_warps, max_programs_per_sm(info.capability))
    if n_regs > 0:
        allocated = -(-n_regs // REGISTER_STEP) * REGISTER_STEP
        fits = min(fits, info.regs_per_sm // (allocated * 32 * num_warps))
    if shared > 0:
        fits = min(fits, info.smem_per_sm // shared)
    return max(1, fits)


# Compiled kernels by launch signature (see ``launch``), with the values of their trailing parameters.
_COMPILED: dict = {}


class _Unmodeled(Exception):
    """An argument ``_specialization`` has no key for: its launch goes through Triton, uncached."""


def _specialization(arg) -> object:
    """A key for what Triton reads off one runtime argument when it specializes a kernel, finer than Triton's own.

    Ints: == 1 (becomes a constant), divisible by 16, 32-bit, below 2^63 (unsigned past it); tensors:
    dtype and 16-byte alignment of the address; TMA descriptors: type, dtype, box, layout and padding;
    ``tl.constexpr`` values (compiled in): the value; tuples: their items'; None, bool, float: the type.
    Anything else (int or float subclasses, numpy scalars, ...) raises ``_Unmodeled``.
    """
    kind = type(arg)
    if kind is int:
        return (arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, arg < 2**63)
    if kind is float or kind is bool or arg is None:
        return kind
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if kind is tuple:
        return (tuple, *map(_specialization, arg))
    if isinstance(arg, triton.language.constexpr):
        return (kind, type(arg.value), arg.value)
    block_shape = getattr(arg, "block_shape", None)
    if block_shape is not None and hasattr(arg, "base"):
        return (kind, arg.base.dtype, tuple(block_shape), getattr(arg, "layout", None), getattr(arg, "padding", None))
    raise _Unmodeled(kind)


def signature_key(args: tuple) -> tuple:
    """What Triton compiles a kernel apart for in ``args`` (see ``_specialization``): a cache key for
    facts read off a compiled kernel, such as how many of its programs stay resident."""
    return tuple(map(_specialization, args))


def launch(kernel, grid: tuple, args: tuple, **options):
    """``kernel[grid](*args, **options)``, returning the compiled kernel, at less host cost on CUDA.

    Triton binds and specializes every argument on every call, tens of microseconds of host time
    a launch: what decides the short calls (TUNING.md#host-cost). Here the first launch of a
    signature (the kernel, the device, ``options``, and each argument's ``_specialization``, which
    tells apart every pair of argument lists Triton compiles apart) goes through Triton and keeps
    the compiled kernel; later launches of that signature hand the arguments straight to it,
    through ``triton_compat.run_compiled``. Triton's path, uncached, serves the rest: the interpreter (no
    compiled kernels), kernels wrapped in ``triton.heuristics`` or ``triton.autotune`` (their
    constexprs are computed per call), and arguments ``_specialization`` does not model. Option
    values are compared by ``==`` (pass each option with one type), and the kernel's globals and
    Triton's debug knobs are read at its first launch only.
    """
    if not is_compiled_kernel(kernel):  # the interpreter's function, or a heuristics/autotune wrapper
        with quiet_interpreter():
            return kernel[grid](*args, **options)
    device = torch.cuda.current_device()
    try:
        key = (kernel, device, *options.items(), *map(_specialization, args))
    except _Unmodeled:
        return kernel[grid](*args, **options)
    entry = _COMPILED.get(key)
    if entry is not None:
        compiled, trailing = entry
        run_compiled(compiled, device, (*grid, 1, 1)[:3], (*args, *trailing))
        return compiled
    compiled = kernel[grid](*args, **options)
    if is_reusable(compiled):
        params = kernel.params[len(args):]  # constexprs and defaulted parameters, given by name or not at all
        _COMPILED[key] = (compiled, tuple(options[p.name] if p.name in options else p.default for p in params))
    return compiled


@contextlib.contextmanager
def quiet_interpreter():
    """Where the interpreter runs the kernels, numpy's warnings off: it evaluates masked-off lanes too (0/0 in
    padding rows, log2(0) of an empty row, the maximum of a row of NaN) and would warn on valid inputs. Only
    around flashlite's own launches: numpy's error state is per thread and restored on exit, and the warning
    filter is restored too (on the GPU nothing changes)."""
    if not interpreter_enabled():
        yield
        return
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def persistent_grid(n_tiles: int, device: torch.device, key: tuple) -> tuple:
    """The grid ``launch_persistent`` uses for ``n_tiles`` tiles of the configuration ``key``."""
    info = device_info(device)
    return (max(1, min(n_tiles, info.num_sms * _PROGRAMS_PER_SM.get(key, 2))),)


def launch_persistent(
    kernel, n_tiles: int, device: torch.device, key: tuple, args: tuple, num_warps: int, **constexprs,
):
    """Launch ``kernel`` on a persistent grid: as many programs as the device holds at once, at most ``n_tiles``.

    The kernel must loop over its tiles with a stride of ``tl.num_programs(0)``,
    so any grid size is correct; the size only matters for speed. The first
    launch of a configuration guesses two programs per multiprocessor; the
    compiled kernel's registers and shared memory then fix the number for later
    launches (cached per ``key``).
    """
    compiled = launch(kernel, persistent_grid(n_tiles, device, key), args, num_warps=num_warps, **constexprs)
    record_residency(key, compiled, num_warps, device)
    return compiled


def record_residency(key: tuple, compiled, num_warps: int, device: torch.device) -> None:
    """After a launch on ``persistent_grid(..., key)``: size later grids of ``key`` from the compiled kernel."""
    if key not in _PROGRAMS_PER_SM:
        measured = occupancy(compiled, num_warps, device_info(device))
        _PROGRAMS_PER_SM[key] = measured if measured is not None else 2


def _compiled_entry(kernel, args: tuple, options: dict) -> tuple | None:
    """``(compiled kernel, trailing arguments, device)`` of a launch already made through ``launch``, or None
    (Triton's uncached path, or no such launch yet)."""
    if not is_compiled_kernel(kernel):
        return None
    device = torch.cuda.current_device()
    try:
        key = (kernel, device, *options.items(), *map(_specialization, args))
    except _Unmodeled:
        return None
    entry = _COMPILED.get(key)
    return None if entry is None else (*entry, device)


def compiled_launcher(kernel, grid: tuple, args: tuple, **options):
    """A function of new arguments only that repeats a launch already made through ``launch``, or None.

    ``f(new_args)`` launches the kernel ``launch(kernel, grid, args, **options)``
    compiled, on the same grid, for ``new_args`` that specialize as ``args`` do
    (the caller's promise: same dtypes, 16-byte alignments, and ints in the same
    classes). It skips ``launch``'s key: for callers that key repeats more
    cheaply themselves. None on Triton's uncached path (the interpreter,
    wrapped kernels, unmodeled arguments) or before the first launch.
    """
    entry = _compiled_entry(kernel, args, options)
    if entry is None:
        return None
    compiled, trailing, device = entry
    grid = (*grid, 1, 1)[:3]
    return lambda new_args: run_compiled(compiled, device, grid, (*new_args, *trailing))


def bind_descriptors(templates: tuple, tensors: tuple) -> list:
    """Host TMA descriptor templates (``triton_compat.descriptor_template``'s; None stays None) bound to a call's
    tensors: template ``j`` to ``tensors[j % len(tensors)]`` (a kernel's descriptors of every tensor's first
    column part, then of every one's second part, come so)."""
    n = len(tensors)
    return [None if d is None else rebind_descriptor(d, tensors[j % n]) for j, d in enumerate(templates)]


class KernelLaunch:
    """One kernel launch of a planned call: the kernel, its grid and launch options fixed, the arguments given
    per call. The first call goes through ``launch`` (Triton compiles, or the interpreter runs); once a
    compiled kernel exists, later calls hand their arguments straight to it (``compiled_launcher``). The
    caller promises that every call's arguments specialize as the first call's did (same dtypes, 16-byte
    alignments, ints in the same classes): a plan keyed on everything that decides them."""

    __slots__ = ("kernel", "grid", "options", "_run")

    def __init__(self, kernel, grid: tuple, **options):
        self.kernel, self.grid, self.options = kernel, grid, options
        self._run = None

    def __call__(self, *args) -> None:
        if self._run is not None:
            self._run(args)
            return
        launch(self.kernel, self.grid, args, **self.options)
        self._run = compiled_launcher(self.kernel, self.grid, args, **self.options)


class TmaLaunch:
    """A ``KernelLaunch`` of a kernel whose leading parameters are host TMA descriptors, planned as ``templates``
    (``triton_compat.descriptor_template``'s, None where the kernel takes None): a call gives the tensors they
    describe (``bind_descriptors``' order), then the other arguments, under ``KernelLaunch``'s promise (and
    each tensor of the shape and strides its templates were planned for).

    Once compiled, a call hands the launcher each descriptor's encoded form, kept per tensor address
    (``triton_compat.tma_launcher``): no descriptor object built and none encoded again for an address seen
    before, where building and encoding them cost a few microseconds each a call (TUNING.md#tma-launch).
    Where that launcher is not there (Triton other than 3.6, the interpreter) or a profiler's hooks are set,
    each call binds the templates and launches as ``KernelLaunch`` does."""

    __slots__ = ("kernel", "grid", "templates", "options", "_run", "_direct")

    def __init__(self, kernel, grid: tuple, templates: tuple, **options):
        self.kernel, self.grid, self.templates, self.options = kernel, grid, templates, options
        self._run = self._direct = None

    def __call__(self, tensors: tuple, *rest) -> None:
        if self._direct is not None and not launch_hooks_set():
            self._direct(tensors, rest)
            return
        args = (*bind_descriptors(self.templates, tensors), *rest)
        if self._run is not None:
            self._run(args)
            return
        launch(self.kernel, self.grid, args, **self.options)
        self._run = compiled_launcher(self.kernel, self.grid, args, **self.options)
        entry = _compiled_entry(self.kernel, args, self.options)
        if entry is not None:
            compiled, trailing, device = entry
            self._direct = tma_launcher(compiled, device, (*self.grid, 1, 1)[:3], self.templates, trailing)


class PersistentLaunch:
    """``launch_persistent`` of a planned call: the kernel, its tiles, residency key, warps and constexprs
    fixed, the arguments given per call. The first call goes through ``launch_persistent`` (which sizes the
    grid from the compiled kernel); later calls hand their arguments straight to that kernel on the grid so
    sized (``compiled_launcher``), under the promise ``KernelLaunch`` states."""

    __slots__ = ("kernel", "n_tiles", "device", "key", "num_warps", "constexprs", "_run")

    def __init__(self, kernel, n_tiles: int, device: torch.device, key: tuple, num_warps: int, **constexprs):
        self.kernel, self.n_tiles, self.device, self.key = kernel, n_tiles, device, key
        self.num_warps, self.constexprs = num_warps, constexprs
        self._run = None

    def __call__(self, *args) -> None:
        if self._run is not None:
            self._run(args)
            return
        launch_persistent(self.kernel, self.n_tiles, self.device, self.key, args, self.num_warps, **self.constexprs)
        grid = persistent_grid(self.n_tiles, self.device, self.key)  # the compiled kernel's residency now
        self._run = compiled_launcher(self.kernel, grid, args, num_warps=self.num_warps, **self.constexprs)
