"""Plain SGD for the dense parameters whose learning rate is scaled by a device tensor, read at each step.

    p <- p - lr * scale * (g + weight_decay * p)        (torch.optim.SGD with momentum 0, dampening 0)

`lr` and `weight_decay` are each param group's numbers, as in torch.optim.SGD (the config's values:
checkpoints save them and `--resume` compares them with the config's); `scale` is `SGD.lr_scale`, a 0-d fp32
tensor on the parameters' device that the learning-rate schedule writes in place between steps
(dlrm.lr_schedule). The step reads it on the device, so a step captured once in a CUDA graph
(dlrm.graphs) applies the scale of each replay, and no step waits for the host.

Why not torch.optim.SGD with a Tensor lr (read in torch 2.13's torch/optim/sgd.py; the GPU machines run
2.11): its default CUDA path (`_multi_tensor_sgd`, foreach) ends in
`torch._foreach_add_(params, grads, alpha=-lr)`, and `alpha` is a Python number, so a tensor lr is read
back with `.item()` (aten._local_scalar_dense: a host sync, which fails inside a graph capture) unless
torch.compile is tracing it; the single-tensor path does the same with `param.add_(grad, alpha=-lr)`. Only
the fused path (`fused=True`, not the default) passes a Tensor lr to its kernel, and it refuses the eager
tables' sparse gradients. Here the scale enters through `torch._foreach_mul(grads, lr_scale)` (the
ScalarTensor overload, which reads the tensor in the kernel), and the learning rate, a constant of the run,
stays a Python number.
"""

import torch


class SGD(torch.optim.Optimizer):
    """SGD without momentum whose step multiplies each group's `lr` by the device tensor `lr_scale`.

    Args:
        params: parameters or param groups (dicts with "params" and optionally "lr", "weight_decay").
        lr: learning rate of groups that do not set one (> 0).
        weight_decay: L2 penalty of groups that do not set one (>= 0), added to the gradient as in
            torch.optim.SGD; not applied to sparse gradients (dlrm.step.make_optimizer gives the eager
            embedding tables, the only sparse ones, weight decay 0).
    `lr_scale` ([] fp32, 1.0 at first) lives on the parameters' device; write it in place
    (`lr_scale.fill_(x)`), never rebind it: a captured step holds this tensor. It is not in `state_dict()`:
    the schedule sets it from the step count, which checkpoints hold.

    Raises:
        ValueError: lr <= 0 or weight_decay < 0, or parameters on more than one device.
    """

    def __init__(self, params, lr: float, weight_decay: float = 0.0):
        if not lr > 0:
            raise ValueError(f"SGD: lr must be > 0, got {lr}")
        if not weight_decay >= 0:
            raise ValueError(f"SGD: weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        devices = {p.device for group in self.param_groups for p in group["params"]}
        if len(devices) > 1:
            raise ValueError(f"SGD: parameters on several devices {sorted(map(str, devices))}")
        device = devices.pop() if devices else torch.device("cpu")
        self.lr_scale = torch.ones((), dtype=torch.float32, device=device)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient (see the class docstring), without a host sync;
        returns `closure()` when given (torch.optim's convention), else None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            dense = [p for p in params if not p.grad.is_sparse]
            grads = [p.grad for p in dense]
            if dense:
                if group["weight_decay"]:
                    grads = torch._foreach_add(grads, dense, alpha=group["weight_decay"])
                torch._foreach_add_(dense, torch._foreach_mul(grads, self.lr_scale), alpha=-group["lr"])
            for p in params:
                if p.grad.is_sparse:  # foreach ops take no sparse tensors
                    p.add_(p.grad.mul(self.lr_scale), alpha=-group["lr"])
        return loss
