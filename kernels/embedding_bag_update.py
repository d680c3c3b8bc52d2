"""The backward of the pooled embedding bags (kernels/embedding_bag.py): one optimizer step on every row the
bags touched, each row once with the sum of its lookups' gradients (FBGEMM's EXACT_* semantics).

Math (letters of dlrm/model/dlrm.py; k_f, S and f(c) as in kernels/embedding_bag.py): lookup (b, c) has
the gradient scale_f(c) * dout[b, f(c), :] (scale 1 for "sum", 1 / k_f for "mean"); g_r is the sum of those
over every lookup of row r, and
    "sgd"              w_r -= lr * g_r
    "adagrad"          s_r += g_r^2 (elementwise, state [R, D]);     w_r -= lr * g_r / (sqrt(s_r) + eps)
    "rowwise_adagrad"  s_r += mean(g_r^2) (one value per row, [R]);  w_r -= lr * g_r / (sqrt(s_r) + eps)
"sgd" with fp32 weights: one kernel of atomic adds over the B*S lookups. Otherwise the B*S rows are sorted
(torch.sort), one kernel sums each lookup's pooled gradient into its segment's fp32 slot ([B*S, D]), a
second updates each distinct row once from its segment's sum. The per-lookup gradients [B, S, D] are never
materialized; shapes are fixed (no host sync: CUDA-graph capturable); lr is a one-element fp32 tensor read
by the kernels. The PyTorch reference is `embedding_bag_update_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.embedding_update import (
    block_sizes,
    check_lr,
    check_optimizer,
    embedding_update_ref,
    lookup_block,
    segment_update_kernel,
    sorted_segments,
)
from kernels.launch import use_triton

__all__ = [
    "POOLINGS",
    "bag_columns",
    "check_pooling",
    "embedding_bag_update",
    "embedding_bag_update_ref",
]

POOLINGS = ("sum", "mean")


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _lookup_grad(grad_ptr, features_ptr, scales_ptr, lookup, mask_n, mask, d, S, F, D):
    """The pooled gradient of lookups `lookup` (positions in [B, S]), scaled by their bag's 1 or 1/k: fp32."""
    b = lookup // S
    column = lookup % S
    feature = tl.load(features_ptr + column, mask=mask_n, other=0)
    scale = tl.load(scales_ptr + column, mask=mask_n, other=0.0)
    grad = tl.load(grad_ptr + (b * F + feature)[:, None] * D + d[None, :], mask=mask, other=0.0)
    return grad.to(tl.float32) * scale[:, None]


@triton.jit(do_not_specialize=["N"])
def _embedding_bag_sgd_kernel(
    # pointers
    index_ptr,  # [N] int64 global rows (N = B * S lookups)
    grad_ptr,  # [B, F, D] dout, any float dtype
    features_ptr,  # [S] int64 feature of each column
    scales_ptr,  # [S] fp32 pooling scale of each column
    weights_ptr,  # [R, D] fp32, updated in place
    lr_ptr,  # [] fp32 learning rate, read at launch time
    # sizes
    N,
    S,
    F,
    D,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n, mask_n, d, mask = lookup_block(N, D, BLOCK_N, BLOCK_D)
    index = tl.load(index_ptr + n, mask=mask_n, other=0)
    grad = _lookup_grad(grad_ptr, features_ptr, scales_ptr, n, mask_n, mask, d, S, F, D)
    lr = tl.load(lr_ptr).to(tl.float32)
    tl.atomic_add(weights_ptr + index[:, None] * D + d[None, :], -lr * grad, mask=mask)


@triton.jit(do_not_specialize=["N"])
def _embedding_bag_segment_sum_kernel(
    # pointers
    order_ptr,  # [N] int64: lookup at each sorted position (argsort of the indices)
    segment_ptr,  # [N] int64: segment (distinct row, in sorted order) of each sorted position
    grad_ptr,  # [B, F, D] dout, any float dtype
    features_ptr,  # [S] int64 feature of each column
    scales_ptr,  # [S] fp32 pooling scale of each column
    sums_ptr,  # [N, D] fp32 zeros: one slot per segment, the first n_segments used
    # sizes
    N,
    S,
    F,
    D,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    p, mask_p, d, mask = lookup_block(N, D, BLOCK_N, BLOCK_D)
    lookup = tl.load(order_ptr + p, mask=mask_p, other=0)
    segment = tl.load(segment_ptr + p, mask=mask_p, other=0)
    grad = _lookup_grad(grad_ptr, features_ptr, scales_ptr, lookup, mask_p, mask, d, S, F, D)
    tl.atomic_add(sums_ptr + segment[:, None] * D + d[None, :], grad, mask=mask)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def check_pooling(pooling: str) -> None:
    """Raises ValueError unless `pooling` is one of POOLINGS."""
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}: expected one of {POOLINGS}")


def bag_columns(bag_sizes: Tensor, pooling: str, columns: int) -> tuple[Tensor, Tensor]:
    """(feature [S] int64 of each of the `columns` = S columns, pooling scale [S] fp32: 1, or 1/k_f for
    "mean"), from bag_sizes [F] on their device without a host sync."""
    features = torch.arange(len(bag_sizes), device=bag_sizes.device)
    features = torch.repeat_interleave(features, bag_sizes, output_size=columns)
    sizes = bag_sizes[features].float()
    return features, (1.0 / sizes if pooling == "mean" else torch.ones_like(sizes))


def embedding_bag_update(
    weights: Tensor,
    state: Tensor,
    index: Tensor,
    grad: Tensor,
    bag_sizes: Tensor,
    pooling: str,
    optimizer: str,
    lr: Tensor,
    eps: float,
) -> None:
    """Apply one optimizer step to the rows of `weights` (and `state`) that `index` touched, each row once
    with the sum of its lookups' gradients, in place (module docstring).

    Args:
        weights: [R, D] fp32/bf16 table-batched weights (contiguous), updated in place.
        state: optimizer state from `kernels.embedding.optimizer_state` (fp32), updated in place.
        index: [B, S] int64 global rows looked up, as returned by the forward.
        grad: [B, F, D] gradient of the pooled vectors (any float dtype).
        bag_sizes: [F] int64 k_f (sum = S); pooling: "sum" or "mean".
        optimizer: "sgd", "adagrad" or "rowwise_adagrad"; eps: Adagrad's epsilon.
        lr: learning rate, a one-element fp32 tensor on weights' device, read by the kernel.
    Raises:
        ValueError: unknown optimizer or pooling, or shapes/dtypes/devices that do not match.
    """
    check_optimizer(optimizer)
    check_pooling(pooling)
    b, s = index.shape
    if grad.shape != (b, bag_sizes.shape[0], weights.shape[1]):
        raise ValueError(
            f"grad {list(grad.shape)} must be [B={b}, F={bag_sizes.shape[0]}, D={weights.shape[1]}]"
        )
    check_lr(lr, weights)
    if not use_triton(weights):
        embedding_bag_update_ref(weights, state, index, grad, bag_sizes, pooling, optimizer, lr, eps)
        return
    n, d, f = b * s, weights.shape[1], bag_sizes.shape[0]
    if n == 0:
        return
    features, scales = bag_columns(bag_sizes, pooling, s)
    grad = grad.contiguous()
    index = index.reshape(-1)
    block_d, block_n = block_sizes(d, n)
    grid = (triton.cdiv(n, block_n),)
    blocks = {"BLOCK_N": block_n, "BLOCK_D": block_d}
    if optimizer == "sgd" and weights.dtype == torch.float32:
        _embedding_bag_sgd_kernel[grid](index, grad, features, scales, weights, lr, n, s, f, d, **blocks)
        return
    sorted_rows, order, segment = sorted_segments(index)
    sums = torch.zeros(n, d, dtype=torch.float32, device=weights.device)
    _embedding_bag_segment_sum_kernel[grid](
        order, segment, grad, features, scales, sums, n, s, f, d, **blocks
    )
    segment_update_kernel[grid](
        sorted_rows, segment, sums, weights, state, lr, n, d, eps, OPTIMIZER=optimizer, **blocks
    )


# --------------------------------------------------------------------------------------------------
# PyTorch references (tests, benchmarks, CPU fallback)
# --------------------------------------------------------------------------------------------------


def embedding_bag_update_ref(
    weights: Tensor,
    state: Tensor,
    index: Tensor,
    grad: Tensor,
    bag_sizes: Tensor,
    pooling: str,
    optimizer: str,
    lr: Tensor,
    eps: float,
) -> None:
    """PyTorch update, in place: each lookup's gradient scale * grad[b, f(c)] ([B, S, D] fp32), then
    `kernels.embedding.embedding_update_ref` (repeated rows summed, one step each)."""
    features, scales = bag_columns(bag_sizes, pooling, index.shape[1])
    per_lookup = grad.float().index_select(1, features) * scales[:, None]
    embedding_update_ref(weights, state, index, per_lookup, optimizer, lr, eps)
