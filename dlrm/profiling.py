"""PyTorch profiler set-up: a scheduled window whose trace lands next to the TensorBoard events, and its
per-stage breakdown written into TensorBoard itself.

The trace is written as `<run_dir>/<host>_<pid>.<time>.pt.trace.json`, named as
`torch.profiler.tensorboard_trace_handler` names it; open it in Perfetto (ui.perfetto.dev) /
chrome://tracing, or TensorBoard's PYTORCH_PROFILER tab (the torch-tb-profiler plugin). The training
loop marks its stages with `record_function` (STAGES: data, embedding, bottom_mlp, interaction, top_mlp,
loss, backward, optimizer; under `--cuda-graphs` all but data run inside one range, graph_replay).
The data range holds a second range named as PyTorch's DataLoader names its own
(`enumerate(DataLoader)#...__next__`), which is what the plugin's overview counts as "DataLoader" time; the
plugin (archived upstream) only reads such ranges as operators ("cpu_op"), while today's profiler writes
every `record_function` range as a "user_annotation", so the written trace gets that one range's category
changed to "cpu_op" (the DataLoader's own range reads "DataLoader 0us" in the plugin otherwise).

When the window's trace is ready, `write_stage_breakdown` adds per stage and per profiled step its host
time (the range's wall-clock time on the host) and, on a GPU, its GPU time (the kernels, copies and memsets
launched while the range was open, from any host thread: backward launches from autograd's thread) to
TensorBoard: scalars `profile/<stage>_ms` (host) and `profile/<stage>_gpu_ms`, and a markdown table under
the Text tab's `profile` tag. No plugin is needed to see them.
"""

import bisect
import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from loguru import logger
from torch.profiler import ProfilerAction, ProfilerActivity, profile, record_function, schedule

from dlrm import atomic
from dlrm.config import ProfilerConfig

STAGES = ("data", "embedding", "bottom_mlp", "interaction", "top_mlp", "loss", "backward", "optimizer")
# The whole-step CUDA graph's replay (dlrm.graphs): forward, loss, backward and the optimizer in one launch,
# so their ranges never open in a profiled window of a graphed run; this range's GPU time is theirs.
GRAPH_REPLAY = "graph_replay"
# torch-tb-profiler counts a range as data loading when its name starts with "enumerate(DataLoader)#" and
# ends with ".__next__" (torch_tb_profiler/profiler/event_parser.py), as PyTorch's DataLoader names it.
DATA_LOADER_RANGE = "enumerate(DataLoader)#TrainLoader.__next__"
_STEP_PREFIX = "ProfilerStep"  # "ProfilerStep*" in events(), "ProfilerStep#<n>" in the trace


def data_range(profiler) -> contextlib.AbstractContextManager:
    """The training loop's "data" range (fetching the next batch), as the profiler plugin recognizes it,
    while `profiler` (make_profiler's) is in its window; outside it a no-op: the two ranges cost host time
    every step, spent for nothing where nothing records them."""
    return _data_ranges() if traced(profiler) else contextlib.nullcontext()


def traced(profiler) -> bool:
    """Whether the step that just ran (before `profiler.step()`) was in `profiler`'s window (make_profiler's
    profiler, or its no-op)."""
    return profiler.current_action != ProfilerAction.NONE


@contextlib.contextmanager
def _data_ranges() -> Iterator[None]:
    with record_function("data"), record_function(DATA_LOADER_RANGE):
        yield


def graph_replay_range() -> contextlib.AbstractContextManager:
    """The GRAPH_REPLAY range while a profiler records, else a no-op: a range costs host time per replay,
    spent for nothing outside a profiled window."""
    return record_function(GRAPH_REPLAY) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


class _NoProfiler(contextlib.AbstractContextManager):
    current_action = ProfilerAction.NONE  # never in a window

    def __exit__(self, *exc) -> None:
        return None

    def step(self) -> float:
        return 0.0


def make_profiler(
    cfg: ProfilerConfig,
    run_dir: Path,
    device: torch.device,
    writer=None,
    first_step: int = 0,
    worker_name: str | None = None,
):
    """A context manager with `.step()`, to be called once per training step; it returns the seconds it
    spent on the profiler's own work (starting and stopping the tracer, writing the window's trace and
    breakdown; 0 outside the window), which are not the step's time. `traced(profiler)` before a `.step()`
    says whether the step just run was in the window.

    Records steps wait + 1 .. wait + warmup + active (one cycle, then idle), counted from `first_step`
    (a resumed run's step). With a SummaryWriter `writer`, the window's per-stage breakdown goes into
    TensorBoard (`write_stage_breakdown`) at the step where the window ends. `worker_name` starts the
    trace's file name (default `<host>_<pid>`; "rank<k>" for the ranks of a torchrun job:
    `rank<k>.<time>.pt.trace.json`). Returns a no-op when `cfg.enabled` is false.
    """
    if not cfg.enabled:
        return _NoProfiler()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return _OneWindowProfiler(
        cfg.wait + cfg.warmup + cfg.active,
        device,
        activities=activities,
        schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
        on_trace_ready=_on_trace_ready(run_dir, writer, first_step, worker_name),
        record_shapes=True,
    )


class _OneWindowProfiler(profile):
    """torch.profiler.profile whose `step()` stops once its one window has been recorded: torch's would go
    on opening a "ProfilerStep#" range every step of the run (host time each step, for nothing).
    `step()` returns the seconds it spent on the profiler's own work while the window is open or opens or
    closes in it (starting the tracer, stopping it, writing the trace: tens of milliseconds to about a
    second), so that the loop keeps them out of its throughput. Before the call that opens the window it
    waits for `device` (a CUDA device): the steps before the window finish on their own clock, not on the
    window's."""

    def __init__(self, window_steps: int, device: torch.device, **kwargs):
        self.window_steps, self.device = window_steps, device
        super().__init__(**kwargs)

    def step(self) -> float:
        if self.step_num >= self.window_steps:
            return 0.0
        before = self.current_action
        opening = before == ProfilerAction.NONE and self.schedule(self.step_num + 1) != ProfilerAction.NONE
        if opening and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        super().step()
        in_window = before != ProfilerAction.NONE or self.current_action != ProfilerAction.NONE
        return time.perf_counter() - start if in_window else 0.0


def _on_trace_ready(run_dir: Path, writer, first_step: int, worker_name: str | None):
    def handler(prof: profile) -> None:
        export_trace(prof, run_dir, worker_name)
        if writer is not None:
            write_stage_breakdown(writer, stage_breakdown(prof.events()), first_step + prof.step_num)

    return handler


def export_trace(prof: profile, run_dir: Path, worker_name: str | None = None) -> Path:
    """Write the trace as `torch.profiler.tensorboard_trace_handler` names it
    (<worker>.<ns>.pt.trace.json, worker `<host>_<pid>` by default, which the TensorBoard plugin lists),
    with the data-loading range marked as the plugin expects; whole or not at all (dlrm.atomic).

    Raises:
        DiskFull: no space left (or a read-only file system) for the trace; nothing of it is left behind.
        OSError: the profiler wrote no trace (it logs why on stderr and raises nothing itself).
    """
    worker = worker_name or f"{socket.gethostname()}_{os.getpid()}"
    path = run_dir / f"{worker}.{time.time_ns()}.pt.trace.json"
    with atomic.replacing(path) as tmp:
        # The profiler writes <name>.tmp and renames it to <name>; on a failed write it logs an error,
        # leaves <name>.tmp and returns.
        try:
            prof.export_chrome_trace(str(tmp))
        finally:
            tmp.with_name(f"{tmp.name}.tmp").unlink(missing_ok=True)
        if not tmp.is_file():
            free = atomic.free_space(path)
            raise OSError(
                0, f"the profiler could not write its trace (its error is above; {free})", str(path)
            )
        try:
            trace = json.loads(tmp.read_text())
        except ValueError as err:  # leave the trace as the profiler wrote it
            logger.warning(
                "{}: not plain JSON ({}); data loading is not marked for the TensorBoard plugin", path, err
            )
            return path
        for event in trace.get("traceEvents", []):
            if event.get("name") == DATA_LOADER_RANGE and event.get("cat") == "user_annotation":
                event["cat"] = "cpu_op"
        tmp.write_text(json.dumps(trace))
    return path


def stage_breakdown(events) -> dict:
    """Per-step time of each stage over the profiled steps of `events` (a profiler's `events()`):
    {"steps": profiled steps, "step_ms": host ms per step, "gpu": whether GPU times exist,
    "stages": {stage: {"host_ms", "gpu_ms"}}} (ms per profiled step; GPU 0 without a GPU). The stages are
    STAGES, and GRAPH_REPLAY after them when the window replayed the step's CUDA graph."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async]
    steps = [e for e in cpu if e.name.startswith(_STEP_PREFIX)]
    n = max(len(steps), 1)
    host = dict.fromkeys((*STAGES, GRAPH_REPLAY), 0.0)
    intervals = []  # (start_us, end_us, stage) of every stage range, sorted by start
    for e in cpu:
        if e.name in host:
            host[e.name] += e.time_range.elapsed_us()
            intervals.append((e.time_range.start, e.time_range.end, e.name))
    intervals.sort()
    starts = [start for start, _, _ in intervals]

    def stage_at(t: float) -> str | None:
        """The innermost stage range open at host time t (stages do not nest in one another, but a stage
        may start inside another's time span on another thread: take the latest start before t)."""
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0 and intervals[i][1] < t:
            i -= 1
        return intervals[i][2] if i >= 0 else None

    gpu = dict.fromkeys(host, 0.0)
    any_kernel = False
    for e in cpu:
        if e.kernels and (stage := stage_at(e.time_range.start)) is not None:
            gpu[stage] += sum(k.duration for k in e.kernels)
        any_kernel = any_kernel or bool(e.kernels)
    # A replayed graph's kernels carry the correlation id of their cudaGraphLaunch call, not of an op, so
    # no op lists them in e.kernels: they are found among the device events by that id.
    graph_launches = {e.id: e.time_range.start for e in cpu if e.name == "cudaGraphLaunch"}
    for e in events:
        kernel = e.device_type != torch.autograd.DeviceType.CPU and not e.is_user_annotation
        if kernel and e.id in graph_launches:
            any_kernel = True
            if (stage := stage_at(graph_launches[e.id])) is not None:
                gpu[stage] += e.time_range.elapsed_us()
    step_us = sum(e.time_range.elapsed_us() for e in steps)
    seen = {name for _, _, name in intervals}  # GRAPH_REPLAY only where the step was replayed
    return {
        "steps": len(steps),
        "step_ms": step_us / n / 1000,
        "gpu": any_kernel,
        "stages": {
            s: {"host_ms": host[s] / n / 1000, "gpu_ms": gpu[s] / n / 1000}
            for s in host
            if s in STAGES or s in seen
        },
    }


def breakdown_table(breakdown: dict) -> str:
    """The breakdown as a markdown table (TensorBoard's Text tab renders it)."""
    gpu = breakdown["gpu"]
    step_ms = breakdown["step_ms"]
    header = "| stage | host ms/step | % of step |" + (" GPU ms/step |" if gpu else "")
    lines = [header, "| --- | --- | --- |" + (" --- |" if gpu else "")]
    for stage, t in breakdown["stages"].items():
        share = f"{100 * t['host_ms'] / step_ms:.1f}%" if step_ms else "-"
        lines.append(f"| {stage} | {t['host_ms']:.3f} | {share} |" + (f" {t['gpu_ms']:.3f} |" if gpu else ""))
    lines.append(f"| whole step | {step_ms:.3f} | 100% |" + (" |" if gpu else ""))
    note = (
        f"Profiled steps: {breakdown['steps']}. Host: wall-clock time of the stage's range on the host. "
        + (
            "GPU: kernels, copies and memsets launched inside the range. "
            if gpu
            else "No GPU time (CPU run). "
        )
        + "On a GPU the host only launches work: the host and GPU times of a stage differ."
        + (
            f" {GRAPH_REPLAY}: the whole training step replayed as one CUDA graph (--cuda-graphs), so the"
            " model's stages do not run apart and read 0 here; scripts/profile_step.py splits the replay's"
            " kernels by stage."
            if GRAPH_REPLAY in breakdown["stages"]
            else ""
        )
    )
    return "\n".join(lines) + "\n\n" + note


def write_stage_breakdown(writer, breakdown: dict, step: int) -> None:
    """Scalars profile/<stage>_ms (host) and profile/<stage>_gpu_ms (GPU runs), profile/step_ms, and the
    markdown table as text `profile`, at `step`."""
    for stage, t in breakdown["stages"].items():
        writer.add_scalar(f"profile/{stage}_ms", t["host_ms"], step)
        if breakdown["gpu"]:
            writer.add_scalar(f"profile/{stage}_gpu_ms", t["gpu_ms"], step)
    writer.add_scalar("profile/step_ms", breakdown["step_ms"], step)
    writer.add_text("profile", breakdown_table(breakdown), step)
    writer.flush()
