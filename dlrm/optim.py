"""The run's optimizer (`RunOptimizer`: the dense parameters' update, the "triton" tables' fused update and
the learning rates) and the dense parameters' updates it runs, SGD and Adagrad, whose learning rate is scaled
by a device tensor read at each step, so that a step captured once in a CUDA graph follows the lr schedule
and never waits for the host.

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
`lr_scale`, a 0-d fp32 tensor on the parameters' device that `RunOptimizer.set_scale` writes in place
between steps (driven by the learning-rate schedule, dlrm.lr_schedule). The step reads it on the device,
so a step captured once in a CUDA graph (dlrm.graphs) applies the scale of each replay, and no step waits
for the host.

Why not torch.optim.Adagrad: its step count lives on the host (or as a tensor read with `.item()`), which a
graph capture cannot hold; with lr_decay 0 the count changes nothing, so this Adagrad keeps none.

Why not torch.optim.SGD with a Tensor lr (read in torch 2.13's torch/optim/sgd.py; the GPU machines run 2.11):
its default CUDA path (`_multi_tensor_sgd`, foreach) ends in `torch._foreach_add_(params, grads, alpha=-lr)`,
and `alpha` is a Python number, so a tensor lr is read back with `.item()` (aten._local_scalar_dense: a host
sync, which fails inside a graph capture) unless torch.compile is tracing it; the single-tensor path does the
same with `param.add_(grad, alpha=-lr)`. Only the fused path (`fused=True`, not the default) passes a Tensor
lr to its kernel, and it refuses the eager tables' sparse gradients. Here SGD's dense step calls that fused
kernel itself (`torch._fused_sgd_`: one launch for all of a group's tensors, reading lr * scale, a 0-d device
tensor, in the kernel; with `train.use_triton`, kernels/multi_tensor.py's launch of the same update, which
gives a small model's tensors many more thread blocks), and the sparse gradients take their own step.
Adagrad's scale enters through `torch._foreach_mul(steps, lr_scale)` (the ScalarTensor overload, which reads
the tensor in the kernel), its learning rate, a constant of the run, a Python number; with `train.use_triton`
its large dense tensors take kernels/adagrad.py's one-pass step instead (the same operations in the same
order).
"""

import hashlib

import torch
import torch.distributed as dist

from dlrm.choices import FUSED_UPDATE_KERNELS
from dlrm.config import TrainConfig
from kernels.adagrad import adagrad_step, adagrad_step_takes
from kernels.multi_tensor import sgd_step_takes, sgd_step_together

# The dense Adagrad of kernel "triton" steps a tensor of at least this many elements with our one-pass
# kernel (kernels/adagrad.py) and the smaller ones with the foreach ops, a few launches for all of them: a
# Triton launch a tensor costs the host more than a small tensor's passes cost the GPU.
ADAGRAD_KERNEL_MIN_ELEMENTS = 1 << 20


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
            torch.optim.SGD; not applied to sparse gradients (dlrm.optim.RunOptimizer gives the eager
            embedding tables, the only sparse ones, weight decay 0).
        kernel: how the dense step runs: "torch" (torch._fused_sgd_) or "triton" (a group that
            kernels.multi_tensor.sgd_step_takes, up to 16 fp32 tensors, by its one launch: the same
            update, with a program a block of each tensor).

    Raises:
        ValueError: lr <= 0 or weight_decay < 0, a kernel other than "torch" or "triton", or parameters on
            more than one device.
    """

    def __init__(self, params, lr: float, weight_decay: float = 0.0, kernel: str = "torch"):
        self._check(lr, weight_decay, "SGD")
        if kernel not in ("torch", "triton"):
            raise ValueError(f'SGD: kernel must be "torch" or "triton", got {kernel!r}')
        self.kernel = kernel
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    def _dense_step(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        if self.kernel == "triton" and sgd_step_takes(params, grads):
            sgd_step_together(params, grads, group["lr"], self.lr_scale)
            return
        # One kernel for every tensor of the group (a scaled foreach step takes two passes: the product
        # with the scale, then the add); weight decay is already in `grads`.
        torch._fused_sgd_(
            params, grads, [], weight_decay=0.0, momentum=0.0, lr=self.lr_scale * group["lr"],
            dampening=0.0, nesterov=False, maximize=False, is_first_step=False,
        )  # fmt: skip

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
        kernel: how the dense step runs: "torch" (foreach ops) or "triton" (tensors of at least
            ADAGRAD_KERNEL_MIN_ELEMENTS by kernels/adagrad.py, the same update in one pass).

    Raises:
        ValueError: lr <= 0, weight_decay < 0, eps < 0 or initial_accumulator_value < 0, a kernel other
            than "torch" or "triton", a "rowwise" group with a parameter that is not 2-D, or parameters on
            more than one device.
    """

    def __init__(
        self,
        params,
        lr: float,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
        weight_decay: float = 0.0,
        kernel: str = "torch",
    ):
        self._check(lr, weight_decay, "Adagrad")
        if kernel not in ("torch", "triton"):
            raise ValueError(f'Adagrad: kernel must be "torch" or "triton", got {kernel!r}')
        self.kernel = kernel
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
        if self.kernel == "triton":
            small = []
            for p, grad, state_sum in zip(params, grads, sums, strict=True):
                if p.numel() >= ADAGRAD_KERNEL_MIN_ELEMENTS and adagrad_step_takes(p, grad, state_sum):
                    adagrad_step(p, grad, state_sum, group["lr"], self.lr_scale, group["eps"])
                else:
                    small.append((p, grad, state_sum))
            if not small:
                return
            params, grads, sums = (list(column) for column in zip(*small, strict=True))
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


# The checkpoint keys of the table sets' fused update states, in `model.table_archs()` order: the embedding
# tables (a logistic model's first-order tables), then a DLRM's first-order tables.
TABLE_STATE_KEYS = ("embedding_optimizer_state", "first_order_optimizer_state")
# The checkpoint key of the bf16 tables' stochastic-rounding count (`RunOptimizer.table_rounding`).
ROUNDING_COUNT_KEY = "table_rounding_count"


def rounding_seed(seed: int, rank: int = 0) -> int:
    """The stochastic rounding's key of run seed `seed` on rank `rank` (63 bits of a hash of both:
    each rank rounds its own rows from a stream of its own)."""
    digest = hashlib.blake2b(f"{seed}/table_rounding/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RunOptimizer:
    """The run's one optimizer: it updates the dense parameters, configures the "triton" table sets' fused
    update, and owns the learning rates both read on the device.

    - `dense`: SGD or Adagrad (this module) of the dense parameters (`model.dense_parameters()`: the MLPs,
      weight decay) in group 0, then the tables a torch optimizer updates (`model.embedding_parameters()`:
      kernel "torch", or a sharded model's replicated tables; `embedding_lr`, no weight decay: decaying
      every row each step would make the update dense) in group 1; "rowwise_adagrad" makes that group
      row-wise (one accumulator per row; the MLPs keep the elementwise update).
    - The fused table sets (`model.table_archs()` of kernel "triton" or "torch_fused", the first-order tables
      among them) update their touched rows in their own backward (kernels/embedding_update.py,
      dlrm.model.fused_update): configured here with the train config's optimizer and `adagrad_eps`; their
      state lives in each set's `optimizer_state` buffer, which the update changes in place and
      `state_dict()` holds for checkpoints.
    - The learning rates, two 0-d fp32 device tensors written in place by `set_scale` (a captured step
      holds them: never rebind them): `lr_scale`, the factor on every dense group's base `lr` (the dense
      update multiplies by it), and `embedding_lr`, the fused update's rate (embedding_lr times the
      factor), one tensor that every "triton" table set reads.
    - `table_rounding`, [2] int64 on the tables' device: (seed, count) of the stochastic rounding of bf16
      tables' fused updates (kernels/embedding_update.py), the seed `rounding_seed(train.seed, rank)`, the
      count advanced in place by every `step()` (inside a captured step too: each replay draws fresh
      bits) where some table set is bf16. Checkpoints hold the count (`ROUNDING_COUNT_KEY`), so a resumed
      run continues the stream.

    The groups' "lr" and "weight_decay" stay the config's base values: checkpoints save them and `--resume`
    compares them with the config's; the factor is set from the step count, which checkpoints hold.

    Args:
        model: a DLRM or logistic model (or its sharded twin) on its device, as it will train.
        train: the run's train config: `optimizer`, `lr`, `embedding_lr` (null means `lr`), `weight_decay`,
            `adagrad_eps`.
    Raises:
        ValueError: as SGD and Adagrad (bad rates, parameters on more than one device).
    """

    def __init__(self, model, train: TrainConfig):
        self.base_lr = train.lr
        self.base_embedding_lr = train.embedding_lr or train.lr
        groups = [{"params": model.dense_parameters(), "lr": train.lr, "weight_decay": train.weight_decay}]
        if tables := model.embedding_parameters():
            group = {"params": tables, "lr": self.base_embedding_lr, "weight_decay": 0.0}
            groups.append({**group, "rowwise": True} if train.optimizer == "rowwise_adagrad" else group)
        kernel = "triton" if train.use_triton else "torch"
        if train.optimizer == "sgd":
            self.dense: ScaledLrOptimizer = SGD(groups, lr=train.lr, kernel=kernel)
        else:
            self.dense = Adagrad(groups, lr=train.lr, eps=train.adagrad_eps, kernel=kernel)
        self.lr_scale = self.dense.lr_scale
        self.scale = 1.0  # the factor the tensors hold
        self.table_sets = model.table_archs()
        self.fused_tables = [arch for arch in self.table_sets if arch.kernel in FUSED_UPDATE_KERNELS]
        device = self.fused_tables[0].weights.device if self.fused_tables else self.lr_scale.device
        self.embedding_lr = torch.full((), self.base_embedding_lr, dtype=torch.float32, device=device)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.table_rounding = torch.tensor([rounding_seed(train.seed, rank), 0], device=device)
        for arch in self.fused_tables:
            arch.configure_optimizer(
                train.optimizer, self.embedding_lr, train.adagrad_eps, self.table_rounding
            )
        self.rounds = any(arch.rounding is not None for arch in self.fused_tables)

    @property
    def param_groups(self) -> list[dict]:
        """The dense optimizer's param groups (torch.optim's)."""
        return self.dense.param_groups

    @property
    def state(self) -> dict:
        """The dense optimizer's state per parameter (Adagrad: {"sum": tensor}; SGD: none)."""
        return self.dense.state

    @property
    def lr(self) -> float:
        """The dense parameters' learning rate now (base lr times the factor), known on the host."""
        return self.base_lr * self.scale

    def set_scale(self, factor: float) -> None:
        """Scale every base learning rate by `factor` from the next step on: writes `lr_scale` and
        `embedding_lr` in place (a kernel on the current stream each, ordered before the step or graph
        replay that follows; no host sync), and only when the factor changes."""
        if factor == self.scale:
            return
        self.scale = factor
        self.lr_scale.fill_(factor)
        self.embedding_lr.fill_(self.base_embedding_lr * factor)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The dense optimizer's zero_grad (the fused tables produce no weight gradient)."""
        self.dense.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """The dense optimizer's step (the fused tables were updated in backward already); then, with bf16
        tables, the stochastic rounding's count advances (on the device, no host sync)."""
        self.dense.step()
        if self.rounds:
            self.table_rounding[1:].add_(1)

    def state_dict(self) -> dict[str, dict | torch.Tensor | None]:
        """The optimizer's entries of a checkpoint (dlrm.checkpoint), by key: "optimizer", the dense
        optimizer's state_dict (torch.optim's format); then, in `TABLE_STATE_KEYS` order, each table set's
        fused update state (its `optimizer_state`: Adagrad's accumulators [rows, D], row-wise Adagrad's
        [rows], empty for SGD; fp32), None for kernel "torch" (its state is in the dense optimizer's);
        and `ROUNDING_COUNT_KEY`, the stochastic rounding's count ([1] int64; 0 without bf16 tables).
        The tensors are the live ones, not copies."""
        tables = {
            key: arch.optimizer_state if arch.kernel in FUSED_UPDATE_KERNELS else None
            for key, arch in zip(TABLE_STATE_KEYS, self.table_sets, strict=False)
        }
        return {"optimizer": self.dense.state_dict(), **tables, ROUNDING_COUNT_KEY: self.table_rounding[1:]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a checkpoint's entries (`state_dict()`'s keys; other keys are ignored): "optimizer" into the
        dense optimizer unless it is None (a sharded checkpoint read whole, whose dense state loads by
        parameter name: dlrm.parallel.checkpoint.load_optimizer_by_name), and each "triton" table set's
        state, copied in place, where the checkpoint has one (kernel "torch" checkpoints have None), and
        the stochastic rounding's count where it has one (the seed is this run's: train.seed and rank).

        Raises:
            ValueError: a dense state_dict of other parameter groups (torch.optim's check).
        """
        if state_dict.get("optimizer") is not None:
            self.dense.load_state_dict(state_dict["optimizer"])
        for key, arch in zip(TABLE_STATE_KEYS, self.table_sets, strict=False):
            if arch.kernel in FUSED_UPDATE_KERNELS and state_dict.get(key) is not None:
                arch.optimizer_state.copy_(state_dict[key])
        if state_dict.get(ROUNDING_COUNT_KEY) is not None:
            self.table_rounding[1:].copy_(state_dict[ROUNDING_COUNT_KEY].reshape(1))
