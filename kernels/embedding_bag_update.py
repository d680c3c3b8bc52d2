"""The backward of the pooled embedding bags (kernels/embedding_bag.py): one optimizer step on every row the
bags touched, each row once with the sum of its lookups' gradients (FBGEMM's EXACT_* semantics).

Math (letters of dlrm/model/dlrm.py; k_f, S and f(c) as in kernels/embedding_bag.py): lookup (b, c) has
the gradient scale_f(c) * dout[b, f(c), :] (scale 1 for "sum", 1 / k_f for "mean"); g_r is the sum of those
over every lookup of row r, and
    "sgd"              w_r -= lr * g_r
    "adagrad"          s_r += g_r^2 (elementwise, state [R, D]);     w_r -= lr * g_r / (sqrt(s_r) + eps)
    "rowwise_adagrad"  s_r += mean(g_r^2) (one value per row, [R]);  w_r -= lr * g_r / (sqrt(s_r) + eps)
"sgd" with fp32 weights: one kernel of atomic adds over the B*S lookups. Otherwise the B*S rows are sorted
(torch.sort) and a kernel steps each distinct row once, summing a short segment's pooled gradients itself
and reading a long segment's sum from the summing kernels' fp32 slot ([B*S, D]). The per-lookup gradients
[B, S, D] are never materialized; shapes are fixed (no host sync: CUDA-graph capturable); lr is a
one-element fp32 tensor read by the kernels. The kernels are kernels/embedding_update.py's
(`launch_update`), reading each lookup's pooled gradient. The PyTorch reference is `embedding_bag_update_ref`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.embedding_update import (
    check_lr,
    check_optimizer,
    check_rounding,
    embedding_update_ref,
    launch_update,
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
    rounding: Tensor | None = None,
    in_order: bool = False,
    drop_last_row: bool = False,
) -> None:
    """Apply one optimizer step to the rows of `weights` (and `state`) that `index` touched, each row once
    with the sum of its lookups' gradients, in place (module docstring).

    Args:
        weights: [R, D] fp32/bf16 table-batched weights (contiguous), updated in place.
        state: optimizer state from `kernels.embedding.optimizer_state` (fp32), updated in place.
        index: [B, S] int32 or int64 global rows looked up, as returned by the forward.
        grad: [B, F, D] gradient of the pooled vectors (any float dtype).
        bag_sizes: [F] int64 k_f (sum = S); pooling: "sum" or "mean".
        optimizer: "sgd", "adagrad" or "rowwise_adagrad"; eps: Adagrad's epsilon.
        lr: learning rate, a one-element fp32 tensor on weights' device, read by the kernel.
        rounding: for bf16 weights, [2] int64 (seed, count): stochastic rounding (None: to nearest), as
            `kernels.embedding_update.embedding_update` takes it.
        in_order: as `kernels.embedding_update.embedding_update`'s (SGD on fp32 weights without atomic adds).
        drop_last_row: the lookups of weights' last row R - 1 (a row-wise shard's padding row) add nothing:
            the row and its state stay as they are, and the kernels never read those lookups' gradients.
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
    check_rounding(rounding, weights)
    if not use_triton(weights):
        embedding_bag_update_ref(
            weights, state, index, grad, bag_sizes, pooling, optimizer, lr, eps, rounding, drop_last_row
        )
        return
    features, scales = bag_columns(bag_sizes, pooling, s)
    bags = (features, scales if pooling == "mean" else None)  # sum pooling's scales of 1 never read
    # A view of the gradient (a slice of a concatenation's) is read in place: launch_update takes strides.
    launch_update(
        weights, state, index.reshape(-1), grad, optimizer, lr, eps, bags, rounding, in_order,
        drop_last_row=drop_last_row,
    )  # fmt: skip


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
    rounding: Tensor | None = None,
    drop_last_row: bool = False,
) -> None:
    """PyTorch update, in place: each lookup's gradient scale * grad[b, f(c)] ([B, S, D] fp32), zero for a
    lookup of the last row where `drop_last_row`, then `kernels.embedding.embedding_update_ref` (repeated
    rows summed, one step each: a zero gradient's step leaves a row as it is)."""
    features, scales = bag_columns(bag_sizes, pooling, index.shape[1])
    per_lookup = grad.float().index_select(1, features) * scales[:, None]
    if drop_last_row:
        per_lookup.masked_fill_((index == weights.shape[0] - 1)[..., None], 0.0)
    embedding_update_ref(weights, state, index, per_lookup, optimizer, lr, eps, rounding)
