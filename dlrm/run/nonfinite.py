"""The non-finite guard (README "Failures and recovery"): the step losses wait in the interval's device
buffer and are read where they are needed anyway (each log line, evaluation and checkpoint), so a
non-finite loss costs no per-step host sync. One stops the run with NonFiniteLoss (exit 3), or with
train.on_nonfinite "skip_batch" is counted as a skipped batch (its update was not applied, on the device)."""

import math

import torch
from loguru import logger

from dlrm.errors import NonFiniteLoss
from dlrm.model import Model
from dlrm.run.state import Interval, Run, RunState


def check_finite(run: Run, state: RunState, interval: Interval) -> None:
    """Read the interval's losses not read yet (one host sync, charged to "device_wait") and note them
    (see `note_losses`)."""
    if interval.read == interval.steps:
        return
    with state.time_spent.part("device_wait"):
        losses = interval.losses[interval.read : interval.steps].tolist()
    first = state.step - interval.steps + interval.read + 1
    interval.read = interval.steps
    finite = [x for x in losses if math.isfinite(x)]
    interval.loss_sum += sum(finite)
    interval.finite += len(finite)
    note_losses(run, state, losses, first)


def note_losses(run: Run, state: RunState, losses: list[float], first_step: int) -> None:
    """Steps `first_step`, ... had `losses`: keep the last finite one; on a non-finite one raise
    NonFiniteLoss (train.on_nonfinite "stop") or count it as skipped ("skip_batch": its update was not
    applied, on the device)."""
    for step, loss in enumerate(losses, first_step):
        if math.isfinite(loss):
            state.last_finite_loss = (step, loss)
        elif run.cfg.train.on_nonfinite == "skip_batch":
            state.skipped_batches += 1
            logger.warning("step {}: loss {}, batch skipped (train.on_nonfinite skip_batch)", step, loss)
        else:
            state.nonfinite_step = step
            raise nonfinite_stop(run, state, f"step {step}: the training loss is {loss}")


def nonfinite_stop(run: Run, state: RunState, what: str) -> NonFiniteLoss:
    """The NonFiniteLoss that stops the run: what happened, the last finite loss, what last.pt holds."""
    last = state.last_finite_loss
    last_text = f"last finite loss {last[1]:.6g} at step {last[0]}" if last else "no finite loss before it"
    last_pt = run.run_dir / "checkpoints" / "last.pt"
    kept = (
        f"{last_pt} holds step {state.last_checkpoint_step}, the last finite state"
        if state.last_checkpoint_step is not None
        else "no last.pt was written before it"
    )
    hint = "" if run.cfg.train.on_nonfinite == "skip_batch" else ', or set train.on_nonfinite "skip_batch"'
    return NonFiniteLoss(f"{what} ({last_text}); stopped, {kept}. Lower train.lr{hint}")


def weights_finite(model: Model) -> bool:
    """Whether every parameter is finite (one sum per parameter, one host sync)."""
    sums = [p.detach().sum(dtype=torch.float32) for p in model.parameters()]
    return bool(torch.isfinite(torch.stack(sums)).all()) if sums else True
