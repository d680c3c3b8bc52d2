"""The learning-rate schedule (`train.lr_schedule`): MLPerf DLRM's warm-up and polynomial decay, and how
the rates reach the training step without a host sync, also when the step is a CUDA graph replay.

Factor on the base learning rates at step k (1-based: the k-th optimizer step of the run, resumes
included), with W warmup_steps, S decay_start_step, N decay_steps:

    k < W                        k / W                   linear warm-up from 0
    W <= k < S (or no decay)     1
    S <= k <= S + N              ((S + N - k) / N) ** 2  polynomial decay of power 2, reaching 0 at S + N
    k > S + N                    0

Source: the MLPerf DLRM reference, facebookresearch/dlrm `dlrm_s_pytorch.py`, class `LRPolicyScheduler`
(options --lr-num-warmup-steps, --lr-decay-start-step, --lr-num-decay-steps), whose `_step_count` at the
k-th optimizer step is k. Its `get_lr` gives the same factors in the warm-up and in the decay before S + N;
three details of it are not copied: between the warm-up and the decay it keeps the last warm-up value
(W - 1) / W rather than 1, after the decay it keeps the last decayed value 1 / N**2 rather than 0, and it
floors a decayed lr at 1e-7.

The factor is a function of the step count alone, which checkpoints hold, so `--resume` goes on with the
exact rates. `LearningRates.set` writes base * factor where the step reads it: device tensors written in
place (`fill_`, a kernel on the current stream, ordered before the step or graph replay that follows) for
the dense optimizer (`dlrm.optim`'s SGD or Adagrad, `lr_scale`) and the "triton" tables' fused update
(each table set's `lr`).
"""

import torch

from dlrm.config import LrScheduleConfig, TrainConfig
from dlrm.optim import ScaledLrOptimizer


def lr_factor(schedule: LrScheduleConfig, step: int) -> float:
    """The factor (in [0, 1]) on the base learning rates at `step`, the 1-based index of the optimizer step
    (module docstring). Raises ValueError for step < 1."""
    if step < 1:
        raise ValueError(f"lr_factor: steps count from 1, got {step}")
    warmup, start, steps = schedule.warmup_steps, schedule.decay_start_step, schedule.decay_steps
    if step < warmup:
        return step / warmup
    if start is None or step < start:
        return 1.0
    return (max(0, start + steps - step) / steps) ** 2


class LearningRates:
    """The run's learning rates, set from the step count before each step.

    Args:
        train: the run's train config: `lr_schedule`, `lr` (the dense parameters) and `embedding_lr` (the
            tables; null means `lr`).
        optimizer: the dense optimizer from dlrm.step.make_optimizer, as built (its groups' "lr" are the base
            rates): dlrm.optim's SGD or Adagrad.
        tables: the model's table sets (`model.table_archs()`: the embeddings, the first-order tables); with
            kernel "triton" each one's `lr` tensor is its fused update's rate.
    `set(step)` writes only when the factor changes: never for the default constant schedule.
    """

    def __init__(self, train: TrainConfig, optimizer: ScaledLrOptimizer, tables: list[torch.nn.Module]):
        self.schedule, self.optimizer = train.lr_schedule, optimizer
        self.fused_tables = [arch for arch in tables if arch.kernel == "triton"]
        self.base_lr = train.lr
        self.base_embedding_lr = train.embedding_lr or train.lr
        self.factor = 1.0  # what make_optimizer set up

    @property
    def lr(self) -> float:
        """The dense parameters' learning rate now (train/lr in TensorBoard), known on the host."""
        return self.base_lr * self.factor

    def set(self, step: int) -> None:
        """Set the rates of optimizer step `step` (1-based), before it runs: no host sync (module
        docstring). Raises ValueError for step < 1."""
        factor = lr_factor(self.schedule, step)
        if factor == self.factor:
            return
        self.factor = factor
        self.optimizer.lr_scale.fill_(factor)
        for arch in self.fused_tables:
            arch.lr.fill_(self.base_embedding_lr * factor)
