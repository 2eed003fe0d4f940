"""Long rows over a thread-block cluster (``flashlite.softmax.cluster``): the plans on a stand-in H100, and the
kernel built for sm_90 on the CPU (a cluster launch, its barrier, one exponential an element). Its answers are
checked on the GPU (tests/test_gpu_softmax.py): the interpreter runs no Gluon kernel."""

import math
import re

import pytest
import torch

from flashlite.core import triton_compat
from flashlite.softmax import api, cluster, plan as softmax_plan, tuning

from .utils import H100, fresh_process_report

GPU = torch.device("cuda", 0)  # a stand-in: only plans are made for it
CPU = torch.device("cpu")


@pytest.fixture
def hopper(monkeypatch):
    """Plans made for a stand-in H100 with clusters (Gluon present or not)."""
    monkeypatch.setattr(softmax_plan, "shares_rows_on_chip", lambda device: device.type == "cuda")
    monkeypatch.setattr(softmax_plan, "device_info", lambda device: H100)
    monkeypatch.setattr(softmax_plan, "gluon_available", lambda: True)
    api.clear_plans()
    yield
    api.clear_plans()


def cluster_plan(ctas: int, part: int, warps: int = 4) -> softmax_plan.SoftmaxPlan:
    return softmax_plan.SoftmaxPlan("cluster", 1, part, warps, ctas, part)


def test_cluster_plans(hopper):
    # Many aligned rows of CLUSTER's lengths that fill at least CLUSTER_MIN_FILL of their tile: a cluster a row, each
    # CTA holding length / CTAS columns on the entry's warps; the entries as they stand, then the table's own.
    plan = softmax_plan.plan_softmax
    for dtype in (torch.bfloat16, torch.float16):
        assert plan(4096, 32768, GPU, shared_rows=dtype) == cluster_plan(2, 16384, 8)
        assert plan(4096, 32768, GPU, "fused", shared_rows=dtype) == cluster_plan(2, 16384, 8)
    assert plan(4096, 65536, GPU, shared_rows=torch.bfloat16) == cluster_plan(4, 16384, 8)
    assert plan(1024, 131072, GPU, shared_rows=torch.bfloat16) == cluster_plan(8, 16384, 8)
    assert plan(4096, 65536, GPU, shared_rows=torch.float32) == cluster_plan(4, 16384, 4)
    assert plan(1024, 131072, GPU, shared_rows=torch.float32) == cluster_plan(8, 16384, 4)
    for itemsize, entries in tuning.CLUSTER.items():
        dtype = torch.float32 if itemsize == 4 else torch.bfloat16
        for tile, (ctas, warps) in entries.items():
            assert plan(4096, tile, GPU, shared_rows=dtype) == cluster_plan(ctas, tile // ctas, warps)
            assert plan(4096, tile * 3 // 4, GPU, shared_rows=dtype) == cluster_plan(ctas, tile // ctas, warps)
    min_rows = math.ceil(tuning.CLUSTER_MIN_ROWS_PER_SM * H100.num_sms)
    assert plan(min_rows, 65536, GPU, shared_rows=torch.bfloat16) == cluster_plan(4, 16384, 8)
    others = [
        plan(4096, 16384, GPU, shared_rows=torch.bfloat16),  # one program holds it faster
        plan(4096, 32768, GPU, shared_rows=torch.float32),
        plan(4096, 24560, GPU, shared_rows=torch.bfloat16),  # under 75% of the tile
        plan(min_rows - 1, 65536, GPU, shared_rows=torch.bfloat16),  # too few rows
        plan(min_rows - 1, 131072, GPU, shared_rows=torch.float32),
        plan(4096, 65536, GPU, shared_rows=torch.bfloat16, vec_cols=8),  # rows in frames
        plan(4096, 65536, GPU, shared_rows=torch.bfloat16, vec_cols=0),  # one element a load
        plan(4096, 65536, GPU, shared_rows=torch.bfloat16, n_splits=4),  # parts forced
        plan(4096, 32768, GPU, shared_rows=torch.bfloat16, block_n=8192),
        plan(4096, 65536, GPU, "online", shared_rows=torch.bfloat16),
        plan(4096, 65536, GPU),  # masked softmax: no such regime
        plan(4096, 65536, CPU, shared_rows=torch.bfloat16),  # the interpreter
        plan(1024, 262144, GPU, shared_rows=torch.bfloat16),  # longer than 8 CTAs hold
    ]
    assert all(p.algorithm != "cluster" for p in others)
    # Its backward: over a cluster where tuning.BWD_CLUSTER says so (fp32 rows of 65536 as it stands), else as
    # after the plans it replaces (y and dy read twice, or shared rows).
    assert softmax_plan.plan_backward(cluster_plan(4, 16384), 4096, 65536, 2, GPU) == softmax_plan.SoftmaxPlan(
        "fused", 1, 65536, tuning.BWD_REREAD_WARPS, reread=True)
    ctas, warps = tuning.BWD_CLUSTER[4][65536]
    assert softmax_plan.plan_backward(cluster_plan(4, 16384), 4096, 65536, 4, GPU) == softmax_plan.SoftmaxPlan(
        "cluster", 1, 65536 // ctas, warps, ctas, 65536 // ctas)
    assert softmax_plan.plan_backward(cluster_plan(4, 8192), 4096, 32768, 4, GPU).reread
    # (a cluster plan of rows the backward keeps in tiles would be run as the fused plan of one row a program)
    assert softmax_plan.plan_backward(cluster_plan(4, 1024), 64, 4096, 2, GPU) == softmax_plan.SoftmaxPlan(
        "fused", 1, 4096, softmax_plan.fused_warps(4096))


def test_no_cluster_plans_without_hopper_or_gluon(hopper, monkeypatch):
    for capability in ((8, 0), (10, 0)):  # clusters are measured on Hopper only
        other = H100.__class__(**{**H100.__dict__, "capability": capability})
        monkeypatch.setattr(softmax_plan, "device_info", lambda device, info=other: info)
        api.clear_plans()
        assert softmax_plan.plan_softmax(4096, 65536, GPU, shared_rows=torch.bfloat16).reread
    monkeypatch.setattr(softmax_plan, "device_info", lambda device: H100)
    monkeypatch.setattr(softmax_plan, "gluon_available", lambda: False)
    api.clear_plans()
    assert softmax_plan.plan_softmax(4096, 65536, GPU, shared_rows=torch.bfloat16).reread


gluon = pytest.mark.skipif(not triton_compat.gluon_available(), reason="this Triton has no Gluon")


BUILDS = [  # (CTAs, columns a CTA, warps, dtype, even, write_y, write_lse)
    (4, 8192, 4, "bfloat16", True, True, False),
    (8, 16384, 8, "float32", False, True, True),  # masked columns, y and the log-sum-exp
    (2, 8192, 4, "float16", True, False, True),  # the log-sum-exp alone: no store of y
]


def _ptx_report(ptx: str, ctas: int) -> dict:
    """What both build tests read in a cluster kernel's sm_90 PTX: its cluster launch and barriers, its exchange (loads
    from L2 or from a peer's shared memory, stores into the CTAs' slots), its 16-byte loads and stores,
    exponentials and local memory."""
    return {
        "cluster": f".reqnctapercluster {ctas}" in ptx,
        "barrier": all(f"barrier.cluster.{step}.aligned" in ptx for step in ("arrive.release", "wait.acquire")),
        "from_l2": ptx.count("ld.global.cg"),
        "from_peers": ptx.count("ld.shared::cluster"),
        "to_peers": ptx.count("st.shared::cluster"),
        "vector_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx)),
        "vector_stores": len(re.findall(r"st\.global(?:\.\w+)*\.v4\.b32", ptx)),
        "exponentials": ptx.count("ex2.approx"),
        "local_memory": ptx.count("ld.local") + ptx.count("st.local"),
    }


def _build_report(cases: list) -> list:
    """What the CPU build test checks in the sm_90 PTX of each case of BUILDS (run in a fresh process: the
    interpreter's functions cannot be built for a GPU)."""
    return [_ptx_report(cluster.build_for_sm90(ctas, part, warps, getattr(torch, dtype), even, write_y,
                                               write_lse).asm["ptx"], ctas)
            for ctas, part, warps, dtype, even, write_y, write_lse in cases]


@gluon
def test_cluster_kernel_builds_for_sm90():
    # A cluster launch of CTAS CTAs meeting at its barriers; the part loaded once in 16-byte vectors and held (no
    # local memory); the states pushed into the CTAs' slots (one st.shared::cluster, thread i to CTA i), nothing
    # read from a peer or from L2; one exponential a held element (the weights are kept and rescaled), a few
    # for the states.
    report = fresh_process_report("tests.test_softmax_cluster", "_build_report", BUILDS)
    for (ctas, part, warps, dtype, even, write_y, write_lse), built in zip(BUILDS, report):
        held = part // (32 * warps)  # columns a thread holds
        vectors = held * getattr(torch, dtype).itemsize // 16
        assert built["cluster"] and built["barrier"], built
        assert built["from_l2"] == 0 and built["from_peers"] == 0 and built["to_peers"] == 1, built
        assert built["vector_loads"] == vectors, built
        assert built["vector_stores"] == (vectors if write_y else 0), built
        assert held <= built["exponentials"] <= held + 2 * ctas + 4, built
        assert built["local_memory"] == 0, built


def test_backward_cluster_plans(hopper, monkeypatch):
    # The backward's table (tuning.BWD_CLUSTER) as a tune might fill it: rows of its lengths over a cluster,
    # whatever the forward ran (fused, a cluster, shared rows), but not online plans, rows of a length that is not
    # a multiple of 16, rows under CLUSTER_MIN_FILL of the tile, the interpreter, or other lengths.
    monkeypatch.setattr(tuning, "BWD_CLUSTER", {2: {131072: (8, 8)}, 4: {65536: (4, 16)}})
    api.clear_plans()
    backward = softmax_plan.plan_backward
    shared = softmax_plan.plan_softmax(40, 131072, GPU, shared_rows=torch.bfloat16)
    assert shared.shares_rows
    assert backward(shared, 40, 131072, 2, GPU) == softmax_plan.SoftmaxPlan("cluster", 1, 16384, 8, 8, 16384)
    assert backward(shared, 40, 100_000, 2, GPU) == softmax_plan.SoftmaxPlan("cluster", 1, 16384, 8, 8, 16384)
    assert backward(cluster_plan(4, 16384), 4096, 65536, 4, GPU) == softmax_plan.SoftmaxPlan(
        "cluster", 1, 16384, 16, 4, 16384)
    fused = softmax_plan.SoftmaxPlan("fused", 1, 65536, 16)
    assert backward(fused, 4096, 65536, 4, GPU).algorithm == "cluster"
    online = softmax_plan.plan_softmax(40, 131072, GPU, "online")
    assert backward(online, 40, 131072, 2, GPU) == online
    others = [
        backward(shared, 40, 100_001, 2, GPU),  # not a multiple of 16
        backward(shared, 40, 98_288, 2, GPU),  # under 75% of the tile
        backward(shared, 40, 131072, 4, GPU),  # no fp32 entry at this length
        backward(shared, 40, 65536, 2, GPU),  # nor a bf16 one at this
        backward(shared, 40, 131072, 2, CPU),  # the interpreter
    ]
    assert all(p.algorithm != "cluster" for p in others)


BACKWARD_BUILDS = [  # (CTAs, columns a CTA, warps, dtype, even)
    (8, 16384, 8, "bfloat16", True),
    (4, 16384, 16, "float32", False),  # masked columns
]


def _backward_build_report(cases: list) -> list:
    """What the CPU build test checks in the sm_90 PTX of each case of BACKWARD_BUILDS (a fresh process, as
    ``_build_report``)."""
    return [_ptx_report(cluster.build_for_sm90(ctas, part, warps, getattr(torch, dtype), even,
                                               backward=True).asm["ptx"], ctas)
            for ctas, part, warps, dtype, even in cases]


@gluon
def test_backward_cluster_kernel_builds_for_sm90():
    # A cluster launch meeting at its barriers; y and dy loaded once each in 16-byte vectors and held (no spills),
    # dx stored so, the parts' sums pushed into the CTAs' slots.
    report = fresh_process_report("tests.test_softmax_cluster", "_backward_build_report", BACKWARD_BUILDS)
    for (ctas, part, warps, dtype, even), built in zip(BACKWARD_BUILDS, report):
        vectors = part // (32 * warps) * getattr(torch, dtype).itemsize // 16
        assert built["cluster"] and built["barrier"], built
        assert built["from_l2"] == 0 and built["to_peers"] == 1 and built["exponentials"] == 0, built
        assert built["vector_loads"] == 2 * vectors, built
        assert built["vector_stores"] == vectors, built
        assert built["local_memory"] == 0, built
