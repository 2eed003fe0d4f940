"""``flashlite.distributed.ring_attention_varlen`` on 2 and 4 CPU ranks (gloo), against single-process
``flash_attention_varlen`` on the gathered packed batch.

As ``test_ring_attention.py``: each world size is spawned once and runs every case of ``CASES``; each rank saves
its shards of the output, the LSE and dq/dk/dv, and the tests here unshard them (``varlen_unshard``) and hold
them to FlashAttention's rule against float64 per document, with single-process ``flash_attention_varlen`` on
the whole batch as the baseline error. Ranks inherit ``TRITON_INTERPRET=1`` and run the kernels through the
interpreter on 16 × 16 tiles. Documents of different lengths in every case, the shortest legal one (2P) and
an empty one among them; a document of 36 at P = 2 gives regrouped halves of 9-row documents (ragged tiles).
Cases: causal (the diagonal step's three pairs, the earlier and later ranks' two) and not, MHA/GQA/MQA, fp32
and bf16, a gradient through the LSE, the PyTorch path. In this process: varlen_shard/unshard, one rank, bad
arguments.
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
from flashlite.distributed import ring_attention_varlen, varlen_shard, varlen_unshard

from .utils import assert_attention_close, cu_seqlens, made_once, spawn_ranks, varlen_ref

TILES_16 = AttentionConfig(16, 16, 4, 1)
RANKS_TIMEOUT_S = 300  # every case of one world size, spawned ranks included
LSE_ATOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple[int, ...]  # the documents, each a multiple of 2P
    heads: int
    kv_heads: int
    head_dim: int = 16
    dtype: torch.dtype = torch.float32
    causal: bool = True
    lse_grad: bool = False
    pytorch: bool = False


CASES = {
    2: [
        Case("causal_gqa_lse", (12, 4, 0, 36), heads=4, kv_heads=2, lse_grad=True),
        Case("full_mha", (8, 20, 4), heads=2, kv_heads=2, causal=False),
        Case("causal_mqa_bf16", (16, 36), heads=4, kv_heads=1, head_dim=32, dtype=torch.bfloat16),
        Case("causal_pytorch_path", (8, 12, 4), heads=4, kv_heads=2, lse_grad=True, pytorch=True),
    ],
    4: [
        Case("causal_gqa_lse", (8, 40, 0, 24), heads=4, kv_heads=2, lse_grad=True),
        Case("full_gqa", (16, 8), heads=4, kv_heads=2, causal=False),
        Case("causal_bf16", (32, 8, 72), heads=2, kv_heads=2, dtype=torch.bfloat16),
        Case("causal_pytorch_path", (16, 8), heads=2, kv_heads=1, pytorch=True),
    ],
}


def make_inputs(case: Case, world_size: int) -> tuple[torch.Tensor, ...]:
    """The whole packed (q, k, v, do, dlse) of a case, the same in every process (seeded by the case)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"varlen/{case.name}/{world_size}".encode()))
    total = sum(case.lengths)

    def normal(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(case.dtype)

    q = normal(total, case.heads, case.head_dim)
    k, v = (normal(total, case.kv_heads, case.head_dim) for _ in range(2))
    return q, k, v, normal(*q.shape), torch.randn(case.heads, total, generator=gen)


def _path(case: Case):
    return pytorch_path() if case.pytorch else contextlib.nullcontext()


def run_case(case: Case, inputs, rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's (o, lse, dq, dk, dv) shards of ``case``; the LSE's as (rows, H), as the others lie."""
    cu = cu_seqlens(case.lengths)
    q, k, v, do = (varlen_shard(t, cu, rank, world_size) for t in inputs[:4])
    dlse = varlen_shard(inputs[4].t(), cu, rank, world_size).t()
    shards = [t.requires_grad_() for t in (q, k, v)]
    with _path(case):
        o, lse = ring_attention_varlen(*shards, cu, max(case.lengths), causal=case.causal, return_lse=True)
        outputs, grad_outputs = ([o, lse], [do, dlse]) if case.lse_grad else ([o], [do])
        grads = torch.autograd.grad(outputs, shards, grad_outputs)
    return [t.detach() for t in (o, lse.t(), *grads)]


def _rank_main(rank: int, world_size: int, port: int, cases: list[Case], inputs: dict, out_dir: str,
               interpreted: bool) -> None:
    torch.set_num_threads(1)
    assert interpreter_enabled() == interpreted, "the rank did not inherit TRITON_INTERPRET as the test process has it"
    tuning.INTERPRETER_CONFIG = TILES_16
    tuning.BACKWARD_INTERPRETER_CONFIG = BackwardConfig(TILES_16, TILES_16)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=RANKS_TIMEOUT_S))
    try:
        results = {case.name: run_case(case, inputs[case.name], rank, world_size) for case in cases}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory):
    """``get(world_size)``: {case name: unsharded (o, lse, dq, dk, dv)} of that world size's spawned run."""

    def run(world_size: int) -> dict:
        cases = CASES[world_size]
        out_dir = str(tmp_path_factory.mktemp(f"ring_varlen{world_size}"))
        inputs = {case.name: make_inputs(case, world_size) for case in cases}
        spawn_ranks(_rank_main, world_size, (cases, inputs, out_dir, interpreter_enabled()), RANKS_TIMEOUT_S)
        per_rank = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]
        return {case.name: [varlen_unshard([per_rank[r][case.name][i] for r in range(world_size)],
                                           cu_seqlens(case.lengths)) for i in range(5)] for case in cases}

    return made_once(run)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tuning, "INTERPRETER_CONFIG", TILES_16)
    monkeypatch.setattr(tuning, "BACKWARD_INTERPRETER_CONFIG", BackwardConfig(TILES_16, TILES_16))


def references(case: Case, q, k, v, do, dlse):
    """(o, lse, dq, dk, dv) of single-process ``flash_attention_varlen`` on the whole batch, and in float64 (LSEs
    as (total, H))."""
    cu, longest = cu_seqlens(case.lengths), max(case.lengths)
    single_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    with _path(case):
        o, lse = flashlite.flash_attention_varlen(*single_inputs, cu, cu, longest, longest, causal=case.causal,
                                                  return_lse=True)
        outputs, grad_outputs = ([o, lse], [do, dlse]) if case.lse_grad else ([o], [do])
        single = [o.detach(), lse.detach().t(), *torch.autograd.grad(outputs, single_inputs, grad_outputs)]
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o64, lse64 = varlen_ref(*inputs64, case.lengths, case.lengths, causal=case.causal, return_lse=True)
    outputs, grad_outputs = ([o64, lse64], [do.double(), dlse.double()]) if case.lse_grad else ([o64], [do.double()])
    ref64 = [o64.detach(), lse64.detach().t(), *torch.autograd.grad(outputs, inputs64, grad_outputs)]
    return single, ref64


@pytest.mark.parametrize("world_size, case", [(p, c) for p, cases in CASES.items() for c in cases],
                         ids=[f"P{p}-{c.name}" for p, cases in CASES.items() for c in cases])
def test_ring_varlen_against_single_process(ring_runs, world_size, case):
    q, k, v, do, dlse = make_inputs(case, world_size)
    single, ref64 = references(case, q, k, v, do, dlse)
    ring = ring_runs(world_size)[case.name]
    for name, got, one, ref in zip(("o", "lse", "dq", "dk", "dv"), ring, single, ref64):
        assert got.shape == one.shape and got.dtype == one.dtype, name
        if name == "lse":
            torch.testing.assert_close(got.double(), ref, atol=LSE_ATOL, rtol=LSE_ATOL)
        else:
            try:
                assert_attention_close(got, ref, one, case.dtype)
            except AssertionError as err:
                raise AssertionError(f"{name}: {err}") from None


# ----------------------------------------------------------------------------- in this process


@pytest.mark.parametrize("lengths, world_size", [((8, 12), 2), ((0, 16, 8, 24), 4), ((6, 6), 3), ((4, 2), 1)])
def test_varlen_shard_round_trip(lengths, world_size):
    cu = cu_seqlens(lengths)
    x = torch.randn(sum(lengths), 3, 2)
    shards = [varlen_shard(x, cu, r, world_size) for r in range(world_size)]
    assert all(s.shape == (sum(lengths) // world_size, 3, 2) for s in shards)
    assert torch.equal(varlen_unshard(shards, cu), x)


def test_varlen_shard_layout():
    # The docstring's example: documents of 8 and 4, P = 2: rank 0 keeps [0 1 6 7 | 8 11], rank 1 [2 3 4 5 | 9 10].
    cu, rows = cu_seqlens([8, 4]), torch.arange(12)
    assert varlen_shard(rows, cu, 0, 2).tolist() == [0, 1, 6, 7, 8, 11]
    assert varlen_shard(rows, cu, 1, 2).tolist() == [2, 3, 4, 5, 9, 10]


@pytest.mark.parametrize("call, error, match", [
    (lambda x, cu: varlen_shard(x, cu_seqlens([8, 6]), 0, 2), ValueError, r"document 1 is 6 long, not a multiple"),
    (lambda x, cu: varlen_shard(x, cu.long(), 0, 2), TypeError, "cu_seqlens must be int32"),
    (lambda x, cu: varlen_shard(x, cu[None], 0, 2), ValueError, "cu_seqlens must be 1-D"),
    (lambda x, cu: varlen_shard(x, cu.flip(0), 0, 2), ValueError, "must rise from 0"),
    (lambda x, cu: varlen_shard(x[:8], cu, 0, 2), ValueError, r"x.shape\[0\] must be the packed total"),
    (lambda x, cu: varlen_shard(x, cu, 2, 2), ValueError, r"rank must be in \[0, world_size\)"),
    (lambda x, cu: varlen_shard(x.numpy(), cu, 0, 2), TypeError, "x must be a torch.Tensor"),
    (lambda x, cu: varlen_unshard([], cu), TypeError, "non-empty list"),
    (lambda x, cu: varlen_unshard([x[:6], x[:5]], cu), ValueError, r"shards\[1\] is"),
    (lambda x, cu: varlen_unshard([x[:4], x[:4]], cu), ValueError, "do not hold"),
])
def test_varlen_shard_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.zeros(12, 2), cu_seqlens([8, 4]))


def test_needs_a_process_group():
    q = torch.randn(8, 2, 16)
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="initialized torch.distributed process group"):
        ring_attention_varlen(q, q, q, cu_seqlens([8]), 8)


@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_is_flash_attention_varlen(one_rank, causal):
    # P = 1: each document is its own two chunks; the diagonal step alone (three pairs under causal).
    lengths = [10, 0, 24, 2]
    cu = cu_seqlens(lengths)
    q = torch.randn(36, 4, 16, requires_grad=True)
    k, v = (torch.randn(36, 2, 16, requires_grad=True) for _ in range(2))
    do, dlse = torch.randn(36, 4, 16), torch.randn(4, 36)
    o, lse = ring_attention_varlen(q, k, v, cu, 24, causal=causal, return_lse=True)
    grads = torch.autograd.grad((o, lse), (q, k, v), (do, dlse))
    ref, ref_lse = flashlite.flash_attention_varlen(q, k, v, cu, cu, 24, 24, causal=causal, return_lse=True)
    ref_grads = torch.autograd.grad((ref, ref_lse), (q, k, v), (do, dlse))
    for a, b in zip((o, lse, *grads), (ref, ref_lse, *ref_grads)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(cu=cu_seqlens([4, 5])), ValueError, "document 1 is 5 long, not a multiple of 2·world_size = 2"),
    (dict(cu=cu_seqlens([4, 6]).long()), TypeError, "cu_seqlens must be int32"),
    (dict(k=torch.zeros(9, 2, 16)), ValueError, "k holds 9 rows, but a shard"),
    (dict(q=torch.zeros(1, 10, 4, 16)), ValueError, "q must be 3-D"),
    (dict(max_seqlen=4), ValueError, r"max_seqlen \(4\) is shorter than the longest document"),
    (dict(max_seqlen=6.0), TypeError, "max_seqlen must be an int"),
    (dict(k=torch.zeros(10, 3, 16), v=torch.zeros(10, 3, 16)), ValueError, "multiple of k/v heads"),
    (dict(q=torch.zeros(10, 4, 16, dtype=torch.float64)), TypeError, "q must be float32"),
    (dict(causal=1), TypeError, "causal must be a bool"),
])
def test_bad_arguments(one_rank, kwargs, error, match):
    args = dict(q=torch.zeros(10, 4, 16), k=torch.zeros(10, 2, 16), v=torch.zeros(10, 2, 16), cu=cu_seqlens([4, 6]),
                max_seqlen=6, causal=True)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        ring_attention_varlen(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("cu"), args.pop("max_seqlen"),
                              **args)


def test_offsets_changed_in_place_are_read_again(one_rank):
    # The layout kept for a cu_seqlens tensor (packed_layout) is dropped when that tensor changes in place.
    cu = cu_seqlens([4, 6])
    q, k, v = torch.randn(10, 2, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    ring_attention_varlen(q, k, v, cu, 6, causal=True)
    cu[1] = 5
    with pytest.raises(ValueError, match="document 0 is 5 long"):
        ring_attention_varlen(q, k, v, cu, 6, causal=True)
