"""Every use of Triton's private API, in one place, with the shims for the Tritons flashlite runs on.

flashlite runs on Triton 3.6 (the GPU image) and 3.9 (CI). Its fast launch path and its CPU builds for
sm_90 reach below Triton's public API; each such reach is one function here, so that a Triton upgrade is
one module to check (tests/test_triton_compat.py runs each function on the CPU):

* ``is_compiled_kernel``: whether a ``@triton.jit`` function compiles (it keeps per-device caches) or runs
  through the CPU interpreter (``TRITON_INTERPRET=1``, read by Triton when the function is defined);
* ``run_compiled``: launch a ``CompiledKernel`` with every parameter's value, skipping ``JITFunction``'s
  per-call binding and specialization (``CompiledKernel.run`` with its ``packed_metadata``);
* ``load_compiled``: load a kernel built by ``warmup`` so that its registers (``n_regs``) can be read;
* ``descriptor_template``: a host tensor descriptor without its base tensor, for ``rebind_descriptor``;
* ``rebind_descriptor``: a host tensor descriptor of another tensor with the same shape, strides and box,
  without the dataclass's checks (``object.__new__``);
* ``tma_launcher``: launch a ``CompiledKernel`` whose leading parameters are TMA descriptors straight through
  Triton 3.6's C launcher, each descriptor's encoded form (``make_tensordesc_arg``) kept per base address, where
  ``launcher_expands_descriptors_as_3_6``;
* ``gluon_source`` and ``mangle_type``: what ``triton.compile`` takes to build a Gluon kernel for a GPU
  that is not here (the CPU build tests, ``bench/backward_resources.py``);
* ``gluon_available``: whether this Triton has Gluon's Hopper API at all;
* ``gluon_tma_add``: Gluon's TMA reduction (add a shared-memory box into a global tile): 3.9's
  ``tma.async_atomic_add``; 3.6 has the op but no function for it, built here from its IR builder.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import triton


def is_compiled_kernel(fn) -> bool:
    """True when the jit function ``fn`` compiles for the GPU (Triton's ``JITFunction`` keeps ``device_caches``;
    the interpreter's function and the ``heuristics``/``autotune`` wrappers do not)."""
    return hasattr(fn, "device_caches")


def current_stream(device: int):
    """The current CUDA stream of ``device`` (torch's, capture streams included), as Triton's launches read it."""
    return triton.runtime.driver.active.get_current_stream(device)


def launch_hooks_set() -> bool:
    """True when a profiler has registered Triton's launch hooks (``knobs.runtime.launch_enter_hook`` /
    ``launch_exit_hook``): ``run_compiled`` then goes through ``CompiledKernel.__getitem__``, which calls them."""
    runtime = triton.knobs.runtime
    return bool(getattr(runtime.launch_enter_hook, "calls", True) or getattr(runtime.launch_exit_hook, "calls", True))


def run_compiled(compiled, device: int, grid: tuple, args: tuple) -> None:
    """Launch the loaded ``CompiledKernel`` ``compiled`` on a 3-D ``grid`` with every parameter's value
    (constexprs included, as Triton's launcher takes them), on ``device``'s current stream.

    What ``compiled[grid](*args)`` does, without building the hooks' metadata and calling the empty hooks
    twice a launch while no hook is registered (Triton 3.6 and 3.9 share ``run``'s calling convention:
    grid, stream, function, packed metadata, launch metadata, two hooks, then the arguments).
    """
    if launch_hooks_set():
        compiled[grid](*args)
        return
    compiled.run(*grid, current_stream(device), compiled.function, compiled.packed_metadata, None, None, None, *args)


def is_reusable(compiled) -> bool:
    """True when ``kernel[grid](...)`` returned a ``CompiledKernel`` (not a future of one, as an async compile
    mode gives): one that ``run_compiled`` can launch again."""
    return hasattr(compiled, "function")


def load_compiled(compiled):
    """``compiled``, loaded on the device: a kernel built by ``warmup()`` reads its registers (``n_regs``,
    ``n_spills``) only once loaded (``_init_handles``)."""
    if hasattr(compiled, "_init_handles"):
        compiled._init_handles()
    return compiled


def rebind_descriptor(template, tensor):
    """A copy of host tensor descriptor ``template`` (``triton.tools.tensor_descriptor.TensorDescriptor`` or
    Gluon's) whose base is ``tensor``: the same shape, strides, box, layout and padding, which the caller
    vouches for (a plan built the template from a tensor of the same signature). The dataclasses' own
    constructors check alignment and box shapes on every call; this costs one dict copy."""
    return new_descriptor(type(template), **{**template.__dict__, "base": tensor})


def descriptor_template(desc):
    """``desc`` without its base tensor: what a plan keeps to ``rebind_descriptor`` later. A plan that held the
    tensor it was built from would keep that tensor alive for as long as the plan lives (and, inside a CUDA-graph
    pool, a tensor the graph does not account for)."""
    return new_descriptor(type(desc), **{**desc.__dict__, "base": None})


def new_descriptor(cls, **fields):
    """A descriptor of class ``cls`` with ``fields`` filled in directly, without its constructor's checks (the
    caller has made them once for its signature)."""
    desc = object.__new__(cls)
    desc.__dict__.update(fields)
    return desc


# Encoded descriptors a descriptor parameter of ``tma_launcher`` keeps (one a tensor address: a model's layers share
# a plan, so each layer's tensors are addresses of their own); past it the older half goes. About 200 bytes each.
ENCODED_KEPT = 512


def launcher_expands_descriptors_as_3_6() -> bool:
    """Whether this Triton's launcher expands descriptor arguments as 3.6's does (``make_tensordesc_arg(arg,
    metadata)``, called by ``wrap_handle_tensordesc``'s ``inner``): the launcher ``tma_launcher`` serves."""
    import inspect

    try:
        from triton.backends.nvidia import driver as nvidia
    except ImportError:  # pragma: no cover - no CUDA backend
        return False
    make_arg = getattr(nvidia, "make_tensordesc_arg", None)
    return make_arg is not None and len(inspect.signature(make_arg).parameters) == 2


def tma_launcher(compiled, device: int, grid: tuple, templates: tuple, trailing: tuple) -> "Callable | None":
    """``f(tensors, rest)``: a launch of the loaded ``compiled`` on the 3-D ``grid`` whose leading parameters are
    the TMA descriptors ``templates`` (``descriptor_template``'s; None where the parameter is None) bound to
    ``tensors`` (descriptor ``j`` to ``tensors[j % len(tensors)]``), then the arguments ``rest`` and
    ``trailing`` (constexprs and defaults, as ``run_compiled`` takes them), on ``device``'s current stream.

    What ``run_compiled`` does with descriptors bound by ``rebind_descriptor``, without building them: Triton
    3.6's launcher (``CudaLauncher.launch``, the ``inner`` of ``driver.wrap_handle_tensordesc``) turns each
    descriptor into ``make_tensordesc_arg``'s list (an encoded CUtensorMap, then the shape and strides) on every
    launch; here that list is computed once per base address of each parameter, by the same function (it
    depends on nothing else: a plan binds its templates only to tensors of their shape and strides), and the
    C launcher gets the lists. The caller checks ``launch_hooks_set()`` first (this path calls no hook).

    None where this Triton's launcher is not built that way (3.9's is not), a descriptor is not lowered to TMA
    (no metadata), the kernel needs scratch memory, or the templates are not the kernel's descriptor
    parameters.
    """
    if not launcher_expands_descriptors_as_3_6():
        return None
    from triton.backends.nvidia import driver as nvidia

    run = compiled.run
    inner = getattr(run, "launch", None)
    cells = getattr(inner, "__closure__", None) or ()
    names = dict(zip(getattr(getattr(inner, "__code__", None), "co_freevars", ()), cells))
    if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= names.keys():
        return None
    make_arg = nvidia.make_tensordesc_arg
    head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
            None, None, None)  # (function, cooperative, PDL, the two scratch buffers, metadata, launch metadata, hooks)
    if len(getattr(nvidia, "_BASE_ARGS_FORMAT", "")) != 4 + len(head):  # (the grid and the stream first)
        return None
    metas = names["tensordesc_meta"].cell_contents
    slots = [j for j, template in enumerate(templates) if template is not None]
    if (sorted(names["tensordesc_indices"].cell_contents) != slots or not metas or any(m is None for m in metas)
            or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)):
        return None
    launcher = names["launcher"].cell_contents
    caches = {j: {} for j in slots}
    meta_of = dict(zip(slots, metas))

    def encoded(j: int, tensor) -> list:
        cache = caches[j]
        address = tensor.data_ptr()
        found = cache.get(address)
        if found is None:
            if len(cache) >= ENCODED_KEPT:
                for seen in list(cache)[:ENCODED_KEPT // 2]:  # (the oldest half: dicts keep their order)
                    del cache[seen]
            found = cache[address] = make_arg(rebind_descriptor(templates[j], tensor), meta_of[j])
        return found

    def launch(tensors: tuple, rest: tuple) -> None:
        args = [*grid, current_stream(device), *head]
        n = len(tensors)
        for j, template in enumerate(templates):
            if template is None:
                args.append(None)
            else:
                args.extend(encoded(j, tensors[j % n]))
        launcher(*args, *rest, *trailing)

    return launch


def gluon_source(kernel, signature: dict, constants: dict, aligned: tuple = ()):
    """The source ``triton.compile`` takes to build Gluon ``kernel`` ahead of time (``GluonASTSource``); ``aligned``:
    the indices of the parameters a launch would find divisible by 16 (pointers 16-byte aligned, ints)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    return GluonASTSource(kernel, signature, constants, attrs or None)


def mangle_type(arg) -> str:
    """Triton's signature type string of a kernel argument (``"*bf16"``, ``"i32"``, a descriptor's type)."""
    from triton.runtime.jit import mangle_type as mangle

    return mangle(arg)


@functools.lru_cache(maxsize=None)
def gluon_available() -> bool:
    """True when this Triton has Gluon's Hopper API (``triton.experimental.gluon``: the GPU image's 3.6 and CI's 3.9
    do)."""
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:  # pragma: no cover - a Triton without Gluon
        return False
    return True


def gluon_tma_add():
    """Gluon's ``tma_add(tensor_desc, coord, src)``: one TMA reduction adding the shared-memory box ``src`` into the
    tile at ``coord`` of ``tensor_desc``'s tensor (``cp.reduce.async.bulk.tensor .add``; asynchronous, its read of
    ``src`` waited for by ``tma.store_wait``). Triton 3.9's ``tma.async_atomic_add``; on 3.6 a Gluon builtin over
    the IR builder's ``create_async_tma_reduce``. None without Gluon."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import tma
    except ImportError:  # pragma: no cover - a Triton without Gluon
        return None
    if hasattr(tma, "async_atomic_add"):
        return tma.async_atomic_add
    from triton._C.libtriton import ir
    from triton.experimental.gluon.language._core import builtin

    @builtin
    def tma_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    return tma_add
