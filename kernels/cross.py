"""Fused DCNv2 cross layer, forward and backward: ``x_{l+1} = x0 * (U (V x_l) + b) + x_l``.

Math (nn.Linear layout: V [r, N], U [N, r]; * elementwise, b broadcast over rows)
    h        = x_l @ V^T                  [M, r]   cuBLAS
    z        = h @ U^T                    [M, N]
    x_{l+1}  = x0 * (z + b) + x_l         [M, N]   one GEMM kernel (h @ U^T) with this epilogue: Triton's,
                                                   or kernels.cross_hopper's (Hopper GPUs, bf16 / fp16)
Backward, with g = dL/dx_{l+1} [M, N] and zb = z + b saved by the forward:
    dz   = g * x0                         [M, N]   one elementwise Triton kernel, with this one
    db   = sum over rows of dz            [N]      (fp32 partials per 32 rows, kernels.gemm.partials)
    dh   = dz @ U                         [M, r]   cuBLAS; on Hopper GPUs (bf16 / fp16) kernels.cross_hopper's
                                                   GEMM takes dz and db in its main loop instead
    dU   = dz^T @ h                       [N, r]   cuBLAS
    dV   = dh^T @ x_l                     [r, N]   cuBLAS
    dx_l = g + dh @ V                     [M, N]   kernels.cross_hopper's GEMM with these two in its
    dx0  = g * zb                         [M, N]   epilogue (Hopper GPUs, bf16 / fp16); elsewhere dx0 in
                                                   the elementwise kernel, which also copies g, and a
                                                   cuBLAS addmm_ onto that copy
For the first layer x_l is x0 itself, and its caller adds dx0 and dx_l: autograd for one layer, the
kernels' own epilogues in a network of layers (``kernels.cross_net``: ``launch_bwd_inputs``' acc and
dxl=None).

Why save zb rather than recompute it: recomputing z = h @ U^T in the backward is a GEMM of 2 M N r FLOPs
(0.23 TFLOP a layer at the MLPerf shape, M = 65,536, N = 3,456, r = 512) fused with an epilogue that streams
five [M, N] tensors; saved, the backward's epilogues only stream [M, N] tensors and the forward writes one
more. The cost: zb [M, N] held per layer until the backward.

Shapes: x0, x_l [M, N]; V [r, N]; U [N, r]; b [N]; any M >= 0, 1 <= N < MAX_N (2**23), r >= 1. The forward
reads x0 and x_l through TMA descriptors and writes out and zb with one row stride, N (x0 and x_l are
copied where their rows lie further apart); the backward takes
rows of x0 and g with contiguous columns (any row stride); h and U are read through TMA descriptors
(``kernels.launch``), copied once into 16-byte rows where r is not a multiple of 16 bytes. The forward
returns (out, h, zb): h [M, r] and zb [M, N] are what the backward reads besides the inputs.

Dtypes: all five tensors fp32, bf16 or fp16 (one dtype); outputs and gradients have it too. Compute: fp32
accumulation; the GEMM operands go to ``tl.dot`` in their own dtype on the GPU's tensor cores (fp32 as one
TF32 product where ``torch.backends.cuda.matmul.allow_tf32``, else as three, 3xTF32, as linear_act), cast to
fp32 in the interpreter (``DOT_FP32``);
the epilogues run in fp32 on values cast right after load and round once to the dtype. h, zb, and dz before
the backward's GEMMs, are rounded to the dtype (as PyTorch's autocast does).

It equals the PyTorch expression ``x0 * F.linear(F.linear(xl, V), U, b) + xl`` computed in fp32 and cast
back to x0's dtype (``cross_layer_ref``), up to the GEMM precision above.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import cross_hopper, launch
from kernels.gemm.layout import describable, rows_contiguous, tma_descriptor
from kernels.gemm.partials import sum_partials
from kernels.gemm.tiles import matmul_tile
from kernels.gemm.tuning import autotuned, input_precision, m_bucket
from kernels.launch import DTYPES, INTERPRETED, use_triton
from kernels.op import define_op

__all__ = ["cross_layer", "cross_layer_ref", "cross_layer_fwd", "cross_layer_bwd"]

# The backward kernel's tile: PARTIAL_ROWS rows (one row of db's partial sums a program) by _BWD_BLOCK_N
# columns, 4096 elements: a pure stream of [M, N] tensors.
PARTIAL_ROWS = 32
_BWD_BLOCK_N = 128

# The forward kernel's offsets inside a tile are 32-bit: up to 256 rows of N elements.
MAX_N = 2**31 // 256

# The TMA descriptor arguments of the forward kernel and the tile dims of their block shapes: x0 and x_l
# are read a quarter of the tile's columns at a time (its epilogue).
_QUARTER = ("BLOCK_M", ("BLOCK_N", 4))
_DESCRIPTORS = {
    "h_desc": ("BLOCK_M", "BLOCK_K"),
    "u_desc": ("BLOCK_N", "BLOCK_K"),
    "x0_desc": _QUARTER,
    "xl_desc": _QUARTER,
    "out_desc": _QUARTER,
    "zb_desc": _QUARTER,
}


@triton.jit
def _tile(N, BLOCK_N: tl.constexpr):
    """(pid_m, pid_n) of this program's output tile, tiles in row-major order: the programs running together
    read the same rows of h, and U ([N, r], 3.5 MiB in bf16 for the MLPerf model) stays in L2 whole."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    return pid // num_pid_n, pid % num_pid_n


@triton.jit
def _halves(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The left and right [BLOCK_M, BLOCK_N // 2] halves of x [BLOCK_M, BLOCK_N]."""
    return tl.split(tl.permute(tl.reshape(x, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _fwd_epilogue(
    z, off_m, off_n, b_ptr, x0_desc, xl_desc, out_desc, zb_desc, out_ptr, zb_ptr, M, N, stride,
    TMA_STORE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The forward's epilogue on z [BLOCK_M, BLOCK_N] fp32 (h @ U^T), the columns off_n .. of the rows off_m
    ..: zb = z + b and out = x0 * zb + x_l stored. x0 and x_l come in through their descriptors (pointer loads
    in the dot's register layout are uncoalesced); out and zb go out through theirs where TMA_STORE, else by
    pointers: one row stride, and offsets inside the tile that are 32-bit (the tile's first row is added to
    the base pointers in 64 bits)."""
    cols = off_n + tl.arange(0, BLOCK_N)
    zb = z + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    x0 = x0_desc.load([off_m, off_n]).to(tl.float32)
    xl = xl_desc.load([off_m, off_n]).to(tl.float32)
    if TMA_STORE:
        out_desc.store([off_m, off_n], (x0 * zb + xl).to(out_desc.dtype))
        zb_desc.store([off_m, off_n], zb.to(zb_desc.dtype))
    else:
        rows = tl.arange(0, BLOCK_M)
        mask = (off_m + rows < M)[:, None] & (cols < N)[None, :]
        offset = rows[:, None] * stride + cols[None, :]
        base = off_m.to(tl.int64) * stride
        tl.store(out_ptr + base + offset, (x0 * zb + xl).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(zb_ptr + base + offset, zb.to(zb_ptr.dtype.element_ty), mask=mask)


# M (the batch) changes between calls: do not specialize on it, so a new batch size reuses the compiled
# kernel. M_BUCKET only feeds the autotuning key.
@triton.jit(do_not_specialize=["M"])
def _cross_fwd_kernel(
    # operands: TMA descriptors
    h_desc,  # of h [M, r], x0's dtype
    u_desc,  # of U [N, r]
    x0_desc,  # of x0 [M, N]
    xl_desc,  # of x_l [M, N]
    out_desc,  # TMA_STORE: of out [M, N] (otherwise any descriptor, not used)
    zb_desc,  # TMA_STORE: of zb [M, N] (otherwise any descriptor, not used)
    # pointers
    b_ptr,  # [N] bias
    out_ptr,  # [M, N] output x_{l+1}
    zb_ptr,  # [M, N] output zb = z + b, for the backward
    # sizes
    M,
    N,
    K,  # r
    M_BUCKET,  # autotuning key only
    stride,  # the row stride of out and zb, in elements (the column stride is 1)
    # meta-parameters
    TMA_STORE: tl.constexpr,  # store out and zb through their descriptors (rows 16 bytes apart)
    DOT_FP32: tl.constexpr,  # cast dot operands to fp32 (interpreter only)
    INPUT_PRECISION: tl.constexpr,  # fp32 dots: "tf32" or "tf32x3", "ieee" interpreted
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = _tile(N, BLOCK_N)
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    z = matmul_tile(h_desc, u_desc, off_m, off_n, K, DOT_FP32, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    # The epilogue, in fp32, a quarter of the tile's columns at a time: on the whole tile, its z, x0, x_l and
    # the stores' addresses spill registers in every config (ptxas for sm_90a: kilobytes a thread); in
    # quarters, with 32-bit offsets, none do.
    q: tl.constexpr = BLOCK_N // 4
    left, right = _halves(z, BLOCK_M, BLOCK_N)
    z0, z1 = _halves(left, BLOCK_M, 2 * q)
    _fwd_epilogue(
        z0, off_m, off_n, b_ptr, x0_desc, xl_desc, out_desc, zb_desc, out_ptr, zb_ptr, M, N, stride,
        TMA_STORE, BLOCK_M, q,
    )  # fmt: skip
    _fwd_epilogue(
        z1, off_m, off_n + q, b_ptr, x0_desc, xl_desc, out_desc, zb_desc, out_ptr, zb_ptr, M, N, stride,
        TMA_STORE, BLOCK_M, q,
    )  # fmt: skip
    z2, z3 = _halves(right, BLOCK_M, 2 * q)
    _fwd_epilogue(
        z2, off_m, off_n + 2 * q, b_ptr, x0_desc, xl_desc, out_desc, zb_desc, out_ptr, zb_ptr, M, N, stride,
        TMA_STORE, BLOCK_M, q,
    )  # fmt: skip
    _fwd_epilogue(
        z3, off_m, off_n + 3 * q, b_ptr, x0_desc, xl_desc, out_desc, zb_desc, out_ptr, zb_ptr, M, N, stride,
        TMA_STORE, BLOCK_M, q,
    )  # fmt: skip


_cross_fwd_kernel = autotuned(_cross_fwd_kernel, "out_ptr", descriptors=_DESCRIPTORS)


def check_inputs(x0: Tensor, xl: Tensor, v: Tensor, u: Tensor, b: Tensor) -> None:
    """Raise ValueError naming the offending values; works on fake tensors too."""
    named = {"x0": x0, "xl": xl, "v": v, "u": u, "b": b}
    for name, t in named.items():
        dims = 1 if name == "b" else 2
        if t.dim() != dims:
            raise ValueError(f"cross_layer: {name} must be {dims}-D, got shape {tuple(t.shape)}")
    m, n = x0.shape
    r = v.shape[0]
    expected = {"xl": (m, n), "v": (r, n), "u": (n, r), "b": (n,)}
    for name, shape in expected.items():
        if tuple(named[name].shape) != shape:
            raise ValueError(
                f"cross_layer: {name} must have shape {shape} for x0 {tuple(x0.shape)} and v "
                f"{tuple(v.shape)}, got {tuple(named[name].shape)}"
            )
    if n < 1 or r < 1:
        raise ValueError(f"cross_layer: need N >= 1 and r >= 1, got x0 {tuple(x0.shape)}, v {tuple(v.shape)}")
    if n >= MAX_N:
        raise ValueError(f"cross_layer: N must be below {MAX_N} (32-bit offsets inside a tile), got {n}")
    if x0.dtype not in DTYPES:
        raise ValueError(f"cross_layer: x0 dtype must be one of {DTYPES}, got {x0.dtype}")
    for name, t in named.items():
        if t.dtype != x0.dtype:
            raise ValueError(f"cross_layer: {name} dtype {t.dtype} differs from x0 dtype {x0.dtype}")
        if t.device != x0.device:
            raise ValueError(f"cross_layer: {name} is on {t.device} but x0 is on {x0.device}")


def cross_layer_fwd(x0: Tensor, xl: Tensor, v: Tensor, u: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The forward: h = xl @ v^T (cuBLAS), then ``_cross_fwd_kernel``: out = x0 * zb + xl, zb = h @ u^T + b.

    Args:
        x0, xl: [M, N] fp32/bf16/fp16, contiguous columns.
        v: [r, N]; u: [N, r]; b: [N]; x0's dtype and device.

    Returns:
        (out [M, N], h [M, r], zb [M, N]), x0's dtype; h and zb are what the backward needs besides the
        inputs.

    Raises:
        ValueError: bad shapes, dtypes or devices.
    """
    check_inputs(x0, xl, v, u, b)
    return launch_fwd(x0, xl, v, u, b)


def launch_fwd(
    x0: Tensor,
    xl: Tensor,
    v: Tensor,
    u: Tensor,
    b: Tensor,
    out: Tensor | None = None,
    h: Tensor | None = None,
    zb: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``cross_layer_fwd`` without its input checks; `out` and `zb` [M, N] and `h` [M, r] (contiguous, x0's
    dtype), where given, are written in place of new tensors (a cross network's buffers,
    kernels.cross_net). x0 and xl are copied where their rows are not N apart: the kernel takes one row
    stride for its four [M, N] tensors. On a Hopper GPU, with bf16 or fp16 tensors that TMA can describe,
    the GEMM and epilogue run in ``kernels.cross_hopper``'s warp-specialized kernel; elsewhere in
    ``_cross_fwd_kernel``."""
    x0, xl = x0.contiguous(), xl.contiguous()
    h = torch.matmul(xl, v.t(), out=h)
    m, n = x0.shape
    out = launch.empty((m, n), x0.dtype, x0.device) if out is None else out
    zb = launch.empty((m, n), x0.dtype, x0.device) if zb is None else zb
    assert out.is_contiguous() and zb.is_contiguous(), "the kernel's four [M, N] tensors share one row stride"
    if m == 0:
        return out, h, zb
    u, b = u.contiguous(), b.contiguous()
    if cross_hopper.supported(h, u, b, x0, xl, out, zb):
        cross_hopper.launch_fwd(h, u, b, x0, xl, out, zb)
        return out, h, zb
    triton_fwd(x0, xl, h, u, b, out, zb)
    return out, h, zb


def triton_fwd(x0: Tensor, xl: Tensor, h: Tensor, u: Tensor, b: Tensor, out: Tensor, zb: Tensor) -> None:
    """``_cross_fwd_kernel``: zb = h @ u^T + b and out = x0 * zb + xl written into `out` and `zb` [M, N]
    (contiguous, M > 0), for x0, xl [M, N] contiguous, h [M, r], u [N, r] and b [N] contiguous."""
    m, n = x0.shape

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    # out and zb are contiguous [M, N] (a cross network's buffers included): their descriptors can store
    # them where N is a multiple of 16 bytes and their bases are 16-byte aligned.
    tma_store = describable(out) and describable(zb)
    x0_desc = tma_descriptor(x0)
    out_desc, zb_desc = (tma_descriptor(out), tma_descriptor(zb)) if tma_store else (x0_desc, x0_desc)
    _cross_fwd_kernel[grid](
        tma_descriptor(h), tma_descriptor(u), x0_desc, tma_descriptor(xl), out_desc, zb_desc, b,
        out, zb, m, n, h.shape[1], m_bucket(m), n,
        TMA_STORE=tma_store, DOT_FP32=INTERPRETED, INPUT_PRECISION=input_precision(x0.dtype),
    )  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _cross_bwd_kernel(
    # pointers
    x0_ptr,  # [M, N] x0
    g_ptr,  # [M, N] g = dL/dx_{l+1}
    zb_ptr,  # [M, N] zb = z + b, the forward's
    dz_ptr,  # [M, N] output dz = g * x0
    dx0_ptr,  # [M, N] output dx0 = g * zb (+ g where ADD_G, + acc where ACCUMULATE)
    acc_ptr,  # [M, N] ACCUMULATE: the x0 gradient of the layers after this one (not read otherwise)
    copy_ptr,  # [M, N] COPY_G: output, a copy of g (not written otherwise)
    part_ptr,  # [cdiv(M, BLOCK_M), N] fp32 output: sums of fp32 dz over each BLOCK_M rows
    # sizes
    M,
    N,
    # row strides, in elements (the column stride is 1)
    stride_x0,
    stride_g,
    stride_zb,
    stride_dz,
    stride_dx0,
    stride_acc,
    stride_copy,
    # meta-parameters
    ACCUMULATE: tl.constexpr,  # add acc (a cross network's x0 gradient, summed over its layers)
    ADD_G: tl.constexpr,  # and + g: the first layer's x_l is x0 (the dh @ V of that path is the caller's)
    COPY_G: tl.constexpr,  # write g's copy, on which the caller adds dh @ V in place (x_l's gradient)
    BLOCK_M: tl.constexpr,  # PARTIAL_ROWS: one row of partial sums a program
    BLOCK_N: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    # In fp32: dz = g * x0, dx0 = g * zb, and dz's column sums. Masked rows and columns load g = 0, so
    # they add 0 to the sums.
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    if COPY_G:
        tl.store(copy_ptr + rows[:, None] * stride_copy + cols[None, :], g, mask=mask)
    g = g.to(tl.float32)
    x0 = tl.load(x0_ptr + rows[:, None] * stride_x0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dz = g * x0
    tl.store(dz_ptr + rows[:, None] * stride_dz + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)
    zb = tl.load(zb_ptr + rows[:, None] * stride_zb + cols[None, :], mask=mask, other=0.0)
    dx0 = g * zb.to(tl.float32)
    if ADD_G:
        dx0 += g
    if ACCUMULATE:  # from another buffer than dx0
        dx0 += tl.load(acc_ptr + rows[:, None] * stride_acc + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
    tl.store(
        dx0_ptr + rows[:, None] * stride_dx0 + cols[None, :], dx0.to(dx0_ptr.dtype.element_ty), mask=mask
    )
    tl.store(part_ptr + pid_m * N + cols, tl.sum(dz, axis=0), mask=cols < N)


def cross_layer_bwd(
    g: Tensor, x0: Tensor, xl: Tensor, v: Tensor, u: Tensor, b: Tensor, h: Tensor, zb: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward (module docstring): ``_cross_bwd_kernel`` (dz, dx0 and db's partial sums), then the
    GEMMs on cuBLAS.

    Args:
        g: [M, N] gradient of the output; x0, xl, v, u, b: the forward's inputs; h: [M, r] and zb:
            [M, N] the forward's h = xl @ v^T and zb = h @ u^T + b. One dtype and device.

    Returns:
        (dx0, dxl, dv, du, db): the gradients of x0 (the direct term g * (z + b) only: for the first layer,
        where xl is x0, the caller adds dxl), xl, v, u and b, x0's dtype.

    Raises:
        ValueError: bad shapes, dtypes or devices.
    """
    check_inputs(x0, xl, v, u, b)
    if g.shape != x0.shape or zb.shape != x0.shape or h.shape != (x0.shape[0], v.shape[0]):
        shapes = f"g {tuple(g.shape)}, h {tuple(h.shape)} or zb {tuple(zb.shape)}"
        raise ValueError(f"cross_layer_bwd: {shapes} do not fit x0, v")
    return launch_bwd(g, x0, xl, v, u, b, h, zb)


def launch_bwd(
    g: Tensor, x0: Tensor, xl: Tensor, v: Tensor, u: Tensor, b: Tensor, h: Tensor, zb: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``cross_layer_bwd`` without its input checks."""
    g, x0 = rows_contiguous(g), rows_contiguous(x0)
    dx0, dxl = (launch.empty(x0.shape, x0.dtype, x0.device) for _ in range(2))
    dz, dh, db = launch_bwd_inputs(g, x0, zb, v, u, None, dxl, dx0)
    return dx0, dxl, dh.t() @ rows_contiguous(xl), dz.t() @ h, db


def launch_bwd_inputs(
    g: Tensor,
    x0: Tensor,
    zb: Tensor,
    v: Tensor,
    u: Tensor,
    acc: Tensor | None,
    dxl: Tensor | None,
    dx0: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """The layer's backward but its weight GEMMs (dV, dU): returns (dz [M, N], dh [M, r], db [N]), x0's
    dtype, and writes x_l's gradient g + dh @ v into `dxl` and x0's direct term g * zb (+ `acc`, the later
    layers' x0 gradient) into `dx0`; where `dxl` is None, dx0 takes x_l's gradient as well (the first layer
    of a network, whose x_l is x0).

    g and x0 rows-contiguous; `dxl` [M, N] a new tensor or g itself (never autograd's gradient: it is
    written); `dx0` [M, N] rows-contiguous, not `acc`'s memory. On a Hopper GPU with tensors TMA can
    describe (bf16 / fp16), ``kernels.cross_hopper``'s kernels compute dz with dh = dz @ u (and db), then
    dh @ V with dxl and dx0 in the epilogue; elsewhere ``_cross_bwd_kernel`` writes dz, db's partial sums
    and dx0 (and g's copy into a new `dxl`), and cuBLAS computes dh and adds dh @ v onto dxl (or dx0) in
    place."""
    m, r = x0.shape[0], v.shape[0]
    dh = launch.empty((m, r), x0.dtype, x0.device)
    given = [t for t in (acc, dxl) if t is not None]
    if cross_hopper.supported(dh, v, g, x0, u, zb, dx0, *given):
        dz = launch.empty(x0.shape, x0.dtype, x0.device)
        db = cross_hopper.launch_dz(g, x0, u, dz, dh)
        cross_hopper.launch_bwd(dh, v, g, zb, acc, dxl, dx0)
        return dz, dh, db
    copy = None if dxl is None or dxl is g else dxl
    dz, db = launch_bwd_epilogue(g, x0, zb, dx0, acc, add_g=dxl is None, copy=copy)
    torch.matmul(dz, u, out=dh)
    (dx0 if dxl is None else dxl).addmm_(dh, v)
    return dz, dh, db


def launch_bwd_epilogue(
    g: Tensor,
    x0: Tensor,
    zb: Tensor,
    dx0: Tensor,
    acc: Tensor | None,
    add_g: bool,
    copy: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``_cross_bwd_kernel`` on rows-contiguous g and x0 [M, N]: (dz [M, N], db [N]), x0's dtype; writes
    `dx0` [M, N] (rows contiguous, not `acc`'s memory): g * zb, + g where `add_g`, + `acc` [M, N] where
    given; and g into `copy` [M, N] (rows contiguous) where given: x_l's gradient g + dh @ V then takes
    dh @ V in place (an addmm onto g itself would first copy g, a pass of its own over two [M, N] tensors;
    here the copy is one more store of values the kernel loads anyway)."""
    m, n = x0.shape
    dz = launch.empty((m, n), x0.dtype, x0.device)
    part = launch.empty((triton.cdiv(m, PARTIAL_ROWS), n), torch.float32, x0.device)
    if m == 0:
        return dz, torch.zeros(n, dtype=x0.dtype, device=x0.device)
    zb = rows_contiguous(zb)
    # Unread and unwritten pointers stand in for the tensors not given.
    _cross_bwd_kernel[(triton.cdiv(m, PARTIAL_ROWS), triton.cdiv(n, _BWD_BLOCK_N))](
        x0, g, zb, dz, dx0, dx0 if acc is None else acc, dz if copy is None else copy, part, m, n,
        x0.stride(0), g.stride(0), zb.stride(0), dz.stride(0), dx0.stride(0),
        dx0.stride(0) if acc is None else acc.stride(0), dz.stride(0) if copy is None else copy.stride(0),
        ACCUMULATE=acc is not None, ADD_G=add_g, COPY_G=copy is not None,
        BLOCK_M=PARTIAL_ROWS, BLOCK_N=_BWD_BLOCK_N, num_warps=4,
    )  # fmt: skip
    return dz, sum_partials(part, x0.dtype)


# --------------------------------------------------------------------------------------------------
# Reference (plain PyTorch, fp32) and CPU fallback
# --------------------------------------------------------------------------------------------------


def cross_layer_ref(x0: Tensor, xl: Tensor, v: Tensor, u: Tensor, b: Tensor) -> Tensor:
    """Reference ``x0 * F.linear(F.linear(xl, v), u, b) + xl`` in plain PyTorch: fp32 math, cast back to x0's
    dtype. Differentiable by autograd (the tests' reference gradients).

    Args:
        x0, xl: [M, N]; v: [r, N]; u: [N, r]; b: [N]; float tensors.

    Returns:
        [M, N] tensor of x0's dtype.
    """
    x0f, xlf = x0.float(), xl.float()
    z = torch.nn.functional.linear(torch.nn.functional.linear(xlf, v.float()), u.float(), b.float())
    return (x0f * z + xlf).to(x0.dtype)


def cross_layer_fwd_ref(
    x0: Tensor, xl: Tensor, v: Tensor, u: Tensor, b: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``cross_layer_fwd`` in plain PyTorch (fp32 math; h and zb rounded to the dtype, as the kernels')."""
    h = (xl.float() @ v.float().t()).to(x0.dtype)
    zb = h.float() @ u.float().t() + b.float()
    out = x0.float() * zb + xl.float()
    return out.to(x0.dtype), h, zb.to(x0.dtype)


def cross_layer_bwd_ref(
    g: Tensor, x0: Tensor, xl: Tensor, v: Tensor, u: Tensor, b: Tensor, h: Tensor, zb: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``cross_layer_bwd`` in plain PyTorch (fp32 math): analytic, since autograd does not record inside a
    custom op's implementation."""
    gf, x0f, hf, uf = g.float(), x0.float(), h.float(), u.float()
    dz = gf * x0f
    dh = dz @ uf
    grads = (gf * zb.float(), gf + dh @ v.float(), dh.t() @ xl.float(), dz.t() @ hf, dz.sum(0))
    return tuple(t.to(x0.dtype) for t in grads)


# --------------------------------------------------------------------------------------------------
# Autograd glue: custom ops, so the layer works under torch.compile and inside CUDA graphs; eager calls run
# the same bodies without the dispatcher (kernels/op.py)
# --------------------------------------------------------------------------------------------------


def _forward(x0: Tensor, xl: Tensor, v: Tensor, u: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The forward's body: (out, h, zb)."""
    check_inputs(x0, xl, v, u, b)
    return launch_fwd(x0, xl, v, u, b) if use_triton(x0) else cross_layer_fwd_ref(x0, xl, v, u, b)


def _cross_fake(x0: Tensor, xl: Tensor, v: Tensor, u: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    check_inputs(x0, xl, v, u, b)
    return x0.new_empty(x0.shape), x0.new_empty((x0.shape[0], v.shape[0])), x0.new_empty(x0.shape)


def _backward_body(
    g: Tensor, x0: Tensor, xl: Tensor, v: Tensor, u: Tensor, b: Tensor, h: Tensor, zb: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward's body: (dx0, dxl, dv, du, db), on the forward's own inputs (not checked again)."""
    if use_triton(x0):
        return launch_bwd(g, x0, xl, v, u, b, h, zb)
    return cross_layer_bwd_ref(g, x0, xl, v, u, b, h, zb)


def _cross_backward_fake(
    g: Tensor, x0: Tensor, xl: Tensor, v: Tensor, u: Tensor, b: Tensor, h: Tensor, zb: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(t.new_empty(t.shape) for t in (x0, xl, v, u, b))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs, output[1], output[2])


def _gradients(backward_fn, ctx, g: Tensor | None, _dh: Tensor | None, _dzb: Tensor | None):
    # backward_fn: the backward op, or its body on the eager path. _dh, _dzb: the gradients of the internal
    # outputs h and zb, which cross_layer never exposes (None).
    return backward_fn(g, *ctx.saved_tensors)


_cross = define_op(
    "cross_layer", _forward, _cross_fake, _setup_context, _gradients, _backward_body, _cross_backward_fake
)


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def cross_layer(x0: Tensor, xl: Tensor, v: Tensor, u: Tensor, b: Tensor) -> Tensor:
    """One fused DCNv2 cross layer, ``x0 * (xl @ v^T @ u^T + b) + xl``, with a fused backward.

    Equals ``x0 * F.linear(F.linear(xl, v), u, b) + xl``. Differentiable in every input; works in eager and
    under ``torch.compile``, which sees the custom op ``torch.ops.dlrm.cross_layer`` (its backward
    ``torch.ops.dlrm.cross_layer_backward``). Runs the Triton kernels on CUDA tensors (and on CPU under
    ``TRITON_INTERPRET=1``), else falls back to plain PyTorch (``cross_layer_ref``'s math).

    Args:
        x0: [M, N] the cross network's input, fp32, bf16 or fp16 (M >= 0, N >= 1), contiguous columns.
        xl: [M, N] this layer's input (x0 itself for the first layer), x0's dtype and device.
        v: [r, N] the down projection V (nn.Linear layout, no bias), r >= 1.
        u: [N, r] the up projection U (nn.Linear layout).
        b: [N] U's bias.

    Returns:
        [M, N] tensor of x0's dtype: the GEMMs accumulated in fp32 (TF32 tensor cores for fp32 inputs on the
        GPU where allowed), h = xl @ v^T rounded once to the dtype, the epilogue in fp32, rounded once.

    Raises:
        ValueError: a tensor of the wrong rank or shape, an unsupported dtype, mixed dtypes or devices (the
            message names the values).
    """
    out, _, _ = _cross(x0, xl, v, u, b)
    return out
