"""The dense parameters' optimizers, SGD and Adagrad, whose learning rate is scaled by a device tensor read at
each step, so that a step captured once in a CUDA graph follows the lr schedule and never waits for the host.

    SGD:      p <- p - lr * scale * g                          (torch.optim.SGD, momentum 0, dampening 0)
    Adagrad:  s <- s + g * g;  p <- p - lr * scale * g / (sqrt(s) + eps)
                                                   (torch.optim.Adagrad with lr_decay 0; Duchi et al. 2011)
    row-wise Adagrad (a param group with "rowwise": True; embedding tables [rows, D]):
              s_r <- s_r + mean(g_r * g_r);  p_r <- p_r - lr * scale * g_r / (sqrt(s_r) + eps)
                                                   (FBGEMM / TorchRec's EXACT_ROWWISE_ADAGRAD: one
                                                    accumulator per row, s [rows], the mean over D)

with g the gradient plus weight_decay * p for dense gradients (as torch.optim does) and s Adagrad's
accumulator ("sum", starting at `initial_accumulator_value`). The row-wise update is the one that
kernels/embedding.py fuses into the "triton" tables' backward for train.optimizer "rowwise_adagrad".

`lr` and `weight_decay` are each param group's numbers, as in torch.optim.SGD (the config's values:
checkpoints save them and `--resume` compares them with the config's); `scale` is the optimizer's
`lr_scale`, a 0-d fp32 tensor on the parameters' device that the learning-rate schedule writes in place
between steps (dlrm.lr_schedule). The step reads it on the device, so a step captured once in a CUDA graph
(dlrm.graphs) applies the scale of each replay, and no step waits for the host.

Why not torch.optim.Adagrad: its step count lives on the host (or as a tensor read with `.item()`), which a
graph capture cannot hold; with lr_decay 0 the count changes nothing, so this Adagrad keeps none.

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


class ScaledLrOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer with `lr_scale`, a 0-d fp32 tensor (1.0 at first) on the parameters' device
    that multiplies every group's `lr` at each step. Write it in place (`lr_scale.fill_(x)`), never rebind
    it: a captured step holds this tensor. It is not in `state_dict()`: the schedule sets it from the step
    count, which checkpoints hold.

    Raises:
        ValueError: parameters on more than one device.
    """

    def __init__(self, params, defaults: dict):
        super().__init__(params, defaults)
        devices = {p.device for group in self.param_groups for p in group["params"]}
        if len(devices) > 1:
            raise ValueError(
                f"{type(self).__name__}: parameters on several devices {sorted(map(str, devices))}"
            )
        device = devices.pop() if devices else torch.device("cpu")
        self.lr_scale = torch.ones((), dtype=torch.float32, device=device)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient (see the module docstring), without a host sync for
        dense gradients; returns `closure()` when given (torch.optim's convention), else None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            dense = [p for p in params if not p.grad.is_sparse]
            if dense:
                grads = [p.grad for p in dense]
                if group["weight_decay"]:
                    grads = torch._foreach_add(grads, dense, alpha=group["weight_decay"])
                self._dense_step(group, dense, grads)
            for p in params:
                if p.grad.is_sparse:  # foreach ops take no sparse tensors
                    self._sparse_step(group, p)
        return loss

    def _dense_step(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Update `params` from their dense `grads` (weight decay included)."""
        raise NotImplementedError

    def _sparse_step(self, group: dict, p: torch.Tensor) -> None:
        """Update `p` from its sparse gradient (no weight decay)."""
        raise NotImplementedError

    @staticmethod
    def _check(lr: float, weight_decay: float, name: str) -> None:
        if not lr > 0:
            raise ValueError(f"{name}: lr must be > 0, got {lr}")
        if not weight_decay >= 0:
            raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay}")


class SGD(ScaledLrOptimizer):
    """SGD without momentum whose step multiplies each group's `lr` by the device tensor `lr_scale`.

    Args:
        params: parameters or param groups (dicts with "params" and optionally "lr", "weight_decay").
        lr: learning rate of groups that do not set one (> 0).
        weight_decay: L2 penalty of groups that do not set one (>= 0), added to the gradient as in
            torch.optim.SGD; not applied to sparse gradients (dlrm.step.make_optimizer gives the eager
            embedding tables, the only sparse ones, weight decay 0).

    Raises:
        ValueError: lr <= 0 or weight_decay < 0, or parameters on more than one device.
    """

    def __init__(self, params, lr: float, weight_decay: float = 0.0):
        self._check(lr, weight_decay, "SGD")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    def _dense_step(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        torch._foreach_add_(params, torch._foreach_mul(grads, self.lr_scale), alpha=-group["lr"])

    def _sparse_step(self, group: dict, p: torch.Tensor) -> None:
        p.add_(p.grad.mul(self.lr_scale), alpha=-group["lr"])


class Adagrad(ScaledLrOptimizer):
    """Adagrad (torch.optim.Adagrad's update with lr_decay 0) whose step multiplies each group's `lr` by the
    device tensor `lr_scale`; its state per parameter is the accumulator "sum" (torch.optim.Adagrad's
    name, so checkpoints of either load), allocated here so that a captured step finds it in place. A group
    with "rowwise" True takes the row-wise update (module docstring): its parameters are [rows, D] tables
    and their "sum" is [rows].

    Args:
        params: parameters or param groups (dicts with "params" and optionally "lr", "weight_decay",
            "rowwise").
        lr: learning rate of groups that do not set one (> 0).
        eps: added to sqrt(sum) in the denominator (torch.optim.Adagrad's default 1e-10).
        initial_accumulator_value: the accumulators' start (>= 0).
        weight_decay: L2 penalty of groups that do not set one (>= 0), added to dense gradients.

    Raises:
        ValueError: lr <= 0, weight_decay < 0, eps < 0 or initial_accumulator_value < 0, a "rowwise" group
            with a parameter that is not 2-D, or parameters on more than one device.
    """

    def __init__(
        self,
        params,
        lr: float,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
        weight_decay: float = 0.0,
    ):
        self._check(lr, weight_decay, "Adagrad")
        if not (eps >= 0 and initial_accumulator_value >= 0):
            got = f"{eps}, {initial_accumulator_value}"
            raise ValueError(f"Adagrad: eps and initial_accumulator_value must be >= 0, got {got}")
        super().__init__(params, {"lr": lr, "eps": eps, "weight_decay": weight_decay, "rowwise": False})
        for group in self.param_groups:
            for p in group["params"]:
                if group["rowwise"] and p.dim() != 2:
                    raise ValueError(f"Adagrad: a rowwise group takes [rows, D] tables, got {list(p.shape)}")
                shape = p.shape[:1] if group["rowwise"] else p.shape
                self.state[p]["sum"] = torch.full(
                    shape, initial_accumulator_value, dtype=p.dtype, device=p.device
                )

    def _dense_step(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        if group.get("rowwise"):  # .get: checkpoints written before the key load without it
            for p, grad in zip(params, grads, strict=True):
                self._rowwise_step(group, p, torch.arange(p.shape[0], device=p.device), grad)
            return
        sums = [self.state[p]["sum"] for p in params]
        torch._foreach_addcmul_(sums, grads, grads)
        std = torch._foreach_sqrt(sums)
        torch._foreach_add_(std, group["eps"])
        steps = torch._foreach_div(grads, std)
        torch._foreach_add_(params, torch._foreach_mul(steps, self.lr_scale), alpha=-group["lr"])

    def _sparse_step(self, group: dict, p: torch.Tensor) -> None:
        """torch.optim.Adagrad's sparse update: only the rows the gradient touches, their sum and weight; the
        gradient is coalesced first, a host sync (the eager tables only, never in a graph)."""
        grad = p.grad.coalesce()
        indices, values = grad._indices(), grad._values()
        if group.get("rowwise"):
            self._rowwise_step(group, p, indices[0], values)
            return
        state_sum = self.state[p]["sum"]
        state_sum.add_(torch.sparse_coo_tensor(indices, values.pow(2), grad.shape))
        std = state_sum.sparse_mask(grad)._values().sqrt_().add_(group["eps"])
        step = torch.sparse_coo_tensor(indices, values / std * self.lr_scale, grad.shape)
        p.add_(step, alpha=-group["lr"])

    def _rowwise_step(self, group: dict, p: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """The row-wise update of rows `rows` [n] (distinct) of table `p` [R, D] from their gradient
        `grad` [n, D]."""
        state_sum = self.state[p]["sum"]
        state_sum.index_add_(0, rows, grad.pow(2).mean(dim=1))
        std = state_sum.index_select(0, rows).sqrt_().add_(group["eps"])
        p.index_add_(0, rows, grad / std[:, None] * self.lr_scale, alpha=-group["lr"])
