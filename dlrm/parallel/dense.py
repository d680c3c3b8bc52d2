"""The dense part (bottom MLP, interaction, top MLP) data parallel: every rank holds all of it, and its
gradients are averaged over the ranks inside the training step.

Why not DistributedDataParallel: DDP averages through autograd hooks and buckets that run outside the
step's stream order, which a whole-step CUDA graph (`--use-triton --cuda-graphs`) cannot capture. Here the
step (dlrm.step.train_step) calls `reduce_grads()` after backward and before the optimizer: one
all_reduce (SUM, then / W) of all dense gradients flattened into one buffer, a collective of a fixed size
that NCCL records into the graph, identical on gloo and in eager. It does not overlap with backward (DDP
would); the dense part of DLRM is small (MLPerf: 2.4M parameters, 9.5 MB of fp32 gradients). The
replicated embedding tables' dense gradients join the same buffer.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def grad_averager(params: list[nn.Parameter], world_size: int) -> Callable[[], None]:
    """A function that replaces each param's .grad by its mean over the `world_size` ranks.

    Every rank must call it at the same point (after backward). Gradients are flattened into one fp32
    buffer (one all_reduce), averaged, and copied back. Parameters without a gradient count as zeros.
    """

    def reduce_grads() -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.mul_(1.0 / world_size)
        for p, g, new in zip(params, grads, flat.split([g.numel() for g in grads]), strict=True):
            if p.grad is None:
                p.grad = g
            p.grad.copy_(new.view_as(g))

    return reduce_grads


def averaged_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradients `grad_averager` averages: the dense part's and the replicated
    (data-parallel) embedding tables' (dlrm.parallel.sharded)."""
    replicated = [p for t in model.table_archs() for p in t.replicated_parameters() if p.requires_grad]
    return model.dense_parameters() + replicated


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module) -> None:
    """Make every rank's dense parameters and buffers equal to rank 0's (run once, at set-up)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)
