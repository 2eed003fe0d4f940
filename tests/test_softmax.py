"""flashlite.softmax / logsumexp against float64 torch, through the Triton interpreter."""

import dataclasses
import math

import pytest
import torch

import flashlite
from flashlite.softmax import api, frames, plan as softmax_plan, shared_rows, tuning
from flashlite.core import partials
from flashlite.core import runtime as _runtime
from flashlite.softmax.api import as_rows, clear_plans, softmax_forward
from flashlite.softmax.backward import softmax_backward
from flashlite.softmax.plan import plan_softmax

from .utils import DTYPES, H100, assert_close, randn, softmax_grad_ref, softmax_ref

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [
        (1, 1),  # N = 1: the answer is exactly 1
        (37, 100),  # odd rows, non-power-of-two N: padded fused tile
        (5, 1000),  # one row a tile, N not a power of two
        (199, 7),  # many short rows: several rows a tile, persistent loop takes several turns
        (3, 4, 33),  # leading dims flattened
    ],
)
@pytest.mark.parametrize("algorithm", ["auto", "fused", "online"])
def test_matches_torch(shape, dtype, algorithm):
    x = randn(*shape, dtype=dtype)
    assert_close(flashlite.softmax(x, algorithm=algorithm), softmax_ref(x))


@pytest.mark.parametrize("n_splits", [1, 3, 8])
@pytest.mark.parametrize("n_cols", [130, 257])
def test_online_many_blocks_and_split_rows(n_cols, n_splits):
    # Blocks of 16: 9 to 17 blocks a row; splits of 3 and 8 give ragged last chunks and the partial merge.
    x = randn(3, n_cols, scale=3.0)
    plan = plan_softmax(3, n_cols, CPU, "online", block_n=16, n_splits=n_splits)
    # Chunks are whole blocks, so 130 columns in 8 splits become 5 chunks of 32.
    assert plan.cols_per_split % 16 == 0 and plan.n_splits == math.ceil(n_cols / plan.cols_per_split)
    assert (plan.n_splits > 1) == (n_splits > 1)
    y, lse = softmax_forward(x, torch.float32, plan, write_lse=True)
    assert_close(y, softmax_ref(x))
    assert_close(lse, torch.logsumexp(x.double(), -1))


def test_split_rows_chosen_when_rows_are_few():
    # One long row on the 4-"SM" interpreter device: the planner must split it across programs.
    plan = plan_softmax(1, 1 << 16, CPU, "online")
    assert plan.n_splits > 1
    x = randn(1, 300)
    plan = plan_softmax(1, 300, CPU, "online", block_n=32)
    assert plan.n_splits > 1  # 1 row < 4 work items per SM x 4 SMs
    assert_close(softmax_forward(x, torch.float32, plan)[0], softmax_ref(x))


def test_rows_not_split_when_rows_fill_the_device():
    # 2 rows are half a row per "SM" on the 4-SM interpreter device: whole rows, one program each.
    assert plan_softmax(2, 1 << 16, CPU, "online").n_splits == 1
    assert plan_softmax(1, 1 << 16, CPU, "online").n_splits > 1


def test_max_raised_by_a_later_block():
    # Later blocks hold larger values: each raises the running max, so alpha < 1 rescales d.
    x = torch.linspace(-20, 20, 200).repeat(2, 1) + randn(2, 200) * 0.1
    plan = plan_softmax(2, 200, CPU, "online", block_n=16, n_splits=1)
    assert_close(softmax_forward(x, torch.float32, plan)[0], softmax_ref(x))


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2])
def test_every_dim(dim):
    x = randn(6, 7, 9)
    assert_close(flashlite.softmax(x, dim=dim), softmax_ref(x, dim))


def test_non_contiguous_views():
    base = randn(8, 40)
    strided_rows = base[::2, 3:30]  # row stride 80, column stride 1: read in place
    assert_close(flashlite.softmax(strided_rows), softmax_ref(strided_rows))
    transposed = base.t()  # softmax dim has stride 40: copied, still right
    assert_close(flashlite.softmax(transposed), softmax_ref(transposed))
    permuted = randn(4, 5, 6).permute(2, 0, 1)  # leading dims not collapsible
    assert_close(flashlite.softmax(permuted, dim=1), softmax_ref(permuted, 1))


def test_reads_strided_rows_without_copy():
    x = randn(4, 64)[:, :50]
    rows = as_rows(x, 1)
    assert rows.data_ptr() == x.data_ptr() and rows.stride() == (64, 1)


@pytest.mark.parametrize("scale", [1e4, -1e4])
def test_large_magnitudes(scale):
    x = randn(4, 300, scale=scale)
    assert_close(flashlite.softmax(x), softmax_ref(x))
    assert_close(flashlite.softmax(x, algorithm="online"), softmax_ref(x))


def test_shift_invariance_at_large_offset():
    # x - m is taken before scaling by log2(e): an offset of 1e4 must not cost accuracy.
    x = randn(4, 100)
    shifted = x + 1e4  # exactly representable shift of the float64 values is not needed: compare to its own ref
    assert_close(flashlite.softmax(shifted), softmax_ref(shifted))
    assert_close(flashlite.softmax(shifted, algorithm="online"), softmax_ref(shifted))


@pytest.mark.parametrize("algorithm", ["fused", "online"])
def test_nan_and_inf_rows(algorithm):
    x = randn(4, 50)
    x[0, 7] = float("nan")  # NaN row: all NaN
    x[1] = float("-inf")  # all -inf: NaN, as torch
    x[2, :25] = float("-inf")  # partly -inf: zeros there
    x[3, 3] = float("inf")  # +inf: NaN, as torch
    y = flashlite.softmax(x, algorithm=algorithm)
    ref = torch.softmax(x.double(), -1)
    assert_close(y, ref)
    assert torch.isnan(y[0]).all() and torch.isnan(y[1]).all()
    assert (y[2, :25] == 0).all()


def test_all_neg_inf_first_block_online():
    x = randn(2, 64)
    x[:, :16] = float("-inf")  # the first block of 16 is empty: alpha from an empty state must be 0, not NaN
    plan = plan_softmax(2, 64, CPU, "online", block_n=16, n_splits=1)
    assert_close(softmax_forward(x, torch.float32, plan)[0], softmax_ref(x))
    plan = plan_softmax(2, 64, CPU, "online", block_n=16, n_splits=4)  # and an empty partial in the merge
    assert_close(softmax_forward(x, torch.float32, plan)[0], softmax_ref(x))


def test_dtype_argument():
    x = randn(5, 30, dtype=torch.bfloat16)
    y = flashlite.softmax(x, dtype=torch.float32)
    assert y.dtype == torch.float32
    assert_close(y, softmax_ref(x), dtype=torch.float32)
    y16 = flashlite.softmax(randn(3, 9), dtype=torch.float16)
    assert y16.dtype == torch.float16


def test_empty_and_scalar():
    assert flashlite.softmax(torch.empty(0, 5)).shape == (0, 5)
    assert flashlite.softmax(torch.empty(3, 0)).shape == (3, 0)
    assert flashlite.softmax(torch.tensor(2.5)).item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", [((7, 33), -1), ((4, 5, 6), 1)])
def test_backward_matches_torch(shape, dim, dtype):
    x = randn(*shape, dtype=dtype, requires_grad=True)
    dy = randn(*shape, dtype=dtype)
    (dx,) = torch.autograd.grad(flashlite.softmax(x, dim=dim), x, dy)
    x64 = x.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(torch.softmax(x64, dim), x64, dy.double())
    assert dx.dtype == dtype
    assert_close(dx, ref, atol=TOL_GRAD[dtype], rtol=TOL_GRAD[dtype])


TOL_GRAD = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("n_splits", [1, 3])
def test_backward_online(n_splits):
    x = randn(3, 100)
    dy = randn(3, 100)
    plan = plan_softmax(3, 100, CPU, "online", block_n=16, n_splits=n_splits)
    y, _ = softmax_forward(x, torch.float32, plan)
    dx = softmax_backward(y, dy, torch.float32, plan)
    x64 = x.double().requires_grad_()
    (ref,) = torch.autograd.grad(torch.softmax(x64, -1), x64, dy.double())
    assert_close(dx, ref, atol=1e-6)


def test_backward_non_contiguous_grad():
    x = randn(6, 20, requires_grad=True)
    dy = randn(20, 6).t()  # grad arrives with column stride 6
    (dx,) = torch.autograd.grad(flashlite.softmax(x), x, dy)
    x64 = x.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(torch.softmax(x64, -1), x64, dy.double())
    assert_close(dx, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", [((9, 70), -1), ((3, 4, 5), 0), ((1,), 0)])
def test_logsumexp(shape, dim, dtype):
    x = randn(*shape, dtype=dtype, scale=5.0)
    out = flashlite.logsumexp(x, dim=dim)
    assert out.dtype == dtype and out.shape == torch.logsumexp(x, dim).shape
    assert_close(out, torch.logsumexp(x.double(), dim))


def test_logsumexp_special_rows_and_grad():
    x = randn(3, 40, scale=1e3)
    x[1] = float("-inf")
    x[2, 5] = float("nan")
    out = flashlite.logsumexp(x)
    assert_close(out, torch.logsumexp(x.double(), -1))
    x = randn(4, 30, requires_grad=True)
    (g,) = torch.autograd.grad(flashlite.logsumexp(x).sum(), x)
    assert_close(g, softmax_ref(x.detach()))


def test_pytorch_path_without_interpreter(monkeypatch):
    monkeypatch.setattr(_runtime, "interpreter_enabled", lambda: False)
    x = randn(4, 10, dtype=torch.bfloat16)
    assert_close(flashlite.softmax(x), softmax_ref(x))
    assert_close(flashlite.logsumexp(x), torch.logsumexp(x.double(), -1))


def test_bad_inputs():
    with pytest.raises(TypeError, match="x must be float32"):
        flashlite.softmax(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="x must be float32"):
        flashlite.softmax(torch.ones(3, dtype=torch.bool))
    with pytest.raises(IndexError, match="dim=2"):
        flashlite.softmax(randn(3, 4), dim=2)
    with pytest.raises(ValueError, match="algorithm must be"):
        flashlite.softmax(randn(3, 4), algorithm="blocked")
    with pytest.raises(TypeError, match="dtype must be"):
        flashlite.softmax(randn(3, 4), dtype=torch.int64)
    with pytest.raises(ValueError, match="algorithm='fused' holds rows"):
        flashlite.softmax(randn(1, 40000), algorithm="fused")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        flashlite.softmax([1.0, 2.0])
    with pytest.raises(IndexError, match="dim=-3"):
        flashlite.logsumexp(randn(3, 4), dim=-3)


# ----------------------------------------------------------------------------- rows shared by resident programs


import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flashlite.core.partials import pack_state, unpack_state  # noqa: E402



@triton.jit
def _pack_round_trip_kernel(m_ptr, d_ptr, packed_ptr, m_out_ptr, d_out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    packed = pack_state(tl.load(m_ptr + offs), tl.load(d_ptr + offs))
    tl.store(packed_ptr + offs, packed)
    m, d = unpack_state(packed)
    tl.store(m_out_ptr + offs, m)
    tl.store(d_out_ptr + offs, d)


def _host_packed(m: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """pack_state on the host: m's float32 bits high, d's low, as int64."""
    m_bits = m.float().numpy().view(np.uint32).astype(np.uint64)
    d_bits = d.float().numpy().view(np.uint32).astype(np.uint64)
    return torch.from_numpy(((m_bits << np.uint64(32)) | d_bits).view(np.int64))


def test_packed_states_round_trip_and_are_never_zero():
    inf, nan = float("inf"), float("nan")
    m = torch.tensor([0.0, -0.0, -inf, 3.5, -1e4, nan, 88.0, 1e-30])
    d = torch.tensor([1.0, 2.0, 0.0, 1e6, 1.0, nan, 4096.0, 1.0])
    packed, m_out, d_out = torch.empty(8, dtype=torch.int64), torch.empty(8), torch.empty(8)
    _pack_round_trip_kernel[(1,)](m, d, packed, m_out, d_out, N=8)
    torch.testing.assert_close(m_out, m, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(d_out, d, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(packed, _host_packed(m, d))
    assert (packed != 0).all()  # 0 is "not published yet": no real state packs to it


# head_group_n: head states per lane, or per group of adjacent columns
@pytest.mark.parametrize("dtype,head_group_n", [(torch.float32, 1), (torch.bfloat16, 4)])
@pytest.mark.parametrize(
    "n_cols,head_cols,even,prefetch",
    [
        (50, 0, False, tuning.PREFETCH_NONE),  # parts of 16 held on chip, the last one ragged (2 columns)
        (100, 16, False, tuning.PREFETCH_NONE),  # parts of 16 streamed twice + 16 on chip; the last tail is past the row
        (128, 16, True, tuning.PREFETCH_NONE),  # every part inside the row: no masks
        (150, 24, False, tuning.PREFETCH_NONE),  # heads of three blocks: the loops (two a turn) fold a padding block of -inf
    ],
)
def test_shared_rows_kernel_with_the_other_parts_published(dtype, head_group_n, n_cols, head_cols, even, prefetch):
    # The interpreter runs programs one at a time, so the other parts of each row are published
    # beforehand (from float64 statistics of their chunks); the kernel's program for every part
    # still publishes its own, waits for the row's slots, merges and normalises its part.
    n_rows, block_n, head_block_n = 4, 16, 8
    part_cols = head_cols + block_n
    n_parts = math.ceil(n_cols / part_cols)
    assert n_parts == 4 and (n_cols == n_parts * part_cols) == even
    x = randn(n_rows, n_cols, dtype=dtype, scale=4.0)
    x[1, part_cols:2 * part_cols] = float("-inf")  # a part with nothing in it: the empty state merges as neutral
    x[2] = float("-inf")  # a row of -inf: NaN, as torch.softmax
    x[3, n_cols - 3] = float("nan")  # NaN in the last part: the whole row NaN
    chunks = x.double().split(part_cols, dim=1)
    part_m = torch.stack([c.max(dim=1).values for c in chunks], 1)
    part_d = torch.stack([torch.exp(c - m.nan_to_num(neginf=0.0)[:, None]).sum(1) for c, m in zip(chunks, part_m.T)], 1)
    slots = _host_packed(part_m.flatten(), part_d.flatten())
    slots[0] = 0  # the first program publishes its own slot before waiting
    y = torch.full_like(x, float("nan"))
    lse = torch.full((n_rows,), float("nan"))
    clear = torch.randint(1, 1 << 40, (37,))  # what an earlier launch published: zeroed for the next one
    with _runtime.quiet_interpreter():  # the test's own launch: as flashlite's
        shared_rows.softmax_shared_rows_kernel[(n_parts,)](
            x, y, lse, slots, clear, 35, n_rows, n_cols, n_parts, head_cols, 0, x.stride(0), x.stride(1), n_cols,
            BLOCK_N=block_n, HEAD_BLOCK_N=head_block_n, HEAD_GROUP_N=head_group_n, HEAD_EVICTION="", PARTS_POW2=n_parts,
            HAS_HEAD=head_cols > 0,
            PREFETCH=prefetch, VEC_COLS=1, EVEN_COLS=even, WRITE_Y=True, WRITE_LSE=True, CLEAR_BLOCK=8,
        )
    assert_close(y, softmax_ref(x))
    assert_close(lse, torch.logsumexp(x.double(), -1))
    assert (clear[:35] == 0).all() and (clear[35:] != 0).all()  # n_clear slots over 4 programs, 8 a turn
    m_published, d_published = unpack_host(slots[:1])  # what the first program published for row 0
    assert m_published.item() == part_m[0, 0].float().item()
    torch.testing.assert_close(d_published.double(), part_d[0, :1], rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "n_cols,head_cols,n_parts",
    [
        (64, 8, 4),  # a head of exactly one block
        (52, 8, 4),  # the last part's head ragged inside its only block, no tail
        (100, 24, 4),  # three head blocks; the row ends inside the last part's second one
        (180, 40, 4),  # five head blocks (the loops take two a turn); the last part's head ragged in its fourth
        (37, 32, 1),  # one part a row, with a head; its tail ragged
    ],
)
@pytest.mark.parametrize("head_group_n", [1, 4])  # head states per lane, or per group of 4 columns
def test_shared_rows_kernel_head_boundaries(n_cols, head_cols, n_parts, head_group_n):
    # Where the row ends inside a head or a tail, and a head of one block: as above, the other parts
    # are published beforehand from float64 statistics.
    n_rows, block_n, head_block_n = 3, 8, 8
    part_cols = head_cols + block_n
    assert math.ceil(n_cols / part_cols) == n_parts
    x = randn(n_rows, n_cols, scale=4.0)
    chunks = x.double().split(part_cols, dim=1)
    part_m = torch.stack([c.max(dim=1).values for c in chunks], 1)
    part_d = torch.stack([torch.exp(c - m[:, None]).sum(1) for c, m in zip(chunks, part_m.T)], 1)
    y = torch.full_like(x, float("nan"))
    lse = torch.full((n_rows,), float("nan"))
    slots = _host_packed(part_m.flatten(), part_d.flatten())
    with _runtime.quiet_interpreter():  # the test's own launch: as flashlite's
        shared_rows.softmax_shared_rows_kernel[(n_parts,)](
            x, y, lse, slots, slots, 0, n_rows, n_cols, n_parts, head_cols, 0, x.stride(0), x.stride(1), n_cols,
            BLOCK_N=block_n, HEAD_BLOCK_N=head_block_n, HEAD_GROUP_N=head_group_n, HEAD_EVICTION="evict_last",
            PARTS_POW2=triton.next_power_of_2(n_parts), HAS_HEAD=True,
            PREFETCH=tuning.PREFETCH_NONE, VEC_COLS=1, EVEN_COLS=n_cols == n_parts * part_cols, WRITE_Y=True, WRITE_LSE=True,
            CLEAR_BLOCK=16,
        )
    assert_close(y, softmax_ref(x))
    assert_close(lse, torch.logsumexp(x.double(), -1))


def _frame_part_states(x: torch.Tensor, part_cols: int, n_parts: int, vec_cols: int, base_lead: int) -> tuple:
    """float64 ``(part_m, part_d)`` [rows, parts] of each part of each row in the frame of ``_row_frame``
    (x contiguous, ``base_lead`` elements past an aligned address): its whole vectors by frame column, the
    edges part 0's."""
    n_rows, n_cols = x.shape
    part_m = torch.full((n_rows, n_parts), float("-inf"), dtype=torch.float64)
    part_d = torch.zeros((n_rows, n_parts), dtype=torch.float64)
    for row in range(n_rows):
        pre = -(base_lead + row * n_cols) % vec_cols  # columns before the first vector boundary in the row
        hi = (n_cols - pre) // vec_cols * vec_cols
        frame = torch.arange(n_cols) - pre
        whole = (frame >= 0) & (frame < hi)
        for part in range(n_parts):
            values = x[row, (whole & (frame // part_cols == part)) | (~whole if part == 0 else False)].double()
            if values.numel():
                part_m[row, part] = values.max()
                part_d[row, part] = torch.exp(values - values.max().nan_to_num(neginf=0.0)).sum()
    return part_m, part_d


@pytest.mark.parametrize("dtype,out_dtype,vec_cols,head_group_n", [
    (torch.float32, torch.float32, 4, 1), (torch.bfloat16, torch.bfloat16, 8, 8),
    (torch.bfloat16, torch.float32, 8, 1), (torch.float32, torch.bfloat16, 8, 4),  # 16 bytes of the narrower dtype
])
@pytest.mark.parametrize("n_cols,head_cols,base_lead", [(45, 0, 0), (61, 16, 0), (99, 8, 0), (61, 16, 3), (64, 8, 1)])
def test_shared_rows_kernel_reads_unaligned_rows_from_their_first_boundary(dtype, out_dtype, vec_cols, head_group_n,
                                                                          n_cols, head_cols, base_lead):
    # Contiguous rows of an odd length (or from a base base_lead elements past a 16-byte boundary) start
    # anywhere inside a 16-byte vector: each row is read from the first vector boundary in it, its whole
    # vectors by the parts, its edges by part 0. The kernel gets x and y from the boundary before x;
    # y gets rows 16 columns apart (the same alignment each row), the 16 between them poisoned, as is
    # what lies before y's first row: every write must stay inside its row.
    n_rows, block_n, head_block_n, gap = 5, 16, 8, 16
    part_cols = head_cols + block_n
    n_parts = math.ceil(n_cols / part_cols)  # the whole vectors never need more columns than the row
    x_frame = randn(n_rows * n_cols + base_lead, dtype=dtype, scale=4.0)
    x = x_frame[base_lead:].view(n_rows, n_cols)
    x[1, 3] = 30.0  # the maximum on a head edge (row 1 starts mid-vector)
    x[2, n_cols - 1] = float("nan")  # NaN on a tail edge: the whole row NaN
    x[3] = float("-inf")  # a row of -inf: NaN, as torch.softmax
    assert x_frame.data_ptr() % 16 == 0  # leads vary from row to row, but for n_cols = 64 (all base_lead)
    part_m, part_d = _frame_part_states(x, part_cols, n_parts, vec_cols, base_lead)
    slots = _host_packed(part_m.flatten().float(), part_d.flatten().float())
    slots[0] = 0  # the first program publishes its own slot before waiting
    y_frame = torch.full((base_lead + n_rows * (n_cols + gap),), float("nan"), dtype=out_dtype)
    y = y_frame[base_lead:].view(n_rows, n_cols + gap)
    lse = torch.full((n_rows,), float("nan"))
    with _runtime.quiet_interpreter():  # the test's own launch: as flashlite's
        shared_rows.softmax_shared_rows_kernel[(n_parts,)](
            x_frame, y_frame, lse, slots, slots, 0, n_rows, n_cols, n_parts, head_cols, base_lead, x.stride(0),
            x.stride(1), y.stride(0),
            BLOCK_N=block_n, HEAD_BLOCK_N=head_block_n, HEAD_GROUP_N=head_group_n, HEAD_EVICTION="",
            PARTS_POW2=triton.next_power_of_2(n_parts),
            HAS_HEAD=head_cols > 0, PREFETCH=tuning.PREFETCH_NONE, VEC_COLS=vec_cols, EVEN_COLS=False,
            WRITE_Y=True, WRITE_LSE=True, CLEAR_BLOCK=16,
        )
    assert_close(y[:, :n_cols], softmax_ref(x))
    assert y[:, n_cols:].isnan().all() and y_frame[:base_lead].isnan().all()
    assert_close(lse, torch.logsumexp(x.double(), -1))


def test_row_vectors():
    # 1: rows aligned as Triton sees them; > 1: contiguous, rows read from the first 16-byte boundary
    # in each; 0: neither, one element a load.
    assert frames.row_vectors(torch.empty(8, 64), torch.float32) == 1
    assert frames.row_vectors(torch.empty(8, 50257), torch.float32) == 4
    assert frames.row_vectors(torch.empty(8, 50257, dtype=torch.bfloat16), torch.bfloat16) == 8
    assert frames.row_vectors(torch.empty(8, 50257, dtype=torch.bfloat16), torch.float32) == 8  # y's vectors too
    assert frames.row_vectors(torch.empty(8, 40), torch.float32) == 4  # 8 vectors, but not 16 columns
    assert frames.row_vectors(torch.empty(1, 50257), torch.float32) == 4
    assert frames.row_vectors(torch.empty(8, 50272)[:, :50257], torch.float32) == 0  # y's rows would not align
    assert frames.row_vectors(torch.empty(8 * 64 + 1)[1:].view(8, 64), torch.float32) == 4  # base 4 bytes past
    assert frames.row_vectors(torch.empty(8 * 64 + 1, dtype=torch.bfloat16)[1:].view(8, 64), torch.bfloat16) == 8
    assert frames.row_vectors(torch.empty(8, 128)[:, 1:65], torch.float32) == 0  # rows 128 apart, 64 long
    buffer = np.zeros(8 * 50 * 4 + 32, dtype=np.uint8)
    offset = (4 - buffer.ctypes.data) % 16
    from_buffer = torch.frombuffer(buffer, dtype=torch.float32, count=8 * 50, offset=offset).view(8, 50)
    assert from_buffer.data_ptr() % 16 == 4 and from_buffer.storage_offset() == 0
    assert frames.row_vectors(from_buffer, torch.float32) == 0  # its storage starts unaligned: no boundary before it


def test_aligned_frame_and_rows_output():
    # The view from the 16-byte boundary before a tensor's first element, and an output that starts as
    # far past one: the shared-row kernel's frame for rows whose base is not aligned.
    storage = torch.randn(3 * 50 + 3)
    x = storage[3:].view(3, 50)
    frame, lead = frames.aligned_frame(x)
    assert lead == 3 and frame.data_ptr() == storage.data_ptr() and frame.shape == x.shape
    aligned = storage[:8].view(2, 4)
    assert frames.aligned_frame(aligned)[0] is aligned and frames.aligned_frame(aligned)[1] == 0
    for dtype in (torch.float32, torch.bfloat16):
        y, y_frame = frames.rows_output(3, 50, dtype, CPU, lead)
        assert y.shape == y_frame.shape == (3, 50) and y.is_contiguous() and y.dtype == dtype
        assert y.data_ptr() - y_frame.data_ptr() == lead * y.element_size() and y_frame.data_ptr() % 16 == 0
    # Only rows read in frames (shared, one-row fused tiles, online) start their output past a boundary.
    framed = softmax_plan.SoftmaxPlan("fused", 1, 16, 4, n_splits=4, cols_per_split=16, vec_cols=4)
    assert softmax_plan.output_lead(x, framed) == lead
    assert softmax_plan.output_lead(x, dataclasses.replace(framed, vec_cols=1)) == 0  # aligned rows
    assert softmax_plan.output_lead(x, dataclasses.replace(framed, vec_cols=0)) == 0  # one element a load
    assert softmax_plan.output_lead(x, softmax_plan.SoftmaxPlan("fused", 1, 64, 4)) == 0  # a row a program, not in frames
    assert softmax_plan.output_lead(x, softmax_plan.SoftmaxPlan("fused", 1, 64, 4, vec_cols=4)) == lead  # ... in frames
    assert softmax_plan.output_lead(x, softmax_plan.SoftmaxPlan("online", 1, 16, 4, vec_cols=4)) == lead


def unpack_host(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """unpack_state on the host: the float32 (m, d) of packed int64 states."""
    bits = packed.numpy().view(np.uint64)
    m = (bits >> np.uint64(32)).astype(np.uint32).view(np.float32)
    d = (bits & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)
    return torch.from_numpy(m.copy()), torch.from_numpy(d.copy())


def test_shared_rows_plan(monkeypatch):
    # On a (stand-in) GPU, rows past FUSED_MAX_COLS stay fused across programs, tiles by element size;
    # rows longer than the resident programs hold add a head, streamed twice, to every part; so do
    # few rows that would take several waves, while one wave's heads fit half of L2. Many rows go in
    # waves of SHARED_WAVE_TILES parts (fp32 ones stream a head as long as they hold, unless framed). A GPU
    # without thread-block clusters: Hopper's take many long rows over clusters (test_softmax_cluster.py).
    gpu = torch.device("cuda", 0)
    l2_bytes = H100.l2_bytes
    monkeypatch.setattr(softmax_plan, "shares_rows_on_chip", lambda device: device.type == "cuda")
    monkeypatch.setattr(softmax_plan, "clusters_supported", lambda device: False)
    monkeypatch.setattr(softmax_plan, "device_info", lambda device: H100)
    clear_plans()
    try:
        fp32 = plan_softmax(4096, 65536, gpu, shared_rows=torch.float32)
        assert (fp32.algorithm, fp32.block_n, fp32.n_splits, fp32.num_warps, fp32.head_cols) == ("fused", 16384, 2, 4, 16384)
        assert fp32.cols_per_split == 32768 and fp32.head_block == tuning.SHARED_WAVE_TILES[4].head_block
        # (bf16 4096 x 65536 is read twice, a program a row: test_softmax_reread.py)
        bf16_waves, bf16_wave_tile = plan_softmax(4096, 131072, gpu, shared_rows=torch.bfloat16), tuning.SHARED_WAVE_TILES[2]
        assert (bf16_waves.block_n, bf16_waves.n_splits, bf16_waves.num_warps, bf16_waves.head_cols, bf16_waves.prefetch) == (
            bf16_wave_tile.cols, 8, bf16_wave_tile.num_warps, 0, bf16_wave_tile.prefetch)
        one_wave_of_parts = plan_softmax(64, 65536, gpu, shared_rows=torch.bfloat16)  # 128 parts: no waves
        assert (one_wave_of_parts.block_n, one_wave_of_parts.n_splits) == (tuning.SHARED_TILES[2].cols, 2)
        bf16 = plan_softmax(7, 100_003, gpu, "fused", shared_rows=torch.bfloat16)
        assert (bf16.block_n, bf16.n_splits, bf16.num_warps) == (32768, 4, 16)  # ragged last part
        odd = plan_softmax(3, 40_000, gpu, shared_rows=torch.float32)  # 3 parts of 13334 -> 3 of 16384
        assert (odd.block_n, odd.n_splits) == (16384, 3)
        fp32_tile, bf16_tile = tuning.SHARED_TILES[4], tuning.SHARED_TILES[2]
        most = fp32_tile.programs_per_sm * 132 * fp32_tile.cols  # what the resident fp32 programs hold on chip
        assert plan_softmax(1, most, gpu, shared_rows=torch.float32).head_cols == 0
        for n_cols in (most + 1, 1 << 24, 3 * most + 17):
            chosen = plan_softmax(1, n_cols, gpu, shared_rows=torch.float32)
            assert chosen.algorithm == "fused" and chosen.block_n == fp32_tile.cols
            assert chosen.n_splits <= fp32_tile.programs_per_sm * 132 and chosen.head_block == fp32_tile.head_block
            assert chosen.head_cols > 0 and chosen.head_cols % chosen.head_block == 0 and chosen.shares_rows
            assert chosen.cols_per_split == chosen.head_cols + chosen.block_n
            assert chosen.n_splits * chosen.cols_per_split >= n_cols > (chosen.n_splits - 1) * chosen.cols_per_split
        bf16_long = plan_softmax(1, 1 << 24, gpu, shared_rows=torch.bfloat16)  # one 16-bit program a multiprocessor
        assert bf16_long.n_splits <= 132 and bf16_long.head_cols > 0
        assert (fp32.prefetch, bf16.prefetch, bf16_long.prefetch) == (fp32_tile.prefetch, *[bf16_tile.prefetch] * 2)
        assert (chosen.head_group, bf16_long.head_group) == (fp32_tile.head_group, bf16_tile.head_group) == (1, 8)
        # 16 rows of 1M: 32 held parts a row, 4 rows a wave. bf16: one wave of 8 parts a row (8 x 16 <= 132),
        # 24 MB of heads <= 25 MB; fp32 (48 MB of heads in one wave): two waves of 8 rows, 32 parts a row.
        one_wave = plan_softmax(16, 1 << 20, gpu, shared_rows=torch.bfloat16)
        assert (one_wave.n_splits, one_wave.block_n, one_wave.cols_per_split) == (8, bf16_tile.cols, 1 << 17)
        assert 16 * one_wave.n_splits * one_wave.head_cols * 2 <= tuning.SHARED_HEADS_L2_FRACTION * l2_bytes
        two_waves = plan_softmax(16, 1 << 20, gpu, shared_rows=torch.float32)
        assert (two_waves.n_splits, two_waves.head_cols, two_waves.block_n) == (32, 16384, fp32_tile.cols)
        assert 8 * two_waves.n_splits <= 2 * 132 < 16 * two_waves.n_splits  # 8 rows a wave, not 16
        assert 8 * two_waves.n_splits * two_waves.head_cols * 4 <= tuning.SHARED_HEADS_L2_FRACTION * l2_bytes
        max_head_waves = tuning.SHARED_MAX_HEAD_WAVES
        monkeypatch.setattr(tuning, "SHARED_MAX_HEAD_WAVES", 1)  # one wave or none: fp32 goes in waves of parts
        clear_plans()
        framed_waves = plan_softmax(16, 1 << 20, gpu, shared_rows=torch.float32, vec_cols=4)
        assert (framed_waves.n_splits, framed_waves.head_cols) == (64, 0)
        waves = plan_softmax(16, 1 << 20, gpu, shared_rows=torch.float32)  # each part with a wave head
        assert (waves.n_splits, waves.head_cols) == (32, tuning.SHARED_WAVE_TILES[4].wave_head)
        # No head carries an eviction hint (the wave heads' evict_last gained under 3% on the H200: TUNING.md).
        assert (waves.head_eviction, fp32.head_eviction) == ("",) * 2
        assert (two_waves.head_eviction, one_wave.head_eviction, bf16_long.head_eviction) == ("",) * 3
        monkeypatch.setattr(tuning, "SHARED_MAX_HEAD_WAVES", max_head_waves)
        clear_plans()
        rows_128 = plan_softmax(128, 1 << 17, gpu, shared_rows=torch.bfloat16)  # one program a row, with a head
        assert (rows_128.n_splits, rows_128.head_cols) == (1, (1 << 17) - bf16_tile.cols) and rows_128.shares_rows
        two_waves = plan_softmax(200, 1 << 17, gpu, shared_rows=torch.bfloat16)  # 2 waves of 100 rows, with heads
        assert (two_waves.n_splits, two_waves.head_cols) == (1, (1 << 17) - bf16_tile.cols)
        many = plan_softmax(400, 1 << 17, gpu, shared_rows=torch.bfloat16)  # 2 waves would not hold their heads
        assert (many.head_cols, many.block_n, many.n_splits) == (0, bf16_wave_tile.cols, 8)
        # Unaligned rows: read from the first vector boundary in each (no more parts than aligned rows),
        # or, where no frame aligns them, in the unaligned tiles.
        framed = plan_softmax(4096, 65533, gpu, shared_rows=torch.float32, vec_cols=4)  # in waves, without heads
        assert (framed.block_n, framed.n_splits, framed.head_cols, framed.vec_cols) == (16384, 4, 0, 4)
        assert plan_softmax(4096, 65536, gpu, shared_rows=torch.float32, vec_cols=4) == framed  # an unaligned base
        scalar = plan_softmax(4096, 50257, gpu, shared_rows=torch.bfloat16, vec_cols=0)
        unaligned_tile = tuning.SHARED_TILES_UNALIGNED[2]
        assert (scalar.block_n, scalar.num_warps, scalar.n_splits, scalar.vec_cols) == (
            unaligned_tile.cols, unaligned_tile.num_warps, math.ceil(50257 / unaligned_tile.cols), 0)
        assert plan_softmax(4, 65536, gpu).algorithm == "online"  # masked softmax: no shared-row kernel
        assert plan_softmax(4, 65536, gpu, "online", shared_rows=torch.float32).algorithm == "online"
        assert plan_softmax(4, 65536, CPU, shared_rows=torch.float32).algorithm == "online"  # interpreter
    finally:
        clear_plans()


def test_shared_rows_plan_falls_back_to_streaming_where_programs_cannot_wait():
    # A shared-row plan handed to the interpreter (where a row's programs would wait for each
    # other forever) runs the online path instead, with the right answer.
    x = randn(3, 100, scale=3.0)
    shared = softmax_plan.SoftmaxPlan("fused", 1, 32, 4, 4, 32)
    y, lse = softmax_forward(x, torch.float32, shared, write_lse=True)
    assert_close(y, softmax_ref(x))
    assert_close(lse, torch.logsumexp(x.double(), -1))


def test_shared_rows_backward_where_programs_cannot_wait():
    # The interpreter shares no rows: the backward of a forward plan of shared rows runs a row a program there.
    backward = softmax_plan.plan_backward(softmax_plan.SoftmaxPlan("fused", 1, 32, 4, 4, 32), 2, 100, 4, torch.device("cpu"))
    assert backward.algorithm == "fused" and not backward.shares_rows
    y = softmax_ref(randn(2, 100)).float()
    dy = randn(2, 100)
    dx = softmax_backward(y, dy, torch.float32, softmax_plan.SoftmaxPlan("fused", 1, 32, 4, 4, 32))
    assert_close(dx, softmax_grad_ref(y, dy))


def test_repeated_calls_repeat_the_first_launch(monkeypatch):
    # A call with a signature seen before (shape, strides, dtypes, dim, algorithm, device, alignment)
    # repeats the first call's launch through compiled_launcher. The interpreter compiles nothing,
    # so here a stand-in launcher runs the same kernel, grid and arguments through it, and counts.
    repeats = []

    def interpreted_launcher(kernel, grid, args, **meta):
        def run(new_args):
            repeats.append(grid)
            _runtime.launch(kernel, grid, new_args, **meta)
        return run

    monkeypatch.setattr(api, "compiled_launcher", interpreted_launcher)
    monkeypatch.setattr(api, "_REPEATS", {})
    cases = [
        (lambda: randn(37, 100, scale=3.0), None),
        (lambda: randn(2, 3, 300, dtype=torch.bfloat16), torch.float32),  # 3-D, another output dtype
        (lambda: randn(40, 4100)[:, 1:].contiguous(), None),  # one row a program (no persistent grid)
    ]
    for make, out_dtype in cases:
        first = make()
        assert_close(flashlite.softmax(first, dtype=out_dtype), softmax_ref(first))
        before = len(repeats)
        second = make()  # fresh data, same signature
        y = flashlite.softmax(second, dtype=out_dtype)
        assert len(repeats) == before + 1, "the second call did not repeat the first launch"
        assert y.dtype == (out_dtype or second.dtype) and y.shape == second.shape
        assert_close(y, softmax_ref(second))
    # Signatures that differ get their own first call; non-last dims and strided views take the general path.
    base = randn(37 * 100 + 1)
    shifted = base[1:].view(37, 100)  # 4 bytes past 16-byte alignment: another specialization
    count = len(repeats)
    assert_close(flashlite.softmax(shifted), softmax_ref(shifted))
    assert len(repeats) == count
    x = randn(6, 50)
    for _ in range(2):
        assert_close(flashlite.softmax(x, dim=0), softmax_ref(x, dim=0))
        assert_close(flashlite.softmax(x[:, ::2]), softmax_ref(x[:, ::2]))
    assert len(repeats) == count
    # clear_plans forgets the repeated launches too: the next call of a seen signature plans afresh.
    seen = randn(37, 100, scale=3.0)
    api.clear_plans()
    assert_close(flashlite.softmax(seen), softmax_ref(seen))
    assert len(repeats) == count and len(api._REPEATS) == 1


def test_zeroed_slots_alternate_a_pair_of_buffers_per_stream(monkeypatch):
    # Host logic of partials.zeroed_slots, with CPU tensors: each launch must find its slots zero
    # although none is zeroed between launches (the "kernel" below zeroes what it is told to clear
    # and leaves its own slots published), across a capacity that grows, a launch that does not
    # happen, and two streams.
    stream = [7]
    monkeypatch.setattr(partials, "current_stream", lambda index: stream[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(partials, "_SLOT_PAIRS", {})
    seen = []

    def kernel(slots, clear, n_clear):
        assert (slots == 0).all(), "a launch found slots published by an earlier one"
        assert n_clear % partials.SLOTS_ALIGN == 0 and n_clear == clear.numel() >= slots.numel()
        slots.fill_(12345)  # published, left so
        clear[:n_clear] = 0
        seen.append(slots.data_ptr())
        return True

    cpu = torch.device("cpu")
    for n_slots in (5, 5, 40, 3, 40, 17):
        assert partials.zeroed_slots(cpu, n_slots, kernel) is True
    assert seen[0] != seen[1] and seen[-1] != seen[-2]  # one buffer, then the other
    before = list(seen)
    assert partials.zeroed_slots(cpu, 8, lambda *a: False) is False  # nothing launched: the same buffer next
    partials.zeroed_slots(cpu, 8, kernel)
    assert seen[-1] != before[-1]
    stream[0] = 8  # another stream: its own pair
    partials.zeroed_slots(cpu, 8, kernel)
    assert len(partials._SLOT_PAIRS) == 2
