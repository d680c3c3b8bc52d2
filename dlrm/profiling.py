"""PyTorch profiler set-up: a scheduled window whose trace lands next to the TensorBoard events.

The trace is written as `<run_dir>/<host>_<pid>.<time>.pt.trace.json` by
`torch.profiler.tensorboard_trace_handler`; open it in Perfetto / chrome://tracing, or the TensorBoard
profiler plugin. The training loop marks its stages with `record_function` (data, embedding, bottom_mlp,
interaction, top_mlp, loss, backward, optimizer).
"""

import contextlib
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from dlrm.config import ProfilerConfig


class _NoProfiler(contextlib.AbstractContextManager):
    def __exit__(self, *exc) -> None:
        return None

    def step(self) -> None:
        pass


def make_profiler(cfg: ProfilerConfig, run_dir: Path, device: torch.device, worker_name: str | None = None):
    """A context manager with `.step()`, to be called once per training step.

    Records steps wait + 1 .. wait + warmup + active (one cycle, then idle). Returns a no-op when
    `cfg.enabled` is false. `worker_name` starts the trace's file name (default `<host>_<pid>`; "rank<k>"
    for the ranks of a torchrun job: `rank<k>.<time>.pt.trace.json`).
    """
    if not cfg.enabled:
        return _NoProfiler()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return profile(
        activities=activities,
        schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(run_dir), worker_name=worker_name),
        record_shapes=True,
    )
