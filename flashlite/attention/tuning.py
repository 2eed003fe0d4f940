"""Attention's tuning tables: tile configs by head dim for the forward (both kernels) and the backward.

Each table says what it sets and why, and carries one provenance line: the
machine and date of the measurement (or "not timed"), the command that
reproduces it, and its section in ``bench/results/h200/TUNING.md``
(``TUNING.md#...`` below), which holds the figures and the alternatives
measured. ``plan`` reads the tables through this module, so that a tuning run
can set them.
"""

from __future__ import annotations

from dataclasses import dataclass


# Head dims the kernel takes. The largest is set by registers: the fp32 output
# accumulator of a 128-row tile, 128 x 256 values over 8 warps, is 128 of a
# thread's 255 registers. The smallest is the K dimension of a tensor-core dot.
# Not timed: limits of the hardware; TUNING.md#head-dims
MIN_HEAD_DIM = 16


# Not timed: limits of the hardware; TUNING.md#head-dims
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes and launch options of one kernel launch."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False  # Q/K/V through host-side tensor descriptors (TMA on Hopper) when aligned
    persistent: bool = False  # a resident grid looping over tiles, instead of one program per tile


# fp16/bf16 configs of the triton.language kernel by padded head dim: BLOCK_M 64 on 4 warps, 3 stages,
# through TMA, so that two programs of one warpgroup share a multiprocessor and one's softmax overlaps the
# other's matmuls. Head dims 16 and 32 take D = 64's tiles (not timed). Warp specialisation stays off:
# Triton 3.6 does not partition this loop on sm_90 (8 warps: identical code; 4 warps: the pass fails).
# H100 2026-11-23, python bench/attention.py --tune (bench/results/h100/attention_tune.log); TUNING.md#forward-configs
# D = 256 (and 192, padded): the fastest of 6 at L = 4096, causal and not (64 x 32 on 4 warps: 462 and 419 TFLOP/s
# against 418 and 356 for the earlier 128 x 32 on 8).
# H200 2026-11-26, python bench/backward_tune.py --kinds fwd_tl (bench/results/h200/backward_tune.md); TUNING.md#forward-configs
FORWARD_CONFIGS = {
    16: AttentionConfig(64, 128, 4, 3, use_tma=True),
    32: AttentionConfig(64, 128, 4, 3, use_tma=True),
    64: AttentionConfig(64, 128, 4, 3, use_tma=True),
    128: AttentionConfig(64, 64, 4, 3, use_tma=True),
    256: AttentionConfig(64, 32, 4, 2, use_tma=True),
}


# D <= 64 without a mask, where each query tile has little work: 64 x 64 tiles, twice the programs, up to
# SHORT_SEQLEN_K keys (SHORT_SEQLEN_K_CAUSAL under causal); past those, 64 x 128 tiles tie or win.
# H100 2026-11-23, python bench/attention.py --tune --head-dims 64 --tune-length 1024 (2048); TUNING.md#short-work
SHORT_WORK_CONFIGS = {hd: AttentionConfig(64, 64, 4, 3, use_tma=True) for hd in (16, 32, 64)}


# H100 2026-11-23, python bench/attention.py --tune --head-dims 64 --tune-length 4096 (8192); TUNING.md#short-work
SHORT_SEQLEN_K, SHORT_SEQLEN_K_CAUSAL = 1024, 4096


# fp32 runs IEEE dots on the FMA units: small tiles, no pipelining; the largest
# that compile for sm_90 without spilling.
# Not timed: chosen by compiling for sm_90; TUNING.md#fp32-configs
FP32_CONFIGS = {
    16: AttentionConfig(32, 32, 4, 1),
    32: AttentionConfig(32, 32, 4, 1),
    64: AttentionConfig(32, 32, 4, 1),
    128: AttentionConfig(32, 16, 4, 1),
    256: AttentionConfig(32, 16, 8, 1),
}


# The interpreter runs one program at a time in numpy: small tiles, several per test.
# Not timed: test speed on CPU; TUNING.md#fp32-configs
INTERPRETER_CONFIG = AttentionConfig(32, 32, 4, 1)


# Candidates for FLASHLITE_AUTOTUNE=1: (BLOCK_M, BLOCK_N, warps, stages), six per
# padded head dim (compiling each takes seconds on first use): the Hopper recipe's
# neighbours that fit in shared memory, and BLOCK_M 64 on 4 warps, small enough
# for two programs a multiprocessor. Head dims under 64 use the 64 list.
# Not timed as lists: candidates for the autotuner to time; TUNING.md#autotune
TUNE_SPACE = [(bm, bn, w, s) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]


# Not timed as lists: candidates for the autotuner to time; TUNING.md#autotune
TUNE_CANDIDATES = {
    64: {(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2)},
    128: {(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2)},
    256: {(128, 32, 8, 2), (128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2)},
}


# Softcapping on a GPU (fp16/bf16) takes tanh from one tanh.approx.f32 instruction (core.masking.tanh_approx)
# instead of an exp2 and a division: the exponentials' special-function unit is what a softcapped tile waits on.
# fp32 keeps the exact formula (its tolerance is tighter than the approximation's 2^-11).
# H200 2026-11-26, python bench/variants.py; TUNING.md#softcap
SOFTCAP_FAST_TANH = True


@dataclass(frozen=True)
class WgmmaConfig:
    """Tile sizes of one launch: query rows per warpgroup, keys per K/V tile, warps, K/V buffers in shared memory.

    ``warp_specialized``: a program is a load warp and two softmax warpgroups of ``block_m`` rows each
    that share every K/V tile (``num_warps`` is then one warpgroup's, and Q is in registers).
    Otherwise a program is ``num_warps`` warps that load their own K/V tiles.
    """

    block_m: int
    block_n: int
    num_warps: int
    kv_stages: int
    q_in_registers: bool = False  # Q as the register operand of the S products, else read from shared memory
    warp_specialized: bool = False

    @property
    def rows_per_program(self) -> int:
        """Query rows one program holds."""
        return 2 * self.block_m if self.warp_specialized else self.block_m


# Sequence starts one load of a packed batch's tile search reads (``plan.packed_schedule``): batches of up to
# 1024 sequences find a program's sequence in one load; longer ones loop.
PACKED_SEQ_BLOCK = 1024

# The Hopper kernel's tiles by head dim. D = 128: one program a multiprocessor, warp-specialized: a load
# warp and two softmax warpgroups that share 128-key K/V tiles (two buffers: 160 KB of shared memory), so
# each K/V tile brought in serves 128 query rows; the softmax warpgroups get 240 registers each, the load
# warp 24. D = 64: two programs of one warpgroup share a multiprocessor, each loading its own K/V tiles,
# so one's softmax also overlaps the other's products.
# H100 2026-11-23, python bench/attention.py --tune-wgmma (bench/results/h100/attention_wgmma_tune.log); TUNING.md#wgmma-configs
WGMMA_CONFIGS = {
    64: WgmmaConfig(64, 128, 4, 2),
    128: WgmmaConfig(64, 128, 4, 2, q_in_registers=True, warp_specialized=True),
    256: WgmmaConfig(64, 128, 4, 1),
}


# Keys are padded head dims: a head dim that is not a power of two (40, 80, 96, 160, 192, 224) runs the tiles
# of the next one, its TMA boxes zero-filled past D. D = 96 on D = 128's tiles: 467 (causal 408) TFLOP/s, the
# triton.language kernel 300-376. D = 256: one 128-key K/V buffer (two do not fit beside Q), 501 TFLOP/s; under
# causal 64-key tiles in two buffers (WGMMA_CAUSAL_CONFIGS), 429 against 393. The warp-specialized kernel
# at D = 256 (64 x 64 tiles: Q in shared memory, 128 registers of O a thread) was slower: 443 and 404.
# H200 2026-11-26, python bench/backward_tune.py --kinds fwd_hopper (bench/results/h200/backward_tune.md); TUNING.md#wgmma-configs
WGMMA_CAUSAL_CONFIGS = {
    256: WgmmaConfig(64, 64, 4, 2),
}


# Head dims of 161 to 192 in column parts (plan.head_dim_parts: 192 = 128 + 64), causal: two 128-key K/V buffers
# beside Q fit (sm_90 build: 221 KB, 223 registers, no spills), where D = 256's causal tiles take 64 keys: 414 ->
# 445 TFLOP/s. Not kept without causal (488 -> 478 against D = 256's one 128-key buffer) nor for 129 to 160 (160:
# 552 / 510 -> 468 / 416). Keyed by the width on chip (the parts' sum).
# H200 2026-12-02, python bench/attention.py --head-split --head-dims 96 192 160 --lengths 4096 with these tiles for every split width (run kept in TUNING.md#head-dim-split) against attention_head_split.json of 2026-11-28; TUNING.md#head-dim-split
WGMMA_SPLIT_CAUSAL_CONFIGS = {
    192: WgmmaConfig(64, 128, 4, 2),
}


# Causal with few keys: each query tile has little work, so smaller programs, more of them
# (by head dim: up to how many keys, and the tiles). D = 128 on the H200: 394 against the warp-specialized
# kernel's 378 TFLOP/s at 1024 keys, 443 against 468 at 2048.
# H100 2026-11-23 (D = 64), H200 2026-11-26 (D = 128), python bench/attention.py --tune-wgmma (bench/results/h200/attention_wgmma_tune.log); TUNING.md#wgmma-configs
WGMMA_SHORT_CAUSAL = {
    64: (2048, WgmmaConfig(64, 64, 4, 2)),
    128: (1024, WgmmaConfig(64, 64, 4, 2, q_in_registers=True)),
}


# Registers a thread of the warp-specialized kernel: its 12 warps share the 64K-register file
# (the launch cap, 168, is 65536 / 384 rounded down to a multiple of 8); the load warp gives
# most of its share to the softmax warpgroups.
# Not timed: the register file's arithmetic; TUNING.md#wgmma-configs
WS_LAUNCH_REGISTERS = 168


# Not timed: the register file's arithmetic; TUNING.md#wgmma-configs
WS_SOFTMAX_REGISTERS = 240


# Not timed: the register file's arithmetic; TUNING.md#wgmma-configs
WS_LOAD_REGISTERS = 24


@dataclass(frozen=True)
class BackwardConfig:
    """Tiles of the two main backward kernels (``block_m`` query rows, ``block_n`` keys in each)."""

    dkdv: AttentionConfig  # K/V tile of block_n rows on chip, Q/dO tiles of block_m rows streamed
    dq: AttentionConfig  # Q/dO tile of block_m rows on chip, K/V tiles of block_n rows streamed


# Rows of one δ program: O and dO tiles of 64 x 256 fp16 are 64 KB, within every head dim's budget.
# Not timed: the largest head dim's budget; TUNING.md#backward-configs
DELTA_BLOCK_M = 64


# The backward's tiles by padded head dim: the fastest of 7-8 dK/dV and 4-6 dQ tile shapes (two passes) at
# D = 64, 96, 128, 192 and 256, L = 4096, causal and not. Head dims 16 and 32 take D = 64's tiles (not timed).
# D = 128's dQ stays 128 x 64 (3 stages): 128 x 128 was 3% faster unmasked but needs more shared memory than
# the H200 has under an additive mask (the dS store).
# H200 2026-11-26, python bench/backward_tune.py (bench/results/h200/backward_tune.md); TUNING.md#backward-configs
BACKWARD_CONFIGS = {
    16: BackwardConfig(AttentionConfig(64, 64, 4, 2), AttentionConfig(64, 64, 4, 3)),
    32: BackwardConfig(AttentionConfig(64, 64, 4, 2), AttentionConfig(64, 64, 4, 3)),
    64: BackwardConfig(AttentionConfig(64, 64, 4, 2), AttentionConfig(64, 64, 4, 3)),
    128: BackwardConfig(AttentionConfig(32, 64, 4, 2), AttentionConfig(128, 64, 8, 3)),
    256: BackwardConfig(AttentionConfig(64, 64, 8, 2), AttentionConfig(128, 64, 8, 1)),
}


@dataclass(frozen=True)
class WgmmaBackwardConfig:
    """Tiles of the Hopper backward (``backward_hopper``). Its dK/dV kernel: ``block_n`` keys a program (16 a
    warp, times ``split``, warps), ``block_m`` query rows a turn, ``stages`` Q/dO buffers in shared memory.
    Its dQ kernel (two passes): ``dq_block_m`` query rows a program, ``dq_block_n`` keys a turn, ``dq_stages``
    K/V buffers."""

    block_m: int
    block_n: int
    stages: int
    split: int = 1  # warps sharing a key's row of Sᵀ, dK and dV (2: two warpgroups split the columns)
    max_registers: int | None = None  # the dK/dV kernel's register cap a thread (ptxas' maxnreg), or its own count
    dq_block_m: int = 64  # the dQ kernel (two passes): query rows a program (64 a warpgroup)
    dq_block_n: int = 64  # keys a K/V tile
    dq_stages: int = 2  # K/V buffers
    # One pass (``backward_hopper._attention_bwd_one_pass_kernel``): a program is two key tiles of ``block_n``
    # on two compute warpgroups and a load warp; dQ summed on chip and added to an fp32 workspace by TMA
    # reductions (not deterministic: deterministic calls keep the two passes). Forced tiles or
    # FLASHLITE_BACKWARD_ONE_PASS=1 (plan.backward_one_pass_enabled) ask for it; TUNING.md#one-pass-ws.
    one_pass: bool = False

    def __post_init__(self):
        # The kernels' shapes: one or two warpgroups, 16 keys a warp; the dQ kernel waits for K/V tile j before
        # it refills tile j - 1's buffer, so it needs two buffers at least.
        if self.block_n % 16 or self.block_n // 16 * self.split not in (4, 8) or self.block_m % (8 * self.split):
            raise ValueError(f"WgmmaBackwardConfig: block_n {self.block_n} and split {self.split} must give 4 or 8 "
                             f"warps, block_m {self.block_m} a multiple of 8 · split")
        if self.one_pass and (self.block_n != 64 or self.split != 1):
            raise ValueError(f"WgmmaBackwardConfig: one pass takes block_n 64 (a warpgroup a key tile) and split 1, "
                             f"not {self.block_n} and {self.split}")
        if self.dq_block_m not in (64, 128) or self.dq_block_n % 16 or self.stages < 1 or self.dq_stages < 2:
            raise ValueError(f"WgmmaBackwardConfig: dq_block_m {self.dq_block_m} must be 64 or 128, dq_block_n "
                             f"{self.dq_block_n} a multiple of 16, stages {self.stages} >= 1, dq_stages "
                             f"{self.dq_stages} >= 2")


# The Hopper backward's tiles by padded head dim (the larger of q/k's and v's; 32 to 256, the GPU tests' range).
# Up to 128: 64 keys a program on one warpgroup, two programs a multiprocessor (one's products overlap the other's
# softmax); up to 64 the dK/dV kernel is capped at 168 registers (12 B of spills), so that three fit: 377 against
# 353 TFLOP/s. 256: 64 keys on two warpgroups that split the columns (dK and dV of 64 x 256 fp32 are 64
# registers each a thread).
# H200 2026-11-26, python bench/backward_tune.py --kinds hopper_one_pass hopper_two_pass tl_table (bench/results/h200/backward_tune_hopper.md, backward_tune_hopper_d64.md); TUNING.md#backward-hopper
WGMMA_BACKWARD_CONFIGS = {
    32: WgmmaBackwardConfig(64, 64, 2, max_registers=168),
    64: WgmmaBackwardConfig(64, 64, 2, max_registers=168),
    128: WgmmaBackwardConfig(64, 64, 2),
    256: WgmmaBackwardConfig(64, 64, 2, split=2),
}


# Registers a thread of the one-pass backward's partitions: two compute warpgroups and a load warp, launched as
# 12 warps (the load warp's warpgroup is padded), as the warp-specialized forward: the launch cap, 168, is 65536 /
# 384 rounded down to a multiple of 8; the load warp's warpgroup gives most of its share to the compute warpgroups.
# Not timed: the register file's arithmetic; TUNING.md#backward-hopper
ONE_PASS_LAUNCH_REGISTERS = 168


# Not timed: the register file's arithmetic; TUNING.md#backward-hopper
ONE_PASS_COMPUTE_REGISTERS = 240


# Not timed: the register file's arithmetic; TUNING.md#backward-hopper
ONE_PASS_LOAD_REGISTERS = 24


# fp32: IEEE dots on the FMA units, small tiles (as the forward's fp32 table). Only run through the
# interpreter: CUDA fp32 takes the PyTorch stand-in (`triton_backward_enabled`).
# Not timed; TUNING.md#backward-configs
BACKWARD_FP32_CONFIGS = {
    hd: BackwardConfig(AttentionConfig(32, 32, 4, 1), AttentionConfig(32, 32, 4, 1)) if hd <= 64
    else BackwardConfig(AttentionConfig(16, 32, 4, 1), AttentionConfig(32, 16, 4, 1))
    for hd in (16, 32, 64, 128, 256)
}


# The interpreter runs one program at a time in numpy: small tiles (tests force smaller ones still).
# Not timed: test speed on CPU; TUNING.md#fp32-configs
BACKWARD_INTERPRETER_CONFIG = BackwardConfig(AttentionConfig(32, 32, 4, 1), AttentionConfig(32, 32, 4, 1))
