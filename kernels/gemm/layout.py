"""Operand layouts of our GEMMs: rows 16 bytes apart (what cuBLAS's fast kernels, Triton's wide loads and
TMA descriptors need), row-padded buffers and views of their leading columns, and TMA descriptors."""

import torch
import torch.nn.functional as F
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

# cuBLAS picks its fast (vectorized, "align4"/"align8") GEMM kernels only when every matrix's leading
# dimension is a multiple of 16 bytes; Triton likewise vectorizes loads only for row strides divisible by 16.
ALIGN_BYTES = 16


def aligned_width(k: int, dtype: torch.dtype) -> int:
    """k rounded up to a multiple of 16 bytes of `dtype`, e.g. 367 fp32 -> 368, 479 bf16 -> 480: the row
    stride of buffers whose rows a GEMM reads or writes."""
    per_row = ALIGN_BYTES // dtype.itemsize
    return -(-k // per_row) * per_row


def rows_aligned(t: Tensor) -> bool:
    """Whether the rows of a 2-D tensor start 16 bytes apart (its row stride is a multiple of 16 bytes)."""
    return t.stride(0) * t.element_size() % ALIGN_BYTES == 0


def has_contiguous_rows(t: Tensor) -> bool:
    """Whether a 2-D t's rows are contiguous: column stride 1, any row stride >= width (e.g. a view of a
    row-padded buffer such as the dot interaction's output)."""
    return t.stride(-1) == 1 and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1])


def rows_contiguous(t: Tensor) -> Tensor:
    """A 2-D t itself if ``has_contiguous_rows(t)``, else a contiguous copy (e.g. of an expanded gradient)."""
    return t if has_contiguous_rows(t) else t.contiguous()


def leading_columns(buffer: Tensor, k: int) -> Tensor:
    """The first k columns of a fresh contiguous 2-D `buffer` [M, Kp], rows Kp apart, as a tensor of its own
    over the same storage: set_, not a view, since custom-op outputs may have no base."""
    shape, stride = (buffer.shape[0], k), (buffer.shape[1], 1)
    return buffer.new_empty(0).set_(buffer.untyped_storage(), buffer.storage_offset(), shape, stride)


def new_padded(m: int, k: int, like: Tensor) -> Tensor:
    """[M, K] in `like`'s dtype and device with rows Kp = ``aligned_width(K)`` apart, over a fresh [M, Kp]
    buffer (``leading_columns``; padding not initialized): rows as a GEMM writes them fast even for odd K
    (cuBLAS's aligned kernels need rows 16 bytes apart)."""
    return leading_columns(like.new_empty((m, aligned_width(k, like.dtype))), k)


def padded_like(t: Tensor) -> Tensor:
    """An empty [M, K] with t's shape, dtype and device and rows ``aligned_width(K)`` apart: the layout of
    ``new_padded``'s tensors, for fake (shape-only) implementations, where storage size does not matter."""
    m, k = t.shape
    return t.new_empty_strided((m, k), (aligned_width(k, t.dtype), 1))


def zero_padded(t: Tensor, width: int) -> Tensor:
    """A contiguous copy [R, width] of a 2-D t [R, K] (width >= K) whose columns K..width-1 are zeros."""
    return F.pad(t, (0, width - t.shape[1])).contiguous()


def aligned_copy(t: Tensor) -> Tensor:
    """A copy of a 2-D t [R, K] in rows zero-padded to 16 bytes (``aligned_width``), as an [R, K] tensor whose
    rows lie that far apart: an operand a GEMM reads with wide loads (cuBLAS's aligned kernels, Triton's
    16-byte loads) whatever K is."""
    k = t.shape[1]
    return leading_columns(zero_padded(t, aligned_width(k, t.dtype)), k)


def aligned_weight(weight: Tensor) -> Tensor:
    """A weight [N, K] for a forward GEMM kernel: itself where contiguous and K is a multiple of 16 bytes,
    else ``aligned_copy`` (only its first K columns are read), so the kernel's loads of W can be 16 bytes
    wide (on rows 367 fp32 apart they can only be 4)."""
    if aligned_width(weight.shape[1], weight.dtype) == weight.shape[1]:
        return weight.contiguous()
    return aligned_copy(weight)


def describable(t: Tensor) -> bool:
    """Whether a 2-D t can itself back a TMA descriptor: columns contiguous, rows and base 16 bytes apart (a
    descriptor through which a kernel stores must be of t itself, never of a copy)."""
    return has_contiguous_rows(t) and rows_aligned(t) and t.data_ptr() % ALIGN_BYTES == 0


def tma_descriptor(t: Tensor) -> TensorDescriptor:
    """A TMA descriptor (Hopper's tensor memory accelerator) of a 2-D t [R, C], through which a GEMM kernel
    loads [rows, cols] blocks: rows and columns past t's end read 0, so no mask is needed, nor a masked K
    tail. The hardware wants the columns contiguous, the rows and the base 16 bytes apart: t itself where it
    is so, else ``aligned_copy(t)``. Its block shape is a placeholder that the GEMM's tuning sets to the
    launched config's tiles (``kernels.gemm.tuning``)."""
    if not describable(t):
        t = aligned_copy(t)
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [16, 16])
