"""The Hopper backward (flashlite.attention.backward_hopper): which calls it takes, and that it builds as designed.

Gluon has no interpreter, so its gradients are checked on the GPU only (``pytest -m gpu``:
tests/test_gpu_attention.py runs FlashAttention's matrix on every backward path, tests/test_gpu_backward.py the
bitwise repeatability of the two-pass path). Here, on CPU: the dispatch rules, and both kernels compiled for
sm_90 (no GPU needed) keep a product in flight while the softmax-like work runs (``wgmma.wait_group 1``), move
tiles by TMA, and add nothing by atomics (dQ is summed in a fixed order). Head dims in column parts (the
default; ``FLASHLITE_HEAD_SPLIT=0`` pads them): the switch, the descriptors a split backward launches with, and
both split kernels built for sm_90 (one product a part, one accumulator a part of dK/dV/dQ, one TMA store a part).
"""

import dataclasses
import re

import pytest
import torch
import triton

from flashlite.attention import backward, backward_hopper, plan, tuning
from flashlite.attention import gluon_tiles

from .utils import fresh_process_report, hopper_qkv, on_hopper, spy_tma_launches

pytestmark = pytest.mark.skipif(not gluon_tiles.wgmma_available(), reason="this Triton has no Gluon Hopper API")


def test_eligible_calls(hopper):
    # Head dims 32 to 256, padded to a table entry (40 -> 64, 96 -> 128, 192 -> 256); v's may differ.
    for head_dim in (32, 40, 64, 96, 128, 160, 192, 256):
        for dtype in (torch.float16, torch.bfloat16):
            q, k, v = map(on_hopper, hopper_qkv(head_dim, dtype))
            assert backward_hopper.wgmma_backward_eligible(q, k, v, q, has_mask=False, scale=0.1)
    q, k, _ = map(on_hopper, hopper_qkv(192))
    v = on_hopper(torch.randn(2, 2, 130, 128, dtype=torch.bfloat16))
    assert backward_hopper.wgmma_backward_eligible(q, k, v, on_hopper(torch.randn(2, 4, 100, 128)).bfloat16(),
                                                   has_mask=False, scale=0.1)


@pytest.mark.parametrize("case", ["cpu", "mask", "fp32", "head_dim_16", "head_dim_59", "empty_q", "empty_k",
                                  "misaligned_do", "broadcast_do", "sliced_head_dim", "switched_off", "zero_scale"])
def test_calls_left_to_the_tl_kernels(hopper, monkeypatch, case):
    # dO as autograd may hand it: a zero-stride expanded gradient (of a sum) has strides TMA cannot take. Head dim
    # 16: under the table's smallest tiles (not GPU-tested). A head dim of 100 sliced from rows of 104: q passes,
    # but dq (dense) would have 200-byte rows, which TMA cannot step.
    head_dim = {"head_dim_16": 16, "head_dim_59": 59}.get(case, 128)
    q, k, v = hopper_qkv(head_dim, torch.float32 if case == "fp32" else torch.bfloat16,
                         seqlen_q=0 if case == "empty_q" else 100, seqlen_k=0 if case == "empty_k" else 130)
    do = torch.randn_like(q)
    if case == "sliced_head_dim":
        q, k, v, do = (torch.randn(*t.shape[:3], 104, dtype=t.dtype)[..., :100] for t in (q, k, v, do))
    if case == "misaligned_do":
        do = torch.randn(2, 4, 100, 129, dtype=q.dtype)[..., :128]
    if case == "broadcast_do":
        do = torch.ones(1, 1, 1, 1, dtype=q.dtype).expand(q.shape)
    if case != "cpu":
        q, k, v, do = map(on_hopper, (q, k, v, do))
    if case == "switched_off":
        monkeypatch.setenv("FLASHLITE_WGMMA_BACKWARD", "0")
    scale = 0.0 if case == "zero_scale" else 0.1
    assert not backward_hopper.wgmma_backward_eligible(q, k, v, do, has_mask=case == "mask", scale=scale)


def test_attention_backward_dispatch(monkeypatch):
    """Eligible calls go to the Hopper kernels, with the forced Hopper tiles; forced tl tiles never do."""
    calls = []
    monkeypatch.setattr(backward, "wgmma_backward_eligible", lambda q, k, v, do, has_mask, scale: not has_mask)

    class Fake:  # stands in for the Hopper launch (Gluon builds for sm_90 only)
        def __init__(self, do, q, k, v, causal, scale, variant_scalars, variant_meta, config, varlen=None):
            calls.append(config)

        def __call__(self, do, q, k, v, lse, delta, alibi=None, seqs=None):
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(backward, "HopperBackwardLaunch", Fake)
    q, k, v = hopper_qkv(64, torch.float32, 17, 33, kv_heads=4)
    o, lse, do = torch.randn_like(q), torch.randn(2, 4, 17), torch.randn_like(q)
    forced = tuning.WgmmaBackwardConfig(64, 64, 3)
    for config in (None, forced):
        backward.attention_backward(do, q, k, v, o, lse, None, True, 0.5, None, False, config=config)
    assert calls == [None, forced]
    backward.attention_backward(do, q, k, v, o, lse, None, True, 0.5, None, False,
                                config=tuning.BACKWARD_INTERPRETER_CONFIG)
    assert len(calls) == 2  # forced tl tiles: the tl kernels


def test_config_rules():
    # Every padded head dim from 32 to 256 has tiles; a program's warps hold 16 keys each (times the split), and
    # the column split divides the tiles' widths. Tiles the kernels cannot run are refused.
    assert set(tuning.WGMMA_BACKWARD_CONFIGS) == {32, 64, 128, 256}
    for bad in (dict(dq_stages=1), dict(split=3), dict(block_n=48), dict(dq_block_m=96)):
        with pytest.raises(ValueError, match="WgmmaBackwardConfig"):
            tuning.WgmmaBackwardConfig(**{**dict(block_m=64, block_n=64, stages=2), **bad})
    for head_dim, c in tuning.WGMMA_BACKWARD_CONFIGS.items():
        meta = backward_hopper.kernel_meta(c, head_dim, head_dim, True)
        assert meta["num_warps"] in (4, 8) and meta["num_warps"] == c.block_n // 16 * c.split
        assert c.block_m % c.split == 0 and head_dim % c.split == 0
        assert backward_hopper.dq_kernel_meta(c, head_dim, head_dim, True)["num_warps"] == c.dq_block_m // 16


def _build_report(cases: list) -> dict:
    """For each (kernel, head_dim, causal, variants): the PTX's wgmma, TMA, atomics and wait depths."""
    report = {}
    for kernel_name, head_dim, causal, variants in cases:
        config = tuning.WGMMA_BACKWARD_CONFIGS[head_dim]
        if kernel_name == "one_pass":
            config = dataclasses.replace(config, one_pass=True)
        switches = dict(HAS_SOFTCAP=True, FAST_TANH=True, HAS_ALIBI=True, HAS_WINDOW=True) if variants else {}
        ptx = backward_hopper.build_for_sm90(kernel_name, config, head_dim, causal, switches).asm["ptx"]
        name = f"{kernel_name}-{head_dim}-{causal}" + ("-variants" if variants else "")
        report[name] = dict(
            wgmma="wgmma.mma_async" in ptx, tma_load="cp.async.bulk.tensor" in ptx,
            tma_reduce=len(re.findall(r"cp\.reduce\.async\.bulk\.tensor[\w.:]*\.add", ptx)),
            registers=sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
            atomics=len(re.findall(r"\b(?:red|atom)\.global[\w.]*add\.f32", ptx)), tanh="tanh.approx.f32" in ptx,
            waits=sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)}))
    return report


def test_kernels_build_with_products_in_flight():
    """Built for sm_90 in a fresh process (the interpreter, on in this one, would stand in for the jit helpers)."""
    cases = [("dkdv", 64, False, False), ("dkdv", 128, True, False), ("dkdv", 256, True, False),  # 256: split
             ("dkdv", 256, False, False), ("dkdv", 64, True, True),
             ("dq", 64, True, False), ("dq", 128, False, False), ("dq", 256, True, False), ("dq", 128, True, True)]
    report = fresh_process_report("tests.test_attention_backward_wgmma", "_build_report", cases)
    for case, built in report.items():
        assert built["wgmma"] and built["tma_load"], case
        assert 1 in built["waits"], f"{case}: no product left in flight (waits {built['waits']})"
        assert built["atomics"] == 0 and built["tma_reduce"] == 0, case  # dQ is summed by its own kernel, in order
        assert built["tanh"] == ("variants" in case), case


def test_one_pass_kernel_builds_with_products_in_flight():
    """The one-pass kernel (two compute warpgroups and a load warp) built for sm_90: its products in flight, dQ by
    TMA reductions (one a compute warpgroup in the source), no atomic adds, the compute warpgroups at their
    registers."""
    cases = [("one_pass", 64, False, False), ("one_pass", 128, True, False), ("one_pass", 64, True, True)]
    report = fresh_process_report("tests.test_attention_backward_wgmma", "_build_report", cases)
    for case, built in report.items():
        assert built["wgmma"] and built["tma_load"], case
        assert 1 in built["waits"], f"{case}: no product left in flight (waits {built['waits']})"
        assert built["tma_reduce"] == 2 and built["atomics"] == 0, case
        assert tuning.ONE_PASS_COMPUTE_REGISTERS in built["registers"], (case, built["registers"])
        assert built["tanh"] == ("variants" in case), case


@pytest.mark.parametrize("head_dim, head_dim_v, env, forced, packed, expected", [
    (128, 128, None, None, False, False),  # off by default
    (128, 128, "1", None, False, True),
    (64, 128, "1", None, False, True),  # Dv != D: one column part each
    (32, 32, "1", None, False, True),
    (256, 256, "1", None, False, False),  # two warpgroups split the columns: two passes
    (192, 192, "1", None, False, False),  # column parts: two passes
    (128, 128, "1", None, True, False),  # packed batches: two passes
    (128, 128, "1", tuning.WgmmaBackwardConfig(64, 64, 2), False, False),  # forced tiles decide
    (128, 128, None, tuning.WgmmaBackwardConfig(64, 64, 2, one_pass=True), False, True),
    (128, 128, "1", tuning.WgmmaBackwardConfig(64, 128, 2), False, False),  # 128-key tiles: two passes
])
def test_one_pass_planned_where_it_serves(hopper, monkeypatch, head_dim, head_dim_v, env, forced, packed, expected):
    """Which backward calls plan the one-pass kernel: ``FLASHLITE_BACKWARD_ONE_PASS=1`` with the table's tiles, or
    forced tiles with ``one_pass``; dense calls of one column part each on 64-key tiles of one warpgroup. A
    planned call launches it alone, with the workspace's descriptor (fp32, whole query tiles, the padded head
    dim), unless deterministic algorithms are on (then both passes)."""
    if env is None:
        monkeypatch.delenv("FLASHLITE_BACKWARD_ONE_PASS", raising=False)
    else:
        monkeypatch.setenv("FLASHLITE_BACKWARD_ONE_PASS", env)
    q, k, _ = map(on_hopper, hopper_qkv(head_dim, torch.bfloat16, seqlen_q=300, seqlen_k=500, kv_heads=2))
    v = on_hopper(torch.randn(2, 2, 500, head_dim_v, dtype=torch.bfloat16))
    do = on_hopper(torch.randn(2, 4, 300, head_dim_v, dtype=torch.bfloat16))
    varlen = (2, 150, 250) if packed else None
    launch = backward_hopper.HopperBackwardLaunch(do, q, k, v, True, 0.1, (0.0, 0, 0), {}, forced, varlen)
    assert (launch.one_pass is not None) == expected
    if not expected or packed:
        return
    launched = []
    spy_tma_launches(monkeypatch, launched)
    lse = delta = torch.zeros(2, 4, 300)
    launch(do, q, k, v, lse, delta)
    assert [kl.kernel for kl, _ in launched] == [backward_hopper._attention_bwd_one_pass_kernel]
    workspace = launched[0][1][6]
    assert workspace.block_shape == [1, 1, 64, plan.head_dim_padded(head_dim)]
    assert tuple(workspace.base.shape) == (2, 4, 320, plan.head_dim_padded(head_dim))
    assert workspace.base.dtype == torch.float32
    assert launched[0][0].grid == (triton.cdiv(500, 128) * 2 * 2,)  # two key tiles of 64 a program
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        launch(do, q, k, v, lse, delta)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert [kl.kernel for kl, _ in launched[1:]] == [backward_hopper._attention_bwd_wgmma_kernel,
                                                     backward_hopper._attention_bwd_dq_wgmma_kernel]


# ----------------------------------------------------------------------------- head dims in column parts (issue 44)


def test_backward_head_split_switch(monkeypatch):
    # On unless FLASHLITE_HEAD_SPLIT=0: both kernels load 129..192 in two parts; off, padded to 256.
    monkeypatch.delenv("FLASHLITE_HEAD_SPLIT", raising=False)
    assert [backward_hopper.column_parts(d) for d in (64, 144, 160, 176, 192, 256)] == [
        (64,), (128, 32), (128, 32), (128, 64), (128, 64), (256,)]
    monkeypatch.setenv("FLASHLITE_HEAD_SPLIT", "0")
    assert [backward_hopper.column_parts(d) for d in (64, 160, 192, 256)] == [(64,), (256,), (256,), (256,)]


@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 192), (160, 160), (192, 128), (128, 192), (176, 144),
                                                  (64, 64), (256, 256), (192, 256)])
def test_backward_head_split_dispatch(hopper, monkeypatch, head_dim, head_dim_v):
    """The backward of a call on Hopper with and without FLASHLITE_HEAD_SPLIT=1: each kernel gets one descriptor a
    column part of each of its tensors (dK/dV kernel: q, k, v, dO, dk, dv; dQ kernel: q, k, v, dO, dq), first parts
    then second parts, boxes as wide as the parts (``plan.head_dim_parts``), bound to the call's tensors, None for
    the second part of a head dim of one part, the parts' sums as the widths on chip, and the padded head dim's
    tiles (256: two warpgroups); unsplit, boxes as wide as the padded head dims."""
    launched = []
    spy_tma_launches(monkeypatch, launched)
    q, k, _ = map(on_hopper, hopper_qkv(head_dim, torch.bfloat16, seqlen_q=300, seqlen_k=500, kv_heads=2))  # GQA
    v = on_hopper(torch.randn(2, 2, 500, head_dim_v, dtype=torch.bfloat16))
    do = on_hopper(torch.randn(2, 4, 300, head_dim_v, dtype=torch.bfloat16))
    assert backward_hopper.wgmma_backward_eligible(q, k, v, do, has_mask=False, scale=0.1)
    for split in (False, True):
        monkeypatch.setenv("FLASHLITE_HEAD_SPLIT", "1" if split else "0")
        launch = backward_hopper.HopperBackwardLaunch(do, q, k, v, True, 0.1, (0.0, 0, 0), {})
        lse = delta = torch.zeros(2, 4, 300)
        dq, dk, dv = launch(do, q, k, v, lse, delta)
        (dkdv, dkdv_args), (dq_launch, dq_args) = launched[-2:]
        parts = plan.head_dim_parts if split else (lambda d: (plan.head_dim_padded(d),))
        q_parts, v_parts = parts(head_dim), parts(head_dim_v)
        assert launch.parts == (q_parts, v_parts)
        config = tuning.WGMMA_BACKWARD_CONFIGS[max(plan.head_dim_padded(head_dim), plan.head_dim_padded(head_dim_v))]
        for kernel_launch, args, tensors, widths, rows in (
                (dkdv, dkdv_args, (q, k, v, do, dk, dv), (q_parts, q_parts, v_parts, v_parts, q_parts, v_parts),
                 (config.block_m, config.block_n, config.block_n, config.block_m, config.block_n, config.block_n)),
                (dq_launch, dq_args, (q, k, v, do, dq), (q_parts, q_parts, v_parts, v_parts, q_parts),
                 (config.dq_block_m, config.dq_block_n, config.dq_block_n, config.dq_block_m, config.dq_block_m))):
            n = len(tensors)
            assert (kernel_launch.options["HEAD_DIM"], kernel_launch.options["HEAD_DIM_V"]) == (
                sum(q_parts), sum(v_parts))
            assert kernel_launch.kernel.arg_names[2 * n] == "lse_ptr"
            for i, desc in enumerate(args[:2 * n]):
                part, which = divmod(i, n)
                if part >= len(widths[which]):
                    assert desc is None, (split, i)
                    continue
                assert desc.base is tensors[which], (split, i)
                assert desc.block_shape == [1, 1, rows[which], widths[which][part]], (split, i)
        assert dkdv.options["num_warps"] == config.block_n // 16 * config.split


def _split_build_report(cases: list) -> dict:
    """For each (kernel, head_dim, head_dim_v, causal, variants, dtype name): the kernel built for sm_90 with its head
    dims in column parts (as ``FLASHLITE_HEAD_SPLIT=1`` plans them) on the padded head dim's tiles: the PTX's wgmma
    widths (N of each m64nNk16), wait depths, the bytes each mbarrier expects, its TMA stores and atomics."""
    report = {}
    for kernel_name, head_dim, head_dim_v, causal, variants, dtype in cases:
        config = tuning.WGMMA_BACKWARD_CONFIGS[256]
        switches = dict(HAS_SOFTCAP=True, FAST_TANH=True, HAS_ALIBI=True, HAS_WINDOW=True) if variants else {}
        compiled = backward_hopper.build_for_sm90(kernel_name, config, head_dim, causal, switches,
                                                  head_dim_v=head_dim_v, split=True, dtype=getattr(torch, dtype))
        ptx = compiled.asm["ptx"]
        numbers = lambda pattern: sorted({int(n) for n in re.findall(pattern, ptx)})  # noqa: E731
        report[f"{kernel_name}-{head_dim}-v{head_dim_v}-{causal}-{dtype}" + ("-variants" if variants else "")] = dict(
            warps=compiled.metadata.num_warps,
            widths=numbers(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16"),
            waits=numbers(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)"),
            expects=numbers(r"mbarrier\.arrive\.expect_tx\.shared(?:::cta)?\.b64 _, \[%r\d+\], (\d+)"),
            stores=len(re.findall(r"cp\.async\.bulk\.tensor\.4d\.global\.shared", ptx)),
            atomics=len(re.findall(r"\b(?:red|atom)\.global[\w.]*add\.f32", ptx)), tanh="tanh.approx.f32" in ptx)
    return report


def test_split_kernels_build_with_products_in_flight():
    """Head dims in column parts, both kernels built for sm_90 in a fresh process: Sᵀ/dPᵀ (S/dP) one product a part
    chained on one accumulator, dK and dV (dQ) one accumulator a part (two warpgroups splitting each part's columns
    in the dK/dV kernel), one mbarrier a tile expecting the bytes of every part, one TMA store a part, and the waits
    leaving the other products in flight (one a part of V/dO's head dim)."""
    shapes = [(192, 192, False, False, "bfloat16"), (192, 192, True, False, "float16"),
              (192, 128, False, False, "float16"), (160, 160, True, False, "bfloat16"),
              (128, 192, True, False, "bfloat16"), (192, 192, True, True, "bfloat16")]  # (the last: every variant)
    cases = [(kernel, *shape) for kernel in ("dkdv", "dq") for shape in shapes]
    report = fresh_process_report("tests.test_attention_backward_wgmma", "_split_build_report", cases)
    config = tuning.WGMMA_BACKWARD_CONFIGS[256]
    for (kernel, head_dim, head_dim_v, causal, variants, dtype), built in zip(cases, report.values()):
        q_parts, v_parts = plan.head_dim_parts(head_dim), plan.head_dim_parts(head_dim_v)
        qv_bytes = (sum(q_parts) + sum(v_parts)) * 2
        if kernel == "dkdv":  # Sᵀ's products (BLOCK_M columns over two warpgroups), then dK's and dV's of each part
            assert built["warps"] == 8, built
            assert set(built["widths"]) == {config.block_m // 2, *(p // 2 for p in q_parts + v_parts)}, built
            assert {config.block_n * qv_bytes, config.block_m * qv_bytes} <= set(built["expects"]), built  # K+V, Q+dO
            assert built["stores"] == len(q_parts) + len(v_parts), built
        else:  # S's products (BLOCK_N columns), then dQ's of each part
            assert built["warps"] == 4, built
            assert set(built["widths"]) == {config.dq_block_n, *q_parts}, built
            assert {config.dq_block_m * qv_bytes, config.dq_block_n * sum(q_parts) * 2,
                    config.dq_block_n * sum(v_parts) * 2} <= set(built["expects"]), built
            assert built["stores"] == len(q_parts), built
        assert len(v_parts) in built["waits"], built  # dPᵀ's (dP's) products in flight while Sᵀ (S) is worked on
        assert built["atomics"] == 0 and built["tanh"] == variants, built


# ----------------------------------------------------------------------------- packed (variable-length) batches


def test_packed_backward_dispatch(hopper, monkeypatch):
    """A packed batch's backward on Hopper takes the Hopper kernels by default (the tl ones under
    FLASHLITE_HOPPER_VARLEN=0): each kernel one program a number of its flattened schedule (key tiles for dK/dV,
    query tiles for dQ) and head, and the packed tuple its cut tiles are stored through (the cu_seqlens, the sequences, each
    gradient with its H and L strides and head dim)."""
    from .utils import cu_seqlens

    launched = []
    spy_tma_launches(monkeypatch, launched)
    lengths = [300, 0, 100, 517, 1]
    total, n_seqs = sum(lengths), len(lengths)
    q = on_hopper(torch.randn(1, 4, total, 192, dtype=torch.bfloat16))  # packed: (1, H, total, D), GQA
    k = on_hopper(torch.randn(1, 2, total, 192, dtype=torch.bfloat16))
    v = on_hopper(torch.randn(1, 2, total, 128, dtype=torch.bfloat16))
    do = on_hopper(torch.randn(1, 4, total, 128, dtype=torch.bfloat16))
    varlen = (n_seqs, 517, 517)
    monkeypatch.setenv("FLASHLITE_HOPPER_VARLEN", "0")
    assert backward.BackwardLaunch(do, q, k, v, True, 0.1, None, False, varlen=varlen).hopper is None
    monkeypatch.delenv("FLASHLITE_HOPPER_VARLEN")
    planned = backward.BackwardLaunch(do, q, k, v, True, 0.1, None, False, varlen=varlen)
    assert planned.hopper is not None
    cu = cu_seqlens(lengths, "cpu")
    lse = delta = torch.zeros(1, 4, total)
    dq, dk, dv = planned.hopper(do, q, k, v, lse, delta, None, (cu, cu))
    (dkdv, dkdv_args), (dq_launch, dq_args) = launched[-2:]
    config = tuning.WGMMA_BACKWARD_CONFIGS[256]
    assert dkdv.grid == ((total // config.block_n + n_seqs) * 2,)
    assert dq_launch.grid == ((total // config.dq_block_m + n_seqs) * 4,)
    assert dkdv.options["SEQ_BLOCK"] >= 32 * dkdv.options["num_warps"]
    assert dq_launch.options["SEQ_BLOCK"] >= 32 * dq_launch.options["num_warps"]
    dkdv_packed = dkdv_args[2 * 6 + 3]  # after the descriptors and lse, delta, alibi
    assert dkdv_packed[:3] == (cu, cu, n_seqs)
    assert dkdv_packed[3] is dk and dkdv_packed[4:7] == (dk.stride(1), dk.stride(2), 192)
    assert dkdv_packed[7] is dv and dkdv_packed[8:] == (dv.stride(1), dv.stride(2), 128)
    dq_packed = dq_args[2 * 5 + 3]
    assert dq_packed[:4] == (cu, cu, n_seqs, dq) and dq_packed[4:] == (dq.stride(1), dq.stride(2), 192)
    assert dkdv_args[2 * 6 + 6:2 * 6 + 8] == (total, total)  # the totals, where the sequences' rows lie
    # A dense call's kernels take none.
    qd, kd, vd = map(on_hopper, hopper_qkv(128, torch.bfloat16, seqlen_q=300, seqlen_k=500, kv_heads=2))
    dod = on_hopper(torch.randn(2, 4, 300, 128, dtype=torch.bfloat16))
    launch = backward_hopper.HopperBackwardLaunch(dod, qd, kd, vd, True, 0.1, (0.0, 0, 0), {})
    launch(dod, qd, kd, vd, torch.zeros(2, 4, 300), torch.zeros(2, 4, 300))
    (dkdv, dkdv_args), (dq_launch, dq_args) = launched[-2:]
    assert dkdv.options["SEQ_BLOCK"] == dq_launch.options["SEQ_BLOCK"] == 0
    assert dkdv_args[2 * 6 + 3] is None and dq_args[2 * 5 + 3] is None


def _packed_build_report(cases: list) -> dict:
    """For each (kernel, head_dim, head_dim_v, causal): the packed batch's kernel built for sm_90 (head dims in
    column parts): its wait depths, TMA stores, pointer stores (a sequence's cut tile) and atomics."""
    report = {}
    for kernel_name, head_dim, head_dim_v, causal in cases:
        config = tuning.WGMMA_BACKWARD_CONFIGS[max(plan.head_dim_padded(head_dim), plan.head_dim_padded(head_dim_v))]
        ptx = backward_hopper.build_for_sm90(kernel_name, config, head_dim, causal, None, head_dim_v, split=True,
                                             packed=True).asm["ptx"]
        report[f"{kernel_name}-{head_dim}-v{head_dim_v}-{causal}"] = dict(
            waits=sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)}),
            tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.4d\.global\.shared", ptx)),
            stores=len(re.findall(r"st\.global", ptx)),
            atomics=len(re.findall(r"\b(?:red|atom)\.global[\w.]*add\.f32", ptx)))
    return report


def test_packed_kernels_build_with_products_in_flight():
    """The packed batch's two backward kernels built for sm_90 in a fresh process: products in flight as in the dense
    kernels, full tiles stored by TMA (one store a column part of each gradient), cut ones by pointer, no atomics."""
    cases = [("dkdv", 128, 128, True), ("dkdv", 64, 64, False), ("dkdv", 192, 128, True),
             ("dq", 128, 128, True), ("dq", 64, 64, False), ("dq", 192, 192, True)]
    report = fresh_process_report("tests.test_attention_backward_wgmma", "_packed_build_report", cases)
    for (kernel_name, head_dim, head_dim_v, causal), built in zip(cases, report.values()):
        q_parts, v_parts = backward_hopper.column_parts(head_dim), backward_hopper.column_parts(head_dim_v)
        assert 1 in built["waits"] or 2 in built["waits"], built
        grads = len(q_parts) + len(v_parts) if kernel_name == "dkdv" else len(q_parts)
        assert built["tma_stores"] == grads, built
        assert built["stores"] > 0 and built["atomics"] == 0, built
