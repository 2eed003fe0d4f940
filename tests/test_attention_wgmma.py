"""The Hopper forward kernel (flashlite.attention.forward_hopper): which calls it takes, and that it builds as designed.

Gluon has no interpreter, so the kernel's results are checked on the GPU only
(``pytest -m gpu``: tests/test_gpu_attention.py and test_gpu_decode.py run every
default-variant case with D = 64/128, fp16/bf16 and no mask on it). Here, on CPU:

* the dispatch rules, with tensors that claim to be on a Hopper GPU;
* the kernel compiled for sm_90 (no GPU needed): its K/V loop must keep one
  wgmma in flight while the softmax runs (``wgmma.wait_group 1`` in the PTX),
  which is the point of the module;
* the descriptors built without the dataclass's checks equal checked ones;
* head dims in column parts (the default; ``FLASHLITE_HEAD_SPLIT=0`` pads them): which parts a head dim takes, the
  descriptors a split call launches with, and both split kernels (the warp-specialized one at 65 to 96) built
  for sm_90 (one product a part, the P V products of every part of O in flight across the softmax:
  ``wgmma.wait_group 2``).
"""

import dataclasses
import re

import pytest
import torch
import triton

from flashlite.attention import api, plan, route, tuning
from flashlite.attention import forward_hopper as fw
from flashlite.attention import gluon_tiles
from flashlite.core import tiles

from .utils import HOPPER, fresh_process_report, hopper_qkv, on_hopper, spy_tma_launches

pytestmark = pytest.mark.skipif(not gluon_tiles.wgmma_available(), reason="this Triton has no Gluon Hopper API")


def test_eligible_calls(hopper):
    # Every head dim padded to a table entry: 40 and 64 (64), 80, 96 and 128 (128), 160, 192 and 256 (256).
    for head_dim in (40, 64, 80, 96, 128, 160, 192, 256):
        for dtype in (torch.float16, torch.bfloat16):
            q, k, v = map(on_hopper, hopper_qkv(head_dim, dtype))
            assert fw.wgmma_eligible(q, k, v, has_mask=False, scale=0.1)
    # A (B, L, H, D) tensor viewed as (B, H, L, D): strides TMA accepts, no copy needed.
    q = on_hopper(torch.randn(2, 100, 4, 128, dtype=torch.bfloat16).transpose(1, 2))
    assert fw.wgmma_eligible(q, q, q, has_mask=False, scale=0.1)


@pytest.mark.parametrize("case", ["cpu", "mask", "fp32", "head_dim_32", "head_dim_59", "empty_q", "empty_k",
                                  "misaligned", "not_hopper", "switched_off", "zero_scale", "negative_scale"])
def test_calls_left_to_the_tl_kernel(hopper, monkeypatch, case):
    # Head dim 32: no table entry (the tl kernel's small tiles serve it); 59: rows of 118 bytes, which TMA
    # cannot step.
    head_dim = {"head_dim_32": 32, "head_dim_59": 59}.get(case, 128)
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    q, k, v = hopper_qkv(head_dim, dtype, seqlen_q=0 if case == "empty_q" else 100, seqlen_k=0 if case == "empty_k" else 130)
    if case == "misaligned":  # a row stride of 129 elements: not 16-byte aligned
        q = torch.randn(2, 4, 100, 129, dtype=dtype)[..., :128]
    if case != "cpu":
        q, k, v = map(on_hopper, (q, k, v))
    if case == "not_hopper":  # Blackwell has no wgmma
        blackwell = dataclasses.replace(HOPPER, capability=(10, 0))
        for module in (tiles, fw):
            monkeypatch.setattr(module, "device_info", lambda device: blackwell)
    if case == "switched_off":
        monkeypatch.setenv("FLASHLITE_WGMMA", "0")
    scale = {"zero_scale": 0.0, "negative_scale": -0.1}.get(case, 0.1)  # masked scores stay -inf only under > 0
    assert not fw.wgmma_eligible(q, k, v, has_mask=case == "mask", scale=scale)


def test_attention_forward_dispatch(monkeypatch):
    """Eligible calls without forced tiles go to the Hopper kernel with their own arguments; forced tiles never do."""
    calls = []

    class Fake:  # stands in for the Hopper launch (Gluon builds for sm_90 only)
        def __init__(self, *args, **kw):
            calls.append((*args, kw["window"], kw["softcap"]))

        def __call__(self, *args):
            return "o", "lse"

    monkeypatch.setattr(route, "wgmma_eligible", lambda q, k, v, has_mask, scale: not has_mask)
    monkeypatch.setattr(route, "HopperForwardLaunch", Fake)
    q, k, v = hopper_qkv(64, torch.float32, 17, 33, kv_heads=4)
    assert api.attention_forward(q, k, v, True, 0.5, None, False, True) == ("o", "lse")
    assert calls == [(q, k, v, True, 0.5, True, None, None)]
    api.attention_forward(q, k, v, False, 0.5, None, False, True, window=(8, 0), softcap=3.0)  # these go there too
    assert calls[-1] == (q, k, v, False, 0.5, True, (8, 0), 3.0)
    calls.pop()
    out, _ = api.attention_forward(q, k, v, True, 0.5, None, False, False, tuning.INTERPRETER_CONFIG)
    assert len(calls) == 1 and out.shape == q.shape  # forced tiles: the tl kernel
    mask = torch.ones(2, 4, 17, 33, dtype=torch.uint8)
    api.attention_forward(q, k, v, False, 0.5, mask, True, False)
    assert len(calls) == 1  # a user mask: the tl kernel


def test_config_rules():
    assert plan.wgmma_config(128, False, 4096) == tuning.WGMMA_CONFIGS[128]
    assert plan.wgmma_config(128, False, 512) == tuning.WGMMA_CONFIGS[128]
    assert plan.wgmma_config(128, True, 2048) == tuning.WGMMA_CONFIGS[128]
    assert plan.wgmma_config(64, False, 1024) == tuning.WGMMA_CONFIGS[64]
    for head_dim, (max_keys, short) in tuning.WGMMA_SHORT_CAUSAL.items():
        assert plan.wgmma_config(head_dim, True, max_keys) == short
        assert plan.wgmma_config(head_dim, True, max_keys + 1) == tuning.WGMMA_CONFIGS[head_dim]
        assert not short.warp_specialized
    # Padded head dims share their power of two's tiles; D = 256 has its own under causal.
    assert plan.wgmma_config(96, True, 100) == plan.wgmma_config(128, True, 100) == tuning.WGMMA_SHORT_CAUSAL[128][1]
    assert plan.wgmma_config(192, False, 4096) == tuning.WGMMA_CONFIGS[256]
    assert plan.wgmma_config(192, True, 100) == plan.wgmma_config(256, True, 8192) == tuning.WGMMA_CAUSAL_CONFIGS[256]
    # In column parts (the width on chip): causal 161-192 on two 128-key buffers; 129-160, non-causal and a width
    # as wide as the padded head dim keep the padded head dim's tiles.
    split_causal = tuning.WGMMA_SPLIT_CAUSAL_CONFIGS[192]
    assert (split_causal.block_n, split_causal.kv_stages) == (128, 2)
    assert plan.wgmma_config(192, True, 8192, 192) == plan.wgmma_config(176, True, 8192, 192) == split_causal
    assert plan.wgmma_config(192, False, 8192, 192) == tuning.WGMMA_CONFIGS[256]
    assert plan.wgmma_config(160, True, 8192, 160) == tuning.WGMMA_CAUSAL_CONFIGS[256]
    assert plan.wgmma_config(256, True, 8192, 256) == tuning.WGMMA_CAUSAL_CONFIGS[256]
    assert plan.wgmma_config(192, True, 8192, 256) == tuning.WGMMA_CAUSAL_CONFIGS[256]  # (Dv = 256 beside)
    ws = tuning.WGMMA_CONFIGS[128]
    assert ws.warp_specialized and ws.num_warps == 4 and ws.rows_per_program == 2 * ws.block_m
    assert tuning.WGMMA_CONFIGS[64].rows_per_program == tuning.WGMMA_CONFIGS[64].block_m
    # The registers moved between the warp-specialized kernel's warpgroups fit what its launch holds.
    assert tuning.WS_LAUNCH_REGISTERS * 3 >= 2 * tuning.WS_SOFTMAX_REGISTERS + tuning.WS_LOAD_REGISTERS
    assert tuning.WS_LAUNCH_REGISTERS * 12 * 32 <= 65536


def test_descriptor_matches_a_checked_one():
    t = torch.randn(2, 100, 4, 136, dtype=torch.float16)[..., :128].transpose(1, 2)  # padded rows, (B, L, H, D)
    fast = gluon_tiles.gluon_descriptor(t, 64, 128)
    box = [1, 1, 64, 128]
    checked = gluon_tiles.GluonTensorDescriptor(t, list(t.shape), tiles.descriptor_strides(t), box, gluon_tiles.box_layout(tuple(box), t.dtype))
    for field in dataclasses.fields(gluon_tiles.GluonTensorDescriptor):
        mine, theirs = getattr(fast, field.name), getattr(checked, field.name)
        assert mine is theirs if field.name == "base" else mine == theirs, field.name


def _compile_for_hopper(config: tuning.WgmmaConfig, head_dim: int, causal: bool, write_lse: bool,
                        variants: dict | None = None, head_dim_v: int | None = None, split: bool = False,
                        dtype: torch.dtype = torch.bfloat16, packed: bool = False):
    """The kernel ``config`` selects, built for sm_90 from CPU (``forward_hopper.build_for_sm90``: the types a launch
    on Hopper would give); ``variants``: ``plan.variant_args``' switches that are on; ``split``: head dims in column
    parts (``plan.head_dim_parts``), else padded; ``packed``: a packed batch's kernel."""
    return fw.build_for_sm90(config, head_dim, causal, write_lse, variants, head_dim_v, split, dtype, packed)


# The variant cases the build test compiles: every score modifier and the sinks together, with v of its own width.
ALL_VARIANTS = dict(HAS_SOFTCAP=True, FAST_TANH=True, HAS_ALIBI=True, HAS_WINDOW=True, HAS_SINKS=True)


def _build_report(cases: list) -> dict:
    """For each (head_dim, causal, variants, head_dim_v): whether the PTX has wgmma and TMA, its wgmma wait
    depths, warps and register moves."""
    report = {}
    for head_dim, causal, variants, head_dim_v in cases:
        config = plan.wgmma_config(max(head_dim, head_dim_v), causal, 1024)
        compiled = _compile_for_hopper(config, head_dim, causal, write_lse=causal,
                                       variants=ALL_VARIANTS if variants else None, head_dim_v=head_dim_v)
        ptx = compiled.asm["ptx"]
        name = f"{head_dim}-{causal}" + ("-variants" if variants else "") + (f"-v{head_dim_v}" if head_dim_v != head_dim else "")
        report[name] = dict(
            warp_specialized=config.warp_specialized, warps=compiled.metadata.num_warps,
            wgmma="wgmma.mma_async" in ptx, tma="cp.async.bulk.tensor" in ptx, tanh="tanh.approx.f32" in ptx,
            waits=sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)}),
            registers=sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}))
    return report


def test_kernel_builds_with_products_in_flight():
    """Built for sm_90 in a fresh process (the interpreter, on in this one, would stand in for the jit helpers).

    Every kernel keeps a P V product in flight across the softmax; the warp-specialized one (D = 128)
    runs 12 warps (two softmax warpgroups and a load warp, padded to a warpgroup) and moves registers
    from the load warp to the softmax warpgroups.
    """
    cases = [(64, False, False, 64), (64, True, False, 64), (128, False, False, 128), (128, True, False, 128),
             (256, False, False, 256), (256, True, False, 256),
             (128, False, True, 128), (64, False, True, 64),  # every variant switched on
             (256, True, False, 128), (128, False, True, 64)]  # v narrower than q/k: O through its own buffer
    report = fresh_process_report("tests.test_attention_wgmma", "_build_report", cases)
    for case, built in report.items():
        assert built["wgmma"] and built["tma"], case
        assert built["tanh"] == ("variants" in case), case  # the softcap's one-instruction tanh, when on
        assert 1 in built["waits"], f"{case}: no wgmma left in flight across the softmax (waits {built['waits']})"
        if built["warp_specialized"]:
            assert built["warps"] == 12, case
            assert {tuning.WS_SOFTMAX_REGISTERS, tuning.WS_LOAD_REGISTERS} <= set(built["registers"]), case
        else:
            assert built["warps"] == 4 and built["registers"] == [], case
    assert report["128-False"]["warp_specialized"]


# ----------------------------------------------------------------------------- head dims in column parts


def test_head_dim_parts():
    # Issue 44: 65 to 80 as 64 + 16, 81 to 96 as 64 + 32, 129 to 160 as 128 + 32, 161 to 192 as 128 + 64; every
    # other head dim (97 to 127 among them) one part, padded.
    for head_dim in range(1, 257):
        parts = plan.head_dim_parts(head_dim)
        if 64 < head_dim <= 80:
            assert parts == (64, 16), head_dim
        elif 80 < head_dim <= 96:
            assert parts == (64, 32), head_dim
        elif 128 < head_dim <= 160:
            assert parts == (128, 32), head_dim
        elif 160 < head_dim <= 192:
            assert parts == (128, 64), head_dim
        else:
            assert parts == (plan.head_dim_padded(head_dim),), head_dim
        assert sum(parts) >= head_dim and all(p & (p - 1) == 0 and p >= 16 for p in parts), head_dim


def test_head_split_switch(monkeypatch):
    # On unless FLASHLITE_HEAD_SPLIT=0 (then padded); on, both kernels split (D = 96 takes the warp-specialized
    # kernel, or the other one for short causal calls).
    monkeypatch.setenv("FLASHLITE_HEAD_SPLIT", "0")
    assert not plan.head_split_enabled()
    assert fw.column_parts(192) == (256,) and fw.column_parts(96) == (128,)
    monkeypatch.setenv("FLASHLITE_HEAD_SPLIT", "1")
    assert plan.head_split_enabled()
    monkeypatch.delenv("FLASHLITE_HEAD_SPLIT", raising=False)
    assert plan.head_split_enabled()
    assert fw.column_parts(192) == (128, 64) and fw.column_parts(160) == (128, 32)
    assert fw.column_parts(96) == (64, 32) and fw.column_parts(80) == (64, 16)
    assert fw.column_parts(100) == (128,) and fw.column_parts(64) == (64,) and fw.column_parts(128) == (128,)
    assert plan.wgmma_config(96, False, 4096).warp_specialized


@pytest.mark.parametrize("head_dim, head_dim_v, causal", [
    (192, 192, False), (192, 192, True), (160, 160, False), (192, 128, True), (128, 192, False), (144, 96, True),
    (96, 96, False), (96, 96, True), (80, 80, False), (96, 64, True), (64, 96, False), (96, 128, False),
    (128, 80, True), (112, 112, False), (96, 192, False),
    (64, 64, False), (256, 256, True), (128, 128, False)])
def test_head_split_dispatch(hopper, monkeypatch, head_dim, head_dim_v, causal):
    """A call on Hopper with and without FLASHLITE_HEAD_SPLIT=1: the kernel (either: warp-specialized at padded
    D = 128, 3000 keys) gets one descriptor a column part of each of q, k, v, o (boxes as wide as the parts,
    ``plan.head_dim_parts``), bound to the call's own tensors, None for the second part of a head dim of one part,
    and the parts' sums as its widths; unsplit, boxes as wide as the padded head dims."""
    launched = []
    spy_tma_launches(monkeypatch, launched)
    q, k, _ = map(on_hopper, hopper_qkv(head_dim, torch.bfloat16, seqlen_k=3000, kv_heads=2))  # GQA
    v = on_hopper(torch.randn(2, 2, 3000, head_dim_v, dtype=torch.bfloat16))
    for split in (False, True):
        monkeypatch.setenv("FLASHLITE_HEAD_SPLIT", "1" if split else "0")
        o, _ = api.attention_forward(q, k, v, causal, 0.1, None, False, True)
        launch, args = launched[-1]
        parts = plan.head_dim_parts if split else (lambda d: (plan.head_dim_padded(d),))
        q_parts, v_parts = parts(head_dim), parts(head_dim_v)
        config = plan.wgmma_config(max(head_dim, head_dim_v), causal, 3000, max(sum(q_parts), sum(v_parts)))
        assert (launch.options["HEAD_DIM"], launch.options["HEAD_DIM_V"]) == (sum(q_parts), sum(v_parts))
        n_descs = 4 * gluon_tiles.MAX_COLUMN_PARTS
        assert launch.kernel is (fw._attention_fwd_ws_kernel if config.warp_specialized
                                 else fw._attention_fwd_wgmma_kernel)
        assert launch.kernel.arg_names[n_descs] == "lse_ptr"
        tensors, widths = (q, k, v, o), (q_parts, q_parts, v_parts, v_parts)
        rows = (config.block_m, config.block_n, config.block_n, config.block_m)
        for i, desc in enumerate(args[:n_descs]):
            part, which = divmod(i, 4)
            if part >= len(widths[which]):
                assert desc is None, (split, i)
                continue
            assert desc.base is tensors[which], (split, i)
            assert desc.block_shape == [1, 1, rows[which], widths[which][part]], (split, i)


def _split_build_report(cases: list) -> dict:
    """For each (head_dim, head_dim_v, causal, variants, dtype name, seqlen_k), the kernel a call of ``seqlen_k`` keys
    takes, built with its head dims in column parts (as ``FLASHLITE_HEAD_SPLIT=1`` plans them): the PTX's wgmma
    widths (N of each m64nNk16), wait depths, the bytes each mbarrier expects, its TMA stores and register moves."""
    report = {}
    for head_dim, head_dim_v, causal, variants, dtype, seqlen_k in cases:
        width = max(sum(plan.head_dim_parts(head_dim)), sum(plan.head_dim_parts(head_dim_v)))
        config = plan.wgmma_config(max(head_dim, head_dim_v), causal, seqlen_k, width)
        compiled = _compile_for_hopper(config, head_dim, causal, write_lse=not causal,
                                       variants=ALL_VARIANTS if variants else None, head_dim_v=head_dim_v,
                                       split=True, dtype=getattr(torch, dtype))
        ptx = compiled.asm["ptx"]
        name = f"{head_dim}-v{head_dim_v}-{causal}-{dtype}-{seqlen_k}" + ("-variants" if variants else "")
        report[name] = dict(
            block=[config.block_m, config.block_n], warps=compiled.metadata.num_warps,
            warp_specialized=config.warp_specialized,
            registers=_ptx_numbers(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx),
            widths=_ptx_numbers(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx),
            waits=_ptx_numbers(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx),
            expects=_ptx_numbers(r"mbarrier\.arrive\.expect_tx\.shared(?:::cta)?\.b64 _, \[%r\d+\], (\d+)", ptx),
            stores=len(re.findall(r"cp\.async\.bulk\.tensor\.4d\.global\.shared", ptx)),
            tanh="tanh.approx.f32" in ptx)
    return report


def _ptx_numbers(pattern: str, ptx: str) -> list:
    """The distinct numbers that ``pattern``'s group captures in ``ptx``, sorted."""
    return sorted({int(n) for n in re.findall(pattern, ptx)})


def test_split_kernel_builds_with_products_in_flight():
    """Head dims in column parts, built for sm_90 in a fresh process (as test_kernel_builds_with_products_in_flight):
    S from one product a part of Q/K chained on one accumulator (their widths the S tile's), O one accumulator a part
    of V/O (one product of each part's width, one TMA store a part, in each softmax warpgroup of the
    warp-specialized kernel), one mbarrier a tile expecting the bytes of every part, and the loop waiting until only
    the P V products, one a part of O, are in flight."""
    cases = [(192, 192, False, False, "bfloat16", 1024), (192, 192, True, False, "float16", 1024),
             (192, 128, False, False, "bfloat16", 1024), (160, 160, True, False, "bfloat16", 1024),
             (128, 192, True, False, "float16", 1024), (192, 192, True, True, "bfloat16", 1024),  # every variant
             # 65 to 96: the warp-specialized kernel (the other one for short causal calls, and beside Dv = 192)
             (96, 96, False, False, "bfloat16", 4096), (96, 96, True, False, "float16", 4096),
             (80, 80, False, False, "float16", 4096), (96, 64, True, False, "bfloat16", 4096),
             (64, 96, False, False, "bfloat16", 4096), (96, 128, True, False, "float16", 4096),
             (128, 80, False, False, "bfloat16", 4096), (96, 96, True, True, "bfloat16", 4096),
             (80, 96, False, True, "float16", 4096), (96, 96, True, False, "bfloat16", 1024),
             (96, 192, False, False, "bfloat16", 4096)]
    report = fresh_process_report("tests.test_attention_wgmma", "_split_build_report", cases)
    for (head_dim, head_dim_v, causal, variants, dtype, seqlen_k), built in zip(cases, report.values()):
        q_parts, v_parts = plan.head_dim_parts(head_dim), plan.head_dim_parts(head_dim_v)
        block_m, block_n = built["block"]
        ws = built["warp_specialized"]
        assert ws == (plan.head_dim_padded(max(head_dim, head_dim_v)) == 128 and (not causal or seqlen_k > 1024))
        assert built["warps"] == (12 if ws else 4), built
        if ws:  # registers moved from the load warp to the softmax warpgroups
            assert {tuning.WS_SOFTMAX_REGISTERS, tuning.WS_LOAD_REGISTERS} <= set(built["registers"]), built
        else:
            assert built["registers"] == [], built
        assert set(built["widths"]) == {block_n, *v_parts}, built  # S's products, then one a part of O
        assert len(v_parts) in built["waits"], built  # every P V product left in flight across the softmax
        assert {block_m * sum(q_parts) * 2, block_n * sum(q_parts) * 2,  # Q's tile, K's: both parts, one barrier
                block_n * sum(v_parts) * 2} <= set(built["expects"]), built
        assert built["stores"] == len(v_parts) * (2 if ws else 1), built  # (each softmax warpgroup stores its rows)
        assert built["tanh"] == variants, built
    assert sum(built["warp_specialized"] for built in report.values()) >= 9


# ----------------------------------------------------------------------------- packed (variable-length) batches


def test_packed_schedule_numbers_every_tile():
    # core.packed.tile_sequence's schedule: sequence b's tiles numbered from cu[b] // rows + b on. Every tile gets a
    # number of its own below plan.packed_schedule's count, and no sequence leaves more than one number unused.
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        rows = (64, 128, 256)[trial % 3]
        lengths = torch.randint(0, 3 * rows, (int(torch.randint(1, 40, (1,), generator=generator)),),
                                generator=generator).tolist()
        if trial % 7 == 0:
            lengths = [rows * int(n % 3) for n in lengths]  # multiples of the tile
        cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        numbers, seq_block = plan.packed_schedule(len(lengths), cu[-1], rows, 4)
        starts = [cu[b] // rows + b for b in range(len(lengths))]
        taken = [start + t for b, start in enumerate(starts) for t in range(triton.cdiv(lengths[b], rows))]
        assert len(set(taken)) == len(taken) and max(taken, default=0) < numbers, (rows, lengths)
        assert numbers - len(taken) <= len(lengths), (rows, lengths)
        assert seq_block & (seq_block - 1) == 0 and 128 <= seq_block <= tuning.PACKED_SEQ_BLOCK


def test_packed_batch_dispatch(hopper, monkeypatch):
    """A packed batch on Hopper takes the Hopper forward by default (the tl kernel under FLASHLITE_HOPPER_VARLEN=0):
    one program a number of the flattened schedule and head,
    the (1, H, total, D) tensors' descriptors, and the packed tuple (cu_seqlens, sequences, O and its strides,
    Dv) that its last query tiles are stored through."""
    from .utils import cu_seqlens

    launched = []
    spy_tma_launches(monkeypatch, launched)
    lengths = [300, 0, 100, 517]
    total = sum(lengths)
    q = on_hopper(torch.randn(1, 4, total, 128, dtype=torch.bfloat16))
    monkeypatch.setenv("FLASHLITE_HOPPER_VARLEN", "0")  # switched off: the tl kernel
    assert not route.Route(q, q, q, None, False, True, 0.1, None, None, False, False, True, False, 1, False,
                           varlen=(len(lengths), 517, 517)).hopper
    monkeypatch.delenv("FLASHLITE_HOPPER_VARLEN")  # the default: the Hopper kernel
    for head_dim, head_dim_v in ((128, 128), (64, 64), (192, 128)):
        q = on_hopper(torch.randn(1, 4, total, head_dim, dtype=torch.bfloat16))  # packed: (1, H, total, D)
        k = on_hopper(torch.randn(1, 2, total, head_dim, dtype=torch.bfloat16))
        v = on_hopper(torch.randn(1, 2, total, head_dim_v, dtype=torch.bfloat16))
        cu = cu_seqlens(lengths, "cpu")
        way = route.Route(q, k, v, None, False, True, 0.1, None, None, False, False, True, False, 1, False,
                          varlen=(len(lengths), 517, 517))
        assert way.hopper
        o, _, _ = way.forward(q, k, v, None, None, None, None, seqs=(cu, cu))
        launch, args = launched[-1]
        config = plan.wgmma_config(max(head_dim, head_dim_v), True, 517)
        assert launch.grid == ((total // config.rows_per_program + len(lengths)) * 4,)
        assert launch.options["SEQ_BLOCK"] == 128
        n_descs = 4 * gluon_tiles.MAX_COLUMN_PARTS
        assert args[0].base is q and args[0].shape == [1, 4, total, head_dim]
        packed = args[n_descs + 3]
        assert packed[:3] == (cu, cu, len(lengths)) and packed[3] is o
        assert packed[4:] == (o.stride(1), o.stride(2), head_dim_v)
        assert args[n_descs + 6:n_descs + 8] == (total, total)  # the totals: the rows a sequence's may lie in
    # A dense call launches without one.
    q, k, v = map(on_hopper, hopper_qkv(128, torch.bfloat16))
    api.attention_forward(q, k, v, True, 0.1, None, False, True)
    launch, args = launched[-1]
    assert launch.options["SEQ_BLOCK"] == 0 and args[4 * gluon_tiles.MAX_COLUMN_PARTS + 3] is None


def _packed_build_report(cases: list) -> dict:
    """For each (head_dim, head_dim_v, causal): the packed batch's kernel built for sm_90 (head dims in column
    parts): its wgmma wait depths, TMA stores and whether O's last tiles have pointer stores."""
    report = {}
    for head_dim, head_dim_v, causal in cases:
        width = max(sum(plan.head_dim_parts(head_dim)), sum(plan.head_dim_parts(head_dim_v)))
        config = plan.wgmma_config(max(head_dim, head_dim_v), causal, 4096, width)
        compiled = _compile_for_hopper(config, head_dim, causal, write_lse=True, head_dim_v=head_dim_v, split=True,
                                       packed=True)
        ptx = compiled.asm["ptx"]
        report[f"{head_dim}-v{head_dim_v}-{causal}"] = dict(
            warp_specialized=config.warp_specialized,
            waits=_ptx_numbers(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx),
            tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.4d\.global\.shared", ptx)),
            stores=len(re.findall(r"st\.global\.v?\d*\.?b(?:16|32)", ptx)))
    return report


def test_packed_kernel_builds_with_products_in_flight():
    """The packed batch's kernels built for sm_90 in a fresh process: the K/V loop as the dense kernel's (a P V
    product of every part of O in flight across the softmax), O's full tiles by TMA, its last ones by pointer."""
    cases = [(128, 128, True), (128, 128, False), (64, 64, True), (256, 256, False), (192, 192, True),
             (96, 64, False), (192, 128, True)]
    report = fresh_process_report("tests.test_attention_wgmma", "_packed_build_report", cases)
    for (head_dim, head_dim_v, causal), built in zip(cases, report.values()):
        v_parts = plan.head_dim_parts(head_dim_v)
        assert len(v_parts) in built["waits"], built
        assert built["tma_stores"] == len(v_parts) * (2 if built["warp_specialized"] else 1), built
        assert built["stores"] > 0, built
    assert report["128-v128-True"]["warp_specialized"]
