"""``flashlite.distributed``: ring attention on 2 and 4 CPU ranks (gloo), against single-process ``flash_attention``.

Each world size is spawned once (``torch.multiprocessing``, a free port) and runs every case of ``CASES``; each
rank saves its shards of the output, the LSE and dq/dk/dv, and the tests here unshard them (``zigzag_unshard``)
and hold them to FlashAttention's rule against float64, with the single-process ``flash_attention`` on the
whole tensors as the baseline error. Ranks inherit ``TRITON_INTERPRET=1`` from this process's environment
(conftest sets it before triton is imported), so they run the kernels through the interpreter, on 16 × 16
tiles: a shard of 18 positions is two query tiles (the second ragged), 10 or 6 is one ragged tile. Cases:
causal (the zigzag's three kinds of step: the local diagonal, the earlier ranks' first halves, the later
ranks' shards against the second half of the queries) and not, MHA/GQA/MQA, fp32 and bf16, a gradient through
the LSE, the PyTorch path (no kernels), a ring over each of two subgroups of the world (``group``; global
ranks 2 and 3 are the second ring's 0 and 1). In this process: zigzag_shard/unshard, one rank (P = 1), and
bad arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import zlib

import pytest
import torch
import torch.distributed as dist

import flashlite
from flashlite.attention import tuning
from flashlite.attention.tuning import AttentionConfig, BackwardConfig
from flashlite.core.runtime import interpreter_enabled, pytorch_path
from flashlite.distributed import ring_attention, zigzag_shard, zigzag_unshard

from .utils import assert_attention_close, attention_ref, made_once, spawn_ranks

TILES_16 = AttentionConfig(16, 16, 4, 1)
RANKS_TIMEOUT_S = 240  # every case of one world size, spawned ranks included; a hang fails rather than blocks
LSE_ATOL = 1e-5  # LSEs are fp32 sums of fp32 scores on every path


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    heads: int
    kv_heads: int
    chunk: int  # zigzag chunk c: each rank holds 2c positions of a sequence of 2·P·c
    head_dim: int = 16
    dtype: torch.dtype = torch.float32
    causal: bool = True
    batch: int = 1
    lse_grad: bool = False  # the loss also takes the returned LSE (a gradient through it)
    pytorch: bool = False  # flashlite's PyTorch path instead of the kernels (core.runtime.pytorch_path)
    subgroups: int = 1  # the world split into this many rings of consecutive ranks (the `group` argument)


CASES = {
    2: [
        Case("causal_gqa_lse", heads=4, kv_heads=2, chunk=9, lse_grad=True),  # shards of 18: two tiles
        Case("full_mha", heads=2, kv_heads=2, chunk=9, causal=False, batch=2),
        Case("causal_mqa_bf16", heads=4, kv_heads=1, chunk=5, head_dim=32, dtype=torch.bfloat16),
        Case("causal_pytorch_path", heads=4, kv_heads=2, chunk=6, lse_grad=True, pytorch=True),
    ],
    4: [
        Case("causal_gqa_lse", heads=4, kv_heads=2, chunk=5, lse_grad=True),  # shards of 10, L = 40
        Case("full_gqa", heads=4, kv_heads=2, chunk=3, causal=False),
        Case("causal_bf16", heads=2, kv_heads=2, chunk=3, dtype=torch.bfloat16),
        Case("causal_two_rings", heads=2, kv_heads=1, chunk=5, subgroups=2),
    ],
}


def make_inputs(case: Case, world_size: int) -> tuple[torch.Tensor, ...]:
    """The whole (q, k, v, do, dlse) of a case, the same in every process (seeded by the case)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{world_size}".encode()))
    length = 2 * (world_size // case.subgroups) * case.chunk

    def normal(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(case.dtype)

    q = normal(case.batch, case.heads, length, case.head_dim)
    k, v = (normal(case.batch, case.kv_heads, length, case.head_dim) for _ in range(2))
    return q, k, v, normal(*q.shape), torch.randn(q.shape[:3], generator=gen)


def _path(case: Case):
    return pytorch_path() if case.pytorch else contextlib.nullcontext()


def run_case(case: Case, inputs, rank: int, world_size: int, group) -> list[torch.Tensor]:
    """This rank's (o, lse, dq, dk, dv) shards of ``case`` on the ring of ``group``."""
    q, k, v, do, dlse = (zigzag_shard(t, rank, world_size) for t in inputs)
    shards = [t.requires_grad_() for t in (q, k, v)]
    with _path(case):
        o, lse = ring_attention(*shards, causal=case.causal, group=group, return_lse=True)
        outputs, grad_outputs = ([o, lse], [do, dlse]) if case.lse_grad else ([o], [do])
        grads = torch.autograd.grad(outputs, shards, grad_outputs)
    return [t.detach() for t in (o, lse, *grads)]


def _rank_main(rank: int, world_size: int, port: int, cases: list[Case], inputs: dict, out_dir: str,
               interpreted: bool) -> None:
    """One spawned rank: every case; its shards saved to ``out_dir/rank<r>.pt``, {name: (ring, rank in it, shards)}."""
    torch.set_num_threads(1)  # ranks share the machine's cores
    assert interpreter_enabled() == interpreted, "the rank did not inherit TRITON_INTERPRET as the test process has it"
    tuning.INTERPRETER_CONFIG = TILES_16
    tuning.BACKWARD_INTERPRETER_CONFIG = BackwardConfig(TILES_16, TILES_16)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=RANKS_TIMEOUT_S))
    try:
        rings = {n: [dist.new_group(list(range(i * world_size // n, (i + 1) * world_size // n))) for i in range(n)]
                 for n in sorted({c.subgroups for c in cases}) if n > 1}  # every rank makes every group, in order
        results = {}
        for case in cases:
            size = world_size // case.subgroups
            ring, ring_rank = divmod(rank, size)
            group = rings[case.subgroups][ring] if case.subgroups > 1 else None
            results[case.name] = (ring, ring_rank, run_case(case, inputs[case.name], ring_rank, size, group))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, out_dir: str) -> dict:
    """Spawn ``world_size`` ranks running ``CASES[world_size]``; {case name: [(o, lse, dq, dk, dv) of each ring]},
    the shards unsharded."""
    cases = CASES[world_size]
    inputs = {case.name: make_inputs(case, world_size) for case in cases}
    spawn_ranks(_rank_main, world_size, (cases, inputs, out_dir, interpreter_enabled()), RANKS_TIMEOUT_S)
    per_rank = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]
    results = {}
    for case in cases:
        size = world_size // case.subgroups
        rings = []
        for ring in range(case.subgroups):
            shards = sorted((per_rank[r][case.name] for r in range(world_size) if per_rank[r][case.name][0] == ring),
                            key=lambda entry: entry[1])
            assert [entry[1] for entry in shards] == list(range(size))
            rings.append([zigzag_unshard([entry[2][i] for entry in shards]) for i in range(5)])
        results[case.name] = rings
    return results


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory):
    """``get(world_size)``: the results of that world size's spawned run, made at the first call (or its error)."""
    return made_once(lambda world_size: run_ranks(world_size, str(tmp_path_factory.mktemp(f"ring{world_size}"))))


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tuning, "INTERPRETER_CONFIG", TILES_16)
    monkeypatch.setattr(tuning, "BACKWARD_INTERPRETER_CONFIG", BackwardConfig(TILES_16, TILES_16))


def references(case: Case, q, k, v, do, dlse):
    """(o, lse, dq, dk, dv) of single-process ``flash_attention`` on the whole tensors, and the same in float64."""
    single_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    with _path(case):
        o, lse = flashlite.flash_attention(*single_inputs, causal=case.causal, return_lse=True)
        outputs, grad_outputs = ([o, lse], [do, dlse]) if case.lse_grad else ([o], [do])
        single = [o.detach(), lse.detach(), *torch.autograd.grad(outputs, single_inputs, grad_outputs)]
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o64, lse64 = attention_ref(*inputs64, causal=case.causal, return_lse=True)
    outputs, grad_outputs = ([o64, lse64], [do.double(), dlse.double()]) if case.lse_grad else ([o64], [do.double()])
    ref64 = [o64.detach(), lse64.detach(), *torch.autograd.grad(outputs, inputs64, grad_outputs)]
    return single, ref64


@pytest.mark.parametrize("world_size, case", [(p, c) for p, cases in CASES.items() for c in cases],
                         ids=[f"P{p}-{c.name}" for p, cases in CASES.items() for c in cases])
def test_ring_against_single_process(ring_runs, world_size, case):
    q, k, v, do, dlse = make_inputs(case, world_size)
    single, ref64 = references(case, q, k, v, do, dlse)
    for ring in ring_runs(world_size)[case.name]:
        for name, got, one, ref in zip(("o", "lse", "dq", "dk", "dv"), ring, single, ref64):
            assert got.shape == one.shape and got.dtype == one.dtype, name
            if name == "lse":
                torch.testing.assert_close(got.double(), ref, atol=LSE_ATOL, rtol=LSE_ATOL)
            else:  # ring error <= 2 x single-process flash_attention's error + the floor, against float64
                try:
                    assert_attention_close(got, ref, one, case.dtype)
                except AssertionError as err:
                    raise AssertionError(f"{name}: {err}") from None


# ----------------------------------------------------------------------------- in this process


@pytest.mark.parametrize("shape, dim, world_size", [
    ((2, 3, 24, 5), 2, 3),
    ((2, 3, 24, 5), -2, 4),
    ((40, 7), 0, 2),
    ((3, 16), 1, 1),  # one rank: chunks 0 and 1, the whole
])
def test_zigzag_round_trip(shape, dim, world_size):
    x = torch.randn(shape)
    shards = [zigzag_shard(x, r, world_size, dim=dim) for r in range(world_size)]
    assert all(s.shape[dim] == x.shape[dim] // world_size for s in shards)
    assert torch.equal(zigzag_unshard(shards, dim=dim), x)


def test_zigzag_layout():
    # The module docstring's example: P = 2, L = 8: rank 0 holds [0 1 | 6 7], rank 1 [2 3 | 4 5].
    positions = torch.arange(8).view(1, 1, 8, 1)
    assert zigzag_shard(positions, 0, 2).flatten().tolist() == [0, 1, 6, 7]
    assert zigzag_shard(positions, 1, 2).flatten().tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("call, error, match", [
    (lambda x: zigzag_shard(x, 0, 3), ValueError, r"multiple of 2·world_size = 6"),
    (lambda x: zigzag_shard(x, 2, 2), ValueError, r"rank must be in \[0, world_size\)"),
    (lambda x: zigzag_shard(x, 0, 0), ValueError, "world_size must be >= 1"),
    (lambda x: zigzag_shard(x, 0.0, 2), TypeError, "rank must be an int"),
    (lambda x: zigzag_shard(x, 0, 2, dim=4), IndexError, "dim=4 is out of range"),
    (lambda x: zigzag_shard(x.numpy(), 0, 2), TypeError, "x must be a torch.Tensor"),
    (lambda x: zigzag_unshard([]), TypeError, "non-empty list"),
    (lambda x: zigzag_unshard([x, x[:, :, :4]]), ValueError, r"shards\[1\] has shape"),
    (lambda x: zigzag_unshard([x[:, :, :3]]), ValueError, "must be even"),
])
def test_zigzag_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.zeros(1, 2, 8, 4))


def test_needs_a_process_group():
    q = torch.randn(1, 2, 8, 16)
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="initialized torch.distributed process group"):
        ring_attention(q, q, q)


@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_is_flash_attention(one_rank, causal):
    # P = 1: the diagonal step alone, no transfer; dk/dv kept, not sent.
    q = torch.randn(1, 4, 18, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 18, 16, requires_grad=True) for _ in range(2))
    do = torch.randn(1, 4, 18, 16)
    o = ring_attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref = flashlite.flash_attention(q, k, v, causal=causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    for a, b in zip((o, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(k=torch.zeros(1, 2, 10, 16), v=torch.zeros(1, 2, 10, 16)), ValueError, "same length"),
    (dict(q=torch.zeros(1, 4, 9, 16), k=torch.zeros(1, 2, 9, 16), v=torch.zeros(1, 2, 9, 16)), ValueError,
     "must be even"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(k=torch.zeros(1, 3, 8, 16), v=torch.zeros(1, 3, 8, 16)), ValueError, "multiple of k/v heads"),
    (dict(q=torch.zeros(1, 4, 8, 16, dtype=torch.float64)), TypeError, "q must be float32"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
])
def test_bad_arguments(one_rank, kwargs, error, match):
    args = dict(q=torch.zeros(1, 4, 8, 16), k=torch.zeros(1, 2, 8, 16), v=torch.zeros(1, 2, 8, 16), causal=True)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        ring_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
