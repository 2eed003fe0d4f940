"""What each refinement buys: the textbook kernels, then each refinement of the fast kernels one at a time.

Two parts, all in one process on the same inputs:

* **The chain** (``CHAIN``): per shape, the textbook kernel (``flashlite.textbook``),
  then flashlite's kernels with their refinements switched on one after the other,
  as far as each applies to the shape. Softmax: fused tiles of several rows on a
  persistent grid (rows past ``FUSED_MAX_COLS`` streamed whole), + split rows
  (online), + shared rows, + frames for odd rows, + reread, + rows over a cluster, then the public
  ``flashlite.softmax`` (its checks, and the repeat-launch cache). A stage whose plan is the previous
  one's is not timed again. Attention (bf16, B·L = 16K, H·D = 2048): the textbook
  kernel, the ``triton.language`` kernel on pointer loads, + TMA, + the Gluon
  Hopper kernel (``flashlite.flash_attention``, its default on H100/H200).
  Decoding: the textbook kernel, the forward kernel (``num_splits=1``), split-K/V
  without GQA packing, + packing (the default).
* **The knobs** (``KNOBS``): every regime or table entry that can be switched
  from outside ``flashlite`` (a forced ``SoftmaxPlan``, a tuning constant patched
  in this process, a config passed in), timed with it ("refined") and without it
  ("simpler": the path it replaced) on 2-4 shapes where it applies, the two
  alternating over ``--rounds`` rounds (order reversed every round, each on a
  fresh copy of the input, ``common.fresh_copy``, after a round not kept);
  medians of ``triton.testing.do_bench``. Calls shorter than ``GRAPH_BELOW_MS``
  are timed again as CUDA-graph replays, the same way: forced plans go through
  ``softmax_forward``, whose host cost (50-70 us a call on shared rows) do_bench
  counts on such calls, for both variants alike. A knob whose best gain over its
  shapes (either way) is under ``KEEP_GAIN`` (3%) is marked for removal, with the
  measurement written down. Knobs that cannot be switched from outside are
  listed in ``NOT_SWITCHABLE``.

Every variant's output is checked against float64 (a few rows, or heads and
query rows, of each tensor) before it is timed; a wrong one is not timed.

    python bench/refinements.py                 # all -> bench/results/<gpu>/refinements.{json,md}
    python bench/refinements.py --only reread   # the chains (softmax, attention, decode) and knobs whose
                                                # name holds one of the words
    python bench/refinements.py --list          # what would run, without running it
    TRITON_INTERPRET=1 python bench/refinements.py --smoke   # every stage and knob once on tiny inputs,
                                                # checked against float64 (CPU through the interpreter, or GPU)

Columns. Chain: ``stage``, ``shape``, ``plan`` (how the stage runs there),
``rate`` (GB/s counting one read and one write of x for softmax, reads of y
and dy and a write of dx for its backward, the bytes of q, k, v and o for
decoding; TFLOP/s ``4·B·H·Lq·Lk·D``, halved under causal,
for attention), ``x_prev`` (its speed over the stage timed before it on that
shape), ``frac`` (rate over the ceiling measured in the same run: device copy
bandwidth, read + write, for GB/s; the bf16 8192³ matmul rate for TFLOP/s),
``graph_rate`` (the rate of CUDA-graph replays, short calls only). Knobs:
``simpler`` and ``refined`` (rates), ``gain`` (simpler's median time over
refined's: above 1, the knob pays), ``spread`` (largest (max - min) / median
of the two variants' rounds), ``*_graph`` (the same from CUDA-graph replays),
``active`` (flashlite's default takes the refined variant on that shape). The
summary gives each knob's best gain, ``by`` the call or its graph, its worst
call gain, and the ``verdict`` (keep: at least ``KEEP_GAIN`` on some shape;
else "< 3%: remove?").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton
from common import (
    attention_flops,
    copy_bandwidth_gbs,
    environment,
    fresh_copy,
    matmul_tflops,
    results_dir,
    tensor_softmax_bytes,
    time_ms,
)

import flashlite
from flashlite.attention import api as attention_api
from flashlite.attention import forward_hopper, split_kv
from flashlite.attention import tuning as attention_tuning
from flashlite.attention.api import attention_forward
from flashlite.attention.plan import default_config, head_dim_padded, tma_safe
from flashlite.core.runtime import interpreter_enabled
from flashlite.core.tiles import tma_usable
from flashlite.softmax import api as softmax_api
from flashlite.softmax import tuning as softmax_tuning
from flashlite.softmax.api import clear_plans, softmax_forward
from flashlite.softmax.backward import softmax_backward
from flashlite.softmax.frames import row_vectors
from flashlite.softmax.plan import SoftmaxPlan, fused_warps, plan_rows, plan_softmax
from flashlite.textbook import flash_attention_forward, fused_softmax, online_softmax
from flashlite.textbook.fused_softmax import MAX_COLS as TEXTBOOK_FUSED_MAX_COLS

KEEP_GAIN = 1.03  # a knob stays if it is at least this much faster than the simpler path on some shape
ROUNDS, CHAIN_ROUNDS = 3, 3  # alternating rounds a knob's shape / a chain's shape (--rounds, --chain-rounds)
WARMUP_MS, REP_MS = 10, 25  # do_bench's budgets a measurement (--warmup, --rep)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.2e-2}  # max |out - ref| / max |ref| against float64
# Calls shorter than this (ms) are timed again as CUDA-graph replays: the device's time without the host's cost
# of a call (50-70 us through softmax_forward on shared rows), which do_bench counts once the kernel is shorter.
GRAPH_BELOW_MS = 0.25
ATTENTION_TOKENS, ATTENTION_WIDTH = 16384, 2048  # B·L and H·D of the attention shapes
K, M = 1 << 10, 1 << 20


# ----------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Rows:
    """A softmax input: ``rows`` x ``cols`` of ``dtype`` ("fp32" or "bf16")."""

    dtype: str
    rows: int
    cols: int

    def __str__(self) -> str:
        """The shape as the tables print it, e.g. ``fp32 4096x4095``."""
        return f"{self.dtype} {self.rows}x{self.cols}"


@dataclass(frozen=True)
class Heads:
    """An attention input (bf16): q (batch, heads, seqlen_q, head_dim), k and v (batch, kv_heads, seqlen_k, head_dim)."""

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = False

    def __str__(self) -> str:
        """The shape as the tables print it, e.g. ``B4 H16 L4096 D128 causal`` or ``B1 H32/8 Lq1 Lk32768 D128``."""
        heads = f"H{self.heads}" + (f"/{self.kv_heads}" if self.kv_heads != self.heads else "")
        lengths = f"L{self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"Lq{self.seqlen_q} Lk{self.seqlen_k}"
        return f"B{self.batch} {heads} {lengths} D{self.head_dim}" + (" causal" if self.causal else "")


def sequences(head_dim: int, length: int, causal: bool) -> Heads:
    """The benchmark list's attention shape: B·L = 16K tokens, H·D = 2048."""
    heads = ATTENTION_WIDTH // head_dim
    return Heads(max(1, ATTENTION_TOKENS // length), heads, heads, length, length, head_dim, causal)


def tiny_sequences(head_dim: int, length: int, causal: bool) -> Heads:
    """A smoke-test attention shape: one sequence of two heads."""
    return Heads(1, 2, 2, length, length, head_dim, causal)


# ----------------------------------------------------------------------------- cases


@dataclass
class Variant:
    """One way to run a case: ``run()`` returns the output that ``Case.check`` compares; ``skip`` says why not run."""

    label: str
    run: Callable[[], torch.Tensor] | None = None
    plan: str = ""
    skip: str = ""


@dataclass
class Case:
    """A shape and the variants timed on it (simplest first), with what one call moves or computes."""

    shape: str
    unit: str  # "GB/s" or "TFLOP/s"
    work: float  # bytes or FLOPs a call
    variants: list[Variant]
    check: Callable[[torch.Tensor], float]  # max |out - ref| / max |ref| against float64
    tol: float
    active: bool | None = None  # knobs: flashlite's default takes the refined variant here
    note: str = ""
    skip: str = ""  # why the whole case was not run
    graph: bool = True  # short calls also timed from CUDA graphs (False where the host's cost is what is timed)


@dataclass
class Knob:
    """A regime or table entry, switched from outside flashlite: ``build(shape, device)`` gives the case
    [simpler, refined] on one shape."""

    name: str
    switch: str  # how it is switched here
    build: Callable[[object, torch.device], Case]
    shapes: list
    smoke_shapes: list
    gpu_only: str = ""  # why the knob cannot run through the interpreter


@dataclass
class Chain:
    """A chain of stages on a list of shapes: ``build(shape, device)`` gives the case of all stages."""

    name: str
    build: Callable[[object, torch.device], Case]
    shapes: list
    smoke_shapes: list


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` for one variant: on a GPU one whose L2 lines keep no ``evict_last`` priority (``fresh_copy``)."""
    if t.is_cuda:
        return fresh_copy(t)
    return t.clone()


def with_values(module, values: dict, fn: Callable[[], torch.Tensor], clear: bool = False) -> Callable[[], torch.Tensor]:
    """``fn`` run with ``module``'s constants set to ``values`` (restored after each call); with ``clear``, the
    softmax plans are forgotten before and after (plans are cached without the constants in their key)."""

    def run() -> torch.Tensor:
        """One call of ``fn`` under the values."""
        saved = {name: getattr(module, name) for name in values}
        for name, value in values.items():
            setattr(module, name, value)
        if clear:
            clear_plans()
        try:
            return fn()
        finally:
            for name, value in saved.items():
                setattr(module, name, value)
            if clear:
                clear_plans()

    return run


def planned_with(module, values: dict, plan_fn: Callable[[], SoftmaxPlan]) -> SoftmaxPlan:
    """The plan ``plan_fn()`` makes while ``module``'s constants are ``values``."""
    return with_values(module, values, plan_fn, clear=True)()


def has_constants(module, *names: str) -> str:
    """"" if ``module`` still has every constant named, else why a knob built on them cannot be switched."""
    missing = [name for name in names if not hasattr(module, name)]
    return f"not switchable: {module.__name__} has no {', '.join(missing)}" if missing else ""


# ----------------------------------------------------------------------------- softmax


def softmax_input(shape: Rows, device: torch.device) -> torch.Tensor:
    """Normal data of ``shape`` on ``device``."""
    return torch.randn(shape.rows, shape.cols, device=device, dtype=DTYPES[shape.dtype])


def softmax_check(x: torch.Tensor) -> Callable[[torch.Tensor], float]:
    """The error of a softmax of ``x`` on its first, middle and last rows against float64."""
    rows = sorted({0, x.shape[0] // 2, x.shape[0] - 1})
    ref = torch.softmax(x[rows].double(), -1)

    def check(y: torch.Tensor) -> float:
        """max |y - ref| / max |ref| on those rows."""
        return ((y[rows].double() - ref).abs().max() / ref.abs().max()).item()

    return check


def describe(plan: SoftmaxPlan) -> str:
    """A short description of a softmax plan, e.g. ``fused 4x1024/w4``, ``shared 8x16384/w4 head 4096 L2``."""
    if plan.algorithm == "online":
        text = f"online {plan.block_n}/w{plan.num_warps}" + (f" x{plan.n_splits} splits" if plan.n_splits > 1 else "")
    elif plan.algorithm == "cluster":
        text = f"cluster {plan.n_splits}x{plan.block_n}/w{plan.num_warps}"
    elif plan.reread:
        text = f"reread {plan.block_n}/w{plan.num_warps}"
    elif plan.shares_rows:
        text = f"shared {plan.n_splits}x{plan.block_n}/w{plan.num_warps}"
        if plan.head_cols:
            text += f" head {plan.head_cols}" + (f" g{plan.head_group}" if plan.head_group > 1 else "")
            text += f" {plan.head_eviction}" if plan.head_eviction else ""
        text += " L2" if plan.prefetch else ""
    else:
        text = f"fused {plan.block_m}x{plan.block_n}/w{plan.num_warps}"
    if plan.vec_cols > 1:
        text += f" frames{plan.vec_cols}"
    elif plan.vec_cols == 0:
        text += " unaligned"
    return text


def forward_variant(label: str, x: torch.Tensor, plan: SoftmaxPlan) -> Variant:
    """``softmax_forward`` of a copy of ``x`` under ``plan``."""
    xc = copy_of(x)
    return Variant(label, lambda: softmax_forward(xc, xc.dtype, plan)[0], describe(plan))


def softmax_case(shape: Rows, x: torch.Tensor, variants: list[Variant], refined: SoftmaxPlan | None = None,
                 note: str = "") -> Case:
    """A softmax case on ``x`` (one read and one write of it a call): ``active`` when flashlite's own plan for
    ``x`` is ``refined``."""
    active = None if refined is None else plan_rows(x, x.dtype) == refined
    return Case(str(shape), "GB/s", tensor_softmax_bytes(x), variants, softmax_check(x), REL_TOL[x.dtype],
                active, note)


def plan_pair(shape: Rows, device: torch.device, simpler: SoftmaxPlan, refined: SoftmaxPlan, x: torch.Tensor,
              note: str = "") -> Case:
    """The case [simpler plan, refined plan] on ``x``; skipped when the two plans are the same."""
    case = softmax_case(shape, x, [forward_variant("simpler", x, simpler), forward_variant("refined", x, refined)],
                        refined, note)
    if simpler == refined:
        case.skip = f"same plan both ways ({describe(refined)})"
    return case


NO_CLUSTERS = {"CLUSTER": {}}  # tuning values of a GPU without thread-block clusters


def rows_plan(x: torch.Tensor, **values) -> SoftmaxPlan:
    """``plan_rows(x, x.dtype)`` with softmax tuning ``values`` and without clusters (``NO_CLUSTERS``): the regimes
    the shared-row, reread and frame knobs switch, which Hopper's clusters replace for many long rows."""
    return planned_with(softmax_tuning, {**NO_CLUSTERS, **values}, lambda: plan_rows(x, x.dtype))


def knob_rows_per_tile(shape: Rows, device: torch.device) -> Case:
    """Fused tiles of several short rows against one row a program (the same grid policy)."""
    x = softmax_input(shape, device)
    refined = plan_softmax(shape.rows, shape.cols, device, "fused")
    simpler = dataclasses.replace(refined, block_m=1, num_warps=fused_warps(refined.block_n))
    return plan_pair(shape, device, simpler, refined, x)


def knob_persistent_grid(shape: Rows, device: torch.device) -> Case:
    """Fused tiles of up to FUSED_PERSISTENT_MAX_COLS on a persistent grid, against a program a tile."""
    x = softmax_input(shape, device)
    plan = plan_rows(x, x.dtype)
    refined = forward_variant("refined", x, plan)
    simpler = forward_variant("simpler", x, plan)
    simpler.run = with_values(softmax_tuning, {"FUSED_PERSISTENT_MAX_COLS": 0}, simpler.run)
    simpler.plan += " a program a tile"
    case = softmax_case(shape, x, [simpler, refined], plan)
    if plan.algorithm != "fused" or plan.block_n > softmax_tuning.FUSED_PERSISTENT_MAX_COLS:
        case.skip = f"no persistent grid here ({describe(plan)})"
    return case


def knob_short_tiles(shape: Rows, device: torch.device) -> Case:
    """Smaller fused tiles (FUSED_SHORT_TILE_ELEMS) for rows of up to FUSED_SHORT_MAX_COLS, against the usual tile."""
    x = softmax_input(shape, device)
    refined = plan_softmax(shape.rows, shape.cols, device, "fused")
    block_m = max(1, min(softmax_tuning.FUSED_TILE_ELEMS // refined.block_n, triton.next_power_of_2(shape.rows)))
    simpler = SoftmaxPlan("fused", block_m, refined.block_n, fused_warps(block_m * refined.block_n))
    return plan_pair(shape, device, simpler, refined, x)


def knob_fused_vs_online(shape: Rows, device: torch.device) -> Case:
    """A row held on chip (fused, one read) against the row streamed twice (online), up to FUSED_MAX_COLS."""
    x = softmax_input(shape, device)
    return plan_pair(shape, device, plan_softmax(shape.rows, shape.cols, device, "online"),
                     plan_softmax(shape.rows, shape.cols, device, "fused"), x)


def knob_split_rows(shape: Rows, device: torch.device) -> Case:
    """Few long rows split across programs (two launches), against a program a row streaming it whole."""
    x = softmax_input(shape, device)
    return plan_pair(shape, device, plan_softmax(shape.rows, shape.cols, device, "online", n_splits=1),
                     plan_softmax(shape.rows, shape.cols, device, "online"), x,
                     note="algorithm='online' and masked softmax; 'auto' shares such rows on a GPU")


def knob_online_stages(shape: Rows, device: torch.device) -> Case:
    """The online loops software-pipelined (ONLINE_NUM_STAGES) against one load in flight."""
    x = softmax_input(shape, device)
    plan = plan_softmax(shape.rows, shape.cols, device, "online")
    simpler = forward_variant("simpler", x, plan)
    simpler.run = with_values(softmax_tuning, {"ONLINE_NUM_STAGES": 1}, simpler.run)
    simpler.plan += " 1 stage"
    refined = forward_variant("refined", x, plan)
    refined.plan += f" {softmax_tuning.ONLINE_NUM_STAGES} stages"
    return softmax_case(shape, x, [simpler, refined], plan, note="online plans")


def knob_shared_rows(shape: Rows, device: torch.device) -> Case:
    """Long rows held by resident programs that merge their states (one read), against the online path."""
    x = softmax_input(shape, device)
    return plan_pair(shape, device, plan_softmax(shape.rows, shape.cols, device, "online"), rows_plan(x), x)


def knob_head_waves(shape: Rows, device: torch.device) -> Case:
    """Few rows in at most two waves, each part streaming a head (SHARED_HEADS_L2_FRACTION), against waves of
    held parts."""
    x = softmax_input(shape, device)
    simpler = rows_plan(x, SHARED_HEADS_L2_FRACTION=0.0)
    return plan_pair(shape, device, simpler, rows_plan(x), x)


def knob_wave_tiles(shape: Rows, device: torch.device) -> Case:
    """Many long rows in waves of parts on their own tiles (SHARED_WAVE_TILES), against SHARED_TILES."""
    x = softmax_input(shape, device)
    simpler = rows_plan(x, SHARED_WAVE_TILES=dict(softmax_tuning.SHARED_TILES))
    return plan_pair(shape, device, simpler, rows_plan(x), x)


def knob_prefetch(shape: Rows, device: torch.device) -> Case:
    """Shared rows asking L2 for the next row's part while the parts meet (PREFETCH_L2), against no prefetch."""
    x = softmax_input(shape, device)
    refined = rows_plan(x)
    case = plan_pair(shape, device, dataclasses.replace(refined, prefetch=softmax_tuning.PREFETCH_NONE.value), refined, x)
    if not refined.prefetch:
        case.skip = f"no prefetch in this plan ({describe(refined)})"
    return case


def knob_head_groups(shape: Rows, device: torch.device) -> Case:
    """Head blocks folded in groups of adjacent columns keeping one state (head_group), against a state a lane."""
    x = softmax_input(shape, device)
    refined = rows_plan(x)
    return plan_pair(shape, device, dataclasses.replace(refined, head_group=1), refined, x)


def knob_head_eviction(shape: Rows, device: torch.device) -> Case:
    """fp32 wave heads loaded evict_last, against no hint."""
    x = softmax_input(shape, device)
    refined = rows_plan(x)
    return plan_pair(shape, device, dataclasses.replace(refined, head_eviction=""), refined, x,
                     note="evict_last lines outlive do_bench's flush and serve the next call: biased for the hint")


def knob_frames(shape: Rows, device: torch.device) -> Case:
    """Odd rows read in frames of whole 16-byte vectors, against one element a load (shared rows: the unaligned
    tiles, SHARED_TILES_UNALIGNED, the rule before frames)."""
    x = softmax_input(shape, device)
    refined = rows_plan(x)
    if refined.shares_rows:
        simpler = plan_softmax(shape.rows, shape.cols, device, "auto", shared_rows=x.dtype, vec_cols=0)
    else:
        simpler = dataclasses.replace(refined, vec_cols=1)
    case = plan_pair(shape, device, simpler, refined, x)
    if refined.vec_cols <= 1:
        case.skip = f"rows not read in frames ({describe(refined)})"
    return case


def reread_plan(n_cols: int) -> SoftmaxPlan:
    """The plan of a program a row that reads its row twice (``plan._plan_reread``'s)."""
    return SoftmaxPlan("fused", 1, triton.next_power_of_2(n_cols), softmax_tuning.FWD_REREAD_WARPS, reread=True)


def knob_reread(shape: Rows, device: torch.device) -> Case:
    """Many 16-bit rows of up to 65536 read twice by a program each (FWD_REREAD_MAX_COLS), against the plan
    without that rule (shared rows in waves on a GPU)."""
    x = softmax_input(shape, device)
    simpler = rows_plan(x, FWD_REREAD_MAX_COLS={})
    return plan_pair(shape, device, simpler, reread_plan(shape.cols), x)


def knob_cluster(shape: Rows, device: torch.device) -> Case:
    """Many long rows over a thread-block cluster each (Hopper: tuning.CLUSTER), against the plan of a GPU
    without clusters (read twice, or shared rows)."""
    x = softmax_input(shape, device)
    return plan_pair(shape, device, rows_plan(x), plan_rows(x, x.dtype), x)


def no_launcher(*args, **kwargs) -> None:
    """Stands in for ``compiled_launcher`` in ``flashlite.softmax.api``: no launch to repeat, so the repeat cache
    keeps None for the call's signature and serves it by the general path."""


def knob_repeat_cache(shape: Rows, device: torch.device) -> Case:
    """``flashlite.softmax`` replaying the first call's launch (the repeat cache of ``flashlite.softmax.api``),
    against the same public call by the general path: host cost. The simpler variant asks for
    ``algorithm="fused"`` (the same plan, a signature of its own), first called while ``compiled_launcher``
    gives nothing to repeat."""
    x = softmax_input(shape, device)
    clear_plans()  # no signature seen yet
    xa, xb = copy_of(x), copy_of(x)
    skip = has_constants(softmax_api, "compiled_launcher")
    general = with_values(softmax_api, {"compiled_launcher": no_launcher}, lambda: flashlite.softmax(xa, algorithm="fused"))
    variants = [Variant("simpler", None if skip else general, "general path", skip),
                Variant("refined", lambda: flashlite.softmax(xb), "repeated launch")]
    case = softmax_case(shape, x, variants, note="host cost: timed by do_bench only")
    case.graph = False
    if plan_rows(x, x.dtype, "fused") != plan_rows(x, x.dtype):
        case.skip = "algorithm='fused' plans otherwise here"
    return case


def backward_case(shape: Rows, device: torch.device, plans: list[tuple[str, SoftmaxPlan, dict]]) -> Case:
    """Backward cases: ``softmax_backward`` of y = softmax(x) and a random dy under each (label, forward plan,
    constants set during the call) of ``plans``."""
    x = softmax_input(shape, device)
    y = flashlite.softmax(x)
    dy = torch.randn_like(y)
    rows = sorted({0, shape.rows // 2, shape.rows - 1})
    yd, dyd = y[rows].double(), dy[rows].double()
    ref = yd * (dyd - (yd * dyd).sum(-1, keepdim=True))

    def check(dx: torch.Tensor) -> float:
        """max |dx - ref| / max |ref| on three rows."""
        return ((dx[rows].double() - ref).abs().max() / ref.abs().max()).item()

    variants = []
    for label, plan, values in plans:
        yc, dyc = copy_of(y), copy_of(dy)

        def run(yc=yc, dyc=dyc, plan=plan) -> torch.Tensor:
            """The backward of the copies under the forward plan."""
            return softmax_backward(yc, dyc, yc.dtype, plan)

        variants.append(Variant(label, with_values(softmax_tuning, values, run, clear=True) if values else run,
                                f"after {describe(plan)}" + (" " + ", ".join(f"{k}={v}" for k, v in values.items())
                                                             if values else "")))
    return Case(str(shape), "GB/s", 3 * x.numel() * x.element_size(), variants, check, REL_TOL[x.dtype])


def knob_backward_reread(shape: Rows, device: torch.device) -> Case:
    """Backward rows from BWD_REREAD_MIN_COLS loaded twice (y, dy) by a program each, against the forward's tile
    holding them."""
    x = softmax_input(shape, device)
    plan = plan_rows(x, x.dtype)
    return backward_case(shape, device, [("simpler", plan, {"BWD_REREAD_MIN_COLS": 1 << 40}), ("refined", plan, {})])


def knob_backward_shared(shape: Rows, device: torch.device) -> Case:
    """Backward rows shared by resident programs (BWD_TILES' shared_cols), against the online backward."""
    x = softmax_input(shape, device)
    return backward_case(shape, device, [("simpler", plan_softmax(shape.rows, shape.cols, device, "online"), {}),
                                         ("refined", plan_rows(x, x.dtype), {})])


def knob_backward_reread_wide(shape: Rows, device: torch.device) -> Case:
    """16-bit backward rows of up to 65536 loaded twice by a program each (BWD_TILES[2].fused_max_cols), against
    shared rows."""
    x = softmax_input(shape, device)
    narrower = dict(softmax_tuning.BWD_TILES)
    narrower[2] = dataclasses.replace(narrower[2], fused_max_cols=32768)
    plan = plan_rows(x, x.dtype)
    return backward_case(shape, device, [("simpler", plan, {"BWD_TILES": narrower}), ("refined", plan, {})])


def softmax_chain(shape: Rows, device: torch.device) -> Case:
    """The softmax chain on ``shape``: the textbook kernels, then flashlite's plans as refinements are added."""
    x = softmax_input(shape, device)
    n_rows, n_cols, dtype = shape.rows, shape.cols, x.dtype
    vec = row_vectors(x, dtype)
    fused = n_cols <= softmax_tuning.FUSED_MAX_COLS
    base = plan_softmax(n_rows, n_cols, device, "fused") if fused else plan_softmax(n_rows, n_cols, device, "online",
                                                                                   n_splits=1)
    split = base if fused else plan_softmax(n_rows, n_cols, device, "online")
    no_reread = {"FWD_REREAD_MAX_COLS": {}, **NO_CLUSTERS}
    shared = planned_with(softmax_tuning, no_reread, lambda: plan_softmax(
        n_rows, n_cols, device, "auto", shared_rows=dtype, vec_cols=0 if vec != 1 else 1))
    framed = planned_with(softmax_tuning, no_reread, lambda: plan_softmax(
        n_rows, n_cols, device, "auto", shared_rows=dtype, vec_cols=vec))
    stages = [("flashlite: fused tiles (several rows, persistent) | online whole rows", base),
              ("+ split rows (online)", split), ("+ shared rows", shared), ("+ frames for odd rows", framed),
              ("+ reread (program a row, read twice)", rows_plan(x)),
              ("+ rows over a cluster (Hopper)", plan_rows(x, dtype))]
    xa, xb = copy_of(x), copy_of(x)
    variants = [Variant("textbook fused (row a program)", lambda: fused_softmax(xa), "fused 1 row/w16",
                        "" if n_cols <= TEXTBOOK_FUSED_MAX_COLS else f"rows past {TEXTBOOK_FUSED_MAX_COLS}"),
                Variant("textbook online (row a program)", lambda: online_softmax(xb), "online 1024/w4")]
    last = None
    for label, plan in stages:
        if plan != last:
            variants.append(forward_variant(label, x, plan))
            last = plan
    xc = copy_of(x)
    variants.append(Variant("+ public call (flashlite.softmax: checks, repeat-launch cache)",
                            lambda: flashlite.softmax(xc),
                            describe(plan_rows(x, dtype))))
    return softmax_case(shape, x, variants)


# ----------------------------------------------------------------------------- attention


def attention_inputs(shape: Heads, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 q, k, v of ``shape`` on ``device``."""
    q = torch.randn(shape.batch, shape.heads, shape.seqlen_q, shape.head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(shape.batch, shape.kv_heads, shape.seqlen_k, shape.head_dim, device=device, dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def attention_check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    heads: int = 2, rows: int = 64) -> Callable[[torch.Tensor], float]:
    """The error of attention on ``heads`` query heads of batch 0 and their last ``rows`` queries, against
    float64 (causal aligned bottom-right)."""
    seqlen_q, seqlen_k, head_dim = q.shape[2], k.shape[2], q.shape[3]
    heads, rows = min(heads, q.shape[1]), min(rows, seqlen_q)
    group = q.shape[1] // k.shape[1]
    kv = [h // group for h in range(heads)]
    qd = q[0, :heads, seqlen_q - rows:].double()
    kd, vd = k[0, kv].double(), v[0, kv].double()
    scores = qd @ kd.transpose(-1, -2) / math.sqrt(head_dim)
    if causal:
        queries = torch.arange(seqlen_q - rows, seqlen_q, device=q.device)[:, None]
        keys = torch.arange(seqlen_k, device=q.device)[None, :]
        scores = scores.masked_fill(keys > queries + seqlen_k - seqlen_q, float("-inf"))
    ref = torch.softmax(scores, -1) @ vd

    def check(o: torch.Tensor) -> float:
        """max |o - ref| / max |ref| on those heads and rows."""
        return ((o[0, :heads, seqlen_q - rows:].double() - ref).abs().max() / ref.abs().max()).item()

    return check


def tl_variant(label: str, q, k, v, causal: bool, config: attention_tuning.AttentionConfig) -> Variant:
    """The ``triton.language`` kernel on copies of q, k, v under ``config``."""
    qc, kc, vc = copy_of(q), copy_of(k), copy_of(v)
    scale = 1 / math.sqrt(q.shape[3])
    tma = config.use_tma and tma_safe(False, config.block_n, head_dim_padded(q.shape[3])) and tma_usable(qc, kc, vc)
    text = f"tl {config.block_m}x{config.block_n}/w{config.num_warps}/s{config.num_stages}" + (" TMA" if tma else "")
    return Variant(label, lambda: attention_forward(qc, kc, vc, causal, scale, None, False, False, config)[0], text,
                   "" if tma or not config.use_tma else "TMA not usable here")


def hopper_variant(label: str, q, k, v, causal: bool, config=None) -> Variant:
    """The Gluon Hopper kernel on copies of q, k, v (``config`` None: its own table's tiles)."""
    qc, kc, vc = copy_of(q), copy_of(k), copy_of(v)
    scale = 1 / math.sqrt(q.shape[3])
    skip = "" if forward_hopper.wgmma_eligible(qc, kc, vc, False, scale) else (
        "not the Hopper kernel's call (it needs Gluon, a Hopper GPU, D = 64 or 128)")
    if config is None and not skip:
        config = forward_hopper.wgmma_config(q.shape[3], causal, k.shape[2])
    text = "" if config is None else (f"gluon {config.block_m}x{config.block_n}/w{config.num_warps}/kv{config.kv_stages}"
                                      + (" WS" if config.warp_specialized else "") + (" qreg" if config.q_in_registers else ""))
    return Variant(label, lambda: forward_hopper.attention_forward_hopper(qc, kc, vc, causal, scale, False, config)[0],
                   text, skip)


def attention_case(shape: Heads, q, k, v, variants: list[Variant], active: bool | None = None, note: str = "") -> Case:
    """An attention forward case in TFLOP/s."""
    flops = attention_flops(shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k, shape.head_dim, shape.causal)
    return Case(str(shape), "TFLOP/s", flops, variants, attention_check(q, k, v, shape.causal), REL_TOL[torch.bfloat16],
                active, note)


def tl_config(shape: Heads, device: torch.device) -> attention_tuning.AttentionConfig:
    """The ``triton.language`` kernel's own config for ``shape`` (the interpreter's on CPU)."""
    return default_config(shape.head_dim, torch.bfloat16, device, shape.causal, shape.seqlen_k)


def knob_tma(shape: Heads, device: torch.device) -> Case:
    """Q/K/V tiles by TMA (tensor descriptors) in the tl kernel, against pointer loads."""
    q, k, v = attention_inputs(shape, device)
    config = dataclasses.replace(tl_config(shape, device), use_tma=True)
    return attention_case(shape, q, k, v, [tl_variant("simpler", q, k, v, shape.causal,
                                                      dataclasses.replace(config, use_tma=False)),
                                           tl_variant("refined", q, k, v, shape.causal, config)],
                          note="the tl kernel serves masks, fp32 and head dims other than 64 and 128 on H100/H200")


def knob_hopper(shape: Heads, device: torch.device) -> Case:
    """The Gluon Hopper kernel (wgmma, a product in flight under the softmax), against the tl kernel with TMA."""
    q, k, v = attention_inputs(shape, device)
    return attention_case(shape, q, k, v, [tl_variant("simpler", q, k, v, shape.causal, tl_config(shape, device)),
                                           hopper_variant("refined", q, k, v, shape.causal)], True)


def knob_warp_specialized(shape: Heads, device: torch.device) -> Case:
    """D = 128 on the warp-specialized Hopper kernel (a load warp, two softmax warpgroups sharing K/V tiles),
    against one warpgroup loading its own tiles (Q in registers, as the short causal tiles)."""
    q, k, v = attention_inputs(shape, device)
    plain = attention_tuning.WgmmaConfig(64, 128, 4, 2, q_in_registers=True)
    refined = hopper_variant("refined", q, k, v, shape.causal)
    return attention_case(shape, q, k, v, [hopper_variant("simpler", q, k, v, shape.causal, plain), refined],
                          " WS" in refined.plan)


def knob_short_causal(shape: Heads, device: torch.device) -> Case:
    """Causal calls with few keys on smaller Hopper tiles (WGMMA_SHORT_CAUSAL), against WGMMA_CONFIGS."""
    q, k, v = attention_inputs(shape, device)
    max_keys, short = attention_tuning.WGMMA_SHORT_CAUSAL[shape.head_dim]
    return attention_case(shape, q, k, v, [
        hopper_variant("simpler", q, k, v, shape.causal, attention_tuning.WGMMA_CONFIGS[shape.head_dim]),
        hopper_variant("refined", q, k, v, shape.causal, short)], shape.causal and shape.seqlen_k <= max_keys)


def knob_short_work(shape: Heads, device: torch.device) -> Case:
    """The tl kernel's 64 x 64 tiles for D <= 64 with little work a query tile (SHORT_WORK_CONFIGS), against
    FORWARD_CONFIGS."""
    q, k, v = attention_inputs(shape, device)
    hd = head_dim_padded(shape.head_dim)
    refined = attention_tuning.SHORT_WORK_CONFIGS[hd]
    eligible = forward_hopper.wgmma_eligible(q, k, v, False, 1.0)
    active = q.is_cuda and not eligible and tl_config(shape, device) == refined
    return attention_case(shape, q, k, v, [
        tl_variant("simpler", q, k, v, shape.causal, attention_tuning.FORWARD_CONFIGS[hd]),
        tl_variant("refined", q, k, v, shape.causal, refined)], active,
        note="on H100/H200 D = 64 takes the Hopper kernel: these tiles serve D <= 32 there")


def attention_chain(shape: Heads, device: torch.device) -> Case:
    """The attention chain: textbook kernel, tl kernel on pointer loads, + TMA, + the Gluon Hopper kernel."""
    q, k, v = attention_inputs(shape, device)
    config = dataclasses.replace(tl_config(shape, device), use_tma=True)
    qa, ka, va = copy_of(q), copy_of(k), copy_of(v)
    qb, kb, vb = copy_of(q), copy_of(k), copy_of(v)
    hopper = hopper_variant("+ Gluon Hopper kernel (flash_attention)", q, k, v, shape.causal)
    hopper.run = lambda: flashlite.flash_attention(qb, kb, vb, causal=shape.causal)
    return attention_case(shape, q, k, v, [
        Variant("textbook flash_attention_forward", lambda: flash_attention_forward(qa, ka, va, shape.causal),
                "64x64/w4" if q.is_cuda else "16x16/w4"),
        tl_variant("flashlite tl kernel, pointer loads", q, k, v, shape.causal,
                   dataclasses.replace(config, use_tma=False)),
        tl_variant("+ TMA", q, k, v, shape.causal, config), hopper])


# ----------------------------------------------------------------------------- decoding


DECODE = Heads(1, 32, 8, 1, 32768, 128)


def decode_splits(device: torch.device) -> int | None:
    """``num_splits`` of the split variants: the automatic rule on a GPU; 4 in the interpreter (where it is 1)."""
    return None if device.type == "cuda" else 4


def decode_case(shape: Heads, device: torch.device, stages: list[tuple[str, str, int | None, bool]],
                active: bool | None = None, textbook: bool = False) -> Case:
    """A decoding case in GB/s of q, k, v and o: ``stages`` of (label, plan text, num_splits, GQA packing) through
    ``flashlite.flash_attention``, after the textbook kernel with ``textbook``."""
    q, k, v = attention_inputs(shape, device)
    if hasattr(attention_api, "clear_routes"):
        attention_api.clear_routes()  # no signature seen yet
    variants = []
    if textbook:
        qa, ka, va = copy_of(q), copy_of(k), copy_of(v)
        variants.append(Variant("textbook flash_attention_forward",
                                lambda: flash_attention_forward(qa, ka, va, shape.causal),
                                "64x64/w4" if q.is_cuda else "16x16/w4"))
    for label, text, splits, packing in stages:
        qc, kc, vc = copy_of(q), copy_of(k), copy_of(v)

        # Unpacked calls pass the default scale as a float: a signature of their own, which flash_attention's
        # cache of repeated calls (api.repeat_key) plans apart, while packing is off (at their first call).
        scale = None if packing else 1 / math.sqrt(shape.head_dim)

        def run(qc=qc, kc=kc, vc=vc, splits=splits, scale=scale) -> torch.Tensor:
            """The public call on the copies."""
            return flashlite.flash_attention(qc, kc, vc, causal=shape.causal, scale=scale, num_splits=splits)

        if packing:
            variants.append(Variant(label, run, text))
        else:
            skip = has_constants(split_kv, "PACK_MAX_SEQLEN_Q")
            variants.append(Variant(label, None if skip else with_values(split_kv, {"PACK_MAX_SEQLEN_Q": 0}, run),
                                    text, skip))
    n_bytes = 2 * (q.numel() + k.numel() + v.numel() + q.numel())
    return Case(str(shape), "GB/s", n_bytes, variants, attention_check(q, k, v, shape.causal, heads=8),
                REL_TOL[torch.bfloat16], active)


def knob_split_kv(shape: Heads, device: torch.device) -> Case:
    """Decoding on split-K/V (the automatic split count, GQA packed), against the forward kernel."""
    splits = decode_splits(device)
    return decode_case(shape, device, [("simpler", "forward kernel, num_splits=1", 1, True),
                                       ("refined", f"split-K/V num_splits={splits or 'auto'}", splits, True)],
                       active=device.type == "cuda")


def knob_gqa_packing(shape: Heads, device: torch.device) -> Case:
    """Split-K/V with a K/V head's query heads packed into one tile (PACK_MAX_SEQLEN_Q), against a program a
    query head (the split count chosen for each by the automatic rule)."""
    splits = decode_splits(device)
    return decode_case(shape, device, [("simpler", f"split num_splits={splits or 'auto'}, no packing", splits, False),
                                       ("refined", f"split num_splits={splits or 'auto'}, packed", splits, True)],
                       active=device.type == "cuda")


def decode_chain(shape: Heads, device: torch.device) -> Case:
    """The decoding chain: textbook kernel, forward kernel, split-K/V without GQA packing, + packing."""
    splits = decode_splits(device)
    return decode_case(shape, device, [("flashlite forward kernel (num_splits=1)", "forward", 1, True),
                                       ("split-K/V, no GQA packing", f"num_splits={splits or 'auto'}", splits, False),
                                       ("+ GQA packing (flash_attention default)", f"num_splits={splits or 'auto'}",
                                        splits, True)], textbook=True)


# ----------------------------------------------------------------------------- what runs


def softmax_shapes(dtypes: tuple[str, ...], *shapes: tuple[int, int]) -> list[Rows]:
    """``Rows`` of every shape in every dtype."""
    return [Rows(dtype, m, n) for dtype in dtypes for m, n in shapes]


SOFTMAX_CHAIN_SHAPES = softmax_shapes(("fp32", "bf16"), (4096, 256), (4096, 1024), (4096, 4096), (4096, 32768),
                                      (128, 128 * K), (16, M), (4, 4 * M), (1, 16 * M), (4096, 4095))

CHAIN = [
    Chain("softmax", softmax_chain, SOFTMAX_CHAIN_SHAPES,
          [Rows("fp32", 64, 256), Rows("bf16", 8, 4095), Rows("fp32", 1, 33000)]),
    Chain("attention", attention_chain,
          [sequences(d, length, causal) for d in (64, 128) for length in (1024, 4096, 16384) for causal in (False, True)],
          [tiny_sequences(64, 48, False), tiny_sequences(64, 48, True)]),
    Chain("decode", decode_chain, [DECODE, dataclasses.replace(DECODE, batch=8)],
          [Heads(1, 4, 2, 1, 256, 32)]),
]

KNOBS = [
    Knob("softmax fused: several rows a tile", "SoftmaxPlan.block_m > 1 vs 1 (plan_softmax)", knob_rows_per_tile,
         [Rows("fp32", 4096, 256), Rows("bf16", 4096, 256), Rows("fp32", 4096, 1024), Rows("bf16", 4096, 2048)],
         [Rows("fp32", 64, 256), Rows("bf16", 32, 1000)]),
    Knob("softmax fused: persistent grid", "tuning.FUSED_PERSISTENT_MAX_COLS = 0 during the call",
         knob_persistent_grid, [Rows("fp32", 4096, 256), Rows("fp32", 4096, 1024), Rows("bf16", 4096, 2048)],
         [Rows("fp32", 64, 256)]),
    Knob("softmax fused: short-row tiles", "FUSED_SHORT_TILE_ELEMS vs FUSED_TILE_ELEMS (forced plan)",
         knob_short_tiles, [Rows("fp32", 4096, 256), Rows("bf16", 4096, 256), Rows("fp32", 4096, 512)],
         [Rows("fp32", 64, 256)]),
    Knob("softmax fused: row held vs streamed", "plan_softmax(..., 'fused') vs 'online' up to FUSED_MAX_COLS",
         knob_fused_vs_online, [Rows("fp32", 4096, 4096), Rows("fp32", 4096, 32768), Rows("bf16", 4096, 32768)],
         [Rows("fp32", 4, 2048)]),
    Knob("softmax online: split rows", "plan_softmax(..., 'online', n_splits=1) vs automatic", knob_split_rows,
         [Rows("fp32", 16, M), Rows("fp32", 1, 16 * M), Rows("bf16", 4, 4 * M)], [Rows("fp32", 1, 16384)]),
    Knob("softmax online: pipelined loops", "tuning.ONLINE_NUM_STAGES = 1 during the call", knob_online_stages,
         [Rows("fp32", 4096, 65536), Rows("fp32", 16, M)], [Rows("fp32", 1, 8192)]),
    Knob("softmax shared rows", "plan_rows (shared) vs plan_softmax(..., 'online')", knob_shared_rows,
         [Rows("fp32", 4096, 65536), Rows("fp32", 128, 128 * K), Rows("fp32", 16, M), Rows("bf16", 1, 16 * M)],
         [Rows("fp32", 4, 65536)], gpu_only="cooperative launches: resident programs wait for each other"),
    Knob("softmax shared rows: heads, few waves", "tuning.SHARED_HEADS_L2_FRACTION = 0 (plan)", knob_head_waves,
         [Rows("bf16", 128, 128 * K), Rows("fp32", 16, M), Rows("bf16", 4, 4 * M)], [Rows("bf16", 128, 128 * K)],
         gpu_only="shared rows"),
    Knob("softmax shared rows: wave tiles", "tuning.SHARED_WAVE_TILES = SHARED_TILES (plan)", knob_wave_tiles,
         [Rows("fp32", 4096, 65536), Rows("fp32", 1024, 128 * K), Rows("bf16", 2048, 128 * K)],
         [Rows("fp32", 1024, 65536)], gpu_only="shared rows"),
    Knob("softmax shared rows: next part into L2", "SoftmaxPlan.prefetch = PREFETCH_NONE", knob_prefetch,
         [Rows("bf16", 128, 128 * K), Rows("bf16", 2048, 128 * K), Rows("bf16", 1, 16 * M)],
         [Rows("bf16", 64, 128 * K)], gpu_only="shared rows"),
    Knob("softmax shared rows: head groups", "SoftmaxPlan.head_group = 1", knob_head_groups,
         [Rows("bf16", 16, M), Rows("bf16", 1, 16 * M)], [Rows("bf16", 1, 16 * M)], gpu_only="shared rows"),
    Knob("softmax shared rows: wave heads evict_last", "SoftmaxPlan.head_eviction = ''", knob_head_eviction,
         [Rows("fp32", 4096, 65536), Rows("fp32", 1024, 128 * K)], [Rows("fp32", 1024, 65536)],
         gpu_only="shared rows"),
    Knob("softmax frames for odd rows", "SoftmaxPlan.vec_cols = 1 (fused) / vec_cols=0 plan (shared)", knob_frames,
         [Rows("fp32", 4096, 4095), Rows("bf16", 4096, 4095), Rows("bf16", 4096, 50257), Rows("fp32", 16, 1_000_003)],
         [Rows("fp32", 16, 4095), Rows("bf16", 8, 4095), Rows("fp32", 1, 20001)]),
    Knob("softmax reread", "tuning.FWD_REREAD_MAX_COLS = {} (plan)", knob_reread,
         [Rows("bf16", 4096, 65536), Rows("bf16", 4096, 57344), Rows("bf16", 1024, 65536)], [Rows("bf16", 4, 8192)]),
    Knob("softmax rows over a cluster", "tuning.CLUSTER = {} (plan)", knob_cluster,
         [Rows("bf16", 4096, 32 * K), Rows("bf16", 4096, 64 * K), Rows("fp32", 4096, 64 * K),
          Rows("fp32", 1024, 128 * K)], [Rows("bf16", 4, 8192)], gpu_only="Hopper thread-block clusters (Gluon)"),
    Knob("softmax repeat-launch cache", "api.compiled_launcher -> None at a signature's first call",
         knob_repeat_cache,
         [Rows("fp32", 4096, 256), Rows("bf16", 4096, 256), Rows("bf16", 4096, 1024), Rows("bf16", 128, 128 * K)],
         [Rows("fp32", 16, 256)]),
    Knob("softmax backward: rows loaded twice", "tuning.BWD_REREAD_MIN_COLS = 2^40 during the call",
         knob_backward_reread, [Rows("fp32", 4096, 16384), Rows("fp32", 4096, 32768), Rows("bf16", 4096, 16384)],
         [Rows("fp32", 4, 8192)]),
    Knob("softmax backward: shared rows", "backward after an online forward plan (stays online)",
         knob_backward_shared, [Rows("fp32", 4096, 65536), Rows("fp32", 128, 128 * K), Rows("bf16", 16, M)],
         [Rows("fp32", 4, 65536)], gpu_only="shared rows"),
    Knob("softmax backward: 16-bit rows <= 65536 loaded twice", "tuning.BWD_TILES[2].fused_max_cols = 32768",
         knob_backward_reread_wide, [Rows("bf16", 4096, 65536), Rows("bf16", 1024, 65536)],
         [Rows("bf16", 16, 65536)], gpu_only="its simpler path is shared rows"),
    Knob("attention tl kernel: TMA", "AttentionConfig.use_tma = False", knob_tma,
         [sequences(128, 4096, False), sequences(128, 4096, True), sequences(64, 16384, True)],
         [tiny_sequences(32, 48, True)]),
    Knob("attention: Gluon Hopper kernel", "attention_forward_hopper vs attention_forward(config=...)", knob_hopper,
         [sequences(64, 1024, False), sequences(64, 16384, True), sequences(128, 4096, False),
          sequences(128, 16384, True)], [tiny_sequences(64, 256, True), tiny_sequences(128, 256, False)],
         gpu_only="Gluon on a Hopper GPU"),
    Knob("attention Hopper: warp-specialized D=128", "WgmmaConfig(64, 128, 4, 2, q_in_registers=True)",
         knob_warp_specialized, [sequences(128, 1024, False), sequences(128, 4096, False), sequences(128, 16384, True)],
         [tiny_sequences(128, 256, False)], gpu_only="Gluon on a Hopper GPU"),
    Knob("attention Hopper: short causal tiles", "WGMMA_CONFIGS[D] vs WGMMA_SHORT_CAUSAL[D]", knob_short_causal,
         [sequences(64, 1024, True), sequences(64, 2048, True), sequences(128, 512, True)],
         [tiny_sequences(64, 256, True)], gpu_only="Gluon on a Hopper GPU"),
    Knob("attention tl kernel: short-work tiles", "FORWARD_CONFIGS vs SHORT_WORK_CONFIGS (config=)", knob_short_work,
         [sequences(64, 1024, False), sequences(64, 4096, True), sequences(32, 1024, False)],
         [tiny_sequences(32, 48, False)]),
    Knob("decode: split-K/V", "flash_attention(num_splits=1) vs automatic", knob_split_kv,
         [DECODE, dataclasses.replace(DECODE, batch=8), dataclasses.replace(DECODE, kv_heads=32)],
         [Heads(1, 4, 2, 1, 256, 32)]),
    Knob("decode: GQA packing", "split_kv.PACK_MAX_SEQLEN_Q = 0 during the call", knob_gqa_packing,
         [DECODE, dataclasses.replace(DECODE, batch=8), dataclasses.replace(DECODE, seqlen_q=4)],
         [Heads(1, 4, 2, 2, 256, 32)]),
]

# Refinements that cannot be switched from outside flashlite: compiled into a kernel, or reachable only through
# a private name.
NOT_SWITCHABLE = [
    ("launch cache (core.runtime.launch)",
     "later launches of a signature skip Triton's binding: only through the private runtime._COMPILED"),
    ("fused REREAD: first read in two halves", "compiled into softmax_fused_kernel"),
    ("online kernel: a state a lane in pass 1, pass 2 last block first", "compiled into softmax_online_kernel"),
    ("shared rows: two head buffers taken in turn", "compiled into softmax_shared_rows_kernel"),
    ("shared rows: slots cleared by the next launch (zeroed_slots)", "host and kernel logic, no switch"),
    ("attention: full tiles without mask arithmetic, causal tiles skipped, heaviest causal tiles first",
     "compiled into attend_kv_tiles / query_tile"),
    ("attention: scores scaled in fp32 inside the exponential", "compiled into every forward kernel"),
    ("Hopper D=64: two programs a multiprocessor", "a property of WGMMA_CONFIGS[64]'s size, not a switch"),
    ("backward frames prefetch (BWD_FRAMED_PREFETCH)", "switchable, not timed here (only rows read in frames)"),
    ("attention backward", "tile tables only (BACKWARD_CONFIGS), no regime to switch; not timed here"),
    ("attention persistent grid, FLASHLITE_AUTOTUNE", "off by default: not refinements of the default path"),
]


# ----------------------------------------------------------------------------- running


def selected(name: str, words: list[str] | None) -> bool:
    """True if ``name`` holds one of ``words`` (case-insensitive), or no words are given."""
    return not words or any(word.lower() in name.lower() for word in words)


def run_variants(case: Case, smoke: bool, rounds: int, warmup: int, rep: int) -> list[dict]:
    """Check every variant of ``case`` against float64, then time those right over ``rounds`` alternating
    rounds (order reversed every other round). One dict a variant: label, plan, error, times (ms), rate."""
    results = []
    for variant in case.variants:
        result = {"stage": variant.label, "plan": variant.plan, "skip": variant.skip}
        if variant.skip or variant.run is None:
            results.append(result)
            continue
        try:
            out = variant.run()
        except Exception as err:  # a variant that fails is reported, not fatal
            if smoke:
                raise
            result["skip"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
            results.append(result)
            continue
        if out.is_cuda:
            torch.cuda.synchronize()
        result["error"] = case.check(out)
        result["ok"] = bool(result["error"] <= case.tol)
        del out
        if smoke:
            assert result["ok"], f"{case.shape} {variant.label}: error {result['error']:.2e} > {case.tol:.0e}"
        results.append(result)
    timed = [(variant.run, result) for variant, result in zip(case.variants, results) if result.get("ok")]
    if smoke or not timed:
        return results
    alternate(timed, "ms", rounds, warmup, rep)
    if case.graph and min(result["median_ms"] for _, result in timed) < GRAPH_BELOW_MS:
        graphs = []
        for run, result in timed:
            try:
                graphs.append((capture(run).replay, result))
            except Exception as err:  # noqa: BLE001 - a launch that cannot be captured keeps its do_bench time
                result["graph_skip"] = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
        alternate(graphs, "graph_ms", rounds, warmup, rep)
    scale = 1e-6 if case.unit == "GB/s" else 1e-9
    for _, result in timed:
        result["rate"] = case.work / result["median_ms"] * scale
        if "graph_ms" in result:
            result["graph_rate"] = case.work / result["median_graph_ms"] * scale
    return results


def alternate(runs: list[tuple[Callable, dict]], key: str, rounds: int, warmup: int, rep: int) -> None:
    """Time each ``run`` over ``rounds`` rounds, in turn and in reversed order every other round, after a round
    that is not kept (clocks, caches); ``result[key]`` gets each round's do_bench median (ms),
    ``result["median_" + key]`` their median and ``result[key + "_spread"]`` (max - min) / median."""
    for run, _ in runs:
        time_ms(run, warmup=warmup, rep=max(5, rep // 4))
    for r in range(rounds):
        for run, result in (runs if r % 2 == 0 else reversed(runs)):
            result.setdefault(key, []).append(time_ms(run, warmup=warmup, rep=rep))
    for _, result in runs:
        median = result["median_" + key] = statistics.median(result[key])
        result[key + "_spread"] = (max(result[key]) - min(result[key])) / median


def capture(fn: Callable[[], torch.Tensor]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one call of ``fn`` (called once before, outside the capture: compiles, allocates);
    its replays time the device alone, without the host's cost of a call (``common.graph_time_ms``)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def release(device: torch.device) -> None:
    """Free what the last case held."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_chain(chain: Chain, args, device: torch.device, ceilings: dict) -> list[dict]:
    """Every shape of ``chain``: one row a stage, with its rate, speed over the stage before and fraction of
    the ceiling."""
    rows = []
    for shape in (chain.smoke_shapes if args.smoke else chain.shapes):
        t0 = time.time()
        case = chain.build(shape, device)
        results = run_variants(case, args.smoke, args.chain_rounds, args.warmup, args.rep)
        previous = None
        for result in results:
            row = {"chain": chain.name, "shape": case.shape, "unit": case.unit, **result}
            if result.get("rate"):
                row["x_prev"] = result["rate"] / previous if previous else None
                row["frac"] = result["rate"] / ceilings[case.unit] if ceilings.get(case.unit) else None
                previous = result["rate"]
            rows.append(row)
        print(f"[{chain.name}] {case.shape}: " + ", ".join(
            f"{r['stage']}: " + (f"{r['rate']:.0f}" if r.get("rate") else r.get("skip") or
                                 (f"ok ({r['error']:.1e})" if r.get("ok") else f"WRONG ({r.get('error', 0):.1e})"))
            for r in results) + f"  [{time.time() - t0:.1f}s]", flush=True)
        del case
        release(device)
    return rows


def run_knob(knob: Knob, args, device: torch.device, ceilings: dict) -> list[dict]:
    """Every shape of ``knob``: one row a shape with both variants' rates and the gain of the refined one."""
    rows = []
    shapes = knob.smoke_shapes if args.smoke else knob.shapes
    if knob.gpu_only and device.type != "cuda":
        print(f"[knob] {knob.name}: skipped on the CPU ({knob.gpu_only})", flush=True)
        return [{"knob": knob.name, "shape": "-", "skip": f"GPU only: {knob.gpu_only}"}]
    for shape in shapes:
        t0 = time.time()
        case = knob.build(shape, device)
        row = {"knob": knob.name, "switch": knob.switch, "shape": case.shape, "unit": case.unit,
               "active": case.active, "note": case.note}
        if case.skip:
            row["skip"] = case.skip
        else:
            simpler, refined = run_variants(case, args.smoke, args.rounds, args.warmup, args.rep)
            row.update(simpler_plan=simpler["plan"], refined_plan=refined["plan"],
                       simpler=simpler.get("rate"), refined=refined.get("rate"),
                       simpler_ms=simpler.get("ms"), refined_ms=refined.get("ms"),
                       simpler_error=simpler.get("error"), refined_error=refined.get("error"))
            skips = [f"{r['stage']}: {r['skip']}" for r in (simpler, refined) if r.get("skip")]
            skips += [f"{r['stage']}: WRONG ({r['error']:.1e})" for r in (simpler, refined) if r.get("ok") is False]
            if skips:
                row["skip"] = "; ".join(skips)
            if simpler.get("rate") and refined.get("rate"):
                row["gain"] = simpler["median_ms"] / refined["median_ms"]
                row["spread"] = max(simpler["ms_spread"], refined["ms_spread"])
                row["frac"] = refined["rate"] / ceilings[case.unit] if ceilings.get(case.unit) else None
            if simpler.get("graph_rate") and refined.get("graph_rate"):
                row.update(simpler_graph=simpler["graph_rate"], refined_graph=refined["graph_rate"],
                           graph_gain=simpler["median_graph_ms"] / refined["median_graph_ms"],
                           graph_spread=max(simpler["graph_ms_spread"], refined["graph_ms_spread"]),
                           simpler_graph_ms=simpler["graph_ms"], refined_graph_ms=refined["graph_ms"])
        rows.append(row)
        status = row.get("skip") or (f"{row['simpler']:.0f} -> {row['refined']:.0f} {row['unit']}, x{row['gain']:.3f}"
                                     if row.get("gain") else "ok")
        if row.get("graph_gain"):
            status += (f"; graph {row['simpler_graph']:.0f} -> {row['refined_graph']:.0f}, "
                       f"x{row['graph_gain']:.3f}")
        print(f"[knob] {knob.name} | {row['shape']}: {status}  [{time.time() - t0:.1f}s]", flush=True)
        del case
        release(device)
    return rows


def summarize(knob_rows: list[dict]) -> list[dict]:
    """One row a knob: its best gain over its shapes (do_bench of the call, or of its CUDA-graph replay where
    the call was short: ``by``), where, its worst call gain, and the verdict against ``KEEP_GAIN``."""
    summary = []
    for name in dict.fromkeys(row["knob"] for row in knob_rows):
        rows = [row for row in knob_rows if row["knob"] == name]
        timed = [row for row in rows if row.get("gain")]
        if not timed:
            reasons = "; ".join(dict.fromkeys(row.get("skip", "not timed") for row in rows))
            summary.append({"knob": name, "verdict": "not timed", "note": reasons})
            continue
        measures = [(row["gain"], "call", row["simpler"], row["refined"], row["spread"], row) for row in timed]
        measures += [(row["graph_gain"], "graph", row["simpler_graph"], row["refined_graph"], row["graph_spread"], row)
                     for row in timed if row.get("graph_gain")]
        gain, by, simpler, refined, spread, best = max(measures, key=lambda m: m[0])
        worst = min(timed, key=lambda row: row["gain"])
        summary.append({
            "knob": name, "best_shape": best["shape"], "by": by, "unit": best["unit"], "simpler": simpler,
            "refined": refined, "gain": gain, "spread": spread, "worst_gain": worst["gain"],
            "worst_shape": worst["shape"], "shapes": len(timed), "frac": refined / best["refined"] * best["frac"]
            if best.get("frac") else None,
            "verdict": "keep" if gain >= KEEP_GAIN else f"< {KEEP_GAIN - 1:.0%}: remove?",
            "active": any(row.get("active") for row in timed),
        })
    return summary


def fmt(value) -> str:
    """A table cell: 3 significant digits for small floats, none past 10, a dash for None."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.0f}"
    return str(value)


def table(rows: list[dict], columns: list[str]) -> str:
    """A Markdown table of ``rows`` restricted to ``columns``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c)).replace("|", "/") for c in columns) + " |" for row in rows]
    return "\n".join(lines)


CHAIN_COLUMNS = ["chain", "shape", "stage", "plan", "rate", "unit", "x_prev", "frac", "graph_rate", "skip"]
KNOB_COLUMNS = ["knob", "shape", "simpler_plan", "refined_plan", "simpler", "refined", "unit", "gain", "spread",
                "simpler_graph", "refined_graph", "graph_gain", "active", "skip"]
SUMMARY_COLUMNS = ["knob", "best_shape", "by", "simpler", "refined", "unit", "gain", "spread", "worst_gain", "frac",
                   "active", "verdict"]


def ceilings_measured(device: torch.device) -> dict:
    """The ceilings of the fractions: copy bandwidth (GB/s, read + write) and the bf16 matmul rate (TFLOP/s)."""
    if device.type != "cuda":
        return {}
    return {"GB/s": copy_bandwidth_gbs(), "TFLOP/s": matmul_tflops()}


def write_report(out_dir: str, meta: dict, chain_rows: list, knob_rows: list, summary: list) -> None:
    """``refinements.json`` (everything, every round's times) and ``refinements.md`` (the three tables)."""
    with open(os.path.join(out_dir, "refinements.json"), "w") as f:
        json.dump({"meta": meta, "chain": chain_rows, "knobs": knob_rows, "summary": summary,
                   "not_switchable": [{"refinement": a, "why": b} for a, b in NOT_SWITCHABLE]}, f, indent=1)
    lines = ["# What each refinement buys", "", ", ".join(f"{k}: {fmt(v)}" for k, v in meta.items()), "",
             "## The chain: textbook kernel, then one refinement at a time", "", table(chain_rows, CHAIN_COLUMNS), "",
             f"## Knobs, each against its simpler path (alternating rounds; keep at a gain >= {KEEP_GAIN})", "",
             table(summary, SUMMARY_COLUMNS), "", "### Every shape", "", table(knob_rows, KNOB_COLUMNS), "",
             "## Not switchable from outside flashlite", ""]
    lines += [f"- {a}: {b}" for a, b in NOT_SWITCHABLE]
    with open(os.path.join(out_dir, "refinements.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def list_plan() -> None:
    """Print what a full run times, without running it."""
    for chain in CHAIN:
        print(f"chain {chain.name}: " + ", ".join(map(str, chain.shapes)))
    for knob in KNOBS:
        print(f"knob {knob.name} [{knob.switch}]: " + ", ".join(map(str, knob.shapes)))
    for name, why in NOT_SWITCHABLE:
        print(f"not switchable: {name} ({why})")


def main(argv=None) -> None:
    """Parse the arguments and run the chain and the knobs (or the smoke test, or the list)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="output folder (default bench/results/<gpu>)")
    parser.add_argument("--smoke", action="store_true", help="every stage and knob once on tiny inputs, checked")
    parser.add_argument("--list", action="store_true", help="print what would run")
    parser.add_argument("--only", nargs="+", help="chains and knobs whose name holds one of these words")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="alternating rounds a knob's shape")
    parser.add_argument("--chain-rounds", type=int, default=CHAIN_ROUNDS, help="alternating rounds a chain's shape")
    parser.add_argument("--warmup", type=int, default=WARMUP_MS, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=REP_MS, help="do_bench repetitions, ms")
    args = parser.parse_args(argv)
    if args.list:
        list_plan()
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.smoke:
            sys.exit("timing needs a GPU; on a CPU run --smoke (with TRITON_INTERPRET=1)")
        if not interpreter_enabled():
            sys.exit("the smoke test on a CPU needs Triton's interpreter: TRITON_INTERPRET=1 python bench/refinements.py "
                     "--smoke")
    t0 = time.time()
    ceilings = ceilings_measured(device)
    chain_rows, knob_rows = [], []
    for chain in CHAIN:
        if selected(chain.name, args.only):
            chain_rows += run_chain(chain, args, device, ceilings)
    for knob in KNOBS:
        if selected(knob.name, args.only):
            knob_rows += run_knob(knob, args, device, ceilings)
    summary = summarize(knob_rows)
    if args.smoke:
        checked = sum(1 for row in chain_rows if row.get("ok")) + sum(
            (row.get("simpler_error") is not None) + (row.get("refined_error") is not None) for row in knob_rows)
        print(f"\nsmoke: {checked} variant outputs within tolerance of float64 on {device.type} "
              f"({time.time() - t0:.0f}s); skipped: " + "; ".join(
                  dict.fromkeys(f"{row['knob']} ({row['skip']})" for row in knob_rows if row.get("skip"))))
        return
    meta = environment() | {"copy_gbs": ceilings["GB/s"], "matmul_tflops": ceilings["TFLOP/s"],
                            "rounds": args.rounds, "chain_rounds": args.chain_rounds, "warmup_ms": args.warmup,
                            "rep_ms": args.rep, "keep_gain": KEEP_GAIN, "seconds": round(time.time() - t0)}
    out = results_dir(args.out)
    write_report(out, meta, chain_rows, knob_rows, summary)
    print(f"\ncopy {ceilings['GB/s']:.0f} GB/s, bf16 matmul {ceilings['TFLOP/s']:.0f} TFLOP/s; "
          f"{time.time() - t0:.0f}s; results in {out}/refinements.{{json,md}}\n")
    print(table([r for r in chain_rows if r.get("rate")], ["shape", "stage", "rate", "unit", "x_prev", "frac",
                                                             "graph_rate"]))
    print()
    print(table(summary, ["knob", "best_shape", "by", "simpler", "refined", "unit", "gain", "worst_gain", "verdict"]))


if __name__ == "__main__":
    main()
