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
