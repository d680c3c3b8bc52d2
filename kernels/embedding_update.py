"""The optimizer update of table-batched embeddings, applied by the lookup's backward (``kernels.embedding``)
to the rows a batch touched, in place, without a table-sized gradient.

Math (letters of dlrm/model/dlrm.py: D embedding dim, R total rows; index [B, F] the rows the lookup read)
    g_r = sum of dout[b, f, :] over the (b, f) with index[b, f] = r   (repeated ids summed)
    "sgd"              w_r -= lr * g_r
    "adagrad"          s_r += g_r^2 (elementwise, state [R, D]);     w_r -= lr * g_r / (sqrt(s_r) + eps)
    "rowwise_adagrad"  s_r += mean(g_r^2) (one value per row, [R]);  w_r -= lr * g_r / (sqrt(s_r) + eps)
    "sgd" and "adagrad" are torch.optim.SGD / torch.optim.Adagrad (lr_decay 0, initial accumulator 0) on
    sparse gradients; "rowwise_adagrad" is FBGEMM/TorchRec's EXACT_ROWWISE_ADAGRAD. Only touched rows change.

Dtypes: weights fp32 or bf16 (updates computed in fp32, rounded once); state fp32 ([R, D] for adagrad, [R]
for rowwise_adagrad, empty for sgd); the gradient of any float dtype; lr a one-element fp32 tensor that
the kernels load (a schedule writes it in place between steps; CUDA-graph replays read the current value).

Rounding of bf16 weights: to nearest, or, given `rounding` (a [2] int64 device tensor: seed, count),
stochastically as FBGEMM rounds its fp16/bf16 weights: 16 uniform random bits are added to the updated fp32
value's bit pattern below the bf16 mantissa and the low 16 bits dropped, so w rounds up to the next bf16
value with probability (w - lower) / (upper - lower) and E[rounded] = w (unbiased: a table whose updates are
smaller than half a bf16 step still moves on average, where rounding to nearest would drop them). The bits
are a keyed hash of each pair of neighbouring elements (`_random_bits`: pair r * BLOCK_D / 2 + d // 2, key
(seed, count)), 16 of its 32 bits each element: fresh for every element and every count, the same for the
same (seed, count). The kernels only read the tensor; its owner advances the count in place once a step
(dlrm.optim.RunOptimizer.step), so every CUDA-graph replay draws new bits and a run resumed with its count
continues the same stream. A NaN stays NaN.

How the update runs:
- "sgd" with fp32 weights: one kernel, atomic adds of -lr * dout straight into the touched rows. Atomic adds
  sum repeated ids exactly (up to fp32 summation order, which varies run to run on a GPU), as SGD needs
  nothing but the sum. A program takes one column's lookups (one table, or one bag column); in a batch of
  at least SGD_HOT_BATCH samples, a block whose rows span fewer than SGD_HOT_ROWS (a small table) sums
  each row's lookups first and adds the sums, one atomic add a touched row rather than one a lookup.
  `in_order` sends it down the sorted path below instead (the same bits every run).
- otherwise (adagrad, rowwise_adagrad, bf16 weights): the non-linear update needs each row's full sum
  first. The B*F indices are sorted (torch.sort, on int32 keys where the rows fit: half the radix passes);
  sorted positions with the same row form a segment (numbered by a scan, in int32 where the lookups fit), and
  a small kernel writes where each segment starts.
  A segment of at most SHORT_SEGMENT positions (most rows of a large table) is summed where its row is
  stepped: the step kernel takes a few segments at a time, adds their positions' gradients in sorted order
  in registers, and reads and writes the row's weights and state once. Longer segments (small tables, hot
  rows) are summed first, in levels. Level 0 cuts the sorted positions into chunks of CROSSING_CHUNK and walks
  each in blocks of 32: a long segment cannot lie inside a block, so a block adds only to its first and last
  segments (two masked column sums; one plain column sum where the block lies in one segment, as most blocks
  of a hot row do), and the program carries the open segment's sum from block to block. A long segment that
  lies inside the chunk is stored in its slot of a [B*F, D] fp32 buffer; the chunk's first and last segments,
  where they cross its edges, leave a partial sum each in the next level's list. A level >= 1 sums its blocks
  of 32 partials by a 0/1 matrix product on the tensor cores, stores the sum of each segment that lies inside
  the block in its slot, and passes the partials of a segment that crosses a block edge on to the next level
  (a level holds at most two partials per block of the one before), until a level fits in one block. Only the
  chunks and blocks holding a long segment are summed: two small kernels and one scan a level list them on the
  device (with each crossing partial's place in the next level) and the summing kernels' persistent programs
  stride over the list. The step kernel then reads a long segment's sum from its slot. No atomics: the sums,
  and so the whole update, are the same bits on every run. Memory is O(B F D), never O(R D).
- `drop_last_row` (a row-wise shard's padding row, dlrm.parallel.sharded_bags): the lookups of the last row
  take no part. The SGD kernel masks them; on the sorted path they sort last, and their segment is given no
  positions, so no kernel reads their gradients and the step kernel leaves the row as it is. They are still
  sorted with the others.
Fixed shapes throughout (no torch.unique, no host sync), so a step can be captured in a CUDA graph.
The PyTorch reference is ``embedding_update_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.launch import INTERPRETED, use_triton

__all__ = [
    "OPTIMIZERS",
    "block_sizes",
    "check_lr",
    "check_optimizer",
    "check_rounding",
    "column_block",
    "embedding_update",
    "embedding_update_ref",
    "launch_update",
    "optimizer_state",
    "sorted_segments",
    "update_lr",
]

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
# Sorted positions a segment-sum program reduces: its [SUM_BLOCK_N, SUM_BLOCK_N] 0/1 matrix stays in
# registers (64 spills them on an H200; tl.dot needs at least 16).
SUM_BLOCK_N = 32
# Sorted positions level 0's summing program takes at a time (`_crossing_sums_kernel`), SUM_BLOCK_N at a
# time, carrying a long segment's sum from block to block: a long segment inside a chunk is summed there
# and stored once, and only the segments that cross a chunk's edge pass partial sums to the next level.
CROSSING_CHUNK = 256
# The summing kernels' persistent programs an SM, their warps and software-pipelining stages; both wait on
# their gathers, so more programs than fit at once measured faster. Level 0's (`_crossing_sums_kernel`),
# which gathers every lookup's gradient of the long segments: one warp, 16 an SM, chunks of 256 (H200,
# bench_embedding_bag's rowwise_adagrad step, pareto bags over 40M-row tables, bf16 weights and gradient:
# 1 warp 16 / 8 an SM 3.109 / 3.131 ms, 2 warps 8 an SM 4.145; chunks of 128 / 256 / 512 3.140 / 3.109 /
# 3.198). The levels >= 1, whose blocks of partials are 1/16 of level 0's positions or fewer, keep the
# settings measured when one kernel summed every level by 0/1 products (2 an SM 9.08 ms, 8 an SM 7.47 with
# 4 warps; 2 warps faster than 4); Triton's pipelining of the loop (asynchronous copies of the gathers
# through shared memory, 3 stages by default) measured slower than none (6.35 ms against 5.92).
CROSSING_PROGRAMS_PER_SM = 16
CROSSING_WARPS = 1
SUM_PROGRAMS_PER_SM = 8
SUM_WARPS = 2
SUM_STAGES = 1
# Segments of at most SHORT_SEGMENT sorted positions (most rows of large tables) are summed by the step
# kernel in a loop over their positions, never stored; longer ones (small tables, hot rows) by the summing
# kernels' levels, through the [N, D] buffer.
SHORT_SEGMENT = 32
# Chunks a program of level 0's listing (`_level_flags_kernel`) takes: each waits on a chain of dependent
# loads (a position's segment, then that segment's start) for each of its chunk's blocks, so the chunks
# spread over many programs (H200, bench_embedding_bag's rowwise_adagrad step: 1024 / 256 / 128 / 64
# chunks a program 3.040 / 2.961 / 2.946 / 2.951 ms).
FLAGS_BLOCK = 128
# Segments a step program takes at a time, and each optimizer's (warps, persistent programs an SM) of the
# step kernel. The kernel waits on its loads: more programs than fit at once measured faster. Adagrad, whose
# rows carry a D-wide fp32 state, takes 2 warps, 64 programs an SM (H200, dlrm_dcnv2's uniform bags, 4M-row
# cap, bf16 weights, the bag lookup and update: 6.07 ms; 1 warp 6.81; 128 / 256 an SM 6.20 / 6.27; 4 warps,
# and 2 or 8 segments a program, slower). SGD and rowwise_adagrad take one warp, 128 an SM
# (bench_embedding_bag's rowwise_adagrad step, pareto bags over 40M-row tables: 2.737 ms; 2 warps 2.753;
# 2 warps 64 an SM 2.774; 1 warp 256 an SM 2.735).
STEP_SEGMENTS = 4
STEP_LAUNCH = {"adagrad": (2, 64), "rowwise_adagrad": (1, 128), "sgd": (1, 128)}


# -- Kernels -----------------------------------------------------------------------------------------
# One set for one-id lookups and for pooled bags (kernels/embedding_bag_update.py): POOLED (a constexpr,
# resolved when the kernel compiles) picks how a lookup's gradient is read.


@triton.jit
def _lookup_grad(
    grad_ptr, features_ptr, scales_ptr, lookup, mask_n, mask, d, S, D, stride_b, stride_f,
    POOLED: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """The fp32 gradient [BLOCK_N, BLOCK_D] of lookups `lookup`: dout[lookup] (dout [N, D]); POOLED: the
    pooled gradient dout[b, f(c)] (dout [B, F, D] with strides (stride_b, stride_f, 1), lookup = b * S + c),
    where SCALED scaled by its bag's 1 or 1/k."""
    if POOLED:
        b = lookup // S
        column = lookup % S
        feature = tl.load(features_ptr + column, mask=mask_n, other=0)
        row = b * stride_b + feature * stride_f
        grad = tl.load(grad_ptr + row[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            grad *= tl.load(scales_ptr + column, mask=mask_n, other=0.0)[:, None]
    else:
        grad = tl.load(grad_ptr + lookup[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    return grad


@triton.jit
def column_block(program, columns, B, BLOCK_B: tl.constexpr):
    """(column, b [BLOCK_B] int64, mask_b, lookup [BLOCK_B] int64) of program `program` in the columns-
    fastest walk over [B, columns] lookups that the one-hot lookup (kernels.embedding) and the SGD kernel
    share: column program % columns, samples b from program // columns * BLOCK_B (neighbouring programs
    read neighbouring lookups), lookup b * columns + column, mask_b b < B."""
    column = program % columns
    b = (program // columns).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    return column, b, b < B, b * columns + column


@triton.jit(do_not_specialize=["B", "dropped_row"])
def _sgd_kernel(
    # pointers
    index_ptr,  # [B * S] global rows (bags': int32 or int64), lookup b * S + c (S: F one-hot, sum k_f bags)
    grad_ptr,  # [B * S, D] dout ([B, F, D] where POOLED, strides (stride_b, stride_f, 1)), any float dtype
    features_ptr,  # POOLED: [S] int64 feature of each column (not read otherwise)
    scales_ptr,  # SCALED: [S] fp32 pooling scale of each column (not read otherwise)
    weights_ptr,  # [R, D] fp32, updated in place
    lr_ptr,  # [] fp32 learning rate, read at launch time (a schedule changes it between graph replays)
    # sizes
    B,
    S,
    D,
    stride_b,
    stride_f,
    dropped_row,  # the row whose lookups add nothing (R - 1 where `launch_update` drops it), else -1
    # meta-parameters
    POOLED: tl.constexpr,
    SCALED: tl.constexpr,  # POOLED with a scale other than 1 (mean pooling)
    HOT: tl.constexpr,
    HOT_ROWS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """SGD by atomic adds of -lr * dout, a program for BLOCK_B samples of one column (program p: column
    p % S, samples from p // S * BLOCK_B; neighbouring programs read neighbouring index entries).
    Where HOT and the block's rows span fewer than HOT_ROWS (a small table: a few rows take every lookup),
    it sums each row's lookups first, as the product of the 0/1 matrix hit[r, b] = (index[b] == low + r)
    with the steps (an IEEE fp32 dot), and adds one sum a touched row: atomic adds to one address
    serialize, and kaggle's seven tables under 64 rows took more of the update than its other nineteen."""
    _, b, mask_b, lookup = column_block(tl.program_id(0), S, B, BLOCK_B)
    d = tl.arange(0, BLOCK_D)
    mask_d = d < D
    index = tl.load(index_ptr + lookup, mask=mask_b, other=0).to(tl.int64)  # bags' may be int32
    mask_b = mask_b & (index != dropped_row)  # its gradient not even read
    mask = mask_b[:, None] & mask_d[None, :]
    grad = _lookup_grad(
        grad_ptr, features_ptr, scales_ptr, lookup, mask_b, mask, d, S, D, stride_b, stride_f, POOLED, SCALED
    )
    step = -tl.load(lr_ptr).to(tl.float32) * grad
    low = tl.min(tl.where(mask_b, index, 2**62), axis=0)
    high = tl.max(tl.where(mask_b, index, -1), axis=0)
    if HOT and high - low < HOT_ROWS:
        r = tl.arange(0, HOT_ROWS)
        hit = ((index - low)[None, :] == r[:, None]) & mask_b[None, :]  # [HOT_ROWS, BLOCK_B]
        sums = tl.dot(hit.to(tl.float32), step, input_precision="ieee")
        touched = tl.max(hit.to(tl.int32), axis=1) > 0
        rows = weights_ptr + (low + r)[:, None] * D + d[None, :]
        tl.atomic_add(rows, sums, mask=touched[:, None] & mask_d[None, :])
    else:
        tl.atomic_add(weights_ptr + index[:, None] * D + d[None, :], step, mask=mask)


@triton.jit
def _block_segment_sums(segment, partial, SPLIT_BF16: tl.constexpr):
    """[BLOCK_N, BLOCK_D] fp32: at each position, the sum of `partial` [BLOCK_N, BLOCK_D] fp32 over the
    block's positions of its segment (`segment` [BLOCK_N]), as the product of the 0/1 matrix same[i, j] =
    (segment_i == segment_j) with the partials on the tensor cores. Each partial is split into three bf16
    pieces hi + mid + lo that hold its value exactly, three dots: every product is exact and only the fp32
    accumulation rounds, as an fp32 sum does (a segmented scan in registers costs four times as long, an
    IEEE fp32 dot twice). SPLIT_BF16 False (the interpreter, whose bf16 dots are wrong): one IEEE fp32 dot."""
    if not SPLIT_BF16:
        same = (segment[:, None] == segment[None, :]).to(tl.float32)
        return tl.dot(same, partial, input_precision="ieee")
    same = (segment[:, None] == segment[None, :]).to(tl.bfloat16)
    hi = partial.to(tl.bfloat16)
    rest = partial - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    sums = tl.dot(same, lo)
    sums = tl.dot(same, mid, sums)
    return tl.dot(same, hi, sums)


@triton.jit
def _mix32(x):
    """lowbias32 of uint32 `x` (any shape): a bijection of the 32-bit words in which flipping any input bit
    flips each output bit with probability close to 1/2 (C. Wellons, "Prospecting for Hash Functions",
    2018: xor-shift 16, multiply, xor-shift 15, multiply, xor-shift 16)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _random_bits(seed, count, row, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BLOCK_N, BLOCK_D] uint32, 16 random bits each, for the elements (r, d) of rows `row` [BLOCK_N] int64:
    the pair p = r * BLOCK_D / 2 + d // 2 of neighbouring elements hashed with the key of (seed, count),
    h = mix(mix(p_lo ^ k0) ^ p_hi ^ k1) (`_mix32`; p_lo, p_hi the low and high 32 bits of p; k0, k1 two
    words of (seed, count), mixed once a program), its high 16 bits for the even element, its low 16 for
    the odd one. A hash a pair, not a counter-based generator such as Philox4x32-10, whose call gives 128
    bits that 8 elements share through cross-lane shuffles: on an H200 that made the bf16 update of the
    MLPerf bags markedly slower than rounding to nearest; the pair's two elements lie in one thread."""
    seed_lo, seed_hi = (seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    count_lo, count_hi = (count & 0xFFFFFFFF).to(tl.uint32), ((count >> 32) & 0xFFFFFFFF).to(tl.uint32)
    k0 = _mix32(seed_lo ^ _mix32(count_lo ^ _mix32(count_hi)))
    k1 = _mix32(seed_hi ^ _mix32(k0 ^ 0x9E3779B9))
    first = row * (BLOCK_D // 2)  # [BLOCK_N] int64: each row's first pair; a row's pairs share its high word
    low = (first & 0xFFFFFFFF).to(tl.uint32)[:, None] | tl.arange(0, BLOCK_D // 2)[None, :].to(tl.uint32)
    high = (((first >> 32) & 0xFFFFFFFF).to(tl.uint32) ^ k1)[:, None]
    h = _mix32(_mix32(low ^ k0) ^ high)
    return tl.join(h >> 16, h & 0xFFFF).reshape(BLOCK_N, BLOCK_D)


@triton.jit
def _stochastic_round_bf16(x, bits):
    """x [BLOCK_N, BLOCK_D] fp32 rounded stochastically to bf16 values (returned as fp32, its low 16 bits
    zero): `bits` (16 random bits an element, `_random_bits`) added to x's bit pattern, then truncated
    (module docstring)."""
    pattern = x.to(tl.uint32, bitcast=True) + bits
    rounded = (pattern & 0xFFFF0000).to(tl.float32, bitcast=True)
    # A NaN's pattern plus the bits may carry out of the exponent (a negative NaN would wrap to a zero).
    return tl.where(x != x, x, rounded)


@triton.jit
def _load_rows(row, mask, valid, weights_ptr, state_ptr, D, OPTIMIZER: tl.constexpr, BLOCK_D: tl.constexpr):
    """(weights [BLOCK_N, BLOCK_D] fp32, state: [BLOCK_N, BLOCK_D] for adagrad, [BLOCK_N] for
    rowwise_adagrad, the weights again for sgd) of the rows `row` [BLOCK_N] int64 where `mask` holds."""
    d = tl.arange(0, BLOCK_D)
    weights = tl.load(weights_ptr + row[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if OPTIMIZER == "adagrad":
        state = tl.load(state_ptr + row[:, None] * D + d[None, :], mask=mask, other=0.0)
    elif OPTIMIZER == "rowwise_adagrad":
        state = tl.load(state_ptr + row, mask=valid, other=0.0)
    else:
        state = weights
    return weights, state


@triton.jit
def _step_rows(
    row, grad, weights, state, mask, valid, weights_ptr, state_ptr, lr, seed, count, D, eps,
    OPTIMIZER: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The optimizer step (module docstring) of the rows `row` [BLOCK_N] int64 whose gradient sums are
    complete in `grad` [BLOCK_N, BLOCK_D] fp32, from their `weights` and `state` (`_load_rows`), where
    `mask` [BLOCK_N, BLOCK_D] holds (its rows: `valid` [BLOCK_N]): the new weights and state stored. `lr`
    fp32; STOCHASTIC: the rounding's `seed` and `count` (`_random_bits`)."""
    d = tl.arange(0, BLOCK_D)
    if OPTIMIZER == "sgd":
        step = lr * grad
    elif OPTIMIZER == "adagrad":
        state += grad * grad
        tl.store(state_ptr + row[:, None] * D + d[None, :], state, mask=mask)
        step = lr * grad / (tl.sqrt(state) + eps)
    else:
        state += tl.sum(tl.where(mask, grad * grad, 0.0), axis=1) / D
        tl.store(state_ptr + row, state, mask=valid)
        step = lr * grad / (tl.sqrt(state)[:, None] + eps)
    updated = weights - step
    if STOCHASTIC:
        updated = _stochastic_round_bf16(updated, _random_bits(seed, count, row, BLOCK_N, BLOCK_D))
    tl.store(weights_ptr + row[:, None] * D + d[None, :], updated.to(weights_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gradient_offsets(
    row, mask, scales_ptr, F, D, stride_b, stride_f, POOLED: tl.constexpr, SCALED: tl.constexpr
):  # fmt: skip
    """(element offset [BLOCK] int64 of each gradient row `row` [BLOCK] (int32 or int64) in dout, its scale
    [BLOCK] fp32): POOLED: row b * F + f of dout [B, F, D] (strides stride_b, stride_f, 1), where SCALED
    scaled by its bag's 1 or 1/k_f; otherwise row r of dout [*, D]. A scale of 1 is a constant: the
    multiplies by it compile away."""
    row = row.to(tl.int64)  # both branches return int64 offsets (a compiled function has one return type)
    scale = tl.full(row.shape, 1.0, tl.float32)
    if POOLED:
        sample = (row.to(tl.int32) // F).to(tl.int64)  # B * F < 2**31: an int32 division
        feature = row - sample * F
        if SCALED:
            scale = tl.load(scales_ptr + feature, mask=mask, other=0.0)
        return sample * stride_b + feature * stride_f, scale
    return row * D, scale


@triton.jit
def _block_positions(blocks_ptr, segment_ptr, i, count, N, BLOCK_N: tl.constexpr):
    """(block, positions [BLOCK_N] int64, their mask, segment [BLOCK_N]) of a summing kernel's i-th
    listed block: segments -1 past N. Past the list's `count` blocks: block 0, every position masked (a
    prefetch past a program's last block)."""
    listed = i < count
    block = tl.load(blocks_ptr + i, mask=listed, other=0)
    p = block * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_p = listed & (p < N)
    return block, p, mask_p, tl.load(segment_ptr + p, mask=mask_p, other=-1)


@triton.jit
def _gather(ptr, offset, mask, OFFSET32: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BLOCK, BLOCK_D] the rows of `ptr` at element offsets `offset` [BLOCK] int64, columns 0 .. BLOCK_D - 1,
    where `mask` [BLOCK, BLOCK_D] holds, 0 elsewhere. OFFSET32: every offset below 2**31, so the
    [BLOCK, BLOCK_D] addresses are formed in 32 bits (half the registers; measured faster, H200)."""
    d = tl.arange(0, BLOCK_D)
    if OFFSET32:
        return tl.load(ptr + (offset.to(tl.int32)[:, None] + d[None, :]), mask=mask, other=0.0)
    return tl.load(ptr + offset[:, None] + d[None, :], mask=mask, other=0.0)


@triton.jit
def _is_long(starts_ptr, segment, mask, SHORT: tl.constexpr):
    """Whether each segment of `segment` (any shape; where `mask` holds) has more than SHORT sorted
    positions, from its start and the next one's (`_segment_starts_kernel`'s `starts`)."""
    length = tl.load(starts_ptr + segment + 1, mask=mask, other=0) - tl.load(
        starts_ptr + segment, mask=mask, other=0
    )
    return length > SHORT


@triton.jit
def _finish(segment, acc, chunk_first, chunk_last, came_in, goes_on, partial_ptr, sums_ptr, D, d, mask_d):
    """Store the sum `acc` [BLOCK_D] fp32 of a long segment's positions in a chunk (none where `segment` is
    -1): the chunk's first segment that came in from an earlier chunk, or its last that goes on into a later
    one, to its place in level 1 (`came_in`, `goes_on`: dest, -1 where not); any other, complete here, to
    its own slot of `sums`."""
    if segment >= 0:
        if (segment == chunk_first) & (came_in >= 0):
            tl.store(partial_ptr + came_in * D + d, acc, mask=mask_d)
        elif (segment == chunk_last) & (goes_on >= 0):
            tl.store(partial_ptr + goes_on * D + d, acc, mask=mask_d)
        else:
            tl.store(sums_ptr + segment.to(tl.int64) * D + d, acc, mask=mask_d)


@triton.jit(do_not_specialize=["N"])
def _crossing_sums_kernel(
    # pointers
    rows_ptr,  # [N] int32 (POOLED) or int64: row of grad read at each sorted position
    segment_ptr,  # [N] int32 or int64: segment (distinct row, in sorted order) of each sorted position
    starts_ptr,  # [N + 1] int64: each segment's first sorted position (`_segment_starts_kernel`)
    grad_ptr,  # [*, D] dout rows ([B, F, D] where POOLED), any float dtype
    scales_ptr,  # SCALED: [F] fp32 pooling scale of each feature (not read otherwise)
    dest_ptr,  # [2 * chunks] int64: where level 1 holds a chunk's first / last partial (or -1)
    partial_ptr,  # [M, D] fp32: level 1's values
    sums_ptr,  # [N, D] fp32: each long segment's sum, stored here where it lies inside a chunk
    chunks_ptr,  # [chunks] int64: in its first `count` places, the chunks to sum (`_level_plan`)
    count_ptr,  # [1] int64: count
    # sizes
    N,
    F,
    D,
    stride_b,  # POOLED: dout's strides along B and F (it may be a view, e.g. a slice of a concatenation's
    stride_f,  # gradient: read in place, not copied); D's is 1
    # meta-parameters
    POOLED: tl.constexpr,
    SCALED: tl.constexpr,  # POOLED with a scale other than 1 (mean pooling)
    OFFSET32: tl.constexpr,  # every element of grad at an offset < 2**31: the gather's offsets in 32 bits
    SHORT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Level 0 of the segment sums, over the listed chunks of CHUNK sorted positions, BLOCK_N at a time. A
    long segment cannot lie inside a block of BLOCK_N <= SHORT positions, so only a block's first and last
    segments can be long: their gradients are gathered and each summed by a masked column sum in fp32. A
    program carries the open long segment's sum from block to block and stores it where the segment ends:
    in its slot of `sums` where it lies inside the chunk, else (the chunk's first segment, come in from an
    earlier chunk; its last, going on into a later one) to its place in level 1 (`dest`). A fixed order, no
    atomics. Persistent: the programs stride over the listed chunks, whose number only the device knows;
    a program loads each block's positions (segments, gradient rows) one block ahead, while it sums the
    block before, so that the block's gather can start at once."""
    d = tl.arange(0, BLOCK_D)
    mask_d = d < D
    count = tl.load(count_ptr)
    for i in range(tl.program_id(0), count, tl.num_programs(0)):
        start = tl.load(chunks_ptr + i) * CHUNK
        chunk = start // CHUNK
        end = tl.minimum(start + CHUNK, N)
        chunk_first = tl.load(segment_ptr + start)
        chunk_last = tl.load(segment_ptr + end - 1)
        came_in, goes_on = tl.load(dest_ptr + 2 * chunk), tl.load(dest_ptr + 2 * chunk + 1)
        acc = tl.zeros([BLOCK_D], tl.float32)
        open_segment = chunk_first * 0 - 1  # none, in the segments' dtype
        p = start + tl.arange(0, BLOCK_N).to(tl.int64)
        next_segment = tl.load(segment_ptr + p, mask=p < end, other=-1)
        next_row = tl.load(rows_ptr + p, mask=p < end, other=0)
        for block_start in range(start, end, BLOCK_N):
            p = block_start + tl.arange(0, BLOCK_N).to(tl.int64)
            mask_p = p < end
            segment, row = next_segment, next_row
            q = p + BLOCK_N
            next_segment = tl.load(segment_ptr + q, mask=q < end, other=-1)
            next_row = tl.load(rows_ptr + q, mask=q < end, other=0)
            last = tl.max(segment)  # positions are sorted, -1 past the chunk
            first = tl.min(tl.where(mask_p, segment, last))
            first_long = _is_long(starts_ptr, first, True, SHORT)
            last_long = _is_long(starts_ptr, last, True, SHORT)
            take = mask_p & (((segment == first) & first_long) | ((segment == last) & last_long))
            offset, scale = _gradient_offsets(
                row, take, scales_ptr, F, D, stride_b, stride_f, POOLED, SCALED
            )  # fmt: skip
            grad = _gather(grad_ptr, offset, take[:, None] & mask_d[None, :], OFFSET32, BLOCK_D)
            grad = grad.to(tl.float32) * scale[:, None]
            if first == last:  # most blocks of a long segment: one column sum, no masks (fewer instructions)
                first_sum = tl.sum(grad, axis=0)
                last_sum = first_sum
            else:
                first_sum = tl.sum(tl.where((segment == first)[:, None], grad, 0.0), axis=0)
                last_sum = tl.sum(tl.where((segment == last)[:, None], grad, 0.0), axis=0)
            # The open segment goes on into this block, or it ended at the block's edge.
            if first != open_segment:
                _finish(
                    open_segment, acc, chunk_first, chunk_last, came_in, goes_on, partial_ptr, sums_ptr, D,
                    d, mask_d,
                )  # fmt: skip
                acc = tl.zeros([BLOCK_D], tl.float32)
            acc += first_sum
            open_segment = tl.where(first_long, first, -1)
            if last != first:  # the first segment ends inside the block; the last one opens
                _finish(
                    open_segment, acc, chunk_first, chunk_last, came_in, goes_on, partial_ptr, sums_ptr, D,
                    d, mask_d,
                )  # fmt: skip
                acc = last_sum
                open_segment = tl.where(last_long, last, -1)
        _finish(
            open_segment, acc, chunk_first, chunk_last, came_in, goes_on, partial_ptr, sums_ptr, D, d, mask_d
        )  # fmt: skip


@triton.jit(do_not_specialize=["N", "SEGMENTS"])
def _segment_sum_kernel(
    # pointers
    segment_ptr,  # [N] int64: segment (distinct row, in sorted order) of each position of the level
    grad_ptr,  # [N, D] fp32: the level's partial sums
    sums_ptr,  # [SEGMENTS, D] fp32: each long segment's sum, stored by the level where it fits in a block
    dest_ptr,  # [2 * blocks] int64: where the next level holds a block's first / last partial (or -1)
    partial_ptr,  # [M, D] fp32: the next level's values
    blocks_ptr,  # [blocks] int64: in its first `count` places, the blocks to sum (`_level_plan`)
    count_ptr,  # [1] int64: count
    # sizes
    N,
    D,
    SEGMENTS,  # segments of level 0; a segment id at or past it marks an unused slot
    # meta-parameters
    SPLIT_BF16: tl.constexpr,  # the block's sums by exact bf16 pieces (False in the interpreter)
    OFFSET32: tl.constexpr,  # every element of grad at an offset < 2**31: the gather's offsets in 32 bits
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """A level >= 1 of the segment sums, persistent as `_crossing_sums_kernel` (positions loaded one block
    ahead)."""
    d = tl.arange(0, BLOCK_D)
    mask_d = (d < D)[None, :]
    count = tl.load(count_ptr)
    step = tl.num_programs(0)
    next_block, _, _, next_segment = _block_positions(
        blocks_ptr, segment_ptr, tl.program_id(0), count, N, BLOCK_N
    )
    for i in range(tl.program_id(0), count, step):
        block, segment = next_block, next_segment
        next_block, _, _, next_segment = _block_positions(
            blocks_ptr, segment_ptr, i + step, count, N, BLOCK_N
        )
        start = block * BLOCK_N
        p = start + tl.arange(0, BLOCK_N).to(tl.int64)
        mask_p = p < N
        mask = mask_p[:, None] & mask_d
        # An unused slot was never written (its buffer is not zeroed): read as zeros, since the block's
        # sums multiply every row by a 0/1 matrix and garbage (NaN) times 0 would reach the other rows.
        used = mask & (segment < SEGMENTS)[:, None]
        partial = _gather(grad_ptr, p * D, used, OFFSET32, BLOCK_D)
        # Each position's sum over its segment's positions in this block, in a fixed order (no atomics).
        sums = _block_segment_sums(segment, partial, SPLIT_BF16)
        following = tl.load(segment_ptr + p + 1, mask=p + 1 < N, other=-1)
        before_block = tl.load(segment_ptr + start - 1, mask=start > 0, other=-1)
        first, last = tl.load(segment_ptr + start), tl.max(segment)  # positions are sorted
        ends_here = mask_p & ((segment != following) | (p == start + BLOCK_N - 1))
        # A segment that began in an earlier block or goes on into a later one has partial sums in several
        # blocks: each block's partial goes to its place in the next level (`dest`, the launcher's), which
        # sums them the same way; a segment inside the block is complete, and stored here.
        came_in = (segment == first) & (first == before_block)
        crosses = came_in | ((segment == last) & (last == following))
        whole = ends_here & ~crosses & (segment < SEGMENTS)
        tl.store(sums_ptr + segment[:, None] * D + d[None, :], sums, mask=mask & whole[:, None])
        first_dest, last_dest = tl.load(dest_ptr + 2 * block), tl.load(dest_ptr + 2 * block + 1)
        dest = tl.where(came_in, first_dest, last_dest)
        placed = ends_here & crosses & (dest >= 0)
        tl.store(partial_ptr + dest[:, None] * D + d[None, :], sums, mask=mask & placed[:, None])


@triton.jit
def _position_grad(
    row, take, grad_ptr, scales_ptr, F, D, stride_b, stride_f, POOLED: tl.constexpr, SCALED: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """[BLOCK_S, BLOCK_D] fp32: the scaled gradient rows `row` [BLOCK_S] (`_gradient_offsets`) where
    `take` [BLOCK_S] holds, zeros elsewhere."""
    offset, scale = _gradient_offsets(row, take, scales_ptr, F, D, stride_b, stride_f, POOLED, SCALED)
    mask = take[:, None] & (tl.arange(0, BLOCK_D) < D)[None, :]
    return _gather(grad_ptr, offset, mask, False, BLOCK_D).to(tl.float32) * scale[:, None]


@triton.jit(do_not_specialize=["N", "last_row"])
def _segment_starts_kernel(
    segment_ptr,  # [N] int32 or int64: segment of each sorted position
    sorted_ptr,  # DROP_LAST: [N] int32 or int64 sorted global rows (not read otherwise)
    starts_ptr,  # [N + 1] int64 output: each segment's first sorted position, then N
    N,
    last_row,  # DROP_LAST: the weights' last row, R - 1
    DROP_LAST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """starts[s] = the first sorted position of segment s, and starts[S] = N after the last segment S - 1,
    so a segment's positions are starts[s] .. starts[s + 1] - 1; the places past S are not written.
    DROP_LAST: where the last segment is `last_row`'s (which sorts last), starts[S] = starts[S - 1]: that
    segment has no positions, so no kernel sums its lookups and the step kernel steps its row with a zero
    gradient, which leaves the row and its state as they are."""
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = p < N
    segment = tl.load(segment_ptr + p, mask=valid, other=0)
    previous = tl.load(segment_ptr + p - 1, mask=valid & (p > 0), other=-1)
    first = valid & (segment != previous)
    tl.store(starts_ptr + segment, p, mask=first)
    if DROP_LAST:
        dropped = tl.load(sorted_ptr + p, mask=valid, other=0) == last_row
        tl.store(starts_ptr + segment + 1, p, mask=first & dropped)
        tl.store(starts_ptr + segment + 1, p + 1, mask=(p == N - 1) & ~dropped)
    else:
        tl.store(starts_ptr + segment + 1, p + 1, mask=p == N - 1)


@triton.jit(do_not_specialize=["M", "K"])
def _level_flags_kernel(
    segment_ptr,  # [M] int32 or int64: the level's segment of each position, sorted
    starts_ptr,  # LEVEL0: [N + 1] int64 each segment's first sorted position (not read otherwise)
    flags_ptr,  # [2K] int64 output: the flags; LEVEL0: [3K], then each block's "listed"
    values_ptr,  # [2K] int64 output: each block's first and last segment
    M,
    K,  # blocks of BLOCK_N positions
    LEVEL0: tl.constexpr,
    SHORT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB: tl.constexpr,  # LEVEL0: the summing kernel's blocks of a chunk; SUB <= SHORT
    BLOCK: tl.constexpr,
):
    """For blocks k of BLOCK_N positions (level 0: chunks): flag 2k, its first segment began in an earlier
    block; flag 2k + 1, its last segment goes on into a later one (and did not come in); at level 0 only a
    long segment's (more than SHORT positions), and after the 2K flags whether chunk k holds a long segment,
    the chunks the summing kernel sums (one scan then takes both): one that does is the first or last
    segment of one of the chunk's blocks of SUB positions, since it cannot lie inside one."""
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = k < K
    begin = k * BLOCK_N
    end = tl.minimum(begin + BLOCK_N - 1, M - 1)
    first = tl.load(segment_ptr + begin, mask=mask, other=0)
    last = tl.load(segment_ptr + end, mask=mask, other=0)
    before = tl.load(segment_ptr + begin - 1, mask=mask & (begin > 0), other=-1)
    after = tl.load(segment_ptr + end + 1, mask=mask & (end + 1 < M), other=-1)
    came_in = (before == first) & (begin > 0)
    goes_on = (after == last) & (end + 1 < M) & ~(came_in & (first == last))
    if LEVEL0:
        came_in = came_in & _is_long(starts_ptr, first, mask, SHORT)
        goes_on = goes_on & _is_long(starts_ptr, last, mask, SHORT)
        listed = tl.zeros([BLOCK], tl.int1)
        for j in tl.static_range(BLOCK_N // SUB):
            sub_begin = begin + j * SUB
            sub_end = tl.minimum(sub_begin + SUB - 1, M - 1)
            inside = mask & (sub_begin < M)
            for edge in tl.static_range(2):
                at = sub_begin if edge == 0 else sub_end
                seg = tl.load(segment_ptr + at, mask=inside, other=0)
                listed = listed | (inside & _is_long(starts_ptr, seg, inside, SHORT))
        tl.store(flags_ptr + 2 * K + k, listed.to(tl.int64), mask=mask)
    tl.store(flags_ptr + 2 * k, came_in.to(tl.int64), mask=mask)
    tl.store(flags_ptr + 2 * k + 1, goes_on.to(tl.int64), mask=mask)
    tl.store(values_ptr + 2 * k, first, mask=mask)
    tl.store(values_ptr + 2 * k + 1, last, mask=mask)


@triton.jit(do_not_specialize=["K", "SEGMENTS"])
def _level_places_kernel(
    flags_ptr,  # [2K] int64 (LEVEL0: [3K]): `_level_flags_kernel`'s
    scan_ptr,  # their inclusive prefix sum, one scan over both parts at level 0
    values_ptr,  # [2K] int64: each block's first and last segment
    used_ptr,  # level >= 1: [1] int64, the positions of this level in use (the level before's places)
    dest_ptr,  # [2K] int64 output: the place of each flag in the next level, or -1
    next_ptr,  # [2K] int64 output: the next level's segment of each place
    places_ptr,  # [1] int64 output: the places in use
    blocks_ptr,  # [K] int64 output: the blocks to sum, in its first `count` places
    count_ptr,  # [1] int64 output: count
    K,
    SEGMENTS,  # segments of level 0; the unused places get SEGMENTS, SEGMENTS + 1, ...
    LEVEL0: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Each flagged place gets the next place in order and its segment there; the unused places after
    them segments of their own (>= SEGMENTS, never stored). The blocks to sum: at level 0 the listed
    ones, in order; at a level >= 1 its first blocks, up to its used positions."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = j < 2 * K
    flag = tl.load(flags_ptr + j, mask=mask, other=0) != 0
    place = tl.load(scan_ptr + j, mask=mask, other=0) - 1
    places = tl.load(scan_ptr + 2 * K - 1)
    tl.store(dest_ptr + j, tl.where(flag, place, -1), mask=mask)
    value = tl.load(values_ptr + j, mask=mask & flag, other=0)
    tl.store(next_ptr + place, value, mask=mask & flag)
    tl.store(next_ptr + j, SEGMENTS + j, mask=mask & (j >= places))
    block = mask & (j < K)
    if LEVEL0:
        listed = tl.load(flags_ptr + 2 * K + j, mask=block, other=0) != 0
        slot = tl.load(scan_ptr + 2 * K + j, mask=block, other=0) - places - 1
        tl.store(blocks_ptr + slot, j, mask=block & listed)
        count = tl.load(scan_ptr + 3 * K - 1) - places
    else:
        tl.store(blocks_ptr + j, j, mask=block)
        count = (tl.load(used_ptr) + BLOCK_N - 1) // BLOCK_N
    if tl.program_id(0) == 0:
        tl.store(places_ptr, places)
        tl.store(count_ptr, count)


@triton.jit(do_not_specialize=["N", "F", "eps"])
def _segment_step_kernel(
    # pointers
    starts_ptr,  # [N + 1] int64: each segment's first sorted position (`_segment_starts_kernel`)
    segment_ptr,  # [N] int32 or int64: segment of each sorted position (its last + 1: the segments)
    sorted_ptr,  # [N] int32 (rows < 2**31) or int64 sorted global rows
    rows_ptr,  # [N] int32 (POOLED) or int64: row of grad read at each sorted position
    grad_ptr,  # [*, D] dout rows ([B, F, D] where POOLED), any float dtype
    scales_ptr,  # SCALED: [F] fp32 pooling scale of each feature (not read otherwise)
    sums_ptr,  # [N, D] fp32: each long segment's sum (the summing kernels'); short ones' slots unused
    weights_ptr,  # [R, D] fp32/bf16, updated in place
    state_ptr,  # adagrad: [R, D] fp32; rowwise_adagrad: [R] fp32; sgd: unused
    lr_ptr,  # [] fp32 learning rate, read at launch time (a schedule changes it between graph replays)
    rounding_ptr,  # STOCHASTIC: [2] int64 (seed, count), read at launch time; not read otherwise
    # sizes
    N,
    F,
    D,
    stride_b,  # POOLED: dout's strides along B and F; D's is 1
    stride_f,
    # optimizer
    eps,
    # meta-parameters
    POOLED: tl.constexpr,
    SCALED: tl.constexpr,  # POOLED with a scale other than 1 (mean pooling)
    OPTIMIZER: tl.constexpr,
    STOCHASTIC: tl.constexpr,  # bf16 weights rounded stochastically (else to nearest, or fp32 as is)
    SHORT: tl.constexpr,  # segments of at most SHORT positions are summed here, longer ones read
    BLOCK_S: tl.constexpr,  # segments a program steps at a time
    BLOCK_D: tl.constexpr,
):
    """Each segment's row stepped once: a short segment's gradient summed here, position by position in
    sorted order (fp32), a long one's read from `sums`. Persistent: programs stride over the groups of
    BLOCK_S segments, whose number only the device knows."""
    segments = tl.load(segment_ptr + N - 1) + 1
    lr = tl.load(lr_ptr).to(tl.float32)
    seed, count = lr, lr  # not read unless STOCHASTIC
    if STOCHASTIC:
        seed, count = tl.load(rounding_ptr), tl.load(rounding_ptr + 1)
    d = tl.arange(0, BLOCK_D)
    mask_d = (d < D)[None, :]
    for group in range(tl.program_id(0), tl.cdiv(segments, BLOCK_S), tl.num_programs(0)):
        # int64 before the product (`group` is a Python int in the interpreter, int32 compiled).
        s = (tl.zeros([BLOCK_S], tl.int64) + group) * BLOCK_S + tl.arange(0, BLOCK_S)
        valid = s < segments
        start = tl.load(starts_ptr + s, mask=valid, other=0)
        length = tl.load(starts_ptr + s + 1, mask=valid, other=0) - start
        short = valid & (length <= SHORT)
        # Most segments hold one or two positions: their gradient rows, the row's weights and state and a
        # long segment's sum are loaded at once (three dependent rounds of loads, not one a position).
        row = tl.load(sorted_ptr + start, mask=valid, other=0).to(tl.int64)
        first = short & (length > 0)
        second = short & (length > 1)
        row0 = tl.load(rows_ptr + start, mask=first, other=0)
        row1 = tl.load(rows_ptr + start + 1, mask=second, other=0)
        mask = valid[:, None] & mask_d
        weights, state = _load_rows(row, mask, valid, weights_ptr, state_ptr, D, OPTIMIZER, BLOCK_D)
        long = (valid & ~short)[:, None] & mask_d
        grad = tl.load(sums_ptr + s[:, None] * D + d[None, :], mask=long, other=0.0)
        grad += _position_grad(
            row0, first, grad_ptr, scales_ptr, F, D, stride_b, stride_f, POOLED, SCALED, BLOCK_D
        )  # fmt: skip
        grad += _position_grad(
            row1, second, grad_ptr, scales_ptr, F, D, stride_b, stride_f, POOLED, SCALED, BLOCK_D
        )  # fmt: skip
        for j in range(2, tl.max(tl.where(short, length, 0))):
            take = short & (j < length)
            row_j = tl.load(rows_ptr + start + j, mask=take, other=0)
            grad += _position_grad(
                row_j, take, grad_ptr, scales_ptr, F, D, stride_b, stride_f, POOLED, SCALED, BLOCK_D
            )  # fmt: skip
        _step_rows(
            row, grad, weights, state, mask, valid, weights_ptr, state_ptr, lr, seed, count, D, eps,
            OPTIMIZER, STOCHASTIC, BLOCK_S, BLOCK_D,
        )  # fmt: skip


@triton.jit(do_not_specialize=["N"])
def _gradient_rows_kernel(
    order_ptr,  # [N] int64: the lookup at each sorted position
    features_ptr,  # [S] int64 feature of each column
    rows_ptr,  # [N] int32 output: the pooled gradient's row of each sorted position
    N,
    S,
    F,
    BLOCK: tl.constexpr,
):
    """The pooled gradient's row of each sorted position (lookup b * S + c reads row b * F + f(c)), in one
    pass instead of torch's division, remainder, gather, product and sum over the B*S positions."""
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = p < N
    lookup = tl.load(order_ptr + p, mask=mask, other=0)
    feature = tl.load(features_ptr + lookup % S, mask=mask, other=0)
    tl.store(rows_ptr + p, (lookup // S) * F + feature, mask=mask)


# -- Launchers ---------------------------------------------------------------------------------------


def block_sizes(d: int, n: int, elements: int = 4096) -> tuple[int, int]:
    """(BLOCK_D, rows per program) of the embedding kernels for width d and n rows: D padded to a power of
    two, about `elements` elements per program, at least 16 rows (fewer only where n is smaller)."""
    block_d = triton.next_power_of_2(d)
    return block_d, min(max(16, elements // block_d), triton.next_power_of_2(n))


def sums_by_atomics(optimizer: str, dtype: torch.dtype) -> bool:
    """Whether the fused update of weights of `dtype` sums a row's lookups by atomic adds, in whatever order
    a GPU's threads come (SGD on fp32 weights, unless `in_order`), rather than in sorted order, the same
    bits on every run (every other optimizer and dtype)."""
    return optimizer == "sgd" and dtype == torch.float32


def check_optimizer(optimizer: str) -> None:
    """Raises ValueError unless `optimizer` is one of OPTIMIZERS."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown embedding optimizer {optimizer!r}: expected one of {OPTIMIZERS}")


def optimizer_state(weights: Tensor, optimizer: str) -> Tensor:
    """Fresh (zero) optimizer state for `weights` [R, D]: [R, D] fp32 for "adagrad", [R] fp32 for
    "rowwise_adagrad", an empty tensor for "sgd"."""
    check_optimizer(optimizer)
    shape = {"sgd": (0,), "adagrad": tuple(weights.shape), "rowwise_adagrad": (weights.shape[0],)}[optimizer]
    return torch.zeros(shape, dtype=torch.float32, device=weights.device)


def check_lr(lr: Tensor, weights: Tensor) -> None:
    ok = isinstance(lr, Tensor) and lr.numel() == 1 and lr.dtype == torch.float32
    if not ok or lr.device != weights.device:
        got = f"{lr.dtype} {list(lr.shape)} on {lr.device}" if isinstance(lr, Tensor) else repr(lr)
        raise ValueError(f"lr must be a one-element fp32 tensor on {weights.device}, got {got}")


def update_lr(lr: Tensor | None, weights: Tensor, op: str) -> Tensor:
    """The learning rate a lookup's backward updates `weights` with: `lr` itself (checked as `check_lr`),
    or for None a zero one, allowed only where no update follows (weights without grad, or grad disabled).

    Raises:
        ValueError: lr None where backward updates the weights (the message names `op`), or lr not a
            one-element fp32 tensor on weights' device.
    """
    if lr is None:
        if weights.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{op}: lr is required when backward updates the weights")
        lr = torch.zeros((), dtype=torch.float32, device=weights.device)
    check_lr(lr, weights)
    return lr


def check_rounding(rounding: Tensor | None, weights: Tensor) -> None:
    """Raises ValueError unless `rounding` is None or a [2] int64 tensor (seed, count) on weights' device."""
    if rounding is None:
        return
    ok = isinstance(rounding, Tensor) and rounding.shape == (2,) and rounding.dtype == torch.int64
    if not ok or rounding.device != weights.device:
        got = (
            f"{rounding.dtype} {list(rounding.shape)} on {rounding.device}"
            if isinstance(rounding, Tensor)
            else repr(rounding)
        )
        raise ValueError(f"rounding must be a [2] int64 tensor (seed, count) on {weights.device}, got {got}")


def _check_update(weights: Tensor, state: Tensor, index: Tensor, grad: Tensor, optimizer: str) -> None:
    if optimizer == "adagrad" and tuple(state.shape) != tuple(weights.shape):
        raise ValueError(f"adagrad state must be {list(weights.shape)}, got {list(state.shape)}")
    if optimizer == "rowwise_adagrad" and tuple(state.shape) != (weights.shape[0],):
        raise ValueError(f"rowwise_adagrad state must be [{weights.shape[0]}], got {list(state.shape)}")
    if optimizer != "sgd" and (state.dtype != torch.float32 or not state.is_contiguous()):
        raise ValueError(f"optimizer state must be contiguous fp32, got {state.dtype}")
    if index.dtype != torch.int64 or grad.shape != (*index.shape, weights.shape[1]):
        raise ValueError(
            f"grad {list(grad.shape)} must be index {list(index.shape)} + [D={weights.shape[1]}], "
            f"index int64 (got {index.dtype})"
        )


def embedding_update(
    weights: Tensor,
    state: Tensor,
    index: Tensor,
    grad: Tensor,
    optimizer: str,
    lr: Tensor,
    eps: float,
    rounding: Tensor | None = None,
    in_order: bool = False,
) -> None:
    """Apply one optimizer step to the rows of `weights` (and `state`) that `index` touched, in place.

    Args:
        weights: [R, D] fp32/bf16 table-batched weights (contiguous), updated in place.
        state: optimizer state from `optimizer_state` (fp32), updated in place.
        index: [B, F] (or any shape) int64 global rows looked up, as returned by the lookup.
        grad: index.shape + [D], gradient of the looked-up vectors (any float dtype).
        optimizer: "sgd", "adagrad" or "rowwise_adagrad" (module docstring).
        lr: learning rate, a one-element fp32 tensor on weights' device ([] or [1]), read by the kernel
            (no host sync; its value at launch, or at each replay of a captured graph, is the one used).
        eps: Adagrad's epsilon (unused by sgd).
        rounding: for bf16 weights, [2] int64 (seed, count) on weights' device: round stochastically with
            the bits of (seed, count) (module docstring; the caller advances the count between updates);
            None: round to nearest. Unused for fp32 weights.
        in_order: SGD on fp32 weights too sums each row's lookups in sorted order before its step, as every
            other update does, not by atomic adds in whatever order a GPU's threads come: the same bits on
            every run, for the cost of the sort.
    Raises:
        ValueError: unknown optimizer, or shapes/dtypes/devices that do not match (message names them).
    """
    check_optimizer(optimizer)
    _check_update(weights, state, index, grad, optimizer)
    check_lr(lr, weights)
    check_rounding(rounding, weights)
    if not use_triton(weights):
        embedding_update_ref(weights, state, index, grad, optimizer, lr, eps, rounding)
        return
    columns = index.shape[-1] if index.ndim > 1 else 1
    index = index.reshape(-1)
    grad = grad.reshape(index.numel(), -1).contiguous()
    launch_update(
        weights, state, index, grad, optimizer, lr, eps, rounding=rounding, in_order=in_order, columns=columns
    )


def sorted_segments(index: Tensor, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """(sorted rows, order, segment), each [N], of the N = index.numel() global rows looked up (each in
    [0, rows)): the rows sorted (int32 where `rows` <= 2**31, else int64: the sort's keys, kept as sorted),
    the lookup at each sorted position (argsort, int64), and the segment (distinct row, numbered in sorted
    order; int32 where N <= 2**31, else int64) of each sorted position. No host sync."""
    keys = index.reshape(-1)
    sorted_rows, order = torch.sort(keys.int() if rows <= 2**31 else keys)
    # Segment of each sorted position: the number of row changes before it. In 32 bits where they fit:
    # the scan and the kernels that read the segments move half the bytes.
    changes = torch.ne(sorted_rows[1:], sorted_rows[:-1])
    dtype = torch.int32 if len(keys) <= 2**31 else torch.int64
    segment = torch.empty(len(sorted_rows), dtype=dtype, device=sorted_rows.device)
    segment[:1] = 0
    torch.cumsum(changes, dim=0, dtype=dtype, out=segment[1:])
    return sorted_rows, order, segment


def _level_plan(
    segment: Tensor, segments: int, starts: Tensor | None, used: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One level of the segment sums (`segment` [m] int32 or int64, sorted, cut into k blocks: level 0's
    chunks of CROSSING_CHUNK, a later level's blocks of SUM_BLOCK_N): (dest [2k], next_segment [2k], places
    [1], blocks [k], count [1]), all int64. dest[2j] is where the next level holds block j's partial sum of
    its first segment when that began in an earlier block, dest[2j + 1] that of its last segment when it
    goes on into a later block (and did not begin earlier), -1 otherwise; next_segment the segment of each
    place, in order, the `places` used ones first, its unused places numbered `segments`, `segments` + 1,
    ... (segments of their own, never stored). The summing kernels sum blocks[:count]. Level 0 (`starts`
    [N + 1], `_segment_starts_kernel`'s, given; `used` None): only a long segment (more than SHORT_SEGMENT
    positions) has places, the step kernel summing the short ones itself, and the chunks to sum are those
    holding a long segment, in order. A level >= 1 (`used` [1]: the places the level before used): its
    first blocks, up to `used` positions. Fixed shapes, no host sync: two kernels and one scan."""
    m, device = len(segment), segment.device
    level0 = used is None
    block_n = CROSSING_CHUNK if level0 else SUM_BLOCK_N
    k = triton.cdiv(m, block_n)
    # One scan over a 1-D array: torch scans a 1-D tensor device-wide (cub), but each row of a 2-D one
    # inside a single thread block, serially along the row.
    flags = torch.empty((3 if level0 else 2) * k, dtype=torch.int64, device=device)
    values = torch.empty(2 * k, dtype=torch.int64, device=device)
    block = 1024
    _level_flags_kernel[(triton.cdiv(k, FLAGS_BLOCK if level0 else block),)](
        segment, segment if starts is None else starts, flags, values, m, k,
        LEVEL0=level0, SHORT=SHORT_SEGMENT, BLOCK_N=block_n, SUB=SUM_BLOCK_N,
        BLOCK=FLAGS_BLOCK if level0 else block,
    )  # fmt: skip
    scan = flags.cumsum(dim=0)
    dest = torch.empty(2 * k, dtype=torch.int64, device=device)
    next_segment = torch.empty(2 * k, dtype=torch.int64, device=device)
    places = torch.empty(1, dtype=torch.int64, device=device)
    blocks = torch.empty(k, dtype=torch.int64, device=device)
    count = torch.empty(1, dtype=torch.int64, device=device)
    _level_places_kernel[(triton.cdiv(2 * k, block),)](
        flags, scan, values, places if used is None else used, dest, next_segment, places, blocks, count,
        k, segments, LEVEL0=level0, BLOCK_N=block_n, BLOCK=block,
    )  # fmt: skip
    return dest, next_segment, places, blocks, count


def _sums_buffer(places: int, d: int, device: torch.device) -> Tensor:
    """[places, D] fp32, not initialized: the long segments' sums, or a level's partial sums. The kernels
    read only the places written (the step kernel the long segments' slots; `_segment_sum_kernel` reads
    the rest as zeros), so no pass zeroes the buffer."""
    return torch.empty(places, d, dtype=torch.float32, device=device)


# The SGD kernel's programs at least, where the lookups allow 16 rows a program (`launch_update`).
SGD_PROGRAMS = 256
# A block of the SGD kernel's lookups whose rows span fewer than this sums each row's lookups before its
# atomic add (`_sgd_kernel`). A power of two, at least 16 (tl.dot). Kaggle's small tables hold 3 to 27 rows:
# 16 measured faster than 32, whose larger 0/1 products cost the 18- to 27-row tables more than their
# atomic adds do (H200, kaggle tf32 B=65,536, triton+graphs: 1.794 against 1.843 ms a step).
SGD_HOT_ROWS = 16
# ... and only in batches of at least this many samples, where a small table's row takes enough adds a step
# for its sums to save them. Smaller batches add each lookup's step, rounding at each add as eager's sparse
# SGD does (a summed step rounds once: a few units of the weight apart on a hot row).
SGD_HOT_BATCH = 1024

# The summing kernels' gathers take 32-bit offsets where every element lies below this one.
OFFSET32_LIMIT = 2**31


def _last_offset(t: Tensor) -> int:
    """The element offset of `t`'s last element from its first (strides >= 0)."""
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


def _segment_sums(
    rows: Tensor,
    segment: Tensor,
    grad: Tensor,
    scales: Tensor,
    starts: Tensor,
    pooled: bool,
    scaled: bool,
    f: int,
    d: int,
    block_d: int,
) -> Tensor:
    """[N, D] fp32: each long segment's gradient sum in its slot (module docstring; the short segments'
    slots are not written), for the N sorted positions' gradient rows `rows`, segments `segment` [N] (int32
    or int64) and their `starts` [N + 1] int64 of `launch_update`'s gradient ([N, D] contiguous; pooled:
    [B, F, D], D's stride 1, row b * F + f, where `scaled` with the features' scales [F] fp32). Level 0
    sums the lookups' gradients in the blocks that hold a long segment; each next level the partial sums of
    the long segments that crossed a block edge of the level before, until a level fits in one block."""
    n = len(segment)
    sums = _sums_buffer(n, d, grad.device)
    level_starts, used = starts, None
    while True:
        m = len(segment)
        dest, next_segment, places, blocks, count = _level_plan(segment, n, level_starts, used)
        partials = _sums_buffer(len(next_segment), d, grad.device)
        offset32 = _last_offset(grad) < OFFSET32_LIMIT
        if used is None:
            strides = grad.stride()[:2] if pooled else (0, 0)
            _crossing_sums_kernel[(_persistent_grid(len(blocks), CROSSING_PROGRAMS_PER_SM, grad.device),)](
                rows, segment, starts, grad, scales, dest, partials, sums, blocks, count, m, f, d, *strides,
                POOLED=pooled, SCALED=scaled, OFFSET32=offset32, SHORT=SHORT_SEGMENT, CHUNK=CROSSING_CHUNK,
                BLOCK_N=SUM_BLOCK_N, BLOCK_D=block_d, num_warps=CROSSING_WARPS, num_stages=SUM_STAGES,
            )  # fmt: skip
        else:
            _segment_sum_kernel[(_persistent_grid(len(blocks), SUM_PROGRAMS_PER_SM, grad.device),)](
                segment, grad, sums, dest, partials, blocks, count, m, d, n, SPLIT_BF16=not INTERPRETED,
                OFFSET32=offset32, BLOCK_N=SUM_BLOCK_N, BLOCK_D=block_d, num_warps=SUM_WARPS,
                num_stages=SUM_STAGES,
            )  # fmt: skip
        if len(blocks) == 1:  # the level was one block
            return sums
        segment, grad, level_starts, used = next_segment, partials, None, places


def launch_update(
    weights: Tensor,
    state: Tensor,
    index: Tensor,
    grad: Tensor,
    optimizer: str,
    lr: Tensor,
    eps: float,
    bags: tuple[Tensor, Tensor] | None = None,
    rounding: Tensor | None = None,
    in_order: bool = False,
    columns: int = 1,
    drop_last_row: bool = False,
) -> None:
    """The update kernels (module docstring) on inputs already checked: index [N] global rows (int64; a
    bag lookup's may be int32); grad [N, D] contiguous, or for pooled bags, with `bags` = (features [S]
    int64, scales [S] fp32 or None where every scale is 1: sum pooling) as
    `kernels.embedding_bag_update.bag_columns` gives them, the pooled gradient
    [B, F, D] with D's stride 1 (a view is read in place; N = B * S, lookup b * S + c); `rounding` and
    `in_order` as `embedding_update`'s. Without bags, `columns` (dividing N) is the lookups a sample: lookup
    b * columns + c reads table c's rows (the SGD kernel sums a small table's lookups of a block before
    adding them). `drop_last_row`: the lookups of weights' last row R - 1 (a row-wise shard's padding row,
    dlrm.parallel.sharded_bags) take no part: the SGD kernel masks them, the sorted path, where they sort
    last, gives their segment no positions (`_segment_starts_kernel`), so their gradients are never read and
    the row and its state stay as they are."""
    n, d = index.numel(), weights.shape[1]
    if n == 0:
        return
    assert SHORT_SEGMENT >= SUM_BLOCK_N, "a long segment must not fit inside a summing block"
    pooled = bags is not None
    features, scales = bags if pooled else (index, None)
    scaled = scales is not None
    scales = scales if scaled else features  # not read unless scaled
    s, f = (features.numel(), grad.shape[1]) if pooled else (1, 1)
    block_d, block_n = block_sizes(d, n)
    last_row = weights.shape[0] - 1 if drop_last_row else -1
    if pooled and grad.shape[0] * grad.shape[1] >= 2**31:  # `_gradient_offsets`'s int32 rows b * F + f
        raise ValueError(f"pooled gradient {list(grad.shape)}: B * F must be below 2**31")
    if pooled and grad.stride(2) != 1:
        grad = grad.contiguous()
    strides = grad.stride()[:2] if pooled else (0, 0)
    if sums_by_atomics(optimizer, weights.dtype) and not in_order:
        # Few lookups (small batches): fewer samples a program, so the atomics spread over SGD_PROGRAMS
        # programs rather than a handful of SMs (kaggle B=128, D=16: 13 programs of 256 rows took 6.3 us of
        # a step, torch's index_add_ 2.2 us); large batches keep `block_sizes`'s rows.
        # At least 16 samples a program, and 16 columns of D: tl.dot's least sizes.
        block_b = max(16, min(block_n, triton.next_power_of_2(triton.cdiv(n, SGD_PROGRAMS))))
        columns = s if pooled else columns
        samples = n // columns
        _sgd_kernel[(columns * triton.cdiv(samples, block_b),)](
            index, grad, features, scales, weights, lr, samples, columns, d, *strides, last_row,
            POOLED=pooled, SCALED=scaled, HOT=samples >= SGD_HOT_BATCH, HOT_ROWS=SGD_HOT_ROWS,
            BLOCK_B=block_b, BLOCK_D=max(16, block_d),
        )  # fmt: skip
        return
    sorted_rows, order, segment = sorted_segments(index, weights.shape[0])
    rows = order
    if pooled:  # lookup b * S + c reads the pooled gradient's row b * F + f(c), scaled by f's 1 or 1/k_f
        rows = torch.empty(n, dtype=torch.int32, device=order.device)  # B * F < 2**31 (above)
        _gradient_rows_kernel[(triton.cdiv(n, 1024),)](order, features, rows, n, s, f, BLOCK=1024)
        if scaled:
            scales = torch.zeros(f, dtype=torch.float32, device=grad.device).scatter_(0, features, scales)
    starts = torch.empty(n + 1, dtype=torch.int64, device=grad.device)
    _segment_starts_kernel[(triton.cdiv(n, 1024),)](
        segment, sorted_rows, starts, n, last_row, DROP_LAST=drop_last_row, BLOCK=1024
    )
    sums = _segment_sums(rows, segment, grad, scales, starts, pooled, scaled, f, d, max(16, block_d))
    stochastic = rounding is not None and weights.dtype == torch.bfloat16
    warps, per_sm = STEP_LAUNCH[optimizer]
    programs = _persistent_grid(triton.cdiv(n, STEP_SEGMENTS), per_sm, grad.device)
    _segment_step_kernel[(programs,)](
        starts, segment, sorted_rows, rows, grad, scales, sums, weights, state, lr,
        rounding if stochastic else lr, n, f, d, *strides, eps, POOLED=pooled, SCALED=scaled,
        OPTIMIZER=optimizer, STOCHASTIC=stochastic, SHORT=SHORT_SEGMENT, BLOCK_S=STEP_SEGMENTS,
        BLOCK_D=max(2, block_d), num_warps=warps,  # the rounding hashes pairs of elements
    )  # fmt: skip


def _persistent_grid(items: int, per_sm: int, device: torch.device) -> int:
    """A persistent kernel's programs for `items` work items (the step kernel's groups of segments, the
    summing kernels' blocks): `per_sm` an SM, fewer where the items cannot fill them (the interpreter: one
    program an item, up to 64)."""
    if device.type != "cuda":
        return min(items, 64)
    return min(items, per_sm * torch.cuda.get_device_properties(device).multi_processor_count)


def stochastic_round_bf16_ref(x: Tensor, noise: Tensor) -> Tensor:
    """x fp32 rounded stochastically to bf16 with `noise` (int32 of x's shape, each in [0, 2**16)): the
    noise added to x's bit pattern, the low 16 bits dropped (module docstring); a NaN stays NaN."""
    pattern = (x.contiguous().view(torch.int32) + noise) & -(1 << 16)  # int32 adds wrap, as uint32 would
    return torch.where(x.isnan(), x, pattern.view(torch.float32)).to(torch.bfloat16)


def embedding_update_ref(
    weights: Tensor,
    state: Tensor,
    index: Tensor,
    grad: Tensor,
    optimizer: str,
    lr: Tensor,
    eps: float,
    rounding: Tensor | None = None,
) -> None:
    """PyTorch update of the touched rows, in place: sums repeated rows, then the module docstring's step.
    `lr`: a one-element fp32 tensor (as `embedding_update`). With `rounding` and bf16 weights, the
    stochastic rounding's bits come from a torch.Generator seeded by (seed, count) (read on the host: the
    reference is the CPU fallback and the tests' twin, not captured), not from the kernels' hash."""
    d = weights.shape[1]
    lr = lr.reshape(())  # [] or [1] -> [], broadcast against the [rows, D] sums
    rows, inverse = torch.unique(index.reshape(-1), return_inverse=True)
    g = torch.zeros(len(rows), d, dtype=torch.float32, device=weights.device)
    g.index_add_(0, inverse, grad.reshape(-1, d).float())
    if optimizer == "sgd":
        step = lr * g
    elif optimizer == "adagrad":
        state[rows] += g * g
        step = lr * g / (state[rows].sqrt() + eps)
    else:
        state[rows] += (g * g).mean(dim=1)
        step = lr * g / (state[rows].sqrt()[:, None] + eps)
    updated = weights[rows].float() - step
    if rounding is not None and weights.dtype == torch.bfloat16:
        seed, count = (int(v) for v in rounding.tolist())
        generator = torch.Generator().manual_seed((seed * 1_000_003 + count) % 2**63)
        noise = torch.randint(0, 1 << 16, updated.shape, generator=generator, dtype=torch.int32)
        weights[rows] = stochastic_round_bf16_ref(updated, noise.to(updated.device))
        return
    weights[rows] = updated.to(weights.dtype)
