"""Rows of odd lengths beside the nearest multiple of 16: forward and backward, flashlite and torch (H100 sweep).

GB/s (do_bench median, inputs from common.fresh_copy): flashlite.softmax under "auto" and "online",
torch.softmax, the backward (softmax_backward under the forward's plan: y and dy read, dx written) and
torch's. Rows whose length is not a multiple of 16 start unaligned; flashlite reads them in frames
(flashlite.softmax.frames.row_frame). To compare with another checkout, run this file with that checkout first on
PYTHONPATH (LABEL names the run in the summary):

    PYTHONPATH=. python bench/softmax_odd_rows.py
    LABEL=old PYTHONPATH=/path/to/old:. python bench/softmax_odd_rows.py
"""
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/common.py
import flashlite  # noqa: E402
from common import fresh_copy, time_ms  # noqa: E402


def softmax_module(name: str):
    """The softmax submodule ``name`` (api, plan, backward) of the flashlite on the path, or, for a checkout from before
    the package was split into subpackages, its one ``flashlite/softmax.py``."""
    try:
        return importlib.import_module(f"flashlite.softmax.{name}")
    except ModuleNotFoundError:
        return importlib.import_module("flashlite.softmax")


plan_module, backward_module = softmax_module("plan"), softmax_module("backward")

# Odd lengths, each beside the next multiple of 16: rows a tile shares (1000), one-row fused tiles (2049 ...
# 30001), streamed rows (50257: the backward; 1000003: split rows).
SHAPES = [(4096, 1000), (4096, 1008), (4096, 4095), (4096, 4096), (4096, 30001), (4096, 30016), (4096, 2049),
          (4096, 2064), (512, 50257), (512, 50272), (16, 1000003), (16, 1000016)]


def gbs(nbytes, fn):
    """GB/s of ``fn`` moving ``nbytes``."""
    return nbytes / time_ms(fn) * 1e-6


def row(dt, M, N):
    """GB/s of every provider on a fresh (M, N) input of dtype ``dt``, and the backward's plan and error."""
    x = fresh_copy(torch.randn(M, N, device="cuda", dtype=dt))
    y = flashlite.softmax(x)
    dy = fresh_copy(torch.randn(M, N, device="cuda", dtype=dt))
    nb = x.numel() * x.element_size()
    plan = plan_module.plan_rows(x, dt)
    if hasattr(plan_module, "plan_backward"):
        bplan = plan_module.plan_backward(plan, M, N, x.element_size(), x.device)
    else:  # a checkout from before the shared-row backward
        bplan = plan if not plan.shares_rows else plan_module.plan_softmax(M, N, x.device, "online")
    out = {
        "fwd": gbs(2 * nb, lambda: flashlite.softmax(x)),
        "fwd_online": gbs(2 * nb, lambda: flashlite.softmax(x, algorithm="online")),
        "torch_fwd": gbs(2 * nb, lambda: torch.softmax(x, -1)),
        "bwd": gbs(3 * nb, lambda: backward_module.softmax_backward(y, dy, dt, plan)),
        "torch_bwd": gbs(3 * nb, lambda: torch._softmax_backward_data(dy, y, -1, dt)),
    }
    ref = torch._softmax_backward_data(dy.double(), y.double(), -1, torch.float64)
    err = (backward_module.softmax_backward(y, dy, dt, plan).double() - ref).abs().max().item()
    out["bwd_plan"] = f"{'s' if bplan.shares_rows else bplan.algorithm[:1]}{bplan.block_m}x{bplan.block_n}"
    out["bwd_err"] = err
    return out


def main():
    """Every shape, both dtypes; a summary table last."""
    lines = []
    for dt in (torch.float32, torch.bfloat16):
        for M, N in SHAPES:
            r = row(dt, M, N)
            err = r.pop("bwd_err")
            line = f"{str(dt)[6:]:9s} {M:5d} x {N:8d} " + "  ".join(
                f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()) + f"  err {err:.1e}"
            print(line, flush=True)
            lines.append(line)
            torch.cuda.empty_cache()
    print("\nSUMMARY", os.environ.get("LABEL", ""), flashlite.__file__)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
