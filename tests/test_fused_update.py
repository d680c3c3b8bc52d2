"""The plain-PyTorch fused table update (dlrm.model.fused_update, sparse kernel "torch_fused") against the
reference update of our Triton kernels (kernels.embedding_update.embedding_update_ref): the same rows
updated the same way, repeated rows summed first, with no host sync."""

import pytest
import torch

from dlrm import train as train_cli
from dlrm.config import RunConfig, load_config, replace
from dlrm.model import fused_update
from kernels.embedding_update import embedding_update_ref, optimizer_state
from tests.conftest import REPO

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")


def _case(seed: int, rows: int = 40, d: int = 8, lookups: int = 300):
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(rows, d, generator=g)
    index = torch.randint(0, rows // 2, (lookups // 3, 3), generator=g)  # many repeats; half the rows unused
    index[0, 0] = 0  # row 0, also the unused places' row, looked up
    grad = torch.randn(*index.shape, d, generator=g)
    return weights, index, grad


def test_segment_sums_are_each_distinct_rows_sum_then_zeros():
    weights, index, grad = _case(1)
    rows, sums = fused_update.segment_sums(index, grad, len(weights))
    distinct = torch.unique(index)
    u = len(distinct)
    assert torch.equal(rows[:u], distinct) and not rows[u:].any() and not sums[u:].any()
    flat, g = index.reshape(-1), grad.reshape(-1, grad.shape[-1])
    for place, row in enumerate(distinct):
        torch.testing.assert_close(sums[place], g[flat == row].sum(0))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("eps", [1e-8, 0.0])
def test_update_is_the_kernels_reference(optimizer, eps):
    """Two steps (Adagrad's state carried over); eps 0 leaves no NaN from the unused places."""
    weights, index, grad = _case(2)
    ours, reference = weights.clone(), weights.clone()
    ours_state, reference_state = optimizer_state(ours, optimizer), optimizer_state(reference, optimizer)
    lr = torch.tensor(0.05)
    for step in range(2):
        fused_update.apply_update(ours, ours_state, index, grad * (step + 1), optimizer, lr, eps)
        embedding_update_ref(reference, reference_state, index, grad * (step + 1), optimizer, lr, eps)
    assert not torch.equal(ours, weights)
    # The row sums add in another order (sorted vs torch.unique's inverse): a few fp32 roundings of ~30
    # terms, squared into the state (seen 4.4e-6 relative on a state element).
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_state, reference_state, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(len(weights), dtype=torch.bool)
    untouched[index.reshape(-1)] = False
    assert torch.equal(ours[untouched], weights[untouched])


def test_lookup_updates_in_backward_and_gives_no_weight_gradient():
    weights, index, grad = _case(3)
    table = torch.nn.Parameter(weights.clone())
    state = optimizer_state(table.detach(), "adagrad")
    lr = torch.tensor(0.1)
    out = fused_update.lookup(table, state, index, "adagrad", lr, 1e-8)
    assert torch.equal(out, weights[index])
    out.backward(grad)
    assert table.grad is None and state.any()
    expected, expected_state = weights.clone(), optimizer_state(weights, "adagrad")
    embedding_update_ref(expected, expected_state, index, grad, "adagrad", lr, 1e-8)
    torch.testing.assert_close(table.detach(), expected, rtol=1e-6, atol=1e-6)


def test_update_reads_no_value_on_the_host(monkeypatch):
    """What a CUDA graph capture needs: no .item(), .tolist() or torch.unique in the update."""
    weights, index, grad = _case(4)

    def host_read(*args, **kwargs):
        raise AssertionError("a host read in the fused update")

    for name in ("item", "tolist", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    monkeypatch.setattr(torch, "unique", host_read)
    for optimizer in OPTIMIZERS:
        state = optimizer_state(weights, optimizer)
        fused_update.apply_update(weights, state, index, grad, optimizer, torch.tensor(0.1), 1e-8)


def test_unknown_optimizer():
    weights, index, grad = _case(5)
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        fused_update.apply_update(weights, torch.zeros(0), index, grad, "lamb", torch.tensor(0.1), 1e-8)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_a_run_of_fused_tables_resumes_to_the_weights_of_an_uninterrupted_run(
    criteo_sample, tmp_path, monkeypatch, optimizer
):
    """The loop with "torch_fused" tables (what --use-torch-compile's whole-step graph trains, here without
    the graph, on the CPU): the tables' optimizer state goes into the checkpoint and back, so 4 + 4 steps
    resumed end at the weights of 8 (the table rows too)."""
    monkeypatch.setattr(RunConfig, "sparse_kernel", property(lambda self: "torch_fused"))
    cfg = load_config(REPO / "configs" / "tiny.json")
    cfg = replace(cfg, "data", path=str(criteo_sample))
    cfg = replace(cfg, "train", optimizer=optimizer, lr=0.05)

    def run(name: str, steps: int, resume=None) -> dict:
        metrics = train_cli.train(replace(cfg, "train", max_steps=steps), tmp_path / name, resume=resume)
        assert metrics["sparse_kernel"] == "torch_fused"
        return torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True)

    whole = run("whole", 8)
    run("first_half", 4)
    resumed = run("second_half", 8, resume=tmp_path / "first_half" / "checkpoints" / "last.pt")
    assert resumed["step"] == whole["step"] == 8
    for key, value in whole["model"].items():
        torch.testing.assert_close(resumed["model"][key], value, rtol=1e-6, atol=1e-7, msg=key)
    if optimizer == "adagrad":
        state = whole["embedding_optimizer_state"]
        assert state.any()
        torch.testing.assert_close(resumed["embedding_optimizer_state"], state, rtol=1e-6, atol=1e-7)
