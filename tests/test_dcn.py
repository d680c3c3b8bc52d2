"""The "dcn" interaction (dlrm/model/dcn.py): DCNv2's low-rank cross network against a plain implementation
written from the paper, TorchRec's initialization, our fused kernel against the PyTorch ops, and the three
backends training alike on a tiny DCN config."""

import dataclasses
import math

import pytest
import torch

from dlrm.config import DcnConfig, ModelConfig, load_config
from dlrm.data.bags import MLPERF_SIZES
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.model import DLRM, model_from_checkpoint
from dlrm.model.dcn import LowRankCrossNet
from dlrm.model.dlrm import InteractionArch
from tests.conftest import REPO
from tests.test_model_options import _curves, small_sample  # noqa: F401 (small_sample: a fixture)
from tests.test_train import assert_updates_agree


def paper_cross_net(x0: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """DCNv2 (Wang et al. 2021) eq. 1 with the low-rank W_l = U_l V_l^T (section 5.1), per sample as column
    vectors: x_{l+1} = x_0 (.) (U_l (V_l^T x_l) + b_l) + x_l, U_l and V_l [d, r], b_l [d]. x0 [B, d]."""
    x0 = x0.unsqueeze(2)  # [B, d, 1]
    x = x0
    for u, v, b in layers:
        x = x0 * (u @ (v.T @ x) + b.unsqueeze(1)) + x
    return x.squeeze(2)


def _paper_layers(cross: LowRankCrossNet) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The module's parameters in the paper's layout, as fresh leaves: U_l = u.weight, V_l = v.weight^T."""
    return [
        tuple(t.detach().clone().requires_grad_() for t in (u.weight, v.weight.T, u.bias))
        for u, v in zip(cross.u, cross.v, strict=True)
    ]


def _interaction_inputs(batch: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, dim, generator=g), torch.randn(batch, NUM_SPARSE, dim, generator=g)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_one_sgd_step_equals_the_paper(kernel):
    """InteractionArch "dcn" and the paper's formula over [dense | embeddings] (dense first, as TorchRec's
    InteractionDCNArch), same weights: same output, same gradients, and the same weights and output after
    one SGD step on a loss of the output (the bias starts at zero as in TorchRec, so it is set off zero
    first, making its term count). "triton": our fused kernel (interpreter on CPU)."""
    torch.manual_seed(0)
    dim, lr = 3, 0.05
    arch = InteractionArch(dim, "dcn", kernel=kernel, dcn=DcnConfig(layers=3, low_rank=4))
    with torch.no_grad():
        for u in arch.cross.u:
            u.bias.normal_()
    layers = _paper_layers(arch.cross)
    dense, embedded = _interaction_inputs(6, dim)
    x0 = torch.cat([dense, embedded.flatten(1)], dim=1)
    target = torch.randn(6, (NUM_SPARSE + 1) * dim)

    def loss(out):  # not linear in the output, so the gradient depends on it
        return (out - target).square().mean()

    optimizer = torch.optim.SGD(arch.parameters(), lr=lr)
    out = arch(dense, embedded)
    paper = paper_cross_net(x0, layers)
    # fp32 both sides, sums over N = 81 and r = 4 in other orders: a few ulp of |x| ~ 10.
    torch.testing.assert_close(out, paper, rtol=1e-5, atol=1e-5)
    loss(out).backward()
    loss(paper).backward()
    optimizer.step()
    with torch.no_grad():
        for layer in layers:
            for p in layer:
                p -= lr * p.grad
    for (u, v, b), mu, mv in zip(layers, arch.cross.u, arch.cross.v, strict=True):
        torch.testing.assert_close(mu.weight, u, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mv.weight, v.T, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mu.bias, b, rtol=1e-5, atol=1e-6)
        assert not torch.equal(mu.bias, torch.zeros_like(b))
    torch.testing.assert_close(arch(dense, embedded), paper_cross_net(x0, layers), rtol=1e-5, atol=1e-5)


def test_initialization_is_torchrec_s():
    """V_l and U_l Xavier-normal (std sqrt(2 / (N + r))), b_l zeros: TorchRec's LowRankCrossNet, at the
    MLPerf model's size (N = 27 x 128 = 3456, r = 512)."""
    torch.manual_seed(0)
    cross = LowRankCrossNet(3456, DcnConfig(layers=3, low_rank=512))
    std = math.sqrt(2 / (3456 + 512))
    for u, v in zip(cross.u, cross.v, strict=True):
        assert v.weight.shape == (512, 3456) and u.weight.shape == (3456, 512)
        for w in (u.weight, v.weight):
            # 1.77M samples: the sample std is within 0.2% of the true one (5 standard errors), the mean
            # within 5 std / sqrt(n).
            assert abs(w.std().item() / std - 1) < 2e-3 and abs(w.mean().item()) < 5 * std / 1300
        assert not u.bias.any()


def test_cross_kernel_equals_the_pytorch_ops():
    """LowRankCrossNet "triton" (our fused layer, interpreter on CPU) and "torch" on the same parameters:
    same output and gradients of the input and of every parameter."""
    torch.manual_seed(1)
    cfg = DcnConfig(layers=2, low_rank=5)
    eager, triton = LowRankCrossNet(40, cfg, "torch"), LowRankCrossNet(40, cfg, "triton")
    triton.load_state_dict(eager.state_dict())
    x0 = torch.randn(33, 40)
    results = []
    for cross in (eager, triton):
        leaf = x0.clone().requires_grad_()
        out = cross(leaf)
        results.append((out, torch.autograd.grad(out.square().sum(), [leaf, *cross.parameters()])))
    # fp32 both sides (IEEE dots in the interpreter), sums in other orders: tolerances.py's fp32 "gemm".
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-4)
    for got, want in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_cross_kernel_equals_the_pytorch_ops_under_bf16_autocast_gpu():
    """On the GPU, under the bf16 autocast of a bf16 step (3 layers of rank 512 over 27 x 128 features, the
    MLPerf shape): the "triton" network's output and every gradient against the "torch" layers' on the same
    parameters, as relative norms within the bf16 roundings the two paths take in different places (each
    [B, N] term rounded to bf16, u = 2**-9, three per layer, compounded over 3 layers and the backward):
    1.0-1.8e-2 measured in the interpreter (whose bf16 stores truncate: 2u) at N = 216, r = 32; 5e-2 is
    room for that, while a lost or doubled term of x0's summed gradient is off by O(1)."""
    torch.manual_seed(1)
    cfg = DcnConfig(layers=3, low_rank=512)
    eager = LowRankCrossNet(27 * 128, cfg, "torch").cuda()
    triton = LowRankCrossNet(27 * 128, cfg, "triton").cuda()
    triton.load_state_dict(eager.state_dict())
    x0 = torch.randn(2048, 27 * 128, device="cuda")
    results = []
    for cross in (eager, triton):
        leaf = x0.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            out = cross(leaf)
        results.append([out, *torch.autograd.grad(out.float().square().sum(), [leaf, *cross.parameters()])])
    for got, want in zip(results[1], results[0], strict=True):
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < 5e-2, err


def test_checkpoint_round_trip_and_width():
    """A "dcn" model: the top MLP reads (F + 1) D features, the cross parameters are in the state_dict, and
    a model rebuilt from it gives the same logits."""
    cfg = ModelConfig(
        embedding_dim=4,
        bottom_mlp=(8, 4),
        top_mlp=(8, 1),
        interaction="dcn",
        dcn=DcnConfig(2, 3),
        max_rows=50,
    )
    model = DLRM(cfg, table_rows=[11] * NUM_SPARSE)
    assert model.over_arch.mlp.layers[0].in_features == (NUM_SPARSE + 1) * 4
    assert model.state_dict()["interaction_arch.cross.v.1.weight"].shape == (3, (NUM_SPARSE + 1) * 4)
    g = torch.Generator().manual_seed(1)
    dense, ids = torch.rand(6, NUM_DENSE, generator=g), torch.randint(-1, 100, (6, NUM_SPARSE), generator=g)
    rebuilt = model_from_checkpoint(cfg, model.sparse_arch.table_rows, model.state_dict())
    torch.testing.assert_close(rebuilt(dense, ids), model(dense, ids))
    other = dataclasses.replace(cfg, dcn=DcnConfig(2, 4))
    with pytest.raises(RuntimeError, match="size mismatch"):  # another rank does not load silently
        model_from_checkpoint(other, model.sparse_arch.table_rows, model.state_dict())


def test_backends_agree_on_a_tiny_dcn(small_sample, tmp_path, initial_weights):  # noqa: F811
    """eager, --use-triton and --use-torch-compile train tiny.json with "dcn" (2 layers, rank 3) alike: the
    same losses over 3 steps, the same update of the tables and of the dense weights, and of the cross
    network's own weights (which get gradients from the second step on: the logit layer starts at zero
    weights)."""
    model = {"interaction": "dcn", "dcn": DcnConfig(layers=2, low_rank=3)}
    runs = {"eager": {}, "triton": {"use_triton": True}, "compile": {"use_torch_compile": True}}
    curves = _curves(small_sample, tmp_path, model, runs, steps=3)
    assert len(curves["eager"]) == 3 and all(math.isfinite(v) for v in curves["eager"])
    # fp32 on every path, sums in other orders (as test_model_options' option runs): 1e-5 of the loss.
    for name in ("triton", "compile"):
        torch.testing.assert_close(curves[name], curves["eager"], rtol=1e-5, atol=1e-5, msg=name)
    # As test_model_options: the first updates are small, so rounding is a larger share of them.
    assert_updates_agree(initial_weights, [tmp_path / name for name in runs], rtol=1e-3)
    # The cross network's weights alone: a kernel that does not train them is off by its whole update.
    updates = [
        _cross_update(weights, tmp_path / name) for weights, name in zip(initial_weights, runs, strict=True)
    ]
    assert updates[0].norm() > 0
    for update, name in zip(updates[1:], ("triton", "compile"), strict=True):
        assert ((update - updates[0]).norm() / updates[0].norm()).item() <= 1e-3, name


def _cross_update(initial: dict[str, torch.Tensor], run_dir) -> torch.Tensor:
    """last.pt's cross-network weights minus the initial ones, one fp32 vector."""
    final = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    return torch.cat([(final[k].float() - v).flatten() for k, v in initial.items() if ".cross." in k])


def test_dlrm_dcnv2_config_is_mlperf_s():
    """configs/dlrm_dcnv2.json loads and is MLPerf's DLRM-DCNv2: D = 128, bottom 512-256-128, 3 cross layers
    of rank 512 over 3456 features, top 1024-1024-512-256-1, the Criteo 1TB tables capped at 40M rows
    (204.2M rows in all), MLPerf's bag sizes (214 ids a sample) made uniform from the one-hot ids as MLPerf's
    materialized dataset is, sum-pooled, Adagrad lr 0.004 eps 1e-8 at a constant rate, global batch 65536."""
    cfg = load_config(REPO / "configs" / "dlrm_dcnv2.json")
    m, t = cfg.model, cfg.train
    assert (m.embedding_dim, m.bottom_mlp, m.top_mlp) == (128, (512, 256, 128), (1024, 1024, 512, 256, 1))
    assert (m.interaction, m.dcn) == ("dcn", DcnConfig(layers=3, low_rank=512))
    assert max(m.table_rows) == m.max_rows == 40_000_000 and sum(m.table_rows) == 204_184_588
    assert (t.optimizer, t.lr, t.adagrad_eps, t.embedding_lr) == ("adagrad", 0.004, 1e-8, None)
    assert t.lr_schedule.warmup_steps == 0 and t.lr_schedule.decay_start_step is None
    assert cfg.data.batch_size == 65536
    assert m.multi_hot_sizes == MLPERF_SIZES and sum(m.multi_hot_sizes) == 214 and m.pooling == "sum"
    assert cfg.data.multi_hot.distribution == "uniform"
    assert t.evals_per_epoch == 20 and t.eval_interval is None  # MLPerf's cadence: 20 a pass
    assert InteractionArch(m.embedding_dim, m.interaction, dcn=m.dcn).out_features == 3456
