"""scripts/bench_embedding_bag.py's plain-PyTorch update (its baseline) against kernels.embedding_bag's
reference update, on the CPU: the baseline steps the rows it should, as the kernels' update does."""

import pytest
import torch

from kernels.embedding_bag import embedding_bag_lookup_ref, embedding_bag_update_ref
from kernels.embedding_bag_update import bag_columns
from kernels.embedding_update import optimizer_state
from tests.conftest import load_script

bench = load_script("bench_embedding_bag")


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_the_plain_pytorch_update_equals_the_reference(optimizer):
    """Repeated rows in and across bags (skewed ids over small tables), a state from earlier steps; the
    spare last row the baseline's unused slots point at stays as it was."""
    g = torch.Generator().manual_seed(0)
    sizes, table_rows, b, d = [3, 1, 5, 2] + [1] * 22, [7] * 26, 40, 8
    rows, bag_sizes = torch.tensor(table_rows), torch.tensor(sizes)
    offsets = torch.cumsum(rows, 0) - rows
    s = sum(sizes)
    ids = (torch.rand(b, s, generator=g) ** 3 * 20).long()
    weights = torch.randn(sum(table_rows) + 1, d, generator=g)
    state = optimizer_state(weights, optimizer) + 0.5
    grad = torch.randn(b, 26, d, generator=g)
    features, scales = bag_columns(bag_sizes, "sum", s)
    _, index = embedding_bag_lookup_ref(weights[:-1], offsets, rows, bag_sizes, ids, "modulus", "sum")
    got_w, got_s = weights.clone(), state.clone()
    # The plain-PyTorch step takes torch's int64 rows (its own lookup's), ours may be int32.
    bench._torch_update(got_w, got_s, index.long(), grad, features, scales, optimizer)
    ref_w, ref_s = weights[:-1].clone(), state[: len(weights) - 1].clone()
    lr = torch.tensor(bench.LR)
    embedding_bag_update_ref(ref_w, ref_s, index, grad, bag_sizes, "sum", optimizer, lr, bench.EPS)
    torch.testing.assert_close(got_w[:-1], ref_w, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_w[-1], weights[-1])
    if optimizer != "sgd":
        torch.testing.assert_close(got_s[: len(weights) - 1], ref_s, rtol=1e-5, atol=1e-6)
        assert torch.equal(got_s[-1], state[-1])


def test_an_optimizer_that_cannot_fit_is_refused_before_any_run(monkeypatch):
    """At the defaults (40M-row cap, B=65,536, MLPerf bags, bf16 weights) adagrad's fp32 [R, D] state alone
    is ~80 GiB: on a 140 GiB GPU the run is refused up front, naming what to lower; rowwise_adagrad and sgd
    fit, and so does adagrad at the 4M-row cap."""

    class Properties:
        total_memory = 140 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: Properties())
    s = sum(bench.parse_sizes("mlperf"))
    assert bench.needed_gib(65536, 128, s, 40_000_000, "adagrad", 2) > 140
    with pytest.raises(bench.click.UsageError, match=r"--optimizers adagrad at --max-rows 40,000,000.*lower"):
        bench.check_memory(65536, 128, s, 40_000_000, ["rowwise_adagrad", "adagrad"], 2)
    bench.check_memory(65536, 128, s, 40_000_000, ["rowwise_adagrad", "sgd"], 2)
    bench.check_memory(65536, 128, s, 4_000_000, ["adagrad"], 2)


def test_kernel_table_per_step_slowest_first():
    """The kernel table bench_embedding_bag writes (profile_step's ``kernel_table``): a profile's events over
    5 steps become each CUDA kernel's us and launches a step, slowest first; CPU ops are left out."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from tests.conftest import load_script

    def event(name, device, us):
        return SimpleNamespace(
            name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: us)
        )

    events = [event("_segment_step_kernel", DeviceType.CUDA, 100.0) for _ in range(5)]
    events += [event("aten::sort", DeviceType.CPU, 450.0) for _ in range(20)]
    events += [event("_segment_sum_kernel", DeviceType.CUDA, 2000.0 / 30) for _ in range(30)]
    table = load_script("profile_step").kernel_table(SimpleNamespace(events=lambda: events), 5)
    assert [kernel for _, kernel, _, _ in table] == ["_segment_sum_kernel", "_segment_step_kernel"]
    assert table[0][2:] == (pytest.approx(400.0), 6)
    assert table[1][2:] == (pytest.approx(100.0), 1)


def test_step_bytes_count_the_gradient_in_the_weights_dtype():
    """The step reads each lookup's pooled gradient row in the pooled output's dtype (the weights'): bf16
    tables move half the gradient bytes of fp32 ones; SGD on fp32 weights adds a row per lookup, no sort."""
    lookups, distinct, bags, d = 1000, 300, 260, 128
    fwd = bench.step_bytes("fwd", lookups, distinct, bags, d, 2, "rowwise_adagrad")
    assert fwd == lookups * (16 + 2 * d) + bags * 2 * d
    step = bench.step_bytes("step", lookups, distinct, bags, d, 2, "rowwise_adagrad")
    assert step - fwd == lookups * (24 + 2 * d) + distinct * 2 * (2 * d + 4)
    fp32_fwd = bench.step_bytes("fwd", lookups, distinct, bags, d, 4, "adagrad")
    fp32_step = bench.step_bytes("step", lookups, distinct, bags, d, 4, "adagrad")
    assert fp32_step - fp32_fwd == lookups * (24 + 4 * d) + distinct * 2 * (4 * d + 4 * d)
    sgd_fwd = bench.step_bytes("fwd", lookups, distinct, bags, d, 4, "sgd")
    assert bench.step_bytes("step", lookups, distinct, bags, d, 4, "sgd") - sgd_fwd == lookups * 3 * 4 * d
