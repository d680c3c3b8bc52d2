"""The profiled window's per-stage breakdown in TensorBoard (scalars and the Text tab's table)."""

import contextlib
import dataclasses
import json
import time
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.autograd import DeviceType

from dlrm.config import ProfilerConfig, load_config, replace
from dlrm.profiling import (
    DATA_LOADER_RANGE,
    GRAPH_REPLAY,
    STAGES,
    breakdown_table,
    data_range,
    graph_replay_range,
    make_profiler,
    stage_breakdown,
    traced,
)
from dlrm.run.loop import train
from tests.conftest import REPO


def test_tiny_run_writes_the_stage_breakdown(criteo_sample, tmp_path):
    cfg = load_config(REPO / "configs" / "tiny.json")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(criteo_sample)))
    train(replace(cfg, "train", device="cpu", max_steps=4), tmp_path)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = events.Tags()["scalars"]
    for stage in STAGES:
        values = events.Scalars(f"profile/{stage}_ms")
        assert len(values) == 1 and values[0].step == 4, stage  # the window: steps 3 and 4
        assert values[0].value > 0, stage
        assert f"profile/{stage}_gpu_ms" not in scalars  # a CPU run has no GPU time
    assert events.Scalars("profile/step_ms")[0].value > events.Scalars("profile/embedding_ms")[0].value
    (text,) = events.Tensors("profile/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert "| stage | host ms/step | % of step |" in table and "Profiled steps: 2." in table
    for stage in STAGES:
        assert f"| {stage} | " in table
    # torch-tb-profiler counts this range (inside "data") as DataLoader time.
    (trace,) = tmp_path.glob("*.pt.trace.json")
    categories = {e.get("name"): e.get("cat") for e in json.loads(trace.read_text())["traceEvents"]}
    assert categories["data"] == "user_annotation" and categories[DATA_LOADER_RANGE] == "cpu_op"


@pytest.mark.gpu
def test_gpu_run_writes_gpu_time_per_stage(criteo_sample, tmp_path):
    cfg = load_config(REPO / "configs" / "tiny.json")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(criteo_sample)))
    train(replace(cfg, "train", device="cuda", max_steps=4), tmp_path)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    for stage in ("embedding", "bottom_mlp", "interaction", "top_mlp", "backward", "optimizer"):
        assert events.Scalars(f"profile/{stage}_gpu_ms")[0].value > 0, stage
    (text,) = events.Tensors("profile/text_summary")
    assert "GPU ms/step" in text.tensor_proto.string_val[0].decode()


def _event(name, start, end, thread=1, kernels=(), id=0, device_type=DeviceType.CPU, user_annotation=False):
    return SimpleNamespace(
        name=name,
        id=id,
        device_type=device_type,
        is_user_annotation=user_annotation,
        is_async=False,
        thread=thread,
        time_range=SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start),
        kernels=[SimpleNamespace(duration=d) for d in kernels],
    )


def test_gpu_time_goes_to_the_stage_open_when_the_work_was_launched():
    events = [
        _event("ProfilerStep*", 0, 1000),
        _event("data", 0, 100),
        _event("aten::copy_", 10, 20, kernels=[30]),  # host-to-device copy
        _event("forward", 100, 400),
        _event("embedding", 110, 200),
        _event("aten::embedding", 120, 130, kernels=[5, 7]),
        _event("top_mlp", 200, 400),
        _event("aten::addmm", 210, 220, kernels=[40]),
        _event("backward", 400, 800),
        _event("aten::mm", 500, 510, thread=2, kernels=[60]),  # autograd's thread
        _event("optimizer", 800, 900),
        _event("aten::add_", 950, 960, kernels=[1000]),  # outside every stage: not counted
        _event("ProfilerStep*", 1000, 3000),
    ]
    result = stage_breakdown(events)
    assert result["steps"] == 2 and result["gpu"] and result["step_ms"] == pytest.approx(1.5)
    stages = result["stages"]
    gpu = {stage: stages[stage]["gpu_ms"] * 2 * 1000 for stage in STAGES}  # back to us in all steps
    assert gpu == {
        "data": 30,
        "embedding": 12,
        "bottom_mlp": 0,
        "interaction": 0,
        "top_mlp": 40,
        "loss": 0,
        "backward": 60,
        "optimizer": 0,
    }
    assert stages["backward"]["host_ms"] == pytest.approx(0.2)
    table = breakdown_table(result)
    assert "| backward | 0.200 | 13.3% | 0.030 |" in table and "GPU ms/step" in table


def test_a_graph_replay_is_a_row_of_its_own():
    """Under --cuda-graphs the step's kernels are launched by the replay (the model's ranges do not open):
    its GPU time lands in a graph_replay row, which a run without graphs does not have. The replayed kernels
    are device events with the id of their cudaGraphLaunch, as the profiler gives them on an
    H100 (torch 2.11); the GPU-side span of the range (a device user annotation) is not a kernel."""
    events = [
        _event("ProfilerStep*", 0, 1000),
        _event("data", 0, 100),
        _event("aten::copy_", 10, 20, kernels=[30], id=5),
        _event(GRAPH_REPLAY, 100, 150, id=6, user_annotation=True),
        _event("cudaGraphLaunch", 110, 140, id=7),
        _event(GRAPH_REPLAY, 150, 900, id=6, device_type=DeviceType.CUDA, user_annotation=True),
        _event("sm90_gemm", 150, 550, id=7, device_type=DeviceType.CUDA),
        _event("elementwise", 600, 900, id=7, device_type=DeviceType.CUDA),
        _event("copy_kernel", 10, 40, id=5, device_type=DeviceType.CUDA),  # the copy's, listed in its kernels
    ]
    result = stage_breakdown(events)
    assert list(result["stages"]) == [*STAGES, GRAPH_REPLAY]
    assert result["stages"][GRAPH_REPLAY] == {"host_ms": 0.05, "gpu_ms": 0.7}
    assert result["stages"]["embedding"] == {"host_ms": 0.0, "gpu_ms": 0.0}
    table = breakdown_table(result)
    assert "| graph_replay | 0.050 | 5.0% | 0.700 |" in table and "scripts/profile_step.py" in table
    without = stage_breakdown([e for e in events if e.name not in (GRAPH_REPLAY, "cudaGraphLaunch")])
    assert list(without["stages"]) == list(STAGES) and GRAPH_REPLAY not in breakdown_table(without)


def test_the_graph_replay_range_is_recorded_only_while_a_profiler_records():
    assert isinstance(graph_replay_range(), contextlib.nullcontext)
    with torch.profiler.profile() as prof, graph_replay_range():
        torch.ones(3).add_(1)
    assert GRAPH_REPLAY in {e.name for e in prof.events()}


@pytest.mark.gpu
def test_a_graphed_gpu_run_writes_the_replays_gpu_time(criteo_sample, tmp_path):
    cfg = load_config(REPO / "configs" / "tiny.json")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(criteo_sample)))
    cfg = dataclasses.replace(cfg, profiler=dataclasses.replace(cfg.profiler, wait=5, warmup=1, active=2))
    train(replace(cfg, "train", device="cuda", use_triton=True, cuda_graphs=True, max_steps=8), tmp_path)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert events.Scalars(f"profile/{GRAPH_REPLAY}_gpu_ms")[0].value > 0


def test_outside_its_window_the_profiler_costs_no_ranges(tmp_path):
    """After the one recorded window, step() opens no more "ProfilerStep#" ranges and the loop's data range
    is a no-op; inside the window the data range is recorded."""
    cfg = ProfilerConfig(wait=1, warmup=1, active=1)
    profiler = make_profiler(cfg, tmp_path, torch.device("cpu"))
    ranges = []
    with profiler:
        for _ in range(10):
            ranges.append(data_range(profiler))
            with ranges[-1]:
                torch.ones(1).add_(1)
            profiler.step()
    assert profiler.step_num == 3  # wait + warmup + active, then no more steps
    nulls = [isinstance(r, contextlib.nullcontext) for r in ranges]
    assert nulls == [True, False, False] + [True] * 7
    assert "data" in {e.name for e in profiler.events()}
    assert isinstance(data_range(make_profiler(dataclasses.replace(cfg, enabled=False), tmp_path, "cpu")),
                      contextlib.nullcontext)  # fmt: skip


@pytest.fixture
def skip_clock(monkeypatch):
    """`time.perf_counter` (the clock the loop and the profiler read) made to jump: the fixture's value,
    called with s seconds, moves the clock s ahead without waiting."""
    skipped_s = [0.0]
    real_clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + skipped_s[0])
    return lambda seconds: skipped_s.__setitem__(0, skipped_s[0] + seconds)


def test_the_windows_steps_return_the_profilers_own_time(tmp_path, monkeypatch, skip_clock):
    """The loop keeps the profiler's own work out of its throughput: step() returns the seconds it spent in
    the calls that open the window (the tracer started), go on in it and close it (the trace's writing
    among them), and 0 before and after it. The trace's writing is made 1000 s slower on the clock the
    profiler reads (no real wait: the tracer's own start may take a busy machine a second)."""
    from dlrm import profiling

    write = profiling.export_trace

    def slow_export(*args, **kwargs):
        skip_clock(1000.0)
        return write(*args, **kwargs)

    monkeypatch.setattr(profiling, "export_trace", slow_export)
    profiler = make_profiler(ProfilerConfig(wait=1, warmup=1, active=1), tmp_path, torch.device("cpu"))
    with profiler:
        returned, in_window = [], []
        for _ in range(5):
            torch.ones(1).add_(1)
            in_window.append(traced(profiler))
            returned.append(profiler.step())
    assert in_window == [False, True, True, False, False]
    assert returned[2] >= 1000 and 0 < returned[0] < 1000 and 0 < returned[1] < 1000, returned
    assert returned[3:] == [0.0, 0.0], returned


def test_the_windows_steps_are_kept_out_of_samples_per_s(criteo_sample, tmp_path, monkeypatch, skip_clock):
    """A run's samples/s counts the steps outside the profiler's window only: here each traced step is made
    100 s slower on the clock the loop reads (no real wait: the bound must not hinge on how fast a busy CI
    machine runs the other steps), and samples/s stays above what those 300 s alone would allow."""
    from dlrm.run import loop

    def slow_when_traced(profiler) -> bool:
        in_window = traced(profiler)
        if in_window:
            skip_clock(100.0)
        return in_window

    monkeypatch.setattr(loop, "traced", slow_when_traced)
    cfg = load_config(REPO / "configs" / "tiny.json")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(criteo_sample)))
    cfg = dataclasses.replace(cfg, profiler=dataclasses.replace(cfg.profiler, wait=2, warmup=1, active=2))
    metrics = train(replace(cfg, "train", device="cpu", max_steps=10, log_interval=10), tmp_path)
    batch = cfg.data.batch_size
    assert metrics["samples_per_s"] > 10 * batch / 300, metrics["samples_per_s"]
