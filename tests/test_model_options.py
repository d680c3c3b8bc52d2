"""Model options (DESIGN.md "Model options"): `model.mlp_block`, `model.gate` and `model.interaction`
"attention"; every option's eager reference, its Triton kernels and torch.compile train alike, checkpoints
record the option, and the shipped configs train on the real sample."""

import dataclasses
import gzip
import json
import math

import pytest
import torch

from dlrm import evaluate as evaluate_cli
from dlrm import train as train_cli
from dlrm.choices import GATES
from dlrm.config import AttentionConfig, ModelConfig, load_config, replace
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.model import DLRM, model_from_checkpoint
from dlrm.model.dlrm import InteractionArch
from dlrm.model.mlp import MLP
from tests.conftest import REPO, SAMPLE_TSV
from tests.test_train import UPDATE_RTOL, _losses, _tiny, assert_updates_agree

# (mlp_block, gate) of every option besides the default.
OPTIONS = [("ln_linear_gelu", "sigmoid_tanh")] + [("gated", gate) for gate in GATES]
SMALL = ModelConfig(embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1), max_rows=50)


def _opt_id(option):
    return option[0] if option[0] != "gated" else f"gated-{option[1]}"


@pytest.mark.parametrize("option", OPTIONS, ids=_opt_id)
@pytest.mark.parametrize("block_last", [True, False], ids=["bottom", "top"])
def test_block_kernels_equal_the_eager_reference(option, block_last):
    """The same parameters through the eager PyTorch blocks and through our Triton kernels (interpreter on
    CPU): same outputs and gradients; with block_last False the last layer is a plain Linear."""
    block, gate = option
    torch.manual_seed(0)
    eager = MLP(13, (24, 7, 5), "relu", "identity", "torch", block, gate, block_last)
    triton = MLP(13, (24, 7, 5), "relu", "identity", "linear_act", block, gate, block_last)
    triton.load_state_dict(eager.state_dict())
    wide = 2 if block == "gated" else 1
    assert eager.layers[0].weight.shape == (24 * wide, 13)
    assert eager.layers[2].weight.shape == ((5 * wide if block_last else 5), 7)
    x = torch.randn(37, 13)
    outs, grads = [], []
    for mlp in (eager, triton):
        y = mlp(x)
        y.backward(torch.ones_like(y))
        outs.append(y)
        grads.append({name: p.grad for name, p in mlp.named_parameters()})
    # fp32 on both sides, sums in other orders: tests/tolerances.py's fp32 "gemm" bounds (atol 1e-4 for the
    # gradients, sums over the 37 rows and up to 48 features; the outputs stay within 1e-5).
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-4, msg=name)


@pytest.mark.parametrize("option", OPTIONS[:2], ids=_opt_id)
def test_state_dict_and_checkpoint_round_trip(option):
    block, gate = option
    cfg = dataclasses.replace(SMALL, mlp_block=block, gate=gate)
    model = DLRM(cfg, table_rows=[11] * NUM_SPARSE)
    keys = model.state_dict().keys()
    if block == "ln_linear_gelu":  # a LayerNorm before every bottom layer and every top layer but the logit
        assert {"dense_arch.mlp.norms.1.weight", "over_arch.mlp.norms.0.bias"} <= keys
        assert "over_arch.mlp.norms.1.weight" not in keys
    else:  # 2N rows for the blocks, a plain logit layer
        assert model.dense_arch.mlp.layers[1].weight.shape == (8, 8)
        assert model.over_arch.mlp.layers[1].weight.shape == (1, 8)
    g = torch.Generator().manual_seed(1)
    dense, ids = torch.rand(6, NUM_DENSE, generator=g), torch.randint(-1, 100, (6, NUM_SPARSE), generator=g)
    rebuilt = model_from_checkpoint(cfg, model.sparse_arch.table_rows, model.state_dict())
    torch.testing.assert_close(rebuilt(dense, ids), model(dense, ids))
    with pytest.raises(RuntimeError, match="norms|size mismatch"):  # another block does not load silently
        model_from_checkpoint(SMALL, model.sparse_arch.table_rows, model.state_dict())


@pytest.fixture(scope="module")
def small_sample(tmp_path_factory):
    """The first 1,320 rows of the shipped sample (1,056 train / 132 val / 132 test; rows 841-1080 have no
    click, so fewer rows would leave val of one class): the interpreter runs a program per sample in the
    interaction kernels, so the Triton runs' evaluations stay short."""
    from dlrm.data.preprocess import preprocess

    tmp = tmp_path_factory.mktemp("small")
    with gzip.open(SAMPLE_TSV, "rt") as f:
        lines = [next(f) for _ in range(1320)]
    with gzip.open(tmp / "head.tsv.gz", "wt") as f:
        f.writelines(lines)
    preprocess([tmp / "head.tsv.gz"], tmp / "sample", eval_fraction=0.2)
    return tmp / "sample"


def _curves(data_dir, tmp_path, model: dict, runs: dict, steps: int = 5, lr: float = 0.02):
    """Train tiny.json with the `model` overrides, batch 64, for `steps` steps per run (name -> train
    overrides), profiler off; the logged losses."""
    curves = {}
    for name, flags in runs.items():
        cfg = _tiny(data_dir, log_interval=1, max_steps=steps, lr=lr, **flags)
        cfg = replace(replace(cfg, "model", **model), "data", batch_size=64)
        cfg = dataclasses.replace(cfg, profiler=dataclasses.replace(cfg.profiler, enabled=False))
        train_cli.train(cfg, tmp_path / name)
        curves[name] = _losses(tmp_path / name)
    return curves


# (model overrides, with a compiled run): compile is slow on CPU, one compiled run per option.
ATTENTION = {"interaction": "attention", "attention": AttentionConfig(heads=2, layers=2, dim=4)}
BACKEND_RUNS = [({"mlp_block": b, "gate": g}, (b, g) in OPTIONS[:2]) for b, g in OPTIONS] + [
    (ATTENTION, True)
]
BACKEND_IDS = [_opt_id(o) for o in OPTIONS] + ["attention"]


@pytest.mark.parametrize(("model", "with_compile"), BACKEND_RUNS, ids=BACKEND_IDS)
def test_backends_agree_on_every_option(small_sample, tmp_path, initial_weights, model, with_compile):
    """eager, --use-triton and (once per option) --use-torch-compile give the same train loss and the same
    update of the tables and of the MLPs on tiny.json with the option (lr 0.02: geglu / swiglu, quadratic in
    their input, diverge at 0.05)."""
    runs = {"eager": {}, "triton": {"use_triton": True}}
    if with_compile:
        runs["compile"] = {"use_torch_compile": True}
    curves = _curves(small_sample, tmp_path, model, runs)
    assert len(curves["eager"]) == 5 and all(math.isfinite(v) for v in curves["eager"])
    # fp32 on every path (the interpreter's dots are IEEE fp32), sums in other orders: ~sqrt(n) * 2**-24
    # relative for a sum of n terms (n <= 64 rows, or a layer's width), which 5 steps keep near 1e-6: 1e-5 of
    # the loss (~0.5) and of the update's norm. Frozen tables move the gated options' loss by only 8e-4 in 5
    # steps, their update by its whole norm (1.0): `assert_updates_agree` sees them.
    for name in runs.keys() - {"eager"}:
        torch.testing.assert_close(curves[name], curves["eager"], rtol=1e-5, atol=1e-5, msg=name)
    # The updates' tolerance is wider than the curves': the logit layer starts at zero weights (the base
    # rate), so the tables get no gradient in the first step and small ones after, and the same absolute
    # rounding is a larger share of a small update (measured up to 2e-4 of its norm, attention; 5e-5,
    # swiglu). 1e-3 still sees a frozen part, off by 1.0.
    assert_updates_agree(initial_weights, [tmp_path / name for name in runs], rtol=1e-3)


@pytest.mark.parametrize("name", ["main_ln", "main_gated", "main_attention"])
def test_option_configs_train_on_the_sample(criteo_sample, tmp_path, name):
    """configs/main_<option>.json is main.json with the option; 20 steps train, the checkpoint records it,
    and dlrm.evaluate rebuilds the model from it."""
    cfg = load_config(REPO / "configs" / f"{name}.json")
    main = load_config(REPO / "configs" / "main.json")
    defaults = {"mlp_block": "linear_act", "gate": "sigmoid_tanh", "interaction": "dot"}
    assert dataclasses.replace(cfg.model, **defaults) == main.model and cfg.model != main.model
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(criteo_sample)))
    cfg = dataclasses.replace(cfg, profiler=dataclasses.replace(cfg.profiler, enabled=False))
    metrics = train_cli.train(replace(cfg, "train", max_steps=20, epochs=1), tmp_path / "run")
    assert math.isfinite(metrics["train_loss"])
    assert 0.0 < metrics["val_auc"] < 1.0 and 0.0 < metrics["test_auc"] < 1.0
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["config"]["model"]["mlp_block"] == cfg.model.mlp_block
    assert state["config"]["model"]["gate"] == cfg.model.gate
    assert state["config"]["model"]["interaction"] == cfg.model.interaction
    assert state["config"]["model"]["attention"] == dataclasses.asdict(cfg.model.attention)
    from click.testing import CliRunner

    result = CliRunner().invoke(
        evaluate_cli.main,
        ["--checkpoint", str(tmp_path / "run" / "checkpoints" / "last.pt"), "--data", str(criteo_sample)],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["samples"] == 1000  # the test split


def _interaction_inputs(seed: int, batch: int = 5, dim: int = 4):
    g = torch.Generator().manual_seed(seed)
    dense, embedded = torch.randn(batch, dim, generator=g), torch.randn(batch, NUM_SPARSE, dim, generator=g)
    sparse = torch.randint(0, 50, (batch, NUM_SPARSE), generator=g)
    sparse[torch.rand(batch, NUM_SPARSE, generator=g) < 0.3] = -1  # missing values
    return dense, embedded, sparse


def test_attention_interaction_kernel_equals_the_sdpa_reference():
    """The attention interaction on our kernel and on F.scaled_dot_product_attention, same parameters:
    same output and gradients (interpreter on CPU); two layers, the first with a residual projection."""
    torch.manual_seed(0)
    cfg = AttentionConfig(heads=2, layers=2, dim=3)
    eager = InteractionArch(4, "attention", kernel="torch", attention=cfg)
    triton = InteractionArch(4, "attention", kernel="triton", attention=cfg)
    triton.load_state_dict(eager.state_dict())
    assert set(eager.state_dict()) == {"qkv.0.weight", "qkv.1.weight", "residual.0.weight"}
    assert eager.out_features == (NUM_SPARSE + 1) * 6
    dense, embedded, sparse = _interaction_inputs(1)
    leaves = [dense.requires_grad_(), embedded.requires_grad_()]
    results = []
    for arch in (eager, triton):
        out = arch(dense, embedded, sparse)
        results.append((out, torch.autograd.grad(out.square().sum(), [*leaves, *arch.parameters()])))
    assert results[0][0].shape == (5, eager.out_features)
    # fp32 on both sides (IEEE dots in the interpreter), sums in other orders: within a few ulp.
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for got, want in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_attention_masks_missing_values_as_keys(kernel):
    """A missing value's embedding (raw id -1) is attended to by no vector: changing it changes only its
    own output position (its query and residual), in one layer."""
    torch.manual_seed(2)
    arch = InteractionArch(4, "attention", kernel=kernel, attention=AttentionConfig(heads=2, layers=1, dim=2))
    dense, embedded, sparse = _interaction_inputs(3)
    sample, feature = 1, int((sparse[1] == -1).nonzero()[0])
    changed = embedded.clone()
    changed[sample, feature] = 10 * torch.randn(4)
    before, after = (arch(dense, e, sparse).view(5, NUM_SPARSE + 1, -1) for e in (embedded, changed))
    diff = (before - after).abs().sum(-1)
    assert diff[sample, feature + 1] > 0 and diff.sum() == diff[sample, feature + 1]
    # Present (not -1), the same id is a key: every position of that sample moves.
    sparse[sample, feature] = 7
    before, after = (arch(dense, e, sparse).view(5, NUM_SPARSE + 1, -1) for e in (embedded, changed))
    assert ((before - after).abs().sum(-1)[sample] > 0).all()


# The wide terms too: their D = 1 tables run our embedding kernel with BLOCK_D = 1 under --use-triton.
GPU_RUNS = [{"mlp_block": b, "gate": g} for b, g in OPTIONS] + [
    ATTENTION,
    {"first_order": True},
    # logistic takes the default model keys (tiny.json's embedding_dim and MLPs are refused with it)
    {f.name: getattr(ModelConfig(arch="logistic"), f.name) for f in dataclasses.fields(ModelConfig)},
]
GPU_IDS = [*BACKEND_IDS, "first_order", "logistic"]
# logistic computes its terms in fp32 (bf16 is refused for it): its reduced precision is TF32.
GPU_CASES = [
    pytest.param(model, precision, id=f"{name}-{precision}")
    for model, name in zip(GPU_RUNS, GPU_IDS, strict=True)
    for precision in ("fp32", "tf32" if name == "logistic" else "bf16")
]


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "precision"), GPU_CASES)
def test_options_on_the_gpu_with_cuda_graphs(criteo_sample, tmp_path, initial_weights, model, precision):
    """Every option on the GPU (first-order terms and the logistic floor included): --use-triton, with the
    whole-step CUDA graph, and --use-torch-compile follow eager's loss curve for 30 steps (an epoch's
    evaluation inside), in fp32 and bf16 (logistic: TF32)."""
    runs = {
        "eager": {"precision": precision},
        "triton": {"use_triton": True, "cuda_graphs": False, "precision": precision},
        "triton_graphs": {"use_triton": True, "cuda_graphs": True, "precision": precision},
        "compile": {"use_torch_compile": True, "precision": precision},
    }
    curves = _curves(criteo_sample, tmp_path, model, runs, steps=30, lr=0.01)
    # bf16 rounds activations (unit roundoff 2**-9) in different places on each path: a logit through ~8
    # such roundings is off by up to 1.6e-2 of itself, the loss by as much of the logits' size (rtol 2e-2),
    # which loss spikes scale: at lr 0.02 geglu / swiglu spiked to a loss of 1.2-1.5 at step 26 and the
    # paths parted by 0.02-0.06 there (H100), so lr 0.01 here, and atol 2e-2 as well in bf16. TF32 (u =
    # 2**-11, GEMM operands only): 1e-3. fp32: the summation orders differ (TF32 off), ~sqrt(n) * 2**-24 per
    # sum, which 30 SGD steps amplify: 1e-3. These bounds are wider than frozen tables move the curve
    # (<= 6.7e-3 in bf16): the updates are compared as well.
    rtol, atol = {"bf16": (2e-2, 2e-2), "tf32": (1e-3, 1e-3)}.get(precision, (0, 1e-3))
    for name in sorted(runs.keys() - {"eager"}):
        torch.testing.assert_close(curves[name], curves["eager"], rtol=rtol, atol=atol, msg=name)
    assert_updates_agree(initial_weights, [tmp_path / name for name in runs], UPDATE_RTOL[precision])


def test_a_checkpoint_from_before_the_options_resumes_and_evaluates(criteo_sample, tmp_path):
    """A checkpoint whose config lacks the option keys (written before they existed) reads as the defaults:
    `--resume` accepts it under a config that has them, and dlrm.evaluate rebuilds it."""
    cfg = _tiny(criteo_sample, max_steps=2)
    cfg = dataclasses.replace(cfg, profiler=dataclasses.replace(cfg.profiler, enabled=False))
    train_cli.train(cfg, tmp_path / "old")
    path = tmp_path / "old" / "checkpoints" / "last.pt"
    state = torch.load(path, weights_only=True)
    for key in ("mlp_block", "gate", "attention", "lora"):
        del state["config"]["model"][key]
    torch.save(state, path)
    metrics = train_cli.train(replace(cfg, "train", max_steps=3), tmp_path / "resumed", resume=path)
    assert metrics["steps"] == 3
    from click.testing import CliRunner

    result = CliRunner().invoke(evaluate_cli.main, ["--checkpoint", str(path), "--data", str(criteo_sample)])
    assert result.exit_code == 0, result.output
