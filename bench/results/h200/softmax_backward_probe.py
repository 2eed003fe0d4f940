"""Softmax backward of (128, 131072) and its neighbours: the forward's plan, the backward's, error against fp32 and
GB/s (do_bench) of the flashlite tree at argv[1] (this one, or an older checkout's package).

    python bench/results/h200/softmax_backward_probe.py $PWD                 # this tree
    python bench/results/h200/softmax_backward_probe.py /path/to/old/tree   # e.g. 5996bd0's flashlite/

Its lines for this tree and 5996bd0 are in softmax_backward_probe.log (TUNING#quack-short-and-backward)."""
import importlib, sys, os
sys.path.insert(0, sys.argv[1])
import torch, triton
sys.path.insert(1, os.path.join(os.getcwd(), "bench"))
try:
    P = importlib.import_module('flashlite.softmax.plan'); B = importlib.import_module('flashlite.softmax.backward')
except ImportError:
    P = B = importlib.import_module('flashlite.softmax')
import flashlite
print(sys.argv[1], flashlite.__file__)
for dt in (torch.float32, torch.bfloat16):
    for shape in ((128, 131072), (64, 262144), (256, 65536), (4096, 65536)):
        y = torch.softmax(torch.randn(*shape, device="cuda"), -1).to(dt)
        dy = torch.randn_like(y)
        p = P.plan_rows(y, dt)
        bp = B.plan_backward(p, *shape, y.element_size(), y.device)
        f = lambda: B.softmax_backward(y, dy, dt, p)
        ref = (y.float() * (dy.float() - (dy.float() * y.float()).sum(-1, keepdim=True)))
        err = (f().float() - ref).abs().max().item()
        ms = triton.testing.do_bench(f, warmup=25, rep=100)
        print(f"{str(dt):15} {shape}: {3 * y.numel() * y.element_size() / ms / 1e6:7.0f} GB/s err {err:.1e} fwd {p.algorithm}/{p.n_splits}/{p.block_n}/{p.num_warps} bwd {bp}", flush=True)
