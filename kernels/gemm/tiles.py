"""Tile pieces of our Triton GEMM kernels, inlined into them: the grouped order of output tiles
(``grouped_tile``), one reduction chunk's dot (``dot_chunk``) and a whole [BLOCK_M, BLOCK_N] tile of
x @ W^T loaded through TMA descriptors (``matmul_tile``), and that tile of a program with its bias added
(``linear_tile``; ``grouped_linear_tile`` in the grouped order), to which each forward kernel adds its
epilogue."""

import triton
import triton.language as tl

__all__ = [
    "MATMUL_TILE_DESCRIPTORS",
    "dot_chunk",
    "grouped_linear_tile",
    "grouped_tile",
    "linear_tile",
    "matmul_tile",
]


@triton.jit
def grouped_tile(pid, num_pid_a, num_pid_b, GROUP: tl.constexpr):
    """(pid_a, pid_b) of a 1-D program id, in groups of GROUP rows of tiles (L2 reuse of the B operand)."""
    num_pid_in_group = GROUP * num_pid_b
    group_id = pid // num_pid_in_group
    first_pid_a = group_id * GROUP
    group_size = min(num_pid_a - first_pid_a, GROUP)
    pid_a = first_pid_a + (pid % num_pid_in_group) % group_size
    pid_b = (pid % num_pid_in_group) // group_size
    return pid_a, pid_b


@triton.jit
def dot_chunk(acc, a, b, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc + a @ b for one reduction chunk (operands cast to fp32 first in the interpreter)."""
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


# The descriptor arguments of a kernel built on ``matmul_tile`` and the tile dims of their block shapes, which
# must match its loads (``kernels.gemm.tuning.autotuned`` sets them per config).
MATMUL_TILE_DESCRIPTORS = {"x_desc": ("BLOCK_M", "BLOCK_K"), "w_desc": ("BLOCK_N", "BLOCK_K")}


@triton.jit
def matmul_tile(
    x_desc, w_desc, off_m, off_n, K,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The [BLOCK_M, BLOCK_N] fp32 tile of x @ W^T whose first row is off_m and first column off_n, reduced
    over K in BLOCK_K chunks loaded through TMA descriptors (x_desc of x [M, K] in [BLOCK_M, BLOCK_K] blocks,
    w_desc of W [N, K] in [BLOCK_N, BLOCK_K] blocks; ``kernels.gemm.layout.tma_descriptor``): rows,
    columns and the K tail past the tensors' ends read 0, with no mask. Inlined (through ``linear_tile``)
    into the GEMM kernels of linear_act, gated_linear and cross, which add their own epilogues.

    Why descriptors: pointer loads need a mask on the K tail where K is not a multiple of BLOCK_K, which
    slows the whole loop on the odd widths the model has (367, 479), and they are no faster where K divides
    evenly. Descriptors are made on the host, which is faster than making them in the kernel and needs no
    per-thread Triton allocator."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = x_desc.load([off_m, k])
        b = w_desc.load([off_n, k])
        acc = dot_chunk(acc, a, b.T, DOT_FP32, INPUT_PRECISION)
    return acc


@triton.jit
def linear_tile(
    x_desc, w_desc, b_ptr, pid_m, pid_n, M, N, K,
    HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Output tile (pid_m, pid_n) of x @ W^T + b, for a forward kernel's epilogue: (acc [BLOCK_M, BLOCK_N]
    fp32 with the bias b [N] added where HAS_BIAS, rows [BLOCK_M] and cols [BLOCK_N] int64 indices of the
    tile (M * N can pass 2**31), mask [BLOCK_M, BLOCK_N] of its in-bounds elements)."""
    acc = matmul_tile(
        x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, K,
        DOT_FP32, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return acc, rows, cols, (rows < M)[:, None] & mask_n[None, :]


@triton.jit
def grouped_linear_tile(
    x_desc, w_desc, b_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """``linear_tile`` of this program's output tile, the tiles in ``grouped_tile`` order (a 1-D grid of
    cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) programs): (acc, rows, cols, mask) as linear_tile's, and the tile's
    column index pid_n."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    acc, rows, cols, mask = linear_tile(
        x_desc, w_desc, b_ptr, pid_m, pid_n, M, N, K,
        HAS_BIAS, DOT_FP32, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    return acc, rows, cols, mask, pid_n
