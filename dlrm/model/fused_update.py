"""Table lookups whose backward applies the optimizer to the touched rows, in plain PyTorch ops of fixed
shapes with no host sync: SparseArch's kernel "torch_fused", what lets `--use-torch-compile` capture the
whole training step as one CUDA graph (dlrm.graphs). Kernel "torch"'s sparse gradients cannot be captured:
coalescing them reads the number of distinct rows on the host.

The update is the one our Triton kernels apply (kernels/embedding_update.py), torch.optim's SGD and Adagrad
on the coalesced gradient, or row-wise Adagrad: for each distinct row r looked up, with g_r the sum of its
lookups' gradients [D],
- "sgd": w_r -= lr * g_r;
- "adagrad": s_r += g_r * g_r, then w_r -= lr * g_r / (sqrt(s_r) + eps);
- "rowwise_adagrad": s_r += mean(g_r * g_r) (one accumulator a row), then w_r -= lr * g_r / (sqrt(s_r) + eps).
SGD adds every lookup's step into its row (index_add_ sums the repeats). Adagrad needs each row's sum
before the step, found without torch.unique (whose output size is read on the host): the N looked-up rows
sorted, the segment of each sorted position (the number of row changes before it) numbers the U distinct
rows 0..U-1, and the sums go to N places of which U are used; an unused place holds row 0 and a zero sum,
and its step is zero.
"""

import torch
from torch import Tensor

from kernels.embedding_update import sorted_segments

__all__ = ["apply_update", "lookup", "segment_sums"]


def segment_sums(index: Tensor, grad: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """(rows [N] int64, sums [N, D] fp32) for the N = index.numel() looked-up rows `index` (each in
    [0, num_rows)) and their gradients `grad` [N, D]: sums[u] is the sum of the gradients of distinct row
    rows[u] (distinct rows in ascending order at u < U); places u >= U hold row 0 and zeros. The sort and the
    segments are the Triton update's (kernels.embedding_update.sorted_segments). Fixed shapes, no host
    sync."""
    n = index.numel()
    sorted_rows, order, segment = sorted_segments(index, num_rows)
    sums = torch.zeros(n, grad.shape[-1], dtype=torch.float32, device=grad.device)
    sums.index_add_(0, segment, grad.reshape(n, -1)[order].float())
    rows = torch.zeros(n, dtype=torch.int64, device=index.device)
    rows.scatter_(0, segment.long(), sorted_rows.long())  # scatter_ takes int64 indices only
    return rows, sums


def apply_update(
    weights: Tensor, state: Tensor, index: Tensor, grad: Tensor, optimizer: str, lr: Tensor, eps: float
) -> None:
    """Update the looked-up rows of `weights` [R, D] fp32 (and Adagrad's `state`: [R, D], or [R] row-wise)
    in place, by the module docstring's rules, from the gradients `grad` [..., D] of the lookups `index`
    [...] (int64 rows of `weights`) at the rate `lr` (a 0-d fp32 tensor on the weights' device, read when
    this runs, so a captured update reads its current value). Raises ValueError for another optimizer."""
    d = weights.shape[1]
    if optimizer == "sgd":
        weights.index_add_(0, index.reshape(-1), grad.reshape(-1, d).float() * -lr)
        return
    if optimizer not in ("adagrad", "rowwise_adagrad"):
        raise ValueError(f"unknown optimizer {optimizer!r}: expected sgd, adagrad or rowwise_adagrad")
    rows, sums = segment_sums(index, grad, weights.shape[0])
    squares = sums * sums
    state.index_add_(0, rows, squares if optimizer == "adagrad" else squares.mean(dim=1))
    scale = state[rows].sqrt().add_(eps)
    step = sums / (scale if optimizer == "adagrad" else scale[:, None])
    # Unused places divide 0 by sqrt(0) + eps (NaN where eps is 0): their step is zero.
    weights.index_add_(0, rows, torch.where(sums != 0, step, 0.0) * -lr)


class _LookupUpdate(torch.autograd.Function):
    """weights[index] forward; backward updates `weights` and `state` in place (`apply_update`) and gives
    no gradient."""

    @staticmethod
    def forward(ctx, weights: Tensor, state: Tensor, index: Tensor, optimizer: str, lr: Tensor, eps: float):
        # Saved to be updated in backward, after they are unpacked (the saved-tensor version check holds).
        ctx.save_for_backward(weights, state, index, lr)
        ctx.optimizer, ctx.eps = optimizer, eps
        return weights.index_select(0, index.reshape(-1)).view(*index.shape, weights.shape[1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        weights, state, index, lr = ctx.saved_tensors
        apply_update(weights, state, index, grad, ctx.optimizer, lr, ctx.eps)
        return None, None, None, None, None, None


def lookup(weights: Tensor, state: Tensor, index: Tensor, optimizer: str, lr: Tensor, eps: float) -> Tensor:
    """weights[index]: [..., D] fp32 for `index` [...] int64 rows of `weights` [R, D] fp32. Differentiable
    when `weights.requires_grad`: backward updates the looked-up rows in place (`apply_update`, with
    `state`, `optimizer`, `lr`, `eps`) and gives the weights no gradient, so they must not also be given to
    a torch optimizer."""
    return _LookupUpdate.apply(weights, state, index, optimizer, lr, eps)
