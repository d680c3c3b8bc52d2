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
exact rates. `LearningRates.set` hands it to the run's optimizer (dlrm.optim.RunOptimizer.set_scale), which
writes it where the step reads it: device tensors written in place (`fill_`, a kernel on the current stream,
ordered before the step or graph replay that follows) that the dense update and the "triton" tables' fused
update read.
"""

from dlrm.config import LrScheduleConfig
from dlrm.optim import RunOptimizer


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
    """The schedule `train.lr_schedule` driving the run's optimizer, set from the step count before each
    step.

    Args:
        schedule: the run's `train.lr_schedule`.
        optimizer: the run's RunOptimizer, whose base rates (`train.lr`, `train.embedding_lr`) the factor
            scales.
    `set(step)` writes the device tensors only when the factor changes: never for the default constant
    schedule.
    """

    def __init__(self, schedule: LrScheduleConfig, optimizer: RunOptimizer):
        self.schedule, self.optimizer = schedule, optimizer

    @property
    def factor(self) -> float:
        """The factor the optimizer's rates hold now."""
        return self.optimizer.scale

    @property
    def lr(self) -> float:
        """The dense parameters' learning rate now (train/lr in TensorBoard), known on the host."""
        return self.optimizer.lr

    def set(self, step: int) -> None:
        """Set the rates of optimizer step `step` (1-based), before it runs: no host sync (module
        docstring). Raises ValueError for step < 1."""
        self.optimizer.set_scale(lr_factor(self.schedule, step))
