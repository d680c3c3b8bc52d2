"""The DCNv2 cross layer's forward GEMM and epilogue on Hopper GPUs (sm_90): one warp-specialized,
persistent kernel written in Gluon (triton.experimental.gluon), which ``kernels.cross.launch_fwd`` takes
where it can (``supported``), its Triton kernel elsewhere.

    zb  = h @ U^T + b        h [M, r], U [N, r], b [N]   fp32 accumulation (wgmma), the bias first
    out = x0 * zb + xl       x0, xl [M, N]
out and zb [M, N] in the inputs' dtype (bf16 or fp16), the epilogue in fp32 on values cast after load, one
rounding at the store.

Why a kernel of its own: the Triton kernel runs its main loop (tensor cores) and then its epilogue, which
streams four [M, N] tensors (memory), one after the other in each program; at the MLPerf shape (M = 65,536,
N = 3,456, r = 512) both take about as long. Here two consumer warpgroups take alternate output tiles
("ping-pong"): while one runs its epilogue, the other's main loop keeps the tensor cores busy, and each
consumer's x0 and x_l arrive by TMA under its own main loop. scripts/bench_cross.py times the layer.

Partitions (gl.warp_specialize), one program an SM, walking output tiles t = pid, pid + P, ... (P programs)
of 128 x 128, row-major, so the programs running together read the same rows of h (U stays in L2):
- producer (a worker of 1 warp, few registers): for each of the program's tiles, for each K chunk, waits
  the ring slot's `empty` barrier and TMA-loads the [128, 64] chunks of h and U into it, which complete on
  the slot's `ready` barrier;
- consumer 0 (the default partition, 4 warps: one warpgroup) takes the program's tiles 0, 2, 4, ...;
  consumer 1 (a worker of 4 warps) tiles 1, 3, 5, ... For each tile a consumer
  1. waits until its previous tile's TMA stores have read its x0 / x_l buffers, then TMA-loads this tile's
     x0 and x_l into them (its `x_bar`);
  2. starts the accumulator at the bias, so that the tensor cores give zb = z + b in fp32;
  3. waits its turn (`order`), runs the main loop (async wgmma, one in flight; each ring slot released on
     `empty` once the wgmma that read it is complete) and hands the turn over once its last wgmma is issued;
  4. epilogue, per column sub-tile [128, EPI_N]: out = x0 * zb + x_l in fp32, out written over the
     sub-tile's x0 buffer and zb over its x_l buffer, both TMA-stored (waited at step 1 of its next tile).

Barriers (arrival count 1 each; phase k of an mbarrier completes at its (k + 1)-th arrival, for `ready` and
`x_bar` with the bytes announced by `expect` too; a wait for parity p returns once the last phase due of
that parity has completed; a fresh barrier counts as having completed a phase of parity 1):
- ready[s]: slot s holds its chunk. Arrive: the producer's expect and TMA loads. Wait: the chunk's consumer,
  parity (g // STAGES) & 1 for the program's g-th chunk (g counts the chunks of all its tiles in order; a
  consumer computes it from its tile's index).
- empty[s]: slot s may be refilled. Arrive: the consumer that read it. Wait: the producer, parity
  ((g // STAGES) & 1) ^ 1 (the first round passes at once).
- order[c]: consumer c may start a main loop. Arrive: the other consumer, having issued its last wgmma of a
  tile. Wait: consumer c at its i-th tile, parity (i & 1) ^ 1 for consumer 0 (its first wait passes) and
  i & 1 for consumer 1. Besides taking the tensor cores in turn, this makes the ring's parity waits sound
  with two consumers: a consumer waits for a chunk only after every earlier chunk was waited for, so no
  `ready` barrier is two phases behind the parity asked of it.
- x_bar[c]: consumer c's x0 and x_l have landed. Arrive: consumer c's expect and TMA loads. Wait: consumer
  c in its i-th tile's epilogue, parity i & 1.

Shared memory (2-byte dtypes): the ring, STAGES x (128 x 64 + 128 x 64) x 2 B = 96 KiB at 3 stages, and the
x0 / x_l buffers, 2 consumers x 2 x 128 x 128 x 2 B = 128 KiB: 224 KiB of Hopper's 227. Registers: 12 warps
at `.maxnreg` MAXNREG (all of the SM's 64 Ki), setmaxnreg moving them from the producer's warpgroup
(PRODUCER_REGS) to the consumers' (CONSUMER_REGS: the [128, 128] fp32 accumulator takes 128 a thread);
no spills (`scripts/cross_registers.py --kernel hopper` compiles it for sm_90a without a GPU).

Gluon has no interpreter: on the CPU, and for fp32, ``kernels.cross`` runs its Triton kernel; the GPU
tests compare the two (tests/test_cross_hopper.py).
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

from kernels.gemm.layout import describable
from kernels.launch import INTERPRETED

__all__ = ["launch", "supported"]

BLOCK_M = 128
BLOCK_N = 128
BLOCK_K = 64
# The epilogue's column sub-tile, its ring slots and its registers. Measured on an H200 at the MLPerf shape
# (bf16, graph replays), against 3 stages with 64-column sub-tiles: 32 columns slightly faster, 2 stages
# much slower (the producer cannot keep ahead of two consumers), 240 / 24 registers the same.
EPI_N = 32
STAGES = 3
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
def _producer(h_desc, u_desc, ring_h, ring_u, ready, empty, M, N, K):
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BK: gl.constexpr = h_desc.block_type.shape[1]
    BN: gl.constexpr = u_desc.block_type.shape[0]
    S: gl.constexpr = ring_h.type.shape[0]
    CHUNK_BYTES: gl.constexpr = h_desc.block_type.nbytes + u_desc.block_type.nbytes
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = gl.cdiv(M, BM) * num_pid_n
    k_tiles = gl.cdiv(K, BK)
    g = 0  # the program's chunk, over all its tiles
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(t, num_pid_n, BM, BN)
        for kk in range(k_tiles):
            s = g % S
            mbarrier.wait(empty.index(s), ((g // S) & 1) ^ 1)
            # The byte count by position: its keyword is named differently in triton 3.6 and 3.7.
            mbarrier.expect(ready.index(s), CHUNK_BYTES)
            tma.async_copy_global_to_shared(h_desc, [off_m, kk * BK], ready.index(s), ring_h.index(s))
            tma.async_copy_global_to_shared(u_desc, [off_n, kk * BK], ready.index(s), ring_u.index(s))
            g += 1


@gluon.jit
def _consumer(
    h_desc, u_desc, x0_desc, xl_desc, out_desc, zb_desc, ring_h, ring_u, ready, empty, x0_bufs, xl_bufs,
    x_bar, order, b_ptr, M, N, K, WHICH: gl.constexpr,
):  # fmt: skip
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BK: gl.constexpr = h_desc.block_type.shape[1]
    BN: gl.constexpr = u_desc.block_type.shape[0]
    EPI: gl.constexpr = x0_desc.block_type.shape[1]
    SPLIT: gl.constexpr = BN // EPI
    S: gl.constexpr = ring_h.type.shape[0]
    X_BYTES: gl.constexpr = 2 * SPLIT * x0_desc.block_type.nbytes
    # One warpgroup: wgmma atoms of 64 rows, the 4 warps along M, the tile's BN columns in one instruction.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 256 // h_desc.dtype.primitive_bitwidth]
    )
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    my_x_bar = x_bar.index(WHICH)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = gl.cdiv(M, BM) * num_pid_n
    k_tiles = gl.cdiv(K, BK)
    step = gl.num_programs(0)
    i = 0  # this consumer's tile: the program's tile 2 i + WHICH
    for t in range(gl.program_id(0) + WHICH * step, num_tiles, 2 * step):
        off_m, off_n = _tile_offsets(t, num_pid_n, BM, BN)
        # 1. This tile's x0 and x_l, once the last tile's stores have read the buffers.
        tma.store_wait(0)
        mbarrier.expect(my_x_bar, X_BYTES)
        for j in gl.static_range(SPLIT):
            buf = WHICH * SPLIT + j
            tma.async_copy_global_to_shared(x0_desc, [off_m, off_n + j * EPI], my_x_bar, x0_bufs.index(buf))
            tma.async_copy_global_to_shared(xl_desc, [off_m, off_n + j * EPI], my_x_bar, xl_bufs.index(buf))
        # 2. The accumulator starts at the bias.
        bias = gl.load(b_ptr + off_n + cols, mask=off_n + cols < N, other=0.0).to(gl.float32)
        acc = gl.zeros([BM, BN], gl.float32, acc_layout) + gl.expand_dims(bias, 0)
        # 3. The main loop, in turn with the other consumer.
        mbarrier.wait(order.index(WHICH), (i & 1) ^ (1 - WHICH))
        g = (2 * i + WHICH) * k_tiles  # the producer's count of this tile's first chunk
        for kk in range(k_tiles):
            s = g % S
            mbarrier.wait(ready.index(s), (g // S) & 1)
            acc = warpgroup_mma(ring_h.index(s), ring_u.index(s).permute((1, 0)), acc, is_async=True)
            # One wgmma in flight: the one before, which read slot g - 1, is complete.
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index((g + S - 1) % S), count=1, pred=kk > 0)
            g += 1
        mbarrier.arrive(order.index(1 - WHICH), count=1)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((g + S - 1) % S), count=1)
        # 4. The epilogue, a column sub-tile at a time, over the sub-tile's buffers.
        mbarrier.wait(my_x_bar, i & 1)
        zbs = _split_n(acc, SPLIT)
        for j in gl.static_range(SPLIT):
            zb = zbs[j]
            x0_buf = x0_bufs.index(WHICH * SPLIT + j)
            xl_buf = xl_bufs.index(WHICH * SPLIT + j)
            x0 = x0_buf.load(zb.type.layout).to(gl.float32)
            xl = xl_buf.load(zb.type.layout).to(gl.float32)
            x0_buf.store((x0 * zb + xl).to(out_desc.dtype))
            xl_buf.store(zb.to(zb_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [off_m, off_n + j * EPI], x0_buf)
            tma.async_copy_shared_to_global(zb_desc, [off_m, off_n + j * EPI], xl_buf)
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
    CONSUMER_REGS: gl.constexpr,  # setmaxnreg of the worker consumer (the default partition: what is left)
    PRODUCER_REGS: gl.constexpr,
):
    dtype: gl.constexpr = h_desc.dtype
    SPLIT: gl.constexpr = u_desc.block_type.shape[0] // x0_desc.block_type.shape[1]
    ring_h = gl.allocate_shared_memory(dtype, [STAGES] + h_desc.block_type.shape, h_desc.layout)
    ring_u = gl.allocate_shared_memory(dtype, [STAGES] + u_desc.block_type.shape, u_desc.layout)
    # Consumer c's x0 and x_l sub-tiles are c * SPLIT + j.
    x0_bufs = gl.allocate_shared_memory(dtype, [2 * SPLIT] + x0_desc.block_type.shape, x0_desc.layout)
    xl_bufs = gl.allocate_shared_memory(dtype, [2 * SPLIT] + xl_desc.block_type.shape, xl_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for c in gl.static_range(2):
        mbarrier.init(x_bar.index(c), count=1)
        mbarrier.init(order.index(c), count=1)
    fence_async_shared()  # the inits before any TMA (the async proxy) signals a barrier
    # (functions and arguments, worker warps, worker registers) by position: triton 3.6 requires the
    # registers, 3.7 names them differently. The 4-warp consumer is the first worker, so that it is an
    # aligned warpgroup (warps 4-7), as wgmma needs. Its arguments are written out: a literal appended to a
    # tuple of them does not pass through warp_specialize.
    # fmt: off
    gl.warp_specialize([
        (_consumer, (h_desc, u_desc, x0_desc, xl_desc, out_desc, zb_desc, ring_h, ring_u, ready, empty,
                     x0_bufs, xl_bufs, x_bar, order, b_ptr, M, N, K, 0)),
        (_consumer, (h_desc, u_desc, x0_desc, xl_desc, out_desc, zb_desc, ring_h, ring_u, ready, empty,
                     x0_bufs, xl_bufs, x_bar, order, b_ptr, M, N, K, 1)),
        (_producer, (h_desc, u_desc, ring_h, ring_u, ready, empty, M, N, K)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    # fmt: on


def supported(*tensors: Tensor) -> bool:
    """Whether ``launch`` runs on these tensors (h, U, b, x0, x_l, out, zb): a CUDA GPU of compute
    capability 9.0 (wgmma, TMA and setmaxnreg are sm_90a's), not the interpreter, one dtype of bf16 or
    fp16, and every 2-D tensor able to back a TMA descriptor itself (columns contiguous, rows and base 16
    bytes apart: N and r multiples of 8)."""
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


def _descriptor(t: Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def launch(h: Tensor, u: Tensor, b: Tensor, x0: Tensor, xl: Tensor, out: Tensor, zb: Tensor) -> None:
    """Write zb = h @ u^T + b and out = x0 * zb + xl into `out` and `zb` [M, N] (module docstring).

    Args:
        h: [M, r]; u: [N, r]; b: [N] contiguous; x0, xl, out, zb: [M, N]; one dtype (bf16 or fp16) on one
            Hopper GPU, as ``supported`` checks (not checked here).
    """
    m, n = x0.shape
    if m == 0:
        return
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    _cross_fwd_ws_kernel[(min(_num_sms(x0.device.index), tiles),)](
        _descriptor(h, [BLOCK_M, BLOCK_K]), _descriptor(u, [BLOCK_N, BLOCK_K]),
        *(_descriptor(t, [BLOCK_M, EPI_N]) for t in (x0, xl, out, zb)),
        b, m, n, h.shape[1],
        STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
