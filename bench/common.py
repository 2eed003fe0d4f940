"""Shared benchmark harness: timing, measured ceilings, and result files.

Every benchmark runs all providers in one process on the same data, times them
with ``triton.testing.do_bench`` (median), and writes JSON (with GPU name,
versions and date), a Markdown table and a PNG plot under
``bench/results/<gpu>/``. Nothing runs at import.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable, Iterable

import torch
import triton
import triton.language as tl

# The FLOP and byte counts every script uses: the package's own (the `flashlite` demo counts with them too).
from flashlite.cli import attention_flops, softmax_bytes  # noqa: F401  (re-exported)


def gpu_slug() -> str:
    """Short folder name of the current GPU, e.g. ``h100`` for 'NVIDIA H100 80GB HBM3'."""
    name = torch.cuda.get_device_name()
    match = re.search(r"(H100|H200|A100|L40S|B200|GH200)", name)
    return (match.group(1) if match else re.sub(r"\W+", "_", name)).lower()


# The peers' distributions whose versions every result file records (None: not installed).
PEER_DISTRIBUTIONS = ("flash-attn-4", "quack-kernels", "nvidia-cutlass-dsl")


def environment() -> dict:
    """The command line, the commit measured, GPU name, library and peer versions and date, stored with every
    result file (a script run another way, torchrun say, overrides ``command``)."""
    return {
        "command": " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
        "commit": source_commit(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "peers": peer_versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def source_commit() -> str:
    """The commit of the tree measured: ``FLASHLITE_COMMIT`` where set (a copy of the tree without its ``.git``,
    as the GPU machine gets: the caller names the commit), else ``git rev-parse --short HEAD`` with ``-dirty``
    when tracked files differ from it, else ``"unknown"``."""
    if os.environ.get("FLASHLITE_COMMIT"):
        return os.environ["FLASHLITE_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def peer_versions() -> dict:
    """``{distribution: version or None}`` of ``PEER_DISTRIBUTIONS``, from their installed metadata (nothing is
    imported: FlashAttention-4's CuTe DSL takes seconds to load)."""
    versions = {}
    for name in PEER_DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def quack_softmax(backward: bool = False) -> tuple[Callable | None, str]:
    """``(fn, version)``: quack's softmax forward ``fn(x)``, or with ``backward`` its backward ``fn(dy, y)``
    (``quack-kernels``, Dao-AILab's CuTe-DSL kernels) where it imports (``../shared/tools/peer_wheels.sh``
    installs it on the GPU machine), else ``(None, why not)``."""
    try:
        import quack
        from quack.softmax import softmax_bwd, softmax_fwd
    except Exception as e:  # noqa: BLE001 (any failure to import means: not measured)
        return None, f"not importable ({type(e).__name__}: {e})"[:200]
    return (softmax_bwd if backward else softmax_fwd), getattr(quack, "__version__", "?")


def quack_provider(backward: bool = False) -> Callable:
    """``quack_softmax(backward)``'s function guarded for a sweep: ``fn(x)`` (forward) or ``fn(dy, y)`` (backward),
    returning None where quack does not import or does not take the shape (rows of a multiple of 16 bytes; its
    clusters hold at most 2^17 fp32 / 2^20 bf16 columns or so), so that the shape is reported as not measured."""
    quack, _ = quack_softmax(backward)

    def call(*tensors):
        rows = tensors[-1]  # x, or y
        if quack is None or rows.shape[1] * rows.element_size() % 16:
            return None
        try:
            return quack(*tensors)
        except Exception:  # noqa: BLE001 (a shape quack refuses: not measured)
            return None
    return call


def fa4_attention() -> tuple[Callable | None, str]:
    """``(flash_attn_func, version)``: FlashAttention-4's attention (``flash-attn-4``, CuTe DSL, inputs (B, L, H, D))
    where it imports (``../shared/tools/peer_wheels.sh`` installs it on the GPU machine), else ``(None, why not)``."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001 (any failure to import means: not measured)
        return None, f"not importable ({type(e).__name__}: {e})"[:200]
    try:
        from importlib.metadata import version
        return flash_attn_func, version("flash-attn-4")
    except Exception:  # noqa: BLE001
        return flash_attn_func, "?"


def backward_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> float:
    """FLOPs of attention's backward, counted as FlashAttention does: 2.5x the forward (five products to two)."""
    return 2.5 * attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal)


def tensor_softmax_bytes(x: torch.Tensor) -> int:
    """``softmax_bytes`` of a softmax over ``x``'s last dim: ``x`` read once, ``y`` written once."""
    return softmax_bytes(x.numel() // max(x.shape[-1], 1), x.shape[-1], x.element_size())


def time_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` (device events, L2 flushed between runs by do_bench)."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


L2_LINE_BYTES = 128
DEMOTE_LINES = 1024  # L2 lines one program of _demote_l2_kernel resets


@triton.jit
def _demote_l2_kernel(base_ptr, n_lines, LINES: tl.constexpr, LINE_BYTES: tl.constexpr):
    """Give lines ``[0, n_lines)`` of ``LINE_BYTES`` (128, as applypriority requires) from ``base_ptr`` normal L2
    eviction priority (inline PTX, GPU only)."""
    lines = tl.program_id(0) * LINES + tl.arange(0, LINES)
    line_ptrs = base_ptr + tl.minimum(lines, n_lines - 1).to(tl.int64) * LINE_BYTES
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tapplypriority.global.L2::evict_normal [$1], 128;", "=r,l",
                              [line_ptrs], dtype=tl.int32, is_pure=False, pack=1)


def fresh_copy(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x`` for one provider to be timed on, none of whose L2 lines keeps ``evict_last`` priority.

    do_bench's flush is a memset, which evicts normal lines first: lines a provider
    loads with ``evict_last`` (torch.compile's kernels do) outlive it and serve the
    next provider timed on the same addresses (bench/results/h200/TUNING.md#timing-method). Keep each provider's copy alive until
    all are timed, so that no two share addresses; lines left at the copy's addresses
    by tensors freed before are reset to normal priority here, so the flush evicts them.
    """
    copy = x.contiguous().clone()
    storage = copy.view(-1).view(torch.uint8)
    n_lines = triton.cdiv(storage.numel(), L2_LINE_BYTES)
    _demote_l2_kernel[(triton.cdiv(n_lines, DEMOTE_LINES),)](storage, n_lines, LINES=DEMOTE_LINES,
                                                             LINE_BYTES=L2_LINE_BYTES)
    return copy


def graph_time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph: device time without host launch cost."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay)


def try_time_ms(fn: Callable[[], object], **kw) -> float | None:
    """``time_ms``, or None if the provider fails (out of memory, unsupported shape)."""
    try:
        fn()
        torch.cuda.synchronize()
        return time_ms(fn, **kw)
    except (torch.OutOfMemoryError, RuntimeError) as err:  # noqa: F841 - a missing bar, not a crash
        torch.cuda.empty_cache()
        return None


def poison_allocator(n_bytes: int = 1 << 30) -> None:
    """Fill memory the caching allocator will hand out next with NaN, so that outputs a kernel forgot to write show."""
    junk = torch.full((n_bytes // 4,), float("nan"), device="cuda")
    del junk


def copy_bandwidth_gbs(n_bytes: int = 2 * 2**30) -> float:
    """Measured device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randn(n_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(functools.partial(dst.copy_, src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n_bytes / ms * 1e-6


def matmul_tflops(n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Measured dense matrix throughput (TFLOP/s) of an n x n x n product on random data."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = time_ms(lambda: a @ b)
    return 2 * n**3 / ms * 1e-9


def gbs(n_bytes: int, ms: float | None) -> float | None:
    """GB/s for ``n_bytes`` moved in ``ms`` milliseconds (None stays None)."""
    return None if ms is None else n_bytes / ms * 1e-6


def tflops(flops: float, ms: float | None) -> float | None:
    """TFLOP/s for ``flops`` in ``ms`` milliseconds (None stays None)."""
    return None if ms is None else flops / ms * 1e-9


def results_dir(out: str | None) -> str:
    """``out`` or ``bench/results/<gpu>``, created."""
    path = out or os.path.join(os.path.dirname(__file__), "results", gpu_slug())
    os.makedirs(path, exist_ok=True)
    return path


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.0f}"
    return str(v)


def markdown_table(rows: list[dict], columns: Iterable[str]) -> str:
    """A Markdown table of ``rows`` restricted to ``columns``."""
    columns = list(columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(name: str, out_dir: str, meta: dict, rows: list[dict], columns: Iterable[str], title: str) -> None:
    """Write ``<name>.json`` (meta + rows) and ``<name>.md`` (title, ceilings, table) into ``out_dir``."""
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    head = [f"# {title}", "", ", ".join(f"{k}: {_fmt(v)}" for k, v in meta.items()), ""]
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write("\n".join(head) + markdown_table(rows, columns) + "\n")


def plot_lines(path: str, panels: list[tuple[str, list, dict[str, list], str]], log_x: bool = True) -> None:
    """One PNG with a subplot per panel: (title, x values, {provider: y values}, y label). Skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written")
        return
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.2 * rows), squeeze=False)
    for ax, (title, xs, series, ylabel) in zip(axes.flat, panels):
        for label, ys in series.items():
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ptxas_report(ptx: str) -> tuple[str, str]:
    """(registers a thread, spill-store bytes) of a kernel's PTX, by Triton's own ptxas."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    from triton.backends.nvidia.compiler import get_ptxas  # (NVIDIA's backend: imported where used)

    ptxas = get_ptxas(90)
    log = subprocess.run([getattr(ptxas, "path", ptxas), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return regs[0] if regs else "?", spills[0] if spills else "?"


def sm90_resources(compiled) -> tuple[str, str, str, list[str]]:
    """``(ptx, registers a thread, spill-store bytes, wgmma wait depths)`` of a kernel built for sm_90
    (``ptxas_report``, ``wait_depths``): what the resource reports read off each build."""
    ptx = compiled.asm["ptx"]
    return (ptx, *ptxas_report(ptx), wait_depths(ptx))


def wait_depths(ptx: str) -> list[str]:
    """The distinct depths of a kernel's ``wgmma.wait_group N`` in its PTX, sorted (0: each product waited for
    before the next is issued; 1 or more: products left in flight across the work between them)."""
    return sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)))
