"""Which providers leave L2 lines that outlive do_bench's flush? (H100 check of the benchmarks' method.)

For each provider P and its inputs: fresh (demoted) copies of the inputs (common.fresh_copy); time a
plain read of them (sum, fp32) under do_bench; run P 20 times; time the read again. A ratio well above
1 means P loads (some of) its inputs with evict_last and the lines survive the memset flush, serving
whatever reads the same addresses next (bench/results/h200/TUNING.md#timing-method): then a benchmark must
time each provider on inputs of its own, as bench/softmax.py does.

    PYTHONPATH=. python bench/l2_leftovers.py
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/common.py
import flashlite  # noqa: E402
from attention import sdpa_backends  # noqa: E402  (bench/attention.py: the SDPA backends the benchmarks pin)
from common import fresh_copy, time_ms  # noqa: E402


def read_gbs(ts):
    """GB/s of reading every tensor of ``ts`` once (do_bench, L2 flushed before each run)."""
    n = sum(t.numel() * t.element_size() for t in ts)
    def read():
        for t in ts:
            t.sum(dtype=torch.float32)
    return n / time_ms(read) * 1e-6


def probe(name, make_inputs, fn, rows):
    """Read GB/s of fresh copies of ``make_inputs()`` before and after 20 calls of ``fn`` on them."""
    ins = [fresh_copy(t) for t in make_inputs()]
    torch.cuda.synchronize()
    before = read_gbs(ins)
    for _ in range(20):
        fn(*ins)
    torch.cuda.synchronize()
    after = read_gbs(ins)
    rows.append((name, before, after))
    print(f"{name:45s} read before {before:7.0f}  after {after:7.0f}  x{after / before:.2f}", flush=True)
    del ins
    torch.cuda.empty_cache()


def sdpa(backend, causal=False):
    """scaled_dot_product_attention pinned to ``backend``."""
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def probe_attention(label: str, make_inputs, rows) -> None:
    """``probe`` flashlite.flash_attention and each SDPA backend on ``make_inputs()`` (q, k, v); ``label`` has a
    ``{}`` for the provider's name."""
    probe(label.format("flashlite"), make_inputs, lambda q, k, v: flashlite.flash_attention(q, k, v), rows)
    for name, backend in sdpa_backends().items():
        try:
            probe(label.format(f"sdpa {name}"), make_inputs, sdpa(backend), rows)
        except RuntimeError as err:
            print(name, "failed", str(err)[:80])


def main():
    """Softmax, masked softmax, decoding and attention providers at sizes that fit L2 or come near it."""
    torch.manual_seed(0)
    rows = []
    comp = torch.compile(lambda x: torch.softmax(x, dim=-1), dynamic=False)
    chain = lambda s, keep: torch.softmax((s * 0.3).masked_fill(~keep, float("-inf")), dim=-1)  # noqa: E731
    comp_chain = torch.compile(chain, dynamic=False)
    for dt in (torch.float32, torch.bfloat16):
        for shape in ((4096, 1024), (4096, 4096), (16, 1 << 20), (4096, 65536)):
            mk = lambda shape=shape, dt=dt: [torch.randn(shape, device="cuda", dtype=dt)]  # noqa: E731
            probe(f"softmax compile {dt} {shape}", mk, comp, rows)
            probe(f"softmax flashlite {dt} {shape}", mk, flashlite.softmax, rows)
            probe(f"softmax torch {dt} {shape}", mk, lambda x: torch.softmax(x, -1), rows)
    # masked softmax, (4, 16, 1024, 1024) bf16 with a full mask
    shape = (4, 16, 1024, 1024)
    mk = lambda: [torch.randn(shape, device="cuda", dtype=torch.bfloat16), torch.rand(shape, device="cuda") < 0.5]  # noqa: E731
    probe("masked flashlite full", mk, lambda s, k: flashlite.masked_softmax(s, scale=0.3, mask=k), rows)
    probe("masked torch chain full", mk, chain, rows)
    probe("masked compile chain full", mk, comp_chain, rows)
    mk1 = lambda: [torch.randn(shape, device="cuda", dtype=torch.bfloat16)]  # noqa: E731
    probe("masked flashlite causal", mk1, lambda s: flashlite.masked_softmax(s, scale=0.3, causal=True), rows)
    # decode: q (1, 32, 1, 128), K/V (1, 32, 4096 / 16384, 128)
    for lk in (4096, 16384):
        mk = lambda lk=lk: [torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16),  # noqa: E731
                            *(torch.randn(1, 32, lk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))]
        probe_attention(f"decode {{}} Lk={lk}", mk, rows)
    # attention forward: (1, 16, 2048, 128) bf16, 8 MB a tensor
    mk = lambda: [torch.randn(1, 16, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]  # noqa: E731
    probe_attention("attention {} L=2048 D=128", mk, rows)
    print("\nSUMMARY (read GB/s after flush: before / after 20 calls of the provider)")
    for name, b, a in rows:
        print(f"{name:45s} {b:7.0f} {a:7.0f} x{a / b:.2f}")


if __name__ == "__main__":
    main()
