"""The Hopper forward kernel (flashlite.attention.forward_hopper): which calls it takes, and that it builds as designed.

Gluon has no interpreter, so the kernel's results are checked on the GPU only
(``pytest -m gpu``: tests/test_gpu_attention.py and test_gpu_decode.py run every
default-variant case with D = 64/128, fp16/bf16 and no mask on it). Here, on CPU:

* the dispatch rules, with tensors that claim to be on a Hopper GPU;
* the kernel compiled for sm_90 (no GPU needed): its K/V loop must keep one
  wgmma in flight while the softmax runs (``wgmma.wait_group 1`` in the PTX),
  which is the point of the module;
* the descriptors built without the dataclass's checks equal checked ones.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import triton

from flashlite.attention import api, plan, route, tuning
from flashlite.attention import forward_hopper as fw
from flashlite.attention import gluon_tiles
from flashlite.core import tiles

from .utils import HOPPER, hopper_qkv, on_hopper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
                        variants: dict | None = None, head_dim_v: int | None = None):
    """The kernel ``config`` selects, built for sm_90 from CPU (the types a launch on Hopper would give);
    ``variants``: ``plan.variant_args``' switches that are on."""
    from triton.backends.compiler import GPUTarget
    from flashlite.core.triton_compat import gluon_source, mangle_type

    head_dim_v = head_dim_v or head_dim
    descs = {name: gluon_tiles.gluon_descriptor(torch.randn(1, 1, 256, width, dtype=torch.bfloat16), rows, width)
             for name, rows, width in (("q_desc", config.block_m, head_dim), ("k_desc", config.block_n, head_dim),
                                       ("v_desc", config.block_n, head_dim_v), ("o_desc", config.block_m, head_dim_v))}
    kernel, meta = fw.kernel_for(config, head_dim, head_dim_v, causal, write_lse, variants)  # a launch's
    options = {name: meta[name] for name in ("num_warps", "maxnreg") if name in meta}
    constants = {name: value for name, value in meta.items() if name != "maxnreg"}
    signature = {}
    for name in kernel.arg_names:
        if name in descs:
            signature[name] = mangle_type(descs[name])
        elif name in constants:
            signature[name] = "constexpr"
        else:
            signature[name] = {"lse_ptr": "*fp32", "alibi_ptr": "*fp32", "sinks_ptr": "*fp32", "qk_scale": "fp32",
                               "softcap": "fp32"}.get(name, "i32")
    return triton.compile(gluon_source(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options=options)


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
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import json; from tests.test_attention_wgmma import _build_report; print(json.dumps(_build_report({cases})))"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
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
