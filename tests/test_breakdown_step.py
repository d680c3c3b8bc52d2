"""scripts/breakdown_step.py's attribution of backward kernels: each autograd node goes to the forward part
of the op that made it (the profiler's sequence numbers), not to an op before it that carries the same
number (an optimizer's op in grad mode, as the bf16 tables' rounding count)."""

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from tests.conftest import load_script

breakdown = load_script("breakdown_step")


def test_a_node_goes_to_the_part_of_the_op_that_made_it():
    w = torch.randn(8, requires_grad=True)
    count = torch.zeros(1, dtype=torch.int64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("optimizer"):
            count += 1  # grad mode, no node: it records the number the next node takes
        with record_function("embedding"):
            y = w * 2
        with record_function("top_mlp"):
            loss = (y * y).sum()
        loss.backward()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    parts = breakdown.node_parts(events)
    # The backward runs the sum's and y * y's nodes (top_mlp), then w * 2's (embedding), then w's
    # AccumulateGrad (no number: no forward op made it).
    nodes = [e.sequence_nr for e in events if e.name.startswith(breakdown.BACKWARD_NODE)]
    nodes = [seq for seq in nodes if seq >= 0]
    assert len(nodes) == 3
    assert sorted(parts[seq] for seq in nodes) == ["embedding", "top_mlp", "top_mlp"]
    assert parts[min(nodes)] == "embedding"


def test_a_part_lists_its_kernels_until_they_make_up_its_share_and_sums_the_rest(monkeypatch):
    monkeypatch.setattr(breakdown, "KERNEL_SHARE", 0.9)
    monkeypatch.setattr(breakdown, "MOST_KERNELS", 3)
    kernels = {
        ("embedding bwd", "aten::sort", "radix"): [50.0, 2.0],
        ("embedding bwd", "embedding_bag_update", "_step"): [30.0, 1.0],
        ("embedding bwd", "aten::cumsum", "scan"): [12.0, 1.0],
        ("embedding bwd", "aten::ne", "ne"): [5.0, 1.0],
        ("embedding bwd", "aten::zeros", "fill"): [3.0, 1.0],
        ("top_mlp bwd", "aten::mm", "gemm"): [99.0, 1.0],
    }
    listed, rest, rest_us = breakdown.part_kernels(kernels, "embedding bwd")
    # 50 + 30 = 80 < 90% of 100, with 12 more: 92 >= 90, so three are listed and two summed.
    assert listed == [(50.0, 2.0, "aten::sort", "radix"), (30.0, 1.0, "embedding_bag_update", "_step"),
                      (12.0, 1.0, "aten::cumsum", "scan")]  # fmt: skip
    assert (rest, rest_us) == (2, 8.0)
    monkeypatch.setattr(breakdown, "MOST_KERNELS", 2)
    listed, rest, rest_us = breakdown.part_kernels(kernels, "embedding bwd")
    assert len(listed) == 2 and (rest, rest_us) == (3, 20.0)


def test_a_kernel_goes_to_the_innermost_op_that_is_not_a_runtime_call():
    def event(name):
        return type("Event", (), {"name": name})()

    chain = [event("cuLaunchKernelEx"), event("embedding_bag_update"), event("autograd::engine::x")]
    assert breakdown.launching_op(chain) == "embedding_bag_update"
    assert breakdown.launching_op([event("aten::cumsum"), event("top_mlp")]) == "aten::cumsum"
    assert breakdown.launching_op([event("cudaLaunchKernel")]) == "cudaLaunchKernel"
