"""The DCNv2 cross layer's GEMMs that stream [M, N] tensors besides their operands, on Hopper GPUs (sm_90):
warp-specialized, persistent kernels written in Gluon (triton.experimental.gluon), which ``kernels.cross``
and ``kernels.cross_net`` take where they can (``supported``), their Triton kernels and cuBLAS elsewhere.

Forward (``launch_fwd``), the up projection with the layer's output:
    zb  = h @ U^T + b        h [M, r], U [N, r], b [N]   fp32 accumulation (wgmma), the bias first
    out = x0 * zb + xl       x0, xl [M, N]
Backward (``launch_dz``), h's gradient with z's and b's:
    dz  = g * x0             g, x0 [M, N]                written (the dU GEMM reads it)
    db  = sum over rows of dz                            fp32 sums of the fp32 products
    dh  = dz @ U             U [N, r]                    fp32 accumulation (wgmma) of dz in the dtype
Backward (``launch_bwd``), x_l's gradient with the x0 gradient's terms that need no GEMM:
    dxl = g + dh @ V         dh [M, r], V [r, N]         g = dL/dx_{l+1} [M, N]
    dx0 = g * zb (+ acc)     zb, acc [M, N]              acc: the x0 gradient of the later layers
    or, where dxl is not wanted (a network's first layer, whose x_l is x0), dx0 = g * zb (+ acc) + dxl.
Outputs in the inputs' dtype (bf16 or fp16), epilogues in fp32 on values cast after load, one rounding at
the store. dxl may be g's own memory (tiles are disjoint, and a tile's g is in shared memory before any of
its stores).

Why kernels of their own: a Triton kernel runs its main loop (tensor cores) and then its epilogue, which
streams four or five [M, N] tensors (memory), one after the other in each program; at the MLPerf shape
(M = 65,536, N = 3,456, r = 512) both take about as long. Here two consumer warpgroups take alternate output
tiles ("ping-pong"): while one runs its epilogue, the other's main loop keeps the tensor cores busy, and
each consumer's first epilogue inputs arrive by TMA under its own main loop. scripts/bench_cross.py times
the layer.

Partitions (gl.warp_specialize), one program an SM, walking output tiles t = pid, pid + P, ... (P programs),
row-major, so the programs running together read the same rows of the A operand (the B operand stays in L2):
- producer (a worker of 1 warp, few registers): for each of the program's tiles, for each K chunk, waits
  the ring slot's `empty` barrier and TMA-loads the A chunk [BLOCK_M, 64] (h or dh) and the B chunk (U's
  [BLOCK_N, 64], K contiguous; V's [64, BLOCK_N], N contiguous, which wgmma reads as it lies) into it, which
  complete on the slot's `ready` barrier;
- consumer 0 (the default partition, 4 warps: one warpgroup) takes the program's tiles 0, 2, 4, ...;
  consumer 1 (a worker of 4 warps) tiles 1, 3, 5, ... For each tile a consumer
  1. waits until its previous tile's TMA stores have read its SLOTS epilogue slots, then TMA-loads the
     tile's first SLOTS column sub-tiles [BLOCK_M, EPI_N] of its epilogue inputs into them: x0 and x_l;
     or g, zb (and acc);
  2. starts the accumulator (at the bias; at 0);
  3. waits its turn (`order`), runs the main loop (async wgmma, one in flight; each ring slot released on
     `empty` once the wgmma that read it is complete) and hands the turn over once its last wgmma is issued;
  4. epilogue, per column sub-tile j, from slot j % SLOTS: the outputs in fp32, written over the slot's
     input buffers (out over x0, zb over x_l; dxl over g, dx0 over zb) and TMA-stored; once those stores
     have read the slot, sub-tile j + SLOTS is TMA-loaded into it. acc's buffer is only read, before the
     sub-tile's stores, which Triton's barrier before a TMA store orders before the next loads into it.

Barriers (arrival count 1 each; phase k of an mbarrier completes at its (k + 1)-th arrival, for `ready` and
`x_bar` with the bytes announced by `expect` too; a wait for parity p returns once the last phase due of
that parity has completed; a fresh barrier counts as having completed a phase of parity 1):
- ready[s]: slot s holds its chunk. Arrive: the producer's expect and TMA loads. Wait: the chunk's consumer,
  parity (c // STAGES) & 1 for the program's c-th chunk (c counts the chunks of all its tiles in order; a
  consumer computes it from its tile's index).
- empty[s]: slot s may be refilled. Arrive: the consumer that read it. Wait: the producer, parity
  ((c // STAGES) & 1) ^ 1 (the first round passes at once).
- order[w]: consumer w may start a main loop. Arrive: the other consumer, having issued its last wgmma of a
  tile. Wait: consumer w at its i-th tile, parity (i & 1) ^ 1 for consumer 0 (its first wait passes) and
  i & 1 for consumer 1. Besides taking the tensor cores in turn, this makes the ring's parity waits sound
  with two consumers: a consumer waits for a chunk only after every earlier chunk was waited for, so no
  `ready` barrier is two phases behind the parity asked of it.
- x_bar[SLOTS w + t]: slot t of consumer w holds its sub-tile. Arrive: consumer w's expect and TMA loads.
  Slot t takes USES = ceil((SPLIT - t) / SLOTS) of a tile's SPLIT sub-tiles: consumer w waits its i-th
  tile's sub-tile j (in slot t = j % SLOTS) at parity (i USES + j // SLOTS) & 1.

Shared memory (2-byte dtypes; a Hopper CTA takes 232,448 bytes): the ring, STAGES x (BLOCK_M + BLOCK_N) x
64 x 2 B, and 2 consumers x SLOTS slots of [BLOCK_M, EPI_N] for each epilogue input. The ring's depth sets
the main loop's pace (its chunks come from L2), so it takes most of it, and the slots what is left: 128 x
128 tiles and 2 slots of 32 columns; two inputs (the forward, and the backward without acc) 5 stages,
160 + 64 = 224 KiB, three (the backward with acc) 4 stages, 128 + 96 = 224 KiB.
Registers: 12 warps at `.maxnreg` MAXNREG (all of the SM's 64 Ki), setmaxnreg moving them from the
producer's warpgroup (PRODUCER_REGS) to the consumers' (CONSUMER_REGS: a [128, 128] fp32 accumulator takes
128 a thread); no spills (`scripts/cross_registers.py --kernel hopper` compiles the kernels for sm_90a
without a GPU). Tiles, sub-tiles, stages and slots measured on an H200 at the MLPerf shape (bf16): the
forward at 5 stages and 2 slots faster than at 4 and 3 slots, 6 and 1, and 3 and all 4 sub-tiles
prefetched; 16-column sub-tiles slower than 32; the backward with acc faster in 128 x 128 tiles at 4
stages and 2 slots than in 64 x 128 tiles at 5 to 7 stages.

``launch_dz``'s kernel is no ping-pong: its own output dh [M, r] is small, and its memory traffic (g and x0
in, dz out) lies in the main loop. One consumer partition of two warpgroups (8 warps) takes a [128, 256]
tile of dh, 64 rows each, sharing each chunk of U; the producer above fills the ring with g's and x0's
[128, 64] chunks and U's [64, 256] (R contiguous). Per chunk the consumer loads g and x0 from the ring,
multiplies them in fp32, and stores dz, rounded, into one of two dz buffers in shared memory, the A
operand of the chunk's wgmma (async, one in flight: a buffer is rewritten once the wgmma two chunks back
is complete). The r / 256 programs of a row block (2 at r = 512) read the same g and x0 (all but one from
L2) and take turns, a chunk each, writing the chunk's dz (a TMA store from its buffer; a buffer is
rewritten once its store has read it) and its column sums: each warp sums its own rows (no data crosses
warps), 8 partial rows a tile, which ``kernels.gemm.partials`` adds up. The tile's dh leaves through the dz
buffers, 64 columns at a time. Barriers: `ready` and `empty` as above, one consumer. Shared memory: 3
stages x (2 x 128 + 256) x 64 x 2 B and the two 16 KiB buffers, 224 KiB; the consumer's warps take the
registers the producer's warpgroup gives back, and a [64, 256] fp32 accumulator takes 128 a thread.

Gluon has no interpreter: on the CPU, and for fp32, ``kernels.cross`` runs its Triton kernels; the GPU
tests compare the kernels with fp64 references and the forward with the Triton kernel
(tests/test_cross_hopper.py).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import launch
from kernels.gemm.layout import describable
from kernels.gemm.partials import sum_partials
from kernels.launch import INTERPRETED

__all__ = ["launch_bwd", "launch_dz", "launch_fwd", "supported"]

BLOCK_K = 64
# (BLOCK_M, BLOCK_N, EPI_N, STAGES, SLOTS) by the number of epilogue inputs (module docstring).
TILES = {2: (128, 128, 32, 5, 2), 3: (128, 128, 32, 4, 2)}
# launch_dz's (BLOCK_M, BLOCK_R, STAGES) and warps of its consumer (two warpgroups on one tile).
DZ_TILE = (128, 256, 3)
DZ_WARPS = 8
MAXNREG = 168  # x 384 threads: the SM's 64 Ki registers
CONSUMER_REGS = 232
PRODUCER_REGS = 40
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _tile_offsets(t, num_pid_n, BM: gl.constexpr, BN: gl.constexpr):
    """(first row, first column) of output tile t, tiles row-major."""
    return (t // num_pid_n) * BM, (t % num_pid_n) * BN


@gluon.jit
def _split_n(x, SPLIT: gl.constexpr):
    """x [BM, BN] as SPLIT column sub-tiles [BM, BN // SPLIT], left to right (SPLIT a power of two). In the
    wgmma accumulator's layout the bits that tell them apart are register bits: no data moves."""
    xs = (x,)
    for _ in gl.static_range(SPLIT.bit_length() - 1):
        halves = ()
        for j in gl.static_range(len(xs)):
            y = xs[j]
            halves += y.reshape(y.shape[0], 2, y.shape[1] // 2).permute(0, 2, 1).split()
        xs = halves
    return xs


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr):
    """(ready, empty) of the ring's STAGES slots, initialized (module docstring)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()  # the inits before any TMA (the async proxy) signals a barrier
    return ready, empty


@gluon.jit
def _pingpong_barriers(SLOTS: gl.constexpr):
    """(x_bar, order) of the two consumers, initialized (module docstring)."""
    x_bar = gl.allocate_shared_memory(gl.int64, [2 * SLOTS, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2 * SLOTS):
        mbarrier.init(x_bar.index(w), count=1)
    for w in gl.static_range(2):
        mbarrier.init(order.index(w), count=1)
    fence_async_shared()
    return x_bar, order


@gluon.jit
def _producer(a_descs, b_desc, rings_a, ring_b, ready, empty, M, N, K, B_KMAJOR: gl.constexpr):
    """The ring's producer: per K chunk, each A operand's chunk (`a_descs`, one block shape: h; dh; g and
    x0) into `rings_a`, and B's. B_KMAJOR: b_desc's blocks are [BLOCK_N, BLOCK_K] (U of the forward), else
    [BLOCK_K, BLOCK_N] (V; U of ``launch_dz``)."""
    BM: gl.constexpr = a_descs[0].block_type.shape[0]
    BK: gl.constexpr = a_descs[0].block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0] if B_KMAJOR else b_desc.block_type.shape[1]
    S: gl.constexpr = ring_b.type.shape[0]
    CHUNK_BYTES: gl.constexpr = len(a_descs) * a_descs[0].block_type.nbytes + b_desc.block_type.nbytes
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = gl.cdiv(M, BM) * num_pid_n
    k_tiles = gl.cdiv(K, BK)
    c = 0  # the program's chunk, over all its tiles
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(t, num_pid_n, BM, BN)
        for kk in range(k_tiles):
            s = c % S
            mbarrier.wait(empty.index(s), ((c // S) & 1) ^ 1)
            # The byte count by position: its keyword is named differently in triton 3.6 and 3.7.
            mbarrier.expect(ready.index(s), CHUNK_BYTES)
            for j in gl.static_range(len(a_descs)):
                tma.async_copy_global_to_shared(
                    a_descs[j], [off_m, kk * BK], ready.index(s), rings_a[j].index(s)
                )
            if B_KMAJOR:
                tma.async_copy_global_to_shared(b_desc, [off_n, kk * BK], ready.index(s), ring_b.index(s))
            else:
                tma.async_copy_global_to_shared(b_desc, [kk * BK, off_n], ready.index(s), ring_b.index(s))
            c += 1


@gluon.jit
def _main_loop(
    acc, ring_a, ring_b, ready, empty, order, i, k_tiles, WHICH: gl.constexpr, B_KMAJOR: gl.constexpr
):
    """Consumer WHICH's main loop of its i-th tile, in turn with the other consumer: acc + A @ B."""
    S: gl.constexpr = ring_a.type.shape[0]
    mbarrier.wait(order.index(WHICH), (i & 1) ^ (1 - WHICH))
    c = (2 * i + WHICH) * k_tiles  # the producer's count of this tile's first chunk
    for kk in range(k_tiles):
        s = c % S
        mbarrier.wait(ready.index(s), (c // S) & 1)
        b = ring_b.index(s).permute((1, 0)) if B_KMAJOR else ring_b.index(s)
        acc = warpgroup_mma(ring_a.index(s), b, acc, is_async=True)
        # One wgmma in flight: the one before, which read slot c - 1, is complete.
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((c + S - 1) % S), count=1, pred=kk > 0)
        c += 1
    mbarrier.arrive(order.index(1 - WHICH), count=1)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((c + S - 1) % S), count=1)
    return acc


@gluon.constexpr_function
def _acc_layout(BN, dtype):
    """One warpgroup's wgmma accumulator: atoms of 64 rows, the 4 warps along M, BN columns an instruction."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 256 // dtype.primitive_bitwidth]
    )


@gluon.jit
def _consumer_tiles(M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, WHICH: gl.constexpr):
    """Consumer WHICH's walk over the program's tiles (its 0, 2, 4, ... or 1, 3, 5, ...): (first tile, end,
    step, tiles along N, K chunks a tile)."""
    num_pid_n = gl.cdiv(N, BN)
    step = gl.num_programs(0)
    return gl.program_id(0) + WHICH * step, gl.cdiv(M, BM) * num_pid_n, 2 * step, num_pid_n, gl.cdiv(K, BK)


@gluon.jit
def _load_slot(descs, bufs, x_bar, off_m, off_n, slot):
    """TMA-load the [BLOCK_M, EPI_N] sub-tile at (off_m, off_n) of each of `descs` into buffer `slot` of the
    `bufs` of the same place, completing on x_bar[slot]."""
    bar = x_bar.index(slot)
    mbarrier.expect(bar, len(descs) * descs[0].block_type.nbytes)
    for k in gl.static_range(len(descs)):
        tma.async_copy_global_to_shared(descs[k], [off_m, off_n], bar, bufs[k].index(slot))


@gluon.jit
def _first_sub_tiles(descs, bufs, x_bar, off_m, off_n, SLOTS: gl.constexpr, WHICH: gl.constexpr):
    """Step 1 of consumer WHICH's tile: once its last tile's TMA stores have read its slots, the tile's
    first SLOTS sub-tiles of each of `descs` into them."""
    EPI: gl.constexpr = descs[0].block_type.shape[1]
    tma.store_wait(0)
    for t in gl.static_range(SLOTS):
        _load_slot(descs, bufs, x_bar, off_m, off_n + t * EPI, WHICH * SLOTS + t)


@gluon.jit
def _wait_sub_tile(x_bar, i, j: gl.constexpr, SPLIT: gl.constexpr, SLOTS: gl.constexpr, WHICH: gl.constexpr):
    """Step 4 of consumer WHICH's i-th tile: wait for its sub-tile j; returns the slot holding it."""
    t: gl.constexpr = j % SLOTS
    USES: gl.constexpr = (SPLIT - t + SLOTS - 1) // SLOTS
    slot = WHICH * SLOTS + t
    mbarrier.wait(x_bar.index(slot), (i * USES + j // SLOTS) & 1)
    return slot


@gluon.jit
def _next_sub_tile(descs, bufs, x_bar, off_m, off_n, slot, j: gl.constexpr, SPLIT: gl.constexpr):
    """After sub-tile j's stores from `slot` are issued: once they have read it, sub-tile j + SLOTS (if
    any) into it."""
    SLOTS: gl.constexpr = bufs[0].type.shape[0] // 2
    if j + SLOTS < SPLIT:
        EPI: gl.constexpr = descs[0].block_type.shape[1]
        tma.store_wait(0)
        _load_slot(descs, bufs, x_bar, off_m, off_n + (j + SLOTS) * EPI, slot)


@gluon.jit
def _store_over(values, bufs, descs, off_m, off_n):
    """A sub-tile's stores (step 4 of the epilogues; dh's tile in the dz kernel): each of `values` rounded to
    its descriptor's dtype over its buffer of `bufs` (whose input the epilogue has read, or whose earlier
    store has drained), then TMA-stored from there to (off_m, off_n) of `descs`."""
    for k in gl.static_range(len(values)):
        bufs[k].store(values[k].to(descs[k].dtype))
    fence_async_shared()
    for k in gl.static_range(len(values)):
        tma.async_copy_shared_to_global(descs[k], [off_m, off_n], bufs[k])


@gluon.jit
def _fwd_consumer(
    h_desc, u_desc, x0_desc, xl_desc, out_desc, zb_desc, ring_h, ring_u, ready, empty, x0_bufs, xl_bufs,
    x_bar, order, b_ptr, M, N, K, WHICH: gl.constexpr,
):  # fmt: skip
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BK: gl.constexpr = h_desc.block_type.shape[1]
    BN: gl.constexpr = u_desc.block_type.shape[0]
    EPI: gl.constexpr = x0_desc.block_type.shape[1]
    SPLIT: gl.constexpr = BN // EPI
    acc_layout: gl.constexpr = _acc_layout(BN, h_desc.dtype)
    SLOTS: gl.constexpr = x0_bufs.type.shape[0] // 2
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    descs = (x0_desc, xl_desc)
    bufs = (x0_bufs, xl_bufs)
    first, end, step, num_pid_n, k_tiles = _consumer_tiles(M, N, K, BM, BN, BK, WHICH)
    i = 0  # this consumer's tile: the program's tile 2 i + WHICH
    for t in range(first, end, step):
        off_m, off_n = _tile_offsets(t, num_pid_n, BM, BN)
        # 1. This tile's first sub-tiles of x0 and x_l.
        _first_sub_tiles(descs, bufs, x_bar, off_m, off_n, SLOTS, WHICH)
        # 2. The accumulator starts at the bias.
        bias = gl.load(b_ptr + off_n + cols, mask=off_n + cols < N, other=0.0).to(gl.float32)
        acc = gl.zeros([BM, BN], gl.float32, acc_layout) + gl.expand_dims(bias, 0)
        # 3. The main loop, in turn with the other consumer.
        acc = _main_loop(acc, ring_h, ring_u, ready, empty, order, i, k_tiles, WHICH, True)
        # 4. The epilogue, a column sub-tile at a time, over its slot's buffers.
        zbs = _split_n(acc, SPLIT)
        for j in gl.static_range(SPLIT):
            zb = zbs[j]
            slot = _wait_sub_tile(x_bar, i, j, SPLIT, SLOTS, WHICH)
            x0_buf = x0_bufs.index(slot)
            xl_buf = xl_bufs.index(slot)
            x0 = x0_buf.load(zb.type.layout).to(gl.float32)
            xl = xl_buf.load(zb.type.layout).to(gl.float32)
            _store_over((x0 * zb + xl, zb), (x0_buf, xl_buf), (out_desc, zb_desc), off_m, off_n + j * EPI)
            _next_sub_tile(descs, bufs, x_bar, off_m, off_n, slot, j, SPLIT)
        i += 1
    tma.store_wait(0)


# M (the batch) changes between calls: not specialized on, so a new batch size reuses the compiled kernel.
@gluon.jit(do_not_specialize=["M"])
def _cross_fwd_ws_kernel(
    h_desc,  # of h [M, r], blocks [BLOCK_M, BLOCK_K]
    u_desc,  # of U [N, r], blocks [BLOCK_N, BLOCK_K]
    x0_desc,  # of x0 [M, N], blocks [BLOCK_M, EPI_N]
    xl_desc,  # of x_l [M, N], blocks [BLOCK_M, EPI_N]
    out_desc,  # of out [M, N], blocks [BLOCK_M, EPI_N]
    zb_desc,  # of zb [M, N], blocks [BLOCK_M, EPI_N]
    b_ptr,  # [N] bias
    M,
    N,
    K,  # r
    STAGES: gl.constexpr,
    SLOTS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,  # setmaxnreg of the worker consumer (the default partition: what is left)
    PRODUCER_REGS: gl.constexpr,
):
    dtype: gl.constexpr = h_desc.dtype
    ring_h = gl.allocate_shared_memory(dtype, [STAGES] + h_desc.block_type.shape, h_desc.layout)
    ring_u = gl.allocate_shared_memory(dtype, [STAGES] + u_desc.block_type.shape, u_desc.layout)
    # Consumer w's slot t of x0 and of x_l is w * SLOTS + t.
    x0_bufs = gl.allocate_shared_memory(dtype, [2 * SLOTS] + x0_desc.block_type.shape, x0_desc.layout)
    xl_bufs = gl.allocate_shared_memory(dtype, [2 * SLOTS] + xl_desc.block_type.shape, xl_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    x_bar, order = _pingpong_barriers(SLOTS)
    # (functions and arguments, worker warps, worker registers) by position: triton 3.6 requires the
    # registers, 3.7 names them differently. The 4-warp consumer is the first worker, so that it is an
    # aligned warpgroup (warps 4-7), as wgmma needs. Its arguments are written out: a literal appended to a
    # tuple of them does not pass through warp_specialize.
    # fmt: off
    gl.warp_specialize([
        (_fwd_consumer, (h_desc, u_desc, x0_desc, xl_desc, out_desc, zb_desc, ring_h, ring_u, ready, empty,
                         x0_bufs, xl_bufs, x_bar, order, b_ptr, M, N, K, 0)),
        (_fwd_consumer, (h_desc, u_desc, x0_desc, xl_desc, out_desc, zb_desc, ring_h, ring_u, ready, empty,
                         x0_bufs, xl_bufs, x_bar, order, b_ptr, M, N, K, 1)),
        (_producer, ((h_desc,), u_desc, (ring_h,), ring_u, ready, empty, M, N, K, True)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    # fmt: on


@gluon.jit
def _bwd_consumer(
    dh_desc, v_desc, g_desc, zb_desc, acc_desc, dxl_desc, dx0_desc, ring_dh, ring_v, ready, empty, g_bufs,
    zb_bufs, acc_bufs, x_bar, order, M, N, K, ACCUMULATE: gl.constexpr, FOLD_DXL: gl.constexpr,
    WHICH: gl.constexpr,
):  # fmt: skip
    BM: gl.constexpr = dh_desc.block_type.shape[0]
    BK: gl.constexpr = dh_desc.block_type.shape[1]
    BN: gl.constexpr = v_desc.block_type.shape[1]
    EPI: gl.constexpr = g_desc.block_type.shape[1]
    SPLIT: gl.constexpr = BN // EPI
    acc_layout: gl.constexpr = _acc_layout(BN, dh_desc.dtype)
    SLOTS: gl.constexpr = g_bufs.type.shape[0] // 2
    descs = (g_desc, zb_desc, acc_desc) if ACCUMULATE else (g_desc, zb_desc)
    bufs = (g_bufs, zb_bufs, acc_bufs) if ACCUMULATE else (g_bufs, zb_bufs)
    first, end, step, num_pid_n, k_tiles = _consumer_tiles(M, N, K, BM, BN, BK, WHICH)
    i = 0  # this consumer's tile: the program's tile 2 i + WHICH
    for t in range(first, end, step):
        off_m, off_n = _tile_offsets(t, num_pid_n, BM, BN)
        # 1. This tile's first sub-tiles of g, zb (and acc).
        _first_sub_tiles(descs, bufs, x_bar, off_m, off_n, SLOTS, WHICH)
        # 2. The accumulator starts at 0 (g is added in the epilogue). 3. The main loop.
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        acc = _main_loop(acc, ring_dh, ring_v, ready, empty, order, i, k_tiles, WHICH, False)
        # 4. The epilogue, a column sub-tile at a time, over its slot's buffers.
        prods = _split_n(acc, SPLIT)
        for j in gl.static_range(SPLIT):
            prod = prods[j]  # the sub-tile's dh @ V, fp32
            slot = _wait_sub_tile(x_bar, i, j, SPLIT, SLOTS, WHICH)
            g_buf = g_bufs.index(slot)
            zb_buf = zb_bufs.index(slot)
            g = g_buf.load(prod.type.layout).to(gl.float32)
            dx0 = g * zb_buf.load(prod.type.layout).to(gl.float32)
            if ACCUMULATE:
                dx0 += acc_bufs.index(slot).load(prod.type.layout).to(gl.float32)
            if FOLD_DXL:
                _store_over((dx0 + (g + prod),), (zb_buf,), (dx0_desc,), off_m, off_n + j * EPI)
            else:
                _store_over((g + prod, dx0), (g_buf, zb_buf), (dxl_desc, dx0_desc), off_m, off_n + j * EPI)
            _next_sub_tile(descs, bufs, x_bar, off_m, off_n, slot, j, SPLIT)
        i += 1
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["M"])
def _cross_bwd_ws_kernel(
    dh_desc,  # of dh [M, r], blocks [BLOCK_M, BLOCK_K]
    v_desc,  # of V [r, N], blocks [BLOCK_K, BLOCK_N] (N contiguous)
    g_desc,  # of g [M, N], blocks [BLOCK_M, EPI_N]
    zb_desc,  # of zb [M, N], blocks [BLOCK_M, EPI_N]
    acc_desc,  # of acc [M, N], blocks [BLOCK_M, EPI_N] (ACCUMULATE; else any such descriptor, unread)
    dxl_desc,  # of dx_l [M, N], blocks [BLOCK_M, EPI_N] (may be g's memory; FOLD_DXL: any, unwritten)
    dx0_desc,  # of dx0 [M, N], blocks [BLOCK_M, EPI_N]
    M,
    N,
    K,  # r
    ACCUMULATE: gl.constexpr,  # dx0 += acc (the x0 gradient of the layers after this one)
    FOLD_DXL: gl.constexpr,  # dx0 += dx_l, dx_l not written (the network's first layer, whose x_l is x0)
    STAGES: gl.constexpr,
    SLOTS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,  # setmaxnreg of the worker consumer (the default partition: what is left)
    PRODUCER_REGS: gl.constexpr,
):
    dtype: gl.constexpr = dh_desc.dtype
    ring_dh = gl.allocate_shared_memory(dtype, [STAGES] + dh_desc.block_type.shape, dh_desc.layout)
    ring_v = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    # Consumer w's slot t of each input is w * SLOTS + t.
    g_bufs = gl.allocate_shared_memory(dtype, [2 * SLOTS] + g_desc.block_type.shape, g_desc.layout)
    zb_bufs = gl.allocate_shared_memory(dtype, [2 * SLOTS] + zb_desc.block_type.shape, zb_desc.layout)
    if ACCUMULATE:
        acc_bufs = gl.allocate_shared_memory(dtype, [2 * SLOTS] + acc_desc.block_type.shape, acc_desc.layout)
    else:
        acc_bufs = g_bufs  # never read
    ready, empty = _ring_barriers(STAGES)
    x_bar, order = _pingpong_barriers(SLOTS)
    # As the forward's (above).
    # fmt: off
    gl.warp_specialize([
        (_bwd_consumer, (dh_desc, v_desc, g_desc, zb_desc, acc_desc, dxl_desc, dx0_desc, ring_dh, ring_v,
                         ready, empty, g_bufs, zb_bufs, acc_bufs, x_bar, order, M, N, K, ACCUMULATE, FOLD_DXL,
                         0)),
        (_bwd_consumer, (dh_desc, v_desc, g_desc, zb_desc, acc_desc, dxl_desc, dx0_desc, ring_dh, ring_v,
                         ready, empty, g_bufs, zb_bufs, acc_bufs, x_bar, order, M, N, K, ACCUMULATE, FOLD_DXL,
                         1)),
        (_producer, ((dh_desc,), v_desc, (ring_dh,), ring_v, ready, empty, M, N, K, False)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    # fmt: on


@gluon.jit
def _dz_stage(bufs, nb, stored):
    """The dz buffer of use nb, once the TMA store that last read it (use nb - 2) is done: the store of use
    nb - 1 (the other buffer), where it issued one, may stay in flight."""
    if stored:
        tma.store_wait(1)
    else:
        tma.store_wait(0)
    return bufs.index(nb % 2)


@gluon.jit
def _dz_consumer(
    g_desc, u_desc, dz_desc, dh_desc, ring_g, ring_x0, ring_u, ready, empty, dz_bufs, part_ptr, M, N, R,
    NUM_WARPS: gl.constexpr,
):  # fmt: skip
    BM: gl.constexpr = g_desc.block_type.shape[0]
    BK: gl.constexpr = g_desc.block_type.shape[1]
    BR: gl.constexpr = u_desc.block_type.shape[1]
    S: gl.constexpr = ring_u.type.shape[0]
    SPLIT: gl.constexpr = BR // BK
    # The accumulator over both warpgroups (64 rows each); dz with a warp's 32 threads along a chunk's 64
    # columns, two each, and row i * NUM_WARPS + w in warp w.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0],
        warps_per_cta=[NUM_WARPS, 1],
        instr_shape=[16, BR, 256 // g_desc.dtype.primitive_bitwidth],
    )
    dz_layout: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [NUM_WARPS, 1], [1, 0])
    num_pid_r = gl.cdiv(R, BR)
    num_tiles = gl.cdiv(M, BM) * num_pid_r
    k_tiles = gl.cdiv(N, BK)
    c = 0  # the program's chunk, as the producer counts
    nb = 0  # uses of the two dz buffers
    stored = False  # the last use issued a TMA store
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_r = _tile_offsets(t, num_pid_r, BM, BR)
        acc = gl.zeros([BM, BR], gl.float32, acc_layout)
        for kk in range(k_tiles):
            s = c % S
            mbarrier.wait(ready.index(s), (c // S) & 1)
            dz = ring_g.index(s).load(dz_layout).to(gl.float32) * ring_x0.index(s).load(dz_layout).to(
                gl.float32
            )
            # The wgmma that read this buffer (use nb - 2) is complete: one stays in flight (below).
            buf = _dz_stage(dz_bufs, nb, stored)
            buf.store(dz.to(dz_desc.dtype))
            fence_async_shared()
            acc = warpgroup_mma(buf, ring_u.index(s), acc, is_async=True)
            # The R tiles of a row block take turns writing dz and its sums, a chunk each.
            stored = kk % num_pid_r == t % num_pid_r
            if stored:
                tma.async_copy_shared_to_global(dz_desc, [off_m, kk * BK], buf)
                # Each warp's column sums over its rows: no data crosses warps.
                sums = gl.sum(dz.reshape(BM // NUM_WARPS, NUM_WARPS, BK), axis=0)
                warp = gl.arange(0, NUM_WARPS, layout=gl.SliceLayout(1, sums.type.layout))
                col = kk * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, sums.type.layout))
                row = (off_m // BM) * NUM_WARPS + warp
                gl.store(part_ptr + row[:, None] * N + col[None, :], sums, mask=(col < N)[None, :])
            nb += 1
            # One wgmma in flight: the one before, which read slot c - 1, is complete.
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index((c + S - 1) % S), count=1, pred=kk > 0)
            c += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((c + S - 1) % S), count=1)
        # dh's tile, BLOCK_K columns at a time through the dz buffers.
        dhs = _split_n(acc, SPLIT)
        for j in gl.static_range(SPLIT):
            buf = _dz_stage(dz_bufs, nb, stored)
            _store_over((dhs[j],), (buf,), (dh_desc,), off_m, off_r + j * BK)
            stored = True
            nb += 1
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["M"])
def _cross_dz_ws_kernel(
    g_desc,  # of g [M, N], blocks [BLOCK_M, BLOCK_K]
    x0_desc,  # of x0 [M, N], blocks [BLOCK_M, BLOCK_K]
    u_desc,  # of U [N, R], blocks [BLOCK_K, BLOCK_R] (R contiguous)
    dz_desc,  # of dz [M, N], blocks [BLOCK_M, BLOCK_K]
    dh_desc,  # of dh [M, R], blocks [BLOCK_M, BLOCK_K]
    part_ptr,  # [cdiv(M, BLOCK_M) * num_warps, N] fp32: dz's column sums, a row for each warp of each tile
    M,
    N,
    R,  # r
    STAGES: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    dtype: gl.constexpr = g_desc.dtype
    ring_g = gl.allocate_shared_memory(dtype, [STAGES] + g_desc.block_type.shape, g_desc.layout)
    ring_x0 = gl.allocate_shared_memory(dtype, [STAGES] + x0_desc.block_type.shape, x0_desc.layout)
    ring_u = gl.allocate_shared_memory(dtype, [STAGES] + u_desc.block_type.shape, u_desc.layout)
    dz_bufs = gl.allocate_shared_memory(dtype, [2] + dz_desc.block_type.shape, dz_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    # fmt: off
    gl.warp_specialize([
        (_dz_consumer, (g_desc, u_desc, dz_desc, dh_desc, ring_g, ring_x0, ring_u, ready, empty, dz_bufs,
                        part_ptr, M, N, R, gl.num_warps())),
        (_producer, ((g_desc, x0_desc), u_desc, (ring_g, ring_x0), ring_u, ready, empty, M, R, N, False)),
    ], [1], [PRODUCER_REGS])
    # fmt: on


def supported(*tensors: Tensor) -> bool:
    """Whether ``launch_fwd``, ``launch_bwd`` or ``launch_dz`` runs on these tensors (its tensor arguments): a
    CUDA GPU of compute capability 9.0 (wgmma, TMA and setmaxnreg are sm_90a's), not the interpreter, one
    dtype of bf16 or fp16, and every 2-D tensor able to back a TMA descriptor itself (columns contiguous,
    rows and base 16 bytes apart: N and r multiples of 8)."""
    first = tensors[0]
    return (
        not INTERPRETED
        and first.is_cuda
        and first.dtype in _GL_DTYPES
        and torch.cuda.get_device_capability(first.device) == (9, 0)
        and all(t.dtype == first.dtype and t.device == first.device for t in tensors)
        and all(describable(t) for t in tensors if t.dim() == 2)
    )


@cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _grid(t: Tensor, block_m: int, block_n: int) -> tuple[int]:
    """A launch's grid: one program an SM, never more than tiles of the [M, N] tensor t; t's device made
    current in this thread first (cudaSetDevice, which makes its primary context current). The launcher
    encodes the TMA descriptors (driver calls) before it makes a context current itself, and a thread that
    has called no CUDA runtime function yet, as autograd's worker thread may not have in a backward, has
    none there ("invalid device context")."""
    torch.cuda.set_device(t.device)
    m, n = t.shape
    return (min(_num_sms(t.device.index), triton.cdiv(m, block_m) * triton.cdiv(n, block_n)),)


def _descriptor(t: Tensor, block: list[int]) -> TensorDescriptor:
    # Blocks as they lie in memory (the last dimension contiguous), also V's [BLOCK_K, BLOCK_N]: wgmma reads
    # a 16-bit B operand in either order.
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def launch_fwd(h: Tensor, u: Tensor, b: Tensor, x0: Tensor, xl: Tensor, out: Tensor, zb: Tensor) -> None:
    """Write zb = h @ u^T + b and out = x0 * zb + xl into `out` and `zb` [M, N] (module docstring).

    Args:
        h: [M, r]; u: [N, r]; b: [N] contiguous; x0, xl, out, zb: [M, N]; one dtype (bf16 or fp16) on one
            Hopper GPU, as ``supported`` checks (not checked here).
    """
    if x0.shape[0] == 0:
        return
    block_m, block_n, epi_n, stages, slots = TILES[2]
    _cross_fwd_ws_kernel[_grid(x0, block_m, block_n)](
        _descriptor(h, [block_m, BLOCK_K]), _descriptor(u, [block_n, BLOCK_K]),
        *(_descriptor(t, [block_m, epi_n]) for t in (x0, xl, out, zb)),
        b, x0.shape[0], x0.shape[1], h.shape[1],
        STAGES=stages, SLOTS=slots, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4,
        maxnreg=MAXNREG,
    )  # fmt: skip


def launch_bwd(
    dh: Tensor, v: Tensor, g: Tensor, zb: Tensor, acc: Tensor | None, dxl: Tensor | None, dx0: Tensor
) -> None:
    """Write dxl = g + dh @ v into `dxl` and dx0 = g * zb (+ acc) into `dx0`; where `dxl` is None,
    dx0 = g * zb (+ acc) + g + dh @ v instead (module docstring).

    Args:
        dh: [M, r]; v: [r, N]; g, zb, dx0: [M, N]; acc: [M, N] or None; dxl: [M, N], g itself, or None;
            one dtype (bf16 or fp16) on one Hopper GPU, as ``supported`` checks (not checked here). No
            output shares memory with an input or the other output, except dxl with g.
    """
    if g.shape[0] == 0:
        return
    block_m, block_n, epi_n, stages, slots = TILES[2 if acc is None else 3]
    # Unread (acc) and unwritten (dxl) descriptors stand in for the tensors not given.
    epilogue = (g, zb, g if acc is None else acc, dx0 if dxl is None else dxl, dx0)
    _cross_bwd_ws_kernel[_grid(g, block_m, block_n)](
        _descriptor(dh, [block_m, BLOCK_K]), _descriptor(v, [BLOCK_K, block_n]),
        *(_descriptor(t, [block_m, epi_n]) for t in epilogue),
        g.shape[0], g.shape[1], dh.shape[1],
        ACCUMULATE=acc is not None, FOLD_DXL=dxl is None, STAGES=stages, SLOTS=slots,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip


def launch_dz(g: Tensor, x0: Tensor, u: Tensor, dz: Tensor, dh: Tensor) -> Tensor:
    """Write dz = g * x0 into `dz` and dh = dz @ u into `dh` (module docstring); returns b's gradient, dz's
    column sums [N] (fp32 sums of the fp32 products), in x0's dtype.

    Args:
        g, x0, dz: [M, N]; u: [N, r]; dh: [M, r]; one dtype (bf16 or fp16) on one Hopper GPU, as
            ``supported`` checks (not checked here). No output shares memory with an input.
    """
    m, n = g.shape
    block_m, block_r, stages = DZ_TILE
    part = launch.empty((triton.cdiv(m, block_m) * DZ_WARPS, n), torch.float32, g.device)
    if m > 0:
        _cross_dz_ws_kernel[_grid(dh, block_m, block_r)](
            *(_descriptor(t, [block_m, BLOCK_K]) for t in (g, x0)), _descriptor(u, [BLOCK_K, block_r]),
            *(_descriptor(t, [block_m, BLOCK_K]) for t in (dz, dh)), part, m, n, u.shape[1],
            STAGES=stages, PRODUCER_REGS=PRODUCER_REGS, num_warps=DZ_WARPS, maxnreg=MAXNREG,
        )  # fmt: skip
    return sum_partials(part, x0.dtype)
