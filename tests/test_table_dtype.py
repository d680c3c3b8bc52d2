"""model.table_dtype "bf16": the tables held in bf16 with fp32 optimizer state, their fused updates rounded
stochastically (the kernels' rounding itself: tests/test_stochastic_rounding.py), on one process and on 2
gloo ranks. The model runs its embeddings, interaction and loss on our kernels (the Triton interpreter on
CPU) and its MLPs in PyTorch, so a step takes a fraction of a second."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dlrm import parallel
from dlrm.checkpoint import load_checkpoint, save_checkpoint
from dlrm.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig, apply_overrides, validate
from dlrm.data.dataset import Batch
from dlrm.model import make_model, model_from_checkpoint
from dlrm.model.sparse import SparseArch
from dlrm.optim import ROUNDING_COUNT_KEY, RunOptimizer
from dlrm.parallel import checkpoint as sharded_checkpoint
from dlrm.parallel.group import Dist
from dlrm.parallel.planner import plan_tables
from dlrm.parallel.sharded import build_sharded_model
from dlrm.step import train_step

ROWS = (5, 17, 3, 40, 2, 9, 31, 4, 11, 7, 23, 6, 2, 13, 8, 19, 3, 29, 5, 10, 37, 4, 15, 6, 21, 12)
MODEL = ModelConfig(embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1), table_rows=ROWS)
TRAIN = TrainConfig(optimizer="adagrad", lr=0.05, seed=3)


def _model(table_dtype: str, sparse_kernel: str = "triton"):
    torch.manual_seed(0)  # the MLPs (the tables draw from the seed alone)
    cfg = dataclasses.replace(MODEL, table_dtype=table_dtype)
    model = make_model(cfg, list(ROWS), mlp_kernel="torch", sparse_kernel=sparse_kernel, seed=1)
    return model, RunOptimizer(model, TRAIN)


def _batches(steps: int, b: int = 64) -> list[Batch]:
    g = torch.Generator().manual_seed(7)
    rows = torch.tensor(ROWS)
    return [
        Batch(
            torch.randn(b, 13, generator=g),
            (torch.rand(b, 26, generator=g) * 2 * rows).long() - 1,
            (torch.rand(b, generator=g) < 0.3).float(),
        )
        for _ in range(steps)
    ]


def _train(model, optimizer, batches) -> list[float]:
    return [train_step(model, optimizer, batch).item() for batch in batches]


def test_bf16_tables_hold_bf16_and_look_up_fp32_or_the_autocast_dtype():
    model, optimizer = _model("bf16")
    arch = model.sparse_arch
    assert arch.weights.dtype == torch.bfloat16 and arch.optimizer_state.dtype == torch.float32
    fp32, _ = _model("fp32")
    # The same initial weights, rounded to nearest once.
    assert torch.equal(arch.weights, fp32.sparse_arch.weights.to(torch.bfloat16))
    ids = _batches(1)[0].sparse
    with torch.no_grad():
        out = arch(ids)
        assert out.dtype == torch.float32
        assert torch.equal(out, arch.weights.float()[arch.hash_ids(ids) + arch.offsets])  # widened exactly
        with torch.autocast("cpu", torch.bfloat16):
            assert arch(ids).dtype == torch.bfloat16
    assert model.first_order is None and optimizer.rounds


def test_bf16_tables_train_close_to_fp32_tables():
    """6 Adagrad steps from the same seed: the bf16-table model's losses follow the fp32-table model's.

    Tolerance: the bf16 tables start as the fp32 ones rounded (relative error <= 2^-9) and each step's
    update is rounded once more, to a neighbouring bf16 value (error < one bf16 spacing, 2^-7 relative, zero
    in expectation). After k steps an embedding differs from the fp32 run's by at most (k + 1) 2^-7 of its
    size (ignoring the fp32 dynamics' own divergence, second order at lr 0.05 over 6 steps). The loss is
    BCE of a logit that the embeddings move through the interaction and top MLP with a gain of order 1,
    so its change is at most of the same relative size: rtol (6 + 1) * 2^-7 ~ 0.055 on each step's loss.
    Measured: 2e-5 relative at the first step, growing to 8e-3 at the sixth.
    """
    batches = _batches(6)
    losses = {dtype: _train(*_model(dtype), batches) for dtype in ("fp32", "bf16")}
    rtol = (len(batches) + 1) * 2.0**-7
    for step, (ours, theirs) in enumerate(zip(losses["bf16"], losses["fp32"], strict=True)):
        assert ours == pytest.approx(theirs, rel=rtol), step
    assert losses["bf16"][-1] != losses["bf16"][0]  # it trained


def test_each_step_advances_the_rounding_count_and_draws_new_bits():
    """RunOptimizer.step advances the count once a step (in place: a captured step replays it), so two
    steps on the same batch round with different bits; the seed comes from train.seed."""
    model, optimizer = _model("bf16")
    seed = int(optimizer.table_rounding[0])
    assert seed == int(_model("bf16")[1].table_rounding[0])  # the same train.seed, the same seed
    assert seed != int(RunOptimizer(_model("bf16")[0], dataclasses.replace(TRAIN, seed=4)).table_rounding[0])
    rounding = optimizer.table_rounding
    batch = _batches(1)[0]
    train_step(model, optimizer, batch)
    assert rounding.tolist() == [seed, 1] and optimizer.table_rounding is rounding  # in place
    _, fp32_optimizer = _model("fp32")
    assert not fp32_optimizer.rounds  # fp32 tables: nothing to advance


def test_a_resumed_run_continues_the_rounding_stream(tmp_path):
    """3 steps, a checkpoint file (dlrm.checkpoint: the tables in bf16, the count), a fresh model and
    optimizer loaded from it, 3 more steps: the tables equal an uninterrupted 6-step run's bit for bit.
    Resumed without the count (its stream restarted at 0) they do not."""
    batches = _batches(6)
    whole, whole_optimizer = _model("bf16")
    _train(whole, whole_optimizer, batches)

    first, optimizer = _model("bf16")
    _train(first, optimizer, batches[:3])
    path = tmp_path / "last.pt"
    save_checkpoint(
        path, model=first.state_dict(), **optimizer.state_dict(), config=RunConfig().to_dict(),
        table_rows=list(ROWS), step=3,
    )  # fmt: skip
    saved = load_checkpoint(path)
    tables = [saved["model"][f"sparse_arch.embeddings.{f}.weight"] for f in range(26)]
    assert all(t.dtype == torch.bfloat16 for t in tables) and int(saved[ROUNDING_COUNT_KEY]) == 3
    # The checkpoint's tables hold 2 bytes a value: half of what fp32 tables take.
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tables}  # views of one
    assert sum(storages.values()) == sum(ROWS) * 8 * 2

    def resume(with_count: bool) -> torch.Tensor:
        model = model_from_checkpoint(
            dataclasses.replace(MODEL, table_dtype="bf16"), list(ROWS), saved["model"], "torch", "triton"
        )
        loaded = RunOptimizer(model, TRAIN)
        loaded.load_state_dict({k: v for k, v in saved.items() if with_count or k != ROUNDING_COUNT_KEY})
        assert torch.equal(model.sparse_arch.weights, first.sparse_arch.weights)  # loaded bit-exactly
        _train(model, loaded, batches[3:])
        return model.sparse_arch.weights

    assert torch.equal(resume(with_count=True), whole.sparse_arch.weights)
    assert not torch.equal(resume(with_count=False), whole.sparse_arch.weights)


def test_a_bf16_checkpoint_scores_on_fp32_eager_tables():
    """`--backend eager` rebuilds the model with kernel "torch", whose tables stay fp32: the bf16 values
    load into them exactly."""
    model, _ = _model("bf16")
    eager = model_from_checkpoint(
        dataclasses.replace(MODEL, table_dtype="bf16"), list(ROWS), model.state_dict(), "torch", "torch"
    )
    assert eager.sparse_arch.embeddings[3].weight.dtype == torch.float32
    assert torch.equal(
        eager.sparse_arch.embeddings[3].weight, model.state_dict()["sparse_arch.embeddings.3.weight"]
    )


def test_config_refuses_bf16_tables_without_the_triton_kernel():
    cfg = RunConfig(model=dataclasses.replace(MODEL, table_dtype="bf16"))
    with pytest.raises(
        ValueError,
        match=r"^model.table_dtype: expected 'fp32' without train.use_triton \(bf16 tables need the Triton "
        r"sparse kernel: --use-triton\), got 'bf16'$",
    ):
        validate(cfg)
    validate(dataclasses.replace(cfg, train=TrainConfig(use_triton=True)))  # any optimizer
    for optimizer in ("sgd", "rowwise_adagrad"):
        validate(dataclasses.replace(cfg, train=TrainConfig(use_triton=True, optimizer=optimizer)))
    with pytest.raises(
        ValueError, match=r"model.table_dtype: expected one of \('fp32', 'bf16'\), got 'fp16'"
    ):
        apply_overrides(RunConfig(), ['model.table_dtype="fp16"'])
    logistic = RunConfig(
        model=ModelConfig(arch="logistic", table_dtype="bf16"), train=TrainConfig(use_triton=True)
    )
    with pytest.raises(
        ValueError, match="^model.table_dtype: expected its default 'fp32' with model.arch 'logistic'"
    ):
        validate(logistic)
    with pytest.raises(ValueError, match="bf16 tables need kernel 'triton', got 'torch'"):
        SparseArch(4, list(ROWS), table_dtype="bf16")


def test_planner_counts_the_tables_bytes_in_their_dtype():
    fp32 = plan_tables(list(ROWS), 16, "adagrad", 2, data_parallel_rows=5)
    bf16 = plan_tables(list(ROWS), 16, "adagrad", 2, data_parallel_rows=5, table_bytes_per_value=2)
    assert fp32.replicated == bf16.replicated and fp32.replicated
    replicated = sum(ROWS[f] for f in fp32.replicated) * 16 * 8  # fp32 weights + Adagrad, on every rank
    sharded = sum(ROWS) * 16 * 8 - replicated * 1
    assert sum(fp32.bytes_per_rank()) - 2 * replicated == sharded
    # bf16 shards: 2 + 4 bytes a value (weights, Adagrad's fp32 state); the replicated tables stay fp32.
    assert sum(bf16.bytes_per_rank()) - 2 * replicated == sharded * 6 // 8
    assert bf16.to_dict()["table_bytes_per_value"] == 2


# --------------------------------------------------------------------------------------------------
# 2 gloo ranks: the sharded tables in bf16, their checkpoint written and read back
# --------------------------------------------------------------------------------------------------


def _sharded_round_trip(directory: str, optimizer_name: str) -> None:
    """Every table split by rows over both ranks (with Adagrad, replicated small ones too), `optimizer_name`
    "adagrad" (state [rows, D]) or "rowwise_adagrad" (state [rows]): the sharded checkpoint holds the tables
    in bf16 (2 bytes a value in its byte count), one process reads them and their state whole bit-exactly,
    and 2 ranks load them back bit-exactly with the rounding count, from the checkpoint or from what one
    process read."""
    rank = torch.distributed.get_rank()
    dist_ = Dist(rank, 2, rank)
    cfg = RunConfig(
        model=dataclasses.replace(MODEL, table_dtype="bf16"),
        train=dataclasses.replace(TRAIN, use_triton=True, optimizer=optimizer_name),
        parallel=ParallelConfig(row_wise_bytes=1, data_parallel_rows=3),
    )
    cpu = torch.device("cpu")
    model, plan = build_sharded_model(cfg, {}, None, rank, 2, cpu)
    optimizer = RunOptimizer(model, cfg.train)
    arch = model.sparse_arch
    assert arch.weights.dtype == torch.bfloat16 and plan.table_bytes_per_value == 2
    if optimizer_name == "adagrad":
        assert plan.replicated and arch.replicated_weights.dtype == torch.float32
    else:  # no table replicated (the planner's rule); one accumulator a row
        assert not plan.replicated and arch.optimizer_state.shape == arch.weights.shape[:1]
    with torch.no_grad():  # weights and state of their own, not the seed's
        arch.weights.copy_(torch.randn(arch.weights.shape, generator=torch.Generator().manual_seed(rank)))
    arch.optimizer_state.uniform_()
    optimizer.table_rounding[1] = 11
    fp32_model, _ = build_sharded_model(dataclasses.replace(cfg, model=MODEL), {}, None, rank, 2, cpu)
    held = sum(s.rows for s in arch.local_shards) * 8
    fp32_bytes = sharded_checkpoint.checkpoint_bytes(fp32_model, RunOptimizer(fp32_model, cfg.train), dist_)
    assert fp32_bytes - sharded_checkpoint.checkpoint_bytes(model, optimizer, dist_) == held * 2

    path = Path(directory) / optimizer_name
    meta = {"step": 4, "table_rows": list(ROWS), "config": cfg.to_dict()}
    sharded_checkpoint.save_sharded(path, model, optimizer, dist_, meta)
    torch.distributed.barrier()
    whole = sharded_checkpoint.load_full(path)
    assert int(whole[ROUNDING_COUNT_KEY]) == 11
    # The one-process "triton" layout: every table's state concatenated.
    assert whole["embedding_optimizer_state"].shape == (sum(ROWS), *arch.optimizer_state.shape[1:])
    rows = [s.rows for s in arch.local_shards]
    for shard, view, state in zip(
        arch.local_shards, arch.weights.split(rows), arch.optimizer_state.split(rows), strict=True
    ):
        key, held = (
            f"sparse_arch.embeddings.{shard.table}.weight",
            slice(shard.row_start, shard.row_start + shard.rows),
        )
        assert whole["model"][key].dtype == torch.bfloat16
        assert torch.equal(whole["model"][key][held], view)
        assert torch.equal(whole["optimizer_by_name"][key][held], state)

    for load in (
        lambda model, optimizer: sharded_checkpoint.load_sharded(path, model, optimizer, dist_),
        lambda model, optimizer: sharded_checkpoint.load_full_into_sharded(whole, model, optimizer),
    ):
        fresh, _ = build_sharded_model(cfg, {}, None, rank, 2, cpu)
        fresh_optimizer = RunOptimizer(fresh, cfg.train)
        load(fresh, fresh_optimizer)
        assert torch.equal(fresh.sparse_arch.weights, arch.weights)
        assert torch.equal(fresh.sparse_arch.optimizer_state, arch.optimizer_state)
        assert fresh_optimizer.table_rounding.tolist() == optimizer.table_rounding.tolist()


def _rank_main(rank: int, port: int, directory: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
        DLRM_TIMEOUT_S="60",
    )  # fmt: skip
    try:
        parallel.init_distributed("cpu", 60.0)
        for optimizer in ("adagrad", "rowwise_adagrad"):
            _sharded_round_trip(directory, optimizer)
    except Exception as err:
        parallel.fail(err)
    parallel.shutdown()


def test_two_ranks_write_and_read_bf16_tables(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(port, str(tmp_path)), nprocs=2, join=True)


def test_bf16_rows_per_second_bound_is_half_the_bytes():
    """The planner's per-row bytes: D 2 + state for bf16 against D 4 + state for fp32; the state D 4 for
    Adagrad, 4 (one fp32 a row) for row-wise Adagrad."""
    from dlrm.parallel.planner import row_bytes

    assert row_bytes(128, "sgd", 2) * 2 == row_bytes(128, "sgd")
    assert row_bytes(128, "adagrad", 2) == 128 * 6 and row_bytes(128, "rowwise_adagrad", 2) == 128 * 2 + 4
