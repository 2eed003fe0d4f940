"""The ``flashlite`` command. ``flashlite demo`` walks from softmax to attention on this machine.

Stages, each checked against a float64 reference (max error printed):

1. naive softmax: five PyTorch ops, each a round trip through memory;
2. fused softmax: a row on chip, one read and one write (``algorithm="fused"``);
3. online softmax: long rows in blocks, the running state ``(m, d)`` (``algorithm="online"``);
4. softmax trace: the online state after every block (``flashlite.study``);
5. masked softmax: causal plus a key-padding mask (``flashlite.masked_softmax``);
6. flash attention, then 7. causal flash attention (``flashlite.flash_attention``);
8. attention trace: ``m``, ``d``, ``alpha`` and the partial output per K/V tile.

With a GPU each kernel is timed (``triton.testing.do_bench``, median) and
reported as GB/s (softmax: one read of ``x`` and one write of ``y``, the least
any softmax must move, so the stages compare on one scale) or TFLOP/s
(attention: ``4 B H Lq Lk D``, halved when causal). Without one the kernels run
through Triton's CPU interpreter on small inputs, in seconds, and only the
errors are reported. PNG plots (the traces, the error of each stage) go to
``--out`` when matplotlib is installed.

The interpreter must be switched on (``TRITON_INTERPRET=1``) before Triton
defines flashlite's kernels, which importing the ``flashlite`` package does.
Importing this module already imports the package, so on the CPU ``main``
runs the command again in a child process with the variable set.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import __version__
from .core.runtime import interpreter_enabled

DEFAULT_OUT = "flashlite_demo"


# ----------------------------------------------------------------------------- sizes and tolerances


@dataclass(frozen=True)
class DemoSizes:
    """Input sizes of the demo: tiny through the interpreter, large enough on a GPU to time bandwidth."""

    softmax: tuple[int, int]  # (rows, cols) of the naive and fused stages
    online: tuple[int, int]  # long rows: several blocks of the online kernel, rows split across programs
    masked: tuple[int, int, int, int]  # (B, H, Lq, Lk)
    attention: tuple[int, int, int, int]  # (B, H, L, D)
    attention_dtype: torch.dtype


# CPU: 4 rows of 40000, past what one program holds (the interpreter's plan: the online kernel, 10 blocks of
# 4096 a row, one program a row).
CPU_SIZES = DemoSizes((64, 1000), (4, 40_000), (1, 2, 128, 128), (1, 2, 128, 32), torch.float32)
# GPU: 256 MB fp32 softmax inputs (well past L2); attention at a typical training shape.
GPU_SIZES = DemoSizes((8192, 8192), (128, 524_288), (4, 16, 1024, 1024), (4, 16, 2048, 64), torch.float16)

# Softmax outputs lie in [0, 1]: a few fp32 roundings of each.
SOFTMAX_TOL = 1e-5
# Attention: FlashAttention's rule, 2 x the error of PyTorch's own attention in the same dtype, plus a floor.
ATTENTION_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
# Traces: relative to d, a few fp32 roundings per block (flashlite.study.check_trace's default).
TRACE_TOL = 2e-5


def softmax_bytes(n_rows: int, n_cols: int, elem_size: int) -> int:
    """Bytes any softmax must move: read ``x`` once, write ``y`` once."""
    return 2 * n_rows * n_cols * elem_size


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs of attention: two matrix products of 2 Lq Lk D each; causal skips half."""
    return 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim * (0.5 if causal else 1.0)


def naive_softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax in five PyTorch ops, as the fused-softmax write-ups start from: 5MN + 2M elements read, 3MN + 2M written."""
    x_max = x.max(dim=1)[0]
    z = x - x_max[:, None]
    numerator = torch.exp(z)
    denominator = numerator.sum(dim=1)
    return numerator / denominator[:, None]


def _max_error(out: torch.Tensor, ref64: torch.Tensor) -> float:
    """Largest |out - ref64| (an output NaN where the reference has none counts as NaN, and fails the check)."""
    return float((out.double() - ref64).abs().max())


# ----------------------------------------------------------------------------- stages


@dataclass
class StageResult:
    """What one stage found: its error against float64 and, on a GPU, its speed."""

    name: str
    shape: str = ""
    dtype: str = ""
    error: float | None = None
    tol: float | None = None
    speed: str = ""
    failure: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the stage ran and its error is within its tolerance."""
        return self.failure is None and self.error is not None and self.error <= self.tol


@dataclass
class _Demo:
    device: torch.device
    sizes: DemoSizes
    on_gpu: bool
    traces: dict = field(default_factory=dict)  # kept for the plots

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=self.device) * scale).to(dtype)

    def timed(self, fn: Callable[[], object]) -> float | None:
        """Median milliseconds of ``fn`` on the GPU; None through the interpreter (its times mean nothing)."""
        if not self.on_gpu:
            return None
        import triton

        return float(triton.testing.do_bench(fn, return_mode="median"))


def _gbs(n_bytes: int, ms: float | None) -> str:
    return "" if ms is None else f"{n_bytes / ms * 1e-6:,.0f} GB/s"


def _tflops(flops: float, ms: float | None) -> str:
    return "" if ms is None else f"{flops / ms * 1e-9:,.1f} TFLOP/s"


def _softmax_stage(
    demo: _Demo, res: StageResult, shape: tuple[int, int], fn: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    x = demo.randn(*shape, scale=2.0)
    res.shape, res.dtype, res.tol = "x".join(map(str, shape)), "float32", SOFTMAX_TOL
    res.error = _max_error(fn(x), torch.softmax(x.double(), dim=1))
    res.speed = _gbs(softmax_bytes(*shape, x.element_size()), demo.timed(lambda: fn(x)))


def stage_naive(demo: _Demo, res: StageResult) -> None:
    """Stage 1: the five-op PyTorch softmax, the textbook starting point, against float64."""
    _softmax_stage(demo, res, demo.sizes.softmax, naive_softmax)


def stage_fused(demo: _Demo, res: StageResult) -> None:
    """Stage 2: flashlite's fused softmax (each row on chip), against float64."""
    import flashlite

    _softmax_stage(demo, res, demo.sizes.softmax, lambda x: flashlite.softmax(x, algorithm="fused"))


def stage_online(demo: _Demo, res: StageResult) -> None:
    """Stage 3: the online softmax on long rows, blocks streamed and rows split across programs."""
    import flashlite
    from flashlite.softmax.plan import plan_softmax

    n_rows, n_cols = demo.sizes.online
    plan = plan_softmax(n_rows, n_cols, demo.device, "online")
    _softmax_stage(demo, res, demo.sizes.online, lambda x: flashlite.softmax(x, algorithm="online"))
    n_blocks = math.ceil(n_cols / plan.block_n)
    res.shape += f" ({n_blocks} blocks of {plan.block_n}, {plan.n_splits} program(s) a row)"


def stage_softmax_trace(demo: _Demo, res: StageResult) -> None:
    """Stage 4: the (m, d) state block by block (``study.trace_softmax``), checked against its definition."""
    from flashlite import study

    block_n = 32
    x, labels = study.story_logits(block_n=block_n, n_blocks=8)
    trace = study.trace_softmax(x.to(demo.device), block_n=block_n)
    errors = study.trace_errors(trace)
    demo.traces["softmax"] = (trace, labels)
    res.shape, res.dtype, res.tol = f"{x.shape[0]}x{x.shape[1]} ({trace.n_blocks} blocks of {block_n})", "float32", TRACE_TOL
    res.error = max(errors.values())
    worst = max(errors, key=errors.get)
    res.speed = f"worst field: {worst}"


def _masked_reference(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    s = (x.double() * scale).masked_fill(~keep, float("-inf"))
    return torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)  # rows with no key left: 0


def stage_masked(demo: _Demo, res: StageResult) -> None:
    """Stage 5: scaled, causal masked softmax of attention-shaped scores, against float64."""
    from flashlite.masked_softmax import masked_softmax

    batch, heads, seqlen_q, seqlen_k = demo.sizes.masked
    x = demo.randn(batch, heads, seqlen_q, seqlen_k, scale=4.0)  # scores of spread 4 ...
    scale = 0.5  # ... scaled, to exercise the scale argument
    # Key padding: the last eighth of the keys of every sequence are padding.
    mask = torch.ones(batch, 1, 1, seqlen_k, dtype=torch.bool, device=demo.device)
    mask[..., seqlen_k - seqlen_k // 8:] = False
    causal = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=demo.device).tril(seqlen_k - seqlen_q)
    ref = _masked_reference(x, causal & mask, scale)

    def run():
        return masked_softmax(x, mask, scale=scale, causal=True)

    res.shape, res.dtype, res.tol = "x".join(map(str, x.shape)) + " causal + padding", "float32", SOFTMAX_TOL
    res.error = _max_error(run(), ref)
    res.speed = _gbs(softmax_bytes(x.numel() // seqlen_k, seqlen_k, x.element_size()), demo.timed(run))


def _attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                         dtype: torch.dtype) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v computed in ``dtype`` (float64: the reference; the input dtype: PyTorch's own error)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    s = (q @ k.transpose(-1, -2)).to(torch.float64 if dtype == torch.float64 else torch.float32) / math.sqrt(q.shape[-1])
    if causal:
        seqlen_q, seqlen_k = s.shape[-2:]
        keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=s.device).tril(seqlen_k - seqlen_q)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1).to(dtype) @ v


def _attention_stage(demo: _Demo, res: StageResult, causal: bool) -> None:
    from flashlite.attention import flash_attention

    batch, heads, seqlen, head_dim = demo.sizes.attention
    dtype = demo.sizes.attention_dtype
    q, k, v = (demo.randn(batch, heads, seqlen, head_dim, dtype=dtype) for _ in range(3))

    def run():
        return flash_attention(q, k, v, causal=causal)

    ref = _attention_reference(q, k, v, causal, torch.float64)
    torch_error = _max_error(_attention_reference(q, k, v, causal, dtype), ref)
    res.shape = "x".join(map(str, q.shape)) + (" causal" if causal else "")
    res.dtype = str(dtype).replace("torch.", "")
    res.tol = 2 * torch_error + ATTENTION_FLOOR[dtype]
    res.error = _max_error(run(), ref)
    res.speed = _tflops(attention_flops(batch, heads, seqlen, seqlen, head_dim, causal), demo.timed(run))


def stage_attention(demo: _Demo, res: StageResult) -> None:
    """Stage 6: flash attention forward, within twice PyTorch's own error in the same dtype."""
    _attention_stage(demo, res, causal=False)


def stage_causal_attention(demo: _Demo, res: StageResult) -> None:
    """Stage 7: causal flash attention (bottom-right aligned), same tolerance rule."""
    _attention_stage(demo, res, causal=True)


def stage_attention_trace(demo: _Demo, res: StageResult) -> None:
    """Stage 8: one query tile's (m, d, alpha) and rescaled output, tile by tile (``study.trace_attention``)."""
    from flashlite import study

    seqlen, head_dim, block = 128, 32, 16
    q, k, v = (demo.randn(seqlen, head_dim) for _ in range(3))
    # The last query tile under the causal mask visits every K/V tile, the diagonal one partly masked.
    trace = study.trace_attention(q, k, v, block_m=block, block_n=block, q_tile=seqlen // block - 1, causal=True)
    errors = study.trace_errors(trace)
    demo.traces["attention"] = trace
    res.shape = f"q {block}x{head_dim}, k/v {seqlen}x{head_dim} causal ({trace.n_tiles} tiles of {block})"
    res.dtype, res.tol = "float32", TRACE_TOL
    res.error = max(errors.values())
    res.speed = f"final output err {errors['final']:.1e}"


# (key for --only, title, function): the order is the story.
STAGES: list[tuple[str, str, Callable[[_Demo, StageResult], None]]] = [
    ("naive", "naive softmax (5 torch ops)", stage_naive),
    ("fused", "fused softmax", stage_fused),
    ("online", "online softmax", stage_online),
    ("softmax-trace", "online softmax trace", stage_softmax_trace),
    ("masked", "masked softmax (causal)", stage_masked),
    ("attention", "flash attention", stage_attention),
    ("causal", "flash attention (causal)", stage_causal_attention),
    ("attention-trace", "flash attention trace", stage_attention_trace),
]


# ----------------------------------------------------------------------------- the demo


def _print_table(results: list[StageResult]) -> None:
    head = ("stage", "shape", "dtype", "max err vs fp64", "tol", "speed / note", "verdict")
    rows = []
    for r in results:
        err = "—" if r.error is None else f"{r.error:.2e}"
        tol = "—" if r.tol is None else f"{r.tol:.0e}"
        verdict = "ok" if r.ok else ("FAILED" if r.failure else "TOO LARGE")
        rows.append((r.name, r.shape, r.dtype, err, tol, r.speed, verdict))
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    for row in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _write_plots(demo: _Demo, results: list[StageResult], out: str) -> list[str]:
    from flashlite import study

    if not study.matplotlib_available():
        print("matplotlib is not installed: no plots written (pip install 'flashlite[plots]')")
        return []
    os.makedirs(out, exist_ok=True)
    written = []
    if "softmax" in demo.traces:
        trace, labels = demo.traces["softmax"]
        written.append(study.plot_softmax_trace(trace, os.path.join(out, "softmax_trace.png"), labels))
    if "attention" in demo.traces:
        written.append(study.plot_attention_trace(demo.traces["attention"], os.path.join(out, "attention_trace.png")))
    written.append(plot_stage_errors(results, os.path.join(out, "stage_errors.png")))
    return written


def plot_stage_errors(results: list[StageResult], path: str) -> str:
    """The demo's figure of each stage's error against float64 beside its tolerance (``study.plot_errors``; a
    failed stage drawn as such), written to ``path``, which it returns. Needs matplotlib."""
    from flashlite import study

    errors = {r.name: (None if r.failure else r.error) for r in results}
    tolerances = {r.name: r.tol for r in results if r.tol is not None}
    return study.plot_errors(errors, path, tolerances)


def run_demo(out: str | None = DEFAULT_OUT, device: str | torch.device = "cpu",
             only: list[str] | None = None) -> list[StageResult]:
    """Run the demo's stages (all, or the keys in ``only``) on ``device``, print progress and a table, write plots to
    ``out`` (None: no plots).

    On the CPU the caller must have set ``TRITON_INTERPRET=1`` before flashlite's
    kernels were imported (``main`` sees to it). Returns one result per stage;
    a stage that raises is reported as failed, with its traceback, not skipped.
    """
    import triton

    device = torch.device(device)
    on_gpu = device.type == "cuda"
    demo = _Demo(device, GPU_SIZES if on_gpu else CPU_SIZES, on_gpu)
    where = torch.cuda.get_device_name(device) if on_gpu else "CPU, through Triton's interpreter (errors only, no timings)"
    print(f"flashlite demo on {where}; torch {torch.__version__}, triton {triton.__version__}")
    stages = [s for s in STAGES if only is None or s[0] in only]
    results = []
    start = time.perf_counter()
    for i, (_, title, fn) in enumerate(stages, 1):
        print(f"[{time.perf_counter() - start:6.1f}s] {i}/{len(stages)} {title} ...", flush=True)
        res = StageResult(title)
        t0 = time.perf_counter()
        torch.manual_seed(i)
        try:
            fn(demo, res)
        except Exception as err:  # noqa: BLE001 - one broken stage must not hide the others
            res.failure = f"{type(err).__name__}: {err}"
            print(f"         FAILED: {res.failure}")
            traceback.print_exc(limit=-3, file=sys.stdout)
        res.seconds = time.perf_counter() - t0
        if res.failure is None:
            print(f"         max error {res.error:.2e} (tol {res.tol:.0e}) {res.speed}  [{res.seconds:.1f}s]")
        results.append(res)
    print()
    _print_table(results)
    print()
    for path in _write_plots(demo, results, out) if out is not None else ():
        print(f"wrote {path}")
    print(f"total {time.perf_counter() - start:.1f}s")
    return results


# ----------------------------------------------------------------------------- entry point


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashlite", description="flashlite: softmax to flash attention in Triton.")
    parser.add_argument("--version", action="version", version=f"flashlite {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="walk from softmax to attention on this machine, checking every stage",
                          description="\n\n".join(__doc__.split("\n\n")[1:3]),
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the PNG plots (default ./{DEFAULT_OUT})")
    demo.add_argument("--device", choices=("cpu", "cuda"), default=None,
                      help="where the kernels run (default: cuda if a GPU is present, else cpu)")
    demo.add_argument("--only", default=None,
                      help="comma-separated stages to run, of: " + ", ".join(key for key, _, _ in STAGES))
    return parser


def main(argv: list[str] | None = None) -> int:
    """``flashlite demo [--out DIR] [--device cpu|cuda] [--only STAGES]``, or ``flashlite --version``; returns the
    exit status (0: every stage ok)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = _parser().parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("flashlite demo: --device cuda but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    only = None
    if args.only:
        only = [key.strip() for key in args.only.split(",")]
        unknown = sorted(set(only) - {key for key, _, _ in STAGES})
        if unknown:
            print(f"flashlite demo: unknown stage(s) {', '.join(unknown)}", file=sys.stderr)
            return 2
    if device == "cpu" and not interpreter_enabled():
        # Importing this module imported the flashlite package, whose kernels are then defined for the GPU:
        # start over in a process with the interpreter on.
        env = dict(os.environ, TRITON_INTERPRET="1")
        return subprocess.call([sys.executable, "-m", "flashlite", *argv], env=env)
    if device == "cuda" and interpreter_enabled():
        print("note: TRITON_INTERPRET is set, so even the GPU kernels run through the interpreter (no timings worth reading)")
    results = run_demo(args.out, device, only)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
