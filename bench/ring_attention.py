"""Ring attention (``flashlite.distributed.ring_attention``): its pieces timed on one GPU and the scaling they
predict; under torchrun, the ring itself.

    python bench/ring_attention.py                     # one GPU: pieces, prediction -> ring_attention.{json,md,png}
    python bench/ring_attention.py --lengths 131072 --worlds 2 4   # a quick subset
    python bench/ring_attention.py --dry-run           # shard bytes and NVLink transfer times only (no GPU needed)
    torchrun --nproc-per-node 8 bench/ring_attention.py [--baseline DIR/ring_attention.json]
                                                       # the ring on 8 GPUs -> ring_attention_p8.{json,md}
    torchrun --nproc-per-node 4 bench/ring_attention.py --varlen --lengths 131072 262144 524288
                                                       # the packed ring -> ring_attention_varlen_p4.{json,md}

Shapes (issue 34): bf16, B = 1, H = 32 query heads, H_kv = 8, D = 128, causal, global L from 128K to 1M tokens;
P ranks in {2, 4, 8} each hold a zigzag shard of L/P positions (``flashlite.distributed``).

One GPU (no torchrun). For each L, the whole problem once: ``flash_attention`` forward and forward+backward
(``single_*``). For each (L, P), on one rank's shard, the pieces of the ring as ``flashlite.distributed`` runs
them: the diagonal step (local causal attention of the shard), the two non-causal half-shard calls of the
other steps (``pair_a``: all queries against the first half of an earlier rank's shard; ``pair_b``: the second
half of the queries against a later rank's whole shard), the merge into the fp32 running output (time, GB/s
and fraction of the copy bandwidth measured in the same run), the same for the backward
(``distributed.block_gradients`` plus the fp32 sums), and the bytes of a K/V shard (bf16) and of its
gradients (fp32) with their transfer times at NVLink 4's published 450 GB/s a direction (H200 SXM: 18 links,
900 GB/s both directions together). The prediction, for the slower of the two extreme ranks (rank P − 1 runs
``pair_a`` steps with whole-shard merges, rank 0 ``pair_b`` steps with half-shard merges):

    forward:  Σ_{s < P-1} max(compute_s, t_kv) + compute_{P-1}
    backward: Σ_s max(compute_s, t_kv·[s < P-1] + t_dkv·[s > 0]) + t_dkv   (dK/dV travel with the next shard)

(forward ``compute_s`` = attention + merge; step 0: the diagonal + the first copy into the fp32 result), and
the scaling efficiency ``(single / P) / ring``, forward and forward+backward. Transfers are assumed to overlap
compute fully (NCCL's send/receive kernels occupy a few multiprocessors while they run: not modelled) and to
reach the published bandwidth (NCCL's point-to-point reaches less: the torchrun mode measures it).

Under torchrun (world_size > 1): the real ring on the node's GPUs, forward and forward+backward (a barrier
before each run, the slowest rank's time), the measured point-to-point bandwidth of one K/V shard transfer, and
the efficiency against the whole problem on one GPU (``--baseline``: a single-GPU run's JSON, else rank 0
measures it while the others wait).

Packed batches (``--varlen``, torchrun): ``ring_attention_varlen`` on a packed batch of L tokens whose
documents are drawn (seeded) from the long-context mix ``round(exp(N(log 4096, 1.5)))`` clipped to [256, 65536]
and rounded down to a multiple of 16 (every rank count up to 8 cuts them into 2P equal chunks), the last one cut
so that they sum to L: many documents of a few thousand tokens, a few long ones. Each rank holds its
``varlen_shard``; the whole batch's ``flash_attention_varlen`` on one GPU is the baseline, timed by rank 0 in
the same job. Before timing, a 4K-token batch checks the ring's output and gradients against that single-GPU
call, both against an fp32 reference per document (FlashAttention's rule: the ring's error at most twice the
single call's, plus a floor); the errors go into the JSON.

Environment: NVLink multicast stays off on this workplace's machines and must stay off: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set here (``os.environ.setdefault``, before
torch.distributed starts), never cuMulticastCreate.
"""

from __future__ import annotations

import os

# NVLink multicast off (module docstring), before torch or NCCL read the environment.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in MULTICAST_OFF.items():
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flashlite  # noqa: E402
from flashlite import distributed as ring_mod  # noqa: E402
from flashlite.attention.merge import merge_states_into  # noqa: E402

from common import (  # noqa: E402
    attention_flops, backward_flops, copy_bandwidth_gbs, environment, gbs, markdown_table, plot_lines, results_dir,
    tflops, time_ms, write_results,
)

BATCH, HEADS, KV_HEADS, HEAD_DIM = 1, 32, 8, 128
DEVICE = "cuda"
LENGTHS = [131072, 262144, 524288, 1048576]
WORLDS = [2, 4, 8]
# NVLink 4 on an H200 SXM: 18 links x 25 GB/s a direction = 450 GB/s each way (900 GB/s bidirectional), NVIDIA's
# published figure; through NVSwitch every GPU pair gets it, so each rank of a ring sends and receives at it.
NVLINK_GBS = 450.0
# Targets of issue 34 (H200s, L >= 256K): scaling efficiency at P = 2, and at P = 4 and 8.
TARGET_EFF_P2, TARGET_EFF_P48, TARGET_MIN_L = 0.90, 0.85, 262144
TARGET_EFF_VARLEN = 0.90  # issue 46: the packed ring at P = 2 and 4, forward and forward+backward
# Calls longer than this are not timed by do_bench (its estimation runs alone would take tens of seconds).
LONG_CALL_MS = 200.0
# A long call's first run is its time when nothing was compiled in it; long calls of at least this are otherwise
# timed by one more run, shorter ones by the median of three more (1M-token calls take seconds each).
ONE_RUN_MS = 2000.0


# ----------------------------------------------------------------------------- the model's numbers


def kv_shard_bytes(shard: int, elem: int = 2) -> int:
    """Bytes of one rank's K and V shard (bf16; ``elem=4``: its fp32 gradients, which travel in the backward)."""
    return 2 * BATCH * KV_HEADS * shard * HEAD_DIM * elem


def merge_bytes(rows: int) -> int:
    """Bytes a merge into the fp32 running output moves: the fp32 output read and written, the bf16 partial read,
    and per row the three fp32 LSEs (two read, one written)."""
    return BATCH * HEADS * rows * (HEAD_DIM * (4 + 2 + 4) + 3 * 4)


def transfer_ms(n_bytes: int, gbs_per_direction: float = NVLINK_GBS) -> float:
    return n_bytes / gbs_per_direction * 1e-6


def predict_forward_ms(diag_ms: float, pair_ms: float, first_copy_ms: float, world: int, t_kv: float) -> float:
    """Forward ring time of one rank whose non-diagonal steps each take ``pair_ms`` (attention and merge)."""
    steps = [diag_ms + first_copy_ms] + [pair_ms] * (world - 1)
    return sum(max(c, t_kv) for c in steps[:-1]) + steps[-1]


def predict_backward_ms(diag_ms: float, pair_ms: float, world: int, t_kv: float, t_dkv: float) -> float:
    """Backward ring time of one rank: step s overlaps the next shard's transfer and the previous gradients'."""
    steps = [diag_ms] + [pair_ms] * (world - 1)
    link = [t_kv * (s < world - 1) + t_dkv * (s > 0) for s in range(world)]
    return sum(max(c, t) for c, t in zip(steps, link)) + t_dkv


def efficiency(single_ms: float | None, world: int, ring_ms: float | None) -> float | None:
    """Scaling efficiency: one GPU's time on the whole problem over P, against the ring's time on P GPUs."""
    return None if not single_ms or not ring_ms else single_ms / world / ring_ms


# ----------------------------------------------------------------------------- timing


def once_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


@contextlib.contextmanager
def counting_compiles():
    """Yields a list that grows by one entry for every Triton kernel built inside the block (Triton's
    ``knobs.runtime.jit_cache_hook``, called before each build); None where this Triton has no such hook."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        yield None
        return
    built, before = [], runtime.jit_cache_hook

    def hook(*args, **kwargs):
        built.append(kwargs.get("repr"))
        return before(*args, **kwargs) if before else None  # a true value would skip the build

    runtime.jit_cache_hook = hook
    try:
        yield built
    finally:
        runtime.jit_cache_hook = before


def timed_ms(fn) -> float:
    """Milliseconds of ``fn``: do_bench's median for short calls; for long ones the first run when it built no
    kernel (else one more run, or three for calls under ``ONE_RUN_MS``)."""
    with counting_compiles() as built:
        first = once_ms(fn)
    if first < LONG_CALL_MS:
        return time_ms(fn)
    if built is not None and not built:
        return first
    second = once_ms(fn)
    return second if second >= ONE_RUN_MS else statistics.median([second, once_ms(fn), once_ms(fn)])


# ----------------------------------------------------------------------------- one GPU


def random_bf16(*shape, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16).requires_grad_(requires_grad)


def measure_single(length: int) -> dict:
    """The whole problem on one GPU: flash_attention forward, and forward+backward, causal."""
    q = random_bf16(BATCH, HEADS, length, HEAD_DIM, requires_grad=True)
    k, v = (random_bf16(BATCH, KV_HEADS, length, HEAD_DIM, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    flops = attention_flops(BATCH, HEADS, length, length, HEAD_DIM, True)
    with torch.no_grad():
        fwd = timed_ms(lambda: flashlite.flash_attention(q, k, v, causal=True))
    fwdbwd = timed_ms(lambda: torch.autograd.grad(flashlite.flash_attention(q, k, v, causal=True), (q, k, v), do))
    row = {"L": length, "single_fwd_ms": fwd, "single_fwdbwd_ms": fwdbwd, "single_fwd_tflops": tflops(flops, fwd),
           "single_fwdbwd_tflops": tflops(3.5 * flops, fwdbwd)}
    del q, k, v, do
    torch.cuda.empty_cache()
    return row


def measure_pieces(shard: int, copy_gbs: float) -> dict:
    """The pieces of one rank's ring steps on a shard of ``shard`` positions (module docstring): they depend on
    the shard only, so (L, P) = (1M, 4) and (512K, 2) share them."""
    half = shard // 2
    scale = 1.0 / math.sqrt(HEAD_DIM)
    q = random_bf16(BATCH, HEADS, shard, HEAD_DIM)
    held = torch.stack([random_bf16(BATCH, KV_HEADS, shard, HEAD_DIM) for _ in range(2)])  # the ring's buffer
    k, v = held[0], held[1]
    do = torch.randn_like(q)
    with torch.no_grad():
        o, lse = flashlite.flash_attention(q, k, v, causal=True, return_lse=True)
    acc, acc_lse = o.float(), lse.clone()
    calls = {  # (query rows, key rows, causal) of the three kinds of step
        "diag": (slice(None), slice(None), True),
        "pair_a": (slice(None), slice(0, half), False),
        "pair_b": (slice(half, None), slice(None), False),
    }
    row = {"shard": shard}
    with torch.no_grad():
        for name, (rows, keys, causal) in calls.items():
            flops = attention_flops(BATCH, HEADS, q[:, :, rows].shape[2], k[:, :, keys].shape[2], HEAD_DIM, causal)
            fn = (lambda rows=rows, keys=keys, causal=causal: flashlite.flash_attention(
                q[:, :, rows], k[:, :, keys], v[:, :, keys], causal=causal, scale=scale, return_lse=True))
            row[f"{name}_fwd_ms"] = timed_ms(fn)
            row[f"{name}_fwd_tflops"] = tflops(flops, row[f"{name}_fwd_ms"])
        # Merges of a bf16 partial into the fp32 running result, in place, as ring_forward makes them: of every row
        # (after a pair_a step), of the second half (pair_b). The partial's values do not change the time: the
        # diagonal step's output stands for it.
        for name, rows in (("merge", slice(None)), ("merge_half", slice(half, None))):
            part, part_lse = o[:, :, rows].contiguous(), lse[:, :, rows].contiguous()
            n_bytes = merge_bytes(part.shape[2])
            row[f"{name}_ms"] = timed_ms(lambda rows=rows, part=part, part_lse=part_lse: merge_states_into(
                acc[:, :, rows], acc_lse[:, :, rows], part, part_lse, acc[:, :, rows], acc_lse[:, :, rows]))
            row[f"{name}_GBs"] = gbs(n_bytes, row[f"{name}_ms"])
        row["merge_frac_copy"] = row["merge_GBs"] / copy_gbs
        row["first_copy_ms"] = timed_ms(lambda: (acc.copy_(o), acc_lse.copy_(lse)))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=DEVICE)
    dkv = torch.zeros(held.shape, dtype=torch.float32, device=DEVICE)
    for name, (rows, keys, causal) in calls.items():
        def step(rows=rows, keys=keys, causal=causal):  # as ring_backward's loop body, without the transfers
            dq_part, dk_part, dv_part = ring_mod.block_gradients(
                do[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], o[:, :, rows], lse[:, :, rows], None,
                causal, scale, True)
            dq[:, :, rows] += dq_part
            dkv[0][:, :, keys] += dk_part
            dkv[1][:, :, keys] += dv_part

        flops = backward_flops(BATCH, HEADS, q[:, :, rows].shape[2], k[:, :, keys].shape[2], HEAD_DIM, causal)
        row[f"{name}_bwd_ms"] = timed_ms(step)
        row[f"{name}_bwd_tflops"] = tflops(flops, row[f"{name}_bwd_ms"])
    row["kv_shard_MB"] = kv_shard_bytes(shard) / 1e6
    row["t_kv_ms"] = transfer_ms(kv_shard_bytes(shard))
    row["t_dkv_ms"] = transfer_ms(kv_shard_bytes(shard, elem=4))
    del q, held, k, v, do, o, lse, acc, acc_lse, dq, dkv
    torch.cuda.empty_cache()
    return row


def predict(row: dict, single: dict) -> None:
    """The ring's predicted times and efficiencies (module docstring), into ``row``."""
    world, t_kv, t_dkv = row["P"], row["t_kv_ms"], row["t_dkv_ms"]
    fwd = max(predict_forward_ms(row["diag_fwd_ms"], row["pair_a_fwd_ms"] + row["merge_ms"], row["first_copy_ms"],
                                 world, t_kv),
              predict_forward_ms(row["diag_fwd_ms"], row["pair_b_fwd_ms"] + row["merge_half_ms"],
                                 row["first_copy_ms"], world, t_kv))
    bwd = max(predict_backward_ms(row["diag_bwd_ms"], row[f"{pair}_bwd_ms"], world, t_kv, t_dkv)
              for pair in ("pair_a", "pair_b"))
    row["pred_fwd_ms"], row["pred_fwdbwd_ms"] = fwd, fwd + bwd
    row["single_fwd_ms"], row["single_fwdbwd_ms"] = single["single_fwd_ms"], single["single_fwdbwd_ms"]
    row["eff_fwd"] = efficiency(single["single_fwd_ms"], world, fwd)
    row["eff_fwdbwd"] = efficiency(single["single_fwdbwd_ms"], world, fwd + bwd)
    row["transfer_hidden"] = t_kv + t_dkv <= min(row["pair_a_bwd_ms"], row["pair_b_bwd_ms"]) and t_kv <= min(
        row["pair_a_fwd_ms"], row["pair_b_fwd_ms"])


MODEL_COLUMNS = ["L", "P", "shard", "kv_shard_MB", "t_kv_ms", "t_dkv_ms", "diag_fwd_ms", "pair_a_fwd_ms",
                 "pair_b_fwd_ms", "pair_a_fwd_tflops", "merge_ms", "merge_GBs", "merge_frac_copy", "diag_bwd_ms",
                 "pair_a_bwd_ms", "pair_b_bwd_ms", "single_fwd_ms", "single_fwdbwd_ms", "pred_fwd_ms",
                 "pred_fwdbwd_ms", "eff_fwd", "eff_fwdbwd", "transfer_hidden"]


def run_model(args) -> None:
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; NVLink {NVLINK_GBS:.0f} GB/s a direction (published); "
          f"B={BATCH} H={HEADS} H_kv={KV_HEADS} D={HEAD_DIM} bf16 causal", flush=True)
    sweep = [(n, w) for n in sorted(args.lengths) for w in sorted(args.worlds) if n % (2 * w) == 0]
    singles, pieces = {}, {}
    for length in sorted({n for n, _ in sweep}):
        t0 = time.time()
        singles[length] = measure_single(length)
        print(f"L={length}: one GPU fwd {singles[length]['single_fwd_ms']:.0f} ms, fwd+bwd "
              f"{singles[length]['single_fwdbwd_ms']:.0f} ms ({time.time() - t0:.0f} s)", flush=True)
    for shard in sorted({n // w for n, w in sweep}):
        t0 = time.time()
        pieces[shard] = row = measure_pieces(shard, copy_gbs)
        print(f"shard {shard}: pair fwd {row['pair_a_fwd_ms']:.1f}/{row['pair_b_fwd_ms']:.1f} ms, diag "
              f"{row['diag_fwd_ms']:.1f}, merge {row['merge_ms']:.2f} ms ({row['merge_GBs']:.0f} GB/s), bwd pair "
              f"{row['pair_a_bwd_ms']:.1f}/{row['pair_b_bwd_ms']:.1f} diag {row['diag_bwd_ms']:.1f} ms, K/V "
              f"{row['t_kv_ms']:.2f} ms at {NVLINK_GBS:.0f} GB/s ({time.time() - t0:.0f} s)", flush=True)
    rows = []
    for length, world in sweep:
        row = {"L": length, "P": world, **pieces[length // world]}
        predict(row, singles[length])
        rows.append(row)
    meta = environment() | {"copy_GBs": copy_gbs, "nvlink_GBs_per_direction": NVLINK_GBS, "batch": BATCH,
                            "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                            "causal": True, "env": {k: os.environ.get(k) for k in MULTICAST_OFF}}
    out = results_dir(args.out)
    write_results("ring_attention", out, meta, rows, MODEL_COLUMNS,
                  "Ring attention on one GPU: pieces and predicted scaling (bf16, H = 32, H_kv = 8, D = 128, causal)")
    with open(os.path.join(out, "ring_attention.json"), "w") as f:  # write_results keeps rows only: add the singles
        json.dump({"meta": meta, "rows": rows, "single": list(singles.values())}, f, indent=1)
    lengths, worlds = sorted(singles), sorted({w for _, w in sweep})
    panels = [(f"predicted efficiency, {kind}", lengths,
               {f"P={w}": [next((r[f"eff_{kind}"] for r in rows if r["L"] == n and r["P"] == w), None)
                           for n in lengths] for w in worlds}, "(single / P) / ring") for kind in ("fwd", "fwdbwd")]
    plot_lines(os.path.join(out, "ring_attention.png"), panels)
    print(markdown_table(rows, ["L", "P", "pred_fwd_ms", "pred_fwdbwd_ms", "eff_fwd", "eff_fwdbwd",
                                "transfer_hidden"]))
    print_summary(rows, "predicted")


def print_summary(rows: list[dict], what: str) -> None:
    judged = [r for r in rows if r["L"] >= TARGET_MIN_L]
    misses = [f"L={r['L']} P={r['P']}: {r['eff_fwdbwd'] or 0:.3f}" for r in judged
              if (r["eff_fwdbwd"] or 0) < (TARGET_EFF_P2 if r["P"] == 2 else TARGET_EFF_P48)]
    if not judged:
        print(f"\ntarget: no shape with L >= {TARGET_MIN_L} in this run")
        return
    print(f"\ntarget ({what}, fwd+bwd, L >= {TARGET_MIN_L}): >= {TARGET_EFF_P2} at P = 2, >= {TARGET_EFF_P48} at "
          f"P = 4, 8: " + ("all met" if not misses else f"{len(misses)} missed"))
    for miss in misses:
        print("  missed: " + miss)


# ----------------------------------------------------------------------------- torchrun: the ring itself


def ring_ms(fn, repeats: int) -> float:
    """The slowest rank's median milliseconds of ``fn`` (a barrier before each run), after one untimed run."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        ms = torch.tensor([once_ms(fn)], device=DEVICE)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        times.append(ms.item())
    return statistics.median(times)


def load_baseline(path: str | None) -> dict:
    """{L: single-GPU row} from a single-GPU run's ring_attention.json, or {}."""
    if not path:
        return {}
    with open(path) as f:
        return {row["L"]: row for row in json.load(f)["single"]}


def run_ring(args) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    baseline, rows = load_baseline(args.baseline), []
    for length in sorted(args.lengths):
        if length % (2 * world):
            continue
        shard = length // world
        q = random_bf16(BATCH, HEADS, shard, HEAD_DIM, requires_grad=True)
        k, v = (random_bf16(BATCH, KV_HEADS, shard, HEAD_DIM, requires_grad=True) for _ in range(2))
        do = torch.randn_like(q)
        repeats = args.repeats if length <= 262144 else 1
        with torch.no_grad():
            fwd = ring_ms(lambda: ring_mod.ring_attention(q, k, v, causal=True), repeats)
        fwdbwd = ring_ms(lambda: torch.autograd.grad(ring_mod.ring_attention(q, k, v, causal=True), (q, k, v), do),
                         repeats)
        ring = ring_mod.Ring(None)
        kv = torch.stack([k.detach(), v.detach()])
        buffer = torch.empty_like(kv)
        p2p = ring_ms(lambda: ring_mod.Ring.wait(ring.start(kv, buffer)), 5)
        del q, k, v, do, kv, buffer
        torch.cuda.empty_cache()
        single = baseline.get(length)
        if single is None:  # rank 0 times the whole problem while the others wait
            single = measure_single(length) if rank == 0 else None
            dist.barrier()
        if rank == 0:
            row = {"L": length, "P": world, "shard": shard, "ring_fwd_ms": fwd, "ring_fwdbwd_ms": fwdbwd,
                   "p2p_GBs": gbs(kv_shard_bytes(shard), p2p), "kv_shard_MB": kv_shard_bytes(shard) / 1e6,
                   "single_fwd_ms": single["single_fwd_ms"], "single_fwdbwd_ms": single["single_fwdbwd_ms"],
                   "eff_fwd": efficiency(single["single_fwd_ms"], world, fwd),
                   "eff_fwdbwd": efficiency(single["single_fwdbwd_ms"], world, fwdbwd)}
            rows.append(row)
            print(row, flush=True)
    if rank == 0:
        meta = environment() | {"command": f"torchrun --nproc-per-node {world} bench/ring_attention.py "
                                           + " ".join(sys.argv[1:]),
                                "world_size": world, "batch": BATCH, "heads": HEADS, "kv_heads": KV_HEADS,
                                "head_dim": HEAD_DIM, "dtype": "bfloat16", "causal": True,
                                "baseline": args.baseline, "env": {k: os.environ.get(k) for k in MULTICAST_OFF}}
        cols = ["L", "P", "shard", "kv_shard_MB", "p2p_GBs", "ring_fwd_ms", "ring_fwdbwd_ms", "single_fwd_ms",
                "single_fwdbwd_ms", "eff_fwd", "eff_fwdbwd"]
        write_results(f"ring_attention_p{world}", results_dir(args.out), meta, rows, cols,
                      f"Ring attention on {world} GPUs (bf16, H = 32, H_kv = 8, D = 128, causal)")
        print(markdown_table(rows, cols))
        print_summary(rows, "measured")
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- torchrun: the packed ring


VARLEN_ALIGN = 16  # every document a multiple of 2P for P <= 8
VARLEN_CHECK_TOKENS = 4096


def document_mix(total: int, seed: int = 0) -> list[int]:
    """Document lengths of one packed batch of ``total`` tokens (module docstring's long-context mix)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, filled = [], 0
    while filled < total:
        n = math.exp(math.log(4096) + 1.5 * float(torch.randn(1, generator=gen)))
        n = min(max(int(n) // VARLEN_ALIGN * VARLEN_ALIGN, 256), 65536, total - filled)
        lengths.append(n)
        filled += n
    return lengths


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)


def varlen_flops(lengths: list[int]) -> float:
    """Causal forward FLOPs of the documents: 4·H·D per visible (query, key) pair."""
    return 4.0 * HEADS * HEAD_DIM * sum(n * (n + 1) // 2 for n in lengths)


def varlen_batch(lengths: list[int], requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    total = sum(lengths)
    q = torch.randn(total, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(total, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def reference_fp32(q, k, v, lengths: list[int], do: torch.Tensor) -> list[torch.Tensor]:
    """(o, dq, dk, dv) of causal attention per document in fp32 PyTorch ops (the check's reference)."""
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    outs, start = [], 0
    for n in lengths:
        qb, kb, vb = (t[start:start + n].transpose(0, 1).unsqueeze(0) for t in leaves)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        start += n
    o = torch.cat(outs)
    return [o.detach(), *torch.autograd.grad(o, leaves, do.float())]


def check_varlen_ring(world: int, rank: int) -> dict:
    """The ring's o, dq, dk, dv on a small packed batch against one GPU's ``flash_attention_varlen`` (module
    docstring): {name: (ring error, single error)} against the fp32 reference, and whether all pass."""
    lengths = [256, 1024, 512, 2048, 256]
    assert sum(lengths) == VARLEN_CHECK_TOKENS
    torch.manual_seed(0)  # the same batch on every rank
    q, k, v = varlen_batch(lengths)
    do = torch.randn_like(q)
    cu = cu_of(lengths)
    shards = [ring_mod.varlen_shard(t, cu, rank, world).requires_grad_() for t in (q, k, v)]
    o = ring_mod.ring_attention_varlen(*shards, cu, max(lengths), causal=True)
    grads = torch.autograd.grad(o, shards, ring_mod.varlen_shard(do, cu, rank, world))
    ring = []
    for t in (o.detach(), *grads):
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t.contiguous())
        ring.append(ring_mod.varlen_unshard(gathered, cu))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    single_o = flashlite.flash_attention_varlen(*leaves, cu, cu, max(lengths), max(lengths), causal=True)
    single = [single_o.detach(), *torch.autograd.grad(single_o, leaves, do)]
    ref = reference_fp32(q, k, v, lengths, do)
    errors, ok = {}, True
    for name, a, b, r in zip(("o", "dq", "dk", "dv"), ring, single, ref):
        ring_err, single_err = (float((x.float() - r).abs().max()) for x in (a, b))
        errors[name] = (ring_err, single_err)
        ok &= ring_err <= 2 * single_err + 1e-3 * float(r.abs().max())
    return {"errors_vs_fp32": errors, "passed": ok}


def measure_single_varlen(lengths: list[int]) -> dict:
    """The whole packed batch on one GPU: flash_attention_varlen forward, and forward+backward, causal."""
    q, k, v = varlen_batch(lengths, requires_grad=True)
    do, cu, longest = torch.randn_like(q), cu_of(lengths), max(lengths)

    def call():
        return flashlite.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)

    with torch.no_grad():
        fwd = timed_ms(call)
    fwdbwd = timed_ms(lambda: torch.autograd.grad(call(), (q, k, v), do))
    del q, k, v, do
    torch.cuda.empty_cache()
    return {"single_fwd_ms": fwd, "single_fwdbwd_ms": fwdbwd}


def profile_ring(fn, rank: int, path: str, title: str) -> None:
    """One call of ``fn`` on every rank under ``torch.profiler``; rank 0 appends to ``path`` its wall time, the
    sum of its compute kernels' and of its NCCL kernels' times, and the kernels' table."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = once_ms(fn)
    if rank:
        return
    events = [e for e in prof.key_averages()  # kernels only (an op's row repeats its kernels' time)
              if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    nccl = sum(e.self_device_time_total for e in events if "nccl" in e.key.lower()) / 1e3
    compute = sum(e.self_device_time_total for e in events if "nccl" not in e.key.lower()) / 1e3
    line = f"{title}: wall {wall:.1f} ms, compute kernels {compute:.1f} ms, NCCL kernels {nccl:.1f} ms"
    print(line, flush=True)
    with open(path, "a") as f:
        f.write(line + "\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30) + "\n\n")


def run_ring_varlen(args) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    check = check_varlen_ring(world, rank)
    if rank == 0:
        print(f"check ({VARLEN_CHECK_TOKENS} tokens, against fp32): {check}", flush=True)
    rows = []
    for length in sorted(args.lengths):
        lengths = document_mix(length)
        cu = cu_of(lengths)
        torch.manual_seed(rank)
        q, k, v = (t.requires_grad_() for t in varlen_batch([n // world for n in lengths]))  # this rank's shards
        do = torch.randn_like(q)
        repeats = args.repeats if length <= 262144 else 2

        def call():
            return ring_mod.ring_attention_varlen(q, k, v, cu, max(lengths), causal=True)

        if args.profile:  # where one rank's time goes, at the first length; nothing is timed after a profile
            path = os.path.join(results_dir(args.out), f"ring_varlen_profile_p{world}.txt")
            with torch.no_grad():
                profile_ring(call, rank, path, f"forward, L = {length}, P = {world}")
            profile_ring(lambda: torch.autograd.grad(call(), (q, k, v), do), rank, path,
                         f"forward+backward, L = {length}, P = {world}")
            break
        with torch.no_grad():
            fwd = ring_ms(call, repeats)
        fwdbwd = ring_ms(lambda: torch.autograd.grad(call(), (q, k, v), do), repeats)
        ring = ring_mod.Ring(None)
        kv = torch.stack([k.detach(), v.detach()])  # the bytes of the ring's K/V shard
        buffer = torch.empty_like(kv)
        p2p = ring_ms(lambda: ring_mod.Ring.wait(ring.start(kv, buffer)), 5)
        del q, k, v, do, kv, buffer
        torch.cuda.empty_cache()
        single = measure_single_varlen(lengths) if rank == 0 else None
        dist.barrier()
        if rank == 0:
            flops = varlen_flops(lengths)
            row = {"L": length, "P": world, "docs": len(lengths), "longest": max(lengths),
                   "median_doc": int(statistics.median(lengths)), "shard": length // world,
                   "p2p_GBs": gbs(kv_shard_bytes(length // world), p2p), "ring_fwd_ms": fwd,
                   "ring_fwdbwd_ms": fwdbwd, "single_fwd_ms": single["single_fwd_ms"],
                   "single_fwdbwd_ms": single["single_fwdbwd_ms"],
                   "single_fwd_tflops": tflops(flops, single["single_fwd_ms"]),
                   "ring_fwd_tflops_per_gpu": tflops(flops / world, fwd),
                   "eff_fwd": efficiency(single["single_fwd_ms"], world, fwd),
                   "eff_fwdbwd": efficiency(single["single_fwdbwd_ms"], world, fwdbwd)}
            rows.append(row)
            print(row, flush=True)
    if rank == 0 and rows:
        meta = environment() | {"command": f"torchrun --nproc-per-node {world} bench/ring_attention.py "
                                           + " ".join(sys.argv[1:]),
                                "world_size": world, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                "dtype": "bfloat16", "causal": True,
                                "mix": "round(exp(N(log 4096, 1.5))) clipped to [256, 65536], multiples of 16",
                                "check": check, "env": {k: os.environ.get(k) for k in MULTICAST_OFF}}
        cols = ["L", "P", "docs", "median_doc", "longest", "p2p_GBs", "ring_fwd_ms", "ring_fwdbwd_ms",
                "single_fwd_ms", "single_fwdbwd_ms", "single_fwd_tflops", "eff_fwd", "eff_fwdbwd"]
        write_results(f"ring_attention_varlen_p{world}", results_dir(args.out), meta, rows, cols,
                      f"Packed ring attention on {world} GPUs (bf16, H = 32, H_kv = 8, D = 128, causal, "
                      "long-context document mix)")
        print(markdown_table(rows, cols))
        misses = [f"L={r['L']}: fwd {r['eff_fwd']:.3f}, fwd+bwd {r['eff_fwdbwd']:.3f}" for r in rows
                  if min(r["eff_fwd"] or 0, r["eff_fwdbwd"] or 0) < TARGET_EFF_VARLEN]
        print(f"\ntarget (packed ring, >= {TARGET_EFF_VARLEN} at P = 2 and 4): "
              + ("all met" if not misses else "missed: " + "; ".join(misses)))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- no GPU


def dry_run(args) -> None:
    """The shapes, shard bytes and transfer times of the sweep, and each step's FLOPs: what needs no GPU."""
    rows = []
    for length in sorted(args.lengths):
        for world in sorted(args.worlds):
            if length % (2 * world):
                continue
            shard = length // world
            rows.append({"L": length, "P": world, "shard": shard, "kv_shard_MB": kv_shard_bytes(shard) / 1e6,
                         "t_kv_ms": transfer_ms(kv_shard_bytes(shard)),
                         "t_dkv_ms": transfer_ms(kv_shard_bytes(shard, elem=4)),
                         "merge_MB": merge_bytes(shard) / 1e6,
                         "pair_TFLOP": attention_flops(BATCH, HEADS, shard, shard // 2, HEAD_DIM, False) / 1e12,
                         "single_TFLOP": attention_flops(BATCH, HEADS, length, length, HEAD_DIM, True) / 1e12})
    print(markdown_table(rows, list(rows[0]) if rows else []))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="output folder (default bench/results/<gpu>)")
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="global sequence lengths L")
    parser.add_argument("--worlds", type=int, nargs="+", default=WORLDS, help="ranks P modelled on one GPU")
    parser.add_argument("--baseline", help="torchrun: a single-GPU run's ring_attention.json (the whole-problem "
                                           "times); default: rank 0 measures them")
    parser.add_argument("--repeats", type=int, default=5, help="torchrun: timed runs of the ring up to L = 256K")
    parser.add_argument("--dry-run", action="store_true", help="print shard bytes and transfer times; no GPU")
    parser.add_argument("--varlen", action="store_true", help="torchrun: the packed ring (ring_attention_varlen)")
    parser.add_argument("--profile", action="store_true", help="with --varlen: profile the first length's calls "
                                                                "-> ring_varlen_profile_p<P>.txt (and time none)")
    args = parser.parse_args(argv)
    for name in ("lengths", "worlds"):
        if any(n < 1 for n in getattr(args, name)):
            parser.error(f"--{name} must be positive")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        run_ring_varlen(args) if args.varlen else run_ring(args)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/ring_attention.py times CUDA kernels: run it on a GPU (or pass --dry-run)")
        run_model(args)


if __name__ == "__main__":
    main()
