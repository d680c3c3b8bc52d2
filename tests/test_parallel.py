"""Many processes (dlrm.parallel) on the CPU with gloo: rank-aware batches, the checks before any work, and
real 2- and 3-process runs of the training loop against one process on the same global batches."""

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from click.testing import CliRunner
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm import evaluate as evaluate_cli
from dlrm import parallel
from dlrm.checkpoint import load_checkpoint
from dlrm.config import ModelConfig, MultiHotConfig, load_config, replace
from dlrm.data.dataset import BatchLoader, load_metadata, open_split
from dlrm.model import sparse
from dlrm.model.sparse import SparseArch
from dlrm.optim import Adagrad
from dlrm.parallel.planner import plan_tables
from dlrm.parallel.run import check_world
from dlrm.parallel.sharded import ShardedSparseArch, build_sharded_model
from dlrm.run import selection, strategy
from dlrm.run.loop import train
from tests.conftest import REPO

TINY = REPO / "configs" / "tiny.json"
# W ranks compute the same sums as one process, in other orders (the dense all-reduce, GEMMs over B/W
# rows instead of B): float32 rounding, compounded over a few steps.
RTOL, ATOL = 1e-4, 1e-5
ADAGRAD_ATOL = 2e-4
BAGS = tuple(1 + f % 4 for f in range(26))  # bag sizes 1..4: one-hot features next to bags
# (world size, kernel, optimizer, empty last rank, data_parallel_rows, pooling) of the bag checks on the
# embedding alone (`_sharded_tables_match_one_table_batch`).
BAG_CHECKS = [
    (2, "torch", "sgd", False, 0, "sum"),
    (2, "triton", "adagrad", False, 30, "mean"),
    (2, "triton", "rowwise_adagrad", False, 0, "sum"),
    (3, "torch", "adagrad", True, 30, "mean"),
    (3, "triton", "sgd", False, 0, "sum"),
    (2, "triton", "sgd", False, 30, "sum"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(data_dir, **train):
    """tiny.json on `data_dir`: global batch 240 (divisible by 1, 2, 3), log every step, no profiler."""
    cfg = load_config(TINY)
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, path=str(data_dir), batch_size=240),
        profiler=dataclasses.replace(cfg.profiler, enabled=False),
    )
    return replace(cfg, "train", device="cpu", log_interval=1, **train)


def _losses(run_dir: Path) -> list[float]:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [e.value for e in events.Scalars("train/loss")]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


def _assert_same_weights(actual: dict, expected: dict, rtol=RTOL, atol=ATOL) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(
            actual[key], value, rtol=rtol, atol=atol, msg=lambda m, key=key: f"{key}: {m}"
        )


# --------------------------------------------------------------------------------------------------
# No processes: the batches of each rank, the checks before any work (the planner: test_parallel_plan.py)
# --------------------------------------------------------------------------------------------------


def test_world_checks_are_one_line_errors(criteo_sample):
    with pytest.raises(
        ValueError, match=r"^data.batch_size: 240 \(the global batch\) is not divisible by the 7"
    ):
        check_world(_config(criteo_sample), 7)
    cfg = replace(_config(criteo_sample), "parallel", row_wise=False)
    with pytest.raises(ValueError, match="^parallel.row_wise: 30 ranks but 26 tables"):
        check_world(replace(cfg, "data", batch_size=30), 30)
    logistic = dataclasses.replace(_config(criteo_sample), model=ModelConfig(arch="logistic"))
    with pytest.raises(ValueError, match="^model.arch: 'logistic' is not supported on many ranks yet"):
        check_world(logistic, 2)
    check_world(replace(_config(criteo_sample), "model", multi_hot_sizes=BAGS), 2)  # bags shard too


def test_ranks_split_every_global_batch(criteo_sample):
    dataset = open_split(criteo_sample, "train")
    single = list(BatchLoader(dataset, 300, shuffle=True, seed=4))
    ranks = [list(BatchLoader(dataset, 300, shuffle=True, seed=4, rank=r, world_size=3)) for r in range(3)]
    assert all(len(r) == len(single) for r in ranks)  # 8000 rows: the last batch of 200 is split 3 x 66
    for i, batch in enumerate(single):
        joined = torch.cat([ranks[r][i].sparse for r in range(3)])
        rows = batch.sparse.shape[0] // 3 * 3
        assert torch.equal(joined, batch.sparse[:rows])
    with pytest.raises(ValueError, match="not divisible by world_size 7"):
        BatchLoader(dataset, 300, rank=0, world_size=7)


# --------------------------------------------------------------------------------------------------
# Real processes
# --------------------------------------------------------------------------------------------------


def _rank_main(rank: int, world_size: int, port: int, jobs: list) -> None:
    """One rank of a gloo job: run each (function, args) in turn, then leave the group. A failure ends
    every rank (exit status 1, which fails the spawn)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), DLRM_TIMEOUT_S="60",
    )  # fmt: skip
    try:
        parallel.init_distributed("cpu", 60.0)
        for function, args in jobs:
            function(*args)
    except Exception as err:
        parallel.fail(err)
    parallel.shutdown()


@pytest.mark.parametrize(("optimizer", "table_dtype"), [("sgd", "fp32"), ("adagrad", "fp32"),
                                                      ("rowwise_adagrad", "bf16")])  # fmt: skip
def test_a_row_shards_update_leaves_its_padding_row_as_it_is(optimizer, table_dtype):
    """Kernel "triton" (interpreted here), one rank of a 2-rank plan that cuts a table by rows: the ids
    outside the rank's row shard look up its padding row, whose lookups the update drops, so after a step
    the padding row and its optimizer state are as they were (zero) while the shard's touched rows moved."""
    table_rows, bags = [64] + [3] * 25, (4,) + (1,) * 25
    plan = plan_tables(table_rows, 4, optimizer, 2, row_wise_bytes=300)
    assert any(s.rows < table_rows[s.table] for s in plan.shards_of(0)), "no row shard on rank 0"
    arch = ShardedSparseArch(plan, 0, 4, kernel="triton", multi_hot_sizes=bags, table_dtype=table_dtype)
    arch.configure_optimizer(optimizer, 0.1)
    padding = arch.bags.padding_row
    columns = [table_rows[s.table] for s in plan.shards_of(0) for _ in range(bags[s.table])]
    generator = torch.Generator().manual_seed(0)
    ids = (torch.rand(32, len(columns), generator=generator) * torch.tensor(columns)).long()
    before, state_before = arch.weights.detach().clone(), arch.optimizer_state.clone()
    pooled = arch.bags.lookup(arch, ids)
    pooled.backward(torch.randn(pooled.shape, generator=generator).to(pooled.dtype))
    assert torch.equal(arch.weights[padding], torch.zeros_like(arch.weights[padding]))
    if arch.optimizer_state.numel():
        assert torch.equal(arch.optimizer_state[padding], state_before[padding])
    assert not torch.equal(arch.weights[:padding], before[:padding])


def _table_optimizer(optimizer: str, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """A torch optimizer of tables: torch.optim's SGD or Adagrad, or dlrm.optim's row-wise Adagrad."""
    if optimizer == "rowwise_adagrad":
        return Adagrad([{"params": params, "rowwise": True}], lr)
    return (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adagrad)(params, lr)


def _sharded_tables_match_one_table_batch(
    kernel: str,
    optimizer: str,
    empty_last_rank: bool = False,
    data_parallel_rows: int = 0,
    bags: tuple[int, ...] | None = None,
    pooling: str = "sum",
    through_cat: bool = False,
) -> None:
    """On every rank: the sharded tables (some split by rows, and with `data_parallel_rows` the tables of
    at most that many rows replicated) look up this rank's part of a global batch as one process's
    SparseArch does, and after two optimizer steps hold the same rows (the replicated tables: their
    gradients averaged over the ranks, then a torch optimizer's step). With `empty_last_rank` the last rank
    holds no table (it still exchanges its samples, both ways). With `bags` (bag sizes) the ids are bags,
    pooled by `pooling`: a bag of a table split by rows is pooled in parts on several ranks. With
    `through_cat` each rank's vectors reach the loss as DCN's x0 takes them, concatenated after a dense
    part: their gradient comes back as a view of x0's (rows 27 D apart), which the exchange reads in
    place."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    table_rows, dim, b, lr = [5 + 3 * f for f in range(26)], 4, 6, 0.1
    full = SparseArch(dim, table_rows, kernel=kernel, multi_hot_sizes=bags, pooling=pooling)
    plan = plan_tables(
        table_rows, dim, optimizer, world - empty_last_rank, row_wise_bytes=300,
        data_parallel_rows=data_parallel_rows,
    )  # fmt: skip
    plan = dataclasses.replace(plan, world_size=world)
    assert any(s.rows < table_rows[s.table] for s in plan.shards)  # some tables split by rows
    assert len(plan.replicated) == sum(rows <= data_parallel_rows for rows in table_rows)
    sharded = ShardedSparseArch(plan, rank, dim, kernel=kernel, multi_hot_sizes=bags, pooling=pooling)
    placed = [(s.table, s.row_start, s.rows) for s in sharded.local_shards]
    held = sum(rows for *_, rows in placed)  # with bags and row shards, the padding row follows
    views = list(sharded.weights[:held].split([s.rows for s in sharded.local_shards]))
    if plan.replicated:
        placed += [(f, 0, table_rows[f]) for f in plan.replicated]
        views += list(sharded.replicated_weights.split([table_rows[f] for f in plan.replicated]))
    tables = {k: v for k, v in full.state_dict().items() if k.startswith("embeddings.")}
    with torch.no_grad():
        for (f, start, rows), view in zip(placed, views, strict=True):
            view.copy_(tables[f"embeddings.{f}.weight"][start : start + rows])
    optimizers = [_table_optimizer(optimizer, sharded.replicated_parameters(), lr)] if plan.replicated else []
    for module in (full, sharded):
        if kernel == "triton":
            module.configure_optimizer(optimizer, lr)
        else:
            params = [module.weights] if module is sharded else list(module.parameters())
            optimizers.append(_table_optimizer(optimizer, params, lr))
    generator = torch.Generator().manual_seed(1)
    mine = slice(rank * b, (rank + 1) * b)
    columns = 26 if bags is None else sum(bags)
    for step in range(2):
        ids = torch.randint(
            -1, 60, (world * b, columns), generator=generator
        )  # -1: missing; past rows: hashed
        grad = torch.randn(world * b, 26, dim, generator=generator)
        expected = full(ids)
        looked_up = sharded(ids[mine])
        # The same rows exactly; after an update, rounded differently (grad / b / W, not grad / B). A bag
        # split over row shards is summed in another order: the pool rounds differently from the start.
        exact = step == 0 and bags is None
        torch.testing.assert_close(
            looked_up, expected[mine].detach(), rtol=0 if exact else 1e-6, atol=0 if exact else 1e-7
        )
        (expected * grad).sum().div(world * b).backward()  # one process: mean over the global batch
        if through_cat:
            looked_up = torch.cat([torch.zeros(b, dim), looked_up.flatten(1)], dim=1)[:, dim:].view(
                b, 26, dim
            )
        (looked_up * grad[mine]).sum().div(b).backward()  # each rank: mean over its part
        for p in sharded.replicated_parameters():  # what dlrm.parallel.dense.grad_averager does
            torch.distributed.all_reduce(p.grad)
            p.grad.div_(world)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    tables = {k: v for k, v in full.state_dict().items() if k.startswith("embeddings.")}
    views = list(sharded.weights.detach()[:held].split([s.rows for s in sharded.local_shards]))
    if plan.replicated:
        views += list(sharded.replicated_weights.detach().split([table_rows[f] for f in plan.replicated]))
    for (f, start, rows), view in zip(placed, views, strict=True):
        expected_rows = tables[f"embeddings.{f}.weight"][start : start + rows]
        torch.testing.assert_close(view, expected_rows, rtol=1e-6, atol=1e-7, msg=f"{kernel} {optimizer} {f}")


def _starts_from_the_one_process_weights(data_dir: str, block_rows: int) -> None:
    """On every rank, for plans that place the tables every way (whole on one rank, split by rows over
    both, replicated; vocab hashing with first-order terms; bags, whose row shards add a padding row): the
    model a 2-rank run starts from (set_up: torch.manual_seed(train.seed), then the strategy's build_model)
    holds its rows of the tables and the dense weights that one process starts from with that seed.
    `block_rows`: init_tables' block, small here so that row shards begin and end inside blocks."""
    sparse.INIT_BLOCK_ROWS = block_rows
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    metadata, train_ids = load_metadata(Path(data_dir)), open_split(Path(data_dir), "train").sparse
    base = replace(_config(data_dir), "train", seed=5)
    configs = [
        replace(base, "parallel", row_wise=False),
        replace(
            replace(base, "parallel", row_wise_bytes=1, data_parallel_rows=30),
            "model",
            hashing="vocab",
            first_order=True,
        ),
        replace(replace(base, "parallel", row_wise_bytes=1), "model", multi_hot_sizes=BAGS),
    ]
    cpu = torch.device("cpu")
    for cfg in configs:
        torch.manual_seed(cfg.train.seed)
        one = strategy.SingleProcess().build_model(cfg, metadata, train_ids, cpu)
        torch.manual_seed(cfg.train.seed)
        sharded, plan = build_sharded_model(cfg, metadata, train_ids, rank, world, cpu)
        assert any(s.rows < plan.table_rows[s.table] for s in plan.shards) or not cfg.parallel.row_wise
        expected, held = one.state_dict(), sharded.state_dict()
        dense = [k for k in expected if not k.startswith(("sparse_arch.", "first_order.tables."))]
        assert dense and all(torch.equal(held[k], expected[k]) for k in dense), [
            k for k in dense if not torch.equal(held[k], expected[k])
        ]
        for ours, theirs in ((sharded.sparse_arch, one.sparse_arch), (sharded.first_order, one.first_order)):
            if ours is None:
                continue
            ours = getattr(ours, "tables", ours)
            theirs = [t.weight for t in getattr(theirs, "tables", theirs).embeddings]
            pieces = [(s.table, s.row_start, s.rows) for s in ours.local_shards]
            held_rows = [rows for *_, rows in pieces]
            views = list(ours.weights[: sum(held_rows)].split(held_rows))
            if ours.replicated:
                pieces += [(f, 0, plan.table_rows[f]) for f in ours.replicated]
                views += list(ours.replicated_weights.split([plan.table_rows[f] for f in ours.replicated]))
            assert pieces
            for (f, start, rows), view in zip(pieces, views, strict=True):
                assert torch.equal(view, theirs[f][start : start + rows]), (f, start, rows)


SCRIPTED_VAL_AUC = [0.6, 0.9, 0.7, 0.65]  # evaluations at steps 1..4: val selects step 2


def _train_with_scripted_val(cfg, run_dir: Path) -> None:
    """`train` with the val AUCs of SCRIPTED_VAL_AUC (the rest of each val evaluation real), so that the
    selected weights are not the last ones: the test evaluation must load best.pt's (here the sharded
    checkpoints/best, on every rank)."""
    real, scripted = selection.evaluate_split, iter(SCRIPTED_VAL_AUC)

    def scripted_val(run, loader, split):
        result = real(run, loader, split)
        return {**result, "auc": next(scripted)} if split == "val" else result

    selection.evaluate_split = scripted_val
    try:
        train(cfg, run_dir)
    finally:
        selection.evaluate_split = real


def _spawn(world_size: int, jobs: list) -> None:
    mp.spawn(_rank_main, args=(world_size, _free_port(), jobs), nprocs=world_size, join=True)


def test_two_ranks_start_from_the_one_process_weights_of_the_seed(criteo_sample):
    _spawn(2, [(_starts_from_the_one_process_weights, (str(criteo_sample), 7))])


# (name, train overrides, parallel overrides, model overrides, data overrides, world sizes) of the runs
# compared with one process. (The Triton interpreter takes ~10 s per step and evaluation here: our kernels
# are compared in `_sharded_tables_match_one_table_batch`, on the embedding alone.)
UNIFORM = MultiHotConfig(distribution="uniform", seed=3)  # bags of BAGS made on the fly from the sample
SCENARIOS = [
    ("sgd_table_wise", {}, {"row_wise": False}, {}, {}, (2, 3)),
    (  # configs/main.json's model (vocab hashing, first-order terms) with Adagrad and every table row-wise
        "adagrad_row_wise_vocab",
        {"optimizer": "adagrad", "lr": 0.05},
        {"row_wise_bytes": 1},
        {"hashing": "vocab", "first_order": True},
        {},
        (2, 3),
    ),
    (
        "sgd_table_wise_bags",
        {},
        {"row_wise": False},
        {"multi_hot_sizes": BAGS},
        {"multi_hot": UNIFORM},
        (2, 3),
    ),
    (  # bags made on the fly, mean-pooled, every table row-wise (a bag pooled in parts on several ranks)
        "adagrad_row_wise_bags",
        {"optimizer": "adagrad", "lr": 0.05},
        {"row_wise_bytes": 1},
        {"multi_hot_sizes": BAGS, "pooling": "mean"},
        {"multi_hot": UNIFORM},
        (2, 3),
    ),
]


def _scenario_config(data_dir, name, max_steps):
    _, train_overrides, parallel_overrides, model_overrides, data_overrides, _ = next(
        s for s in SCENARIOS if s[0] == name
    )
    cfg = _config(data_dir, max_steps=max_steps, **train_overrides)
    cfg = replace(cfg, "parallel", **parallel_overrides)
    cfg = replace(cfg, "model", **model_overrides) if model_overrides else cfg
    return replace(cfg, "data", **data_overrides) if data_overrides else cfg


def test_two_and_three_ranks_train_the_one_process_batches(criteo_sample, tmp_path):
    """From the same weights (a one-process checkpoint at step 2), 2 and 3 ranks train steps 3..6 of the
    same global batches as one process: the same logged losses, eval metrics and final weights (the
    "torch" tables; the "triton" ones on the embedding alone, `_sharded_tables_match_one_table_batch`). Also:
    their sharded checkpoint, read whole, holds those weights; 2 ranks' checkpoint at step 4 resumes on 3
    ranks and on 1 process with identical weights, and goes on to the same step-6 weights."""
    reference = {}
    jobs2, jobs3 = [], []
    for name, *_, worlds in SCENARIOS:
        start = tmp_path / f"{name}-start"
        train(_scenario_config(criteo_sample, name, 2), start)
        reference[name] = tmp_path / f"{name}-1"
        start_ckpt = start / "checkpoints" / "last.pt"
        train(_scenario_config(criteo_sample, name, 6), reference[name], start_ckpt)
        for world_size, jobs in ((2, jobs2), (3, jobs3)):
            if world_size in worlds:
                run = tmp_path / f"{name}-{world_size}"
                jobs.append((train, (_scenario_config(criteo_sample, name, 6), run, start_ckpt)))
    # Resharding: 2 ranks write step 4; 3 ranks load it (and save it again untouched), then go on to 6.
    name = "adagrad_row_wise_vocab"
    start_ckpt = tmp_path / f"{name}-start" / "checkpoints" / "last.pt"
    half = tmp_path / "half-2"
    jobs2.append((train, (_scenario_config(criteo_sample, name, 4), half, start_ckpt)))
    half_ckpt = half / "checkpoints" / "last"
    jobs3.append((train, (_scenario_config(criteo_sample, name, 4), tmp_path / "reloaded-3", half_ckpt)))
    jobs3.append((train, (_scenario_config(criteo_sample, name, 6), tmp_path / "resumed-3", half_ckpt)))
    # 2 ranks' bag checkpoint (row shards, each rank's padding row after them) reloads on 3 ranks.
    bags_2 = tmp_path / "adagrad_row_wise_bags-2" / "checkpoints" / "last"
    bags_cfg = _scenario_config(criteo_sample, "adagrad_row_wise_bags", 6)
    jobs3.append((train, (bags_cfg, tmp_path / "bags-reloaded-3", bags_2)))
    # Our Triton kernels (interpreted) and the torch tables, on the embedding alone, SGD and Adagrad.
    for kernel, optimizer in (("triton", "sgd"), ("triton", "adagrad"), ("torch", "adagrad")):
        jobs2.insert(0, (_sharded_tables_match_one_table_batch, (kernel, optimizer)))
    for kernel, optimizer in (("triton", "adagrad"), ("torch", "sgd")):  # 9 of the 26 tables replicated
        jobs2.insert(0, (_sharded_tables_match_one_table_batch, (kernel, optimizer, False, 30)))
    through_cat = ("triton", "adagrad", False, 30, None, "sum", True)  # the tables' gradient a view of x0's
    jobs2.insert(0, (_sharded_tables_match_one_table_batch, through_cat))
    jobs3.insert(0, (_sharded_tables_match_one_table_batch, ("triton", "adagrad")))
    jobs3.insert(0, (_sharded_tables_match_one_table_batch, ("torch", "sgd", True)))
    jobs3.insert(0, (_sharded_tables_match_one_table_batch, ("triton", "sgd", True, 30)))
    # Bags (the tables split by rows pool a bag in parts on several ranks; the replicated ones pool their
    # own samples' bags): row-wise Adagrad is the "triton" kernel's own update.
    for world_size, kernel, optimizer, empty_last_rank, rows, pooling in BAG_CHECKS:
        check = (kernel, optimizer, empty_last_rank, rows, BAGS, pooling)
        (jobs2 if world_size == 2 else jobs3).insert(0, (_sharded_tables_match_one_table_batch, check))
    # The other loaders and bf16 on 2 ranks, with the profiler on (a trace per rank).
    streaming = replace(_config(criteo_sample, max_steps=4, precision="bf16"), "data", loader="streaming")
    streaming = dataclasses.replace(streaming, profiler=dataclasses.replace(streaming.profiler, enabled=True))
    jobs2.append((train, (streaming, tmp_path / "streaming-bf16-2", None)))
    resident = replace(_config(criteo_sample, max_steps=2), "data", loader="gpu_resident")
    jobs2.append((train, (resident, tmp_path / "resident-2", None)))
    selecting = _config(criteo_sample, max_steps=4, eval_interval=1, select_on="auc")
    jobs2.append((_train_with_scripted_val, (selecting, tmp_path / "selecting-2")))
    # The exchange in bf16 (forward vectors, backward gradients), from the same start as sgd_table_wise.
    bf16_exchange = replace(
        _scenario_config(criteo_sample, "sgd_table_wise", 6), "parallel", exchange_dtype="bf16"
    )
    start_ckpt = tmp_path / "sgd_table_wise-start" / "checkpoints" / "last.pt"
    jobs2.append((train, (bf16_exchange, tmp_path / "bf16-exchange-2", start_ckpt)))
    _spawn(2, jobs2)
    _spawn(3, jobs3)
    train(_scenario_config(criteo_sample, name, 6), tmp_path / "resumed-1", half_ckpt)

    for name, *_, worlds in SCENARIOS:
        expected = json.loads((reference[name] / "metrics.json").read_text())
        expected_losses = _losses(reference[name])
        expected_weights = _weights(reference[name] / "checkpoints" / "last.pt")
        assert len(expected_losses) == 4  # steps 3..6
        for world_size in worlds:
            run = tmp_path / f"{name}-{world_size}"
            metrics = json.loads((run / "metrics.json").read_text())
            assert (
                metrics["world_size"] == world_size and metrics["samples"] == expected["samples"] == 6 * 240
            )
            assert metrics["step_ms_min"] <= metrics["step_ms_max"]
            torch.testing.assert_close(_losses(run), expected_losses, rtol=RTOL, atol=ATOL, msg=name)
            for key in ("val_auc", "val_logloss", "val_ne", "test_auc", "test_logloss", "test_ne"):
                assert metrics[key] == pytest.approx(expected[key], rel=1e-4), (name, world_size, key)
            plan = json.loads((run / "sharding_plan.json").read_text())
            assert plan["world_size"] == world_size
            # Adagrad divides by the root of small accumulated squares, which magnifies the sums' other
            # order (the all-reduce, GEMMs over B/W rows): after 4 steps single elements of the tables
            # moved by 1e-5 to 8e-5 (1 of ~10k), with or without the first-order terms.
            atol = ADAGRAD_ATOL if "adagrad" in name else ATOL
            _assert_same_weights(_weights(run / "checkpoints" / "last"), expected_weights, atol=atol)

    # bf16 on the wire rounds each vector and gradient to 8 bits of mantissa (relative 2^-9): the loss curve
    # moves, by far less than the loss itself (measured: at most 1.2e-7 of it over these 4 steps, where the
    # small initial embeddings move the logit little; the bound allows 100x that).
    bf16_losses, fp32_losses = _losses(tmp_path / "bf16-exchange-2"), _losses(reference["sgd_table_wise"])
    assert bf16_losses != fp32_losses
    torch.testing.assert_close(bf16_losses, fp32_losses, rtol=1.2e-5, atol=0)

    for run, steps in (("streaming-bf16-2", 4), ("resident-2", 2)):
        metrics = json.loads((tmp_path / run / "metrics.json").read_text())
        assert metrics["steps"] == steps and metrics["samples"] == steps * 240, run
        assert (
            math.isfinite(metrics["train_loss"])
            and 0 < metrics["val_auc"] < 1
            and 0 < metrics["test_auc"] < 1
        ), run
    assert sorted(p.name.split(".")[0] for p in (tmp_path / "streaming-bf16-2").glob("*.pt.trace.json")) == [
        "rank0",
        "rank1",
    ]
    # `python -m dlrm.evaluate` reads a sharded checkpoint in one process: the metrics of the run (test by
    # default). The scripted run selected step 2 of 4 on val: its test numbers are best's weights'.
    for run in (tmp_path / "sgd_table_wise-2", tmp_path / "selecting-2"):
        metrics = json.loads((run / "metrics.json").read_text())
        for split in ("test", "val"):
            args = ["--checkpoint", run / "checkpoints" / "best", "--data", criteo_sample, "--split", split]
            result = CliRunner().invoke(evaluate_cli.main, [str(a) for a in args])
            assert result.exit_code == 0, result.output
            scored = json.loads(result.output.splitlines()[-1])
            key = "logloss" if run.name == "selecting-2" and split == "val" else "auc"  # val AUC scripted
            assert scored[key] == pytest.approx(metrics[f"{split}_{key}"], abs=1e-6), (run, split)
    assert metrics["best_step"] == 2 and metrics["val_auc"] == 0.9 and metrics["steps"] == 4
    last = CliRunner().invoke(
        evaluate_cli.main, ["--checkpoint", str(run / "checkpoints" / "last"), "--data", str(criteo_sample)]
    )
    # Other weights than best's: off by more than the 1e-6 that the equalities above allow (the model starts
    # at the base rate, so 2 more steps of the tiny config move the logloss by a few 1e-6 only).
    assert abs(json.loads(last.output.splitlines()[-1])["logloss"] - metrics["test_logloss"]) > 1e-6
    events = EventAccumulator(str(run))
    events.Reload()
    assert [e.step for e in events.Scalars("test/auc")] == [2]

    reference_6 = _weights(tmp_path / "adagrad_row_wise_vocab-1" / "checkpoints" / "last.pt")
    half_weights = _weights(half_ckpt)
    _assert_same_weights(_weights(tmp_path / "reloaded-3" / "checkpoints" / "last"), half_weights, 0, 0)
    reloaded_bags = _weights(tmp_path / "bags-reloaded-3" / "checkpoints" / "last")
    _assert_same_weights(reloaded_bags, _weights(bags_2), 0, 0)
    for run in ("resumed-3", "resumed-1"):
        last = tmp_path / run / "checkpoints" / ("last.pt" if run.endswith("-1") else "last")
        _assert_same_weights(_weights(last), reference_6, atol=ADAGRAD_ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("precision", "optimizer", "bags", "rtol", "atol"),
    [
        ("fp32", "sgd", False, 1e-3, 1e-4),
        ("bf16", "sgd", False, 2e-2, 1e-3),
        ("fp32", "adagrad", False, 1e-3, 5e-3),
        ("fp32", "adagrad", True, 1e-3, 5e-3),
    ],
)
def test_two_gpus_with_cuda_graphs_follow_one_gpu(
    criteo_sample, tmp_path, precision, optimizer, bags, rtol, atol
):
    """torchrun on 2 GPUs, `--use-triton --cuda-graphs` (NCCL all_to_all and all_reduce captured in the
    step's graph, the replicated tables' update and Adagrad's too; evaluation as graph replays): from the
    same step-2 checkpoint, the loss curve, weights and test metrics of one GPU; with `bags`, of BAGS made
    on the fly, every model-parallel table split by rows (partial pools, padding rows zeroed inside the
    graph). (TF32 is off in fp32; the tolerance covers cuBLAS choosing other kernels for B/2 rows.
    Adagrad's step lr g / sqrt(sum of g^2) is about lr in size however small g is, so a row whose few
    gradients are near zero moves by a share of lr = 0.1 under such rounding: measured on 2 H200s, 1 of
    16,000 elements of a table 1.5e-3 off, the losses within the fp32 tolerance.)"""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    config = tmp_path / "c.json"
    raw = json.loads(TINY.read_text())
    raw["data"].update(path=str(criteo_sample), batch_size=256)
    raw["train"].update(
        max_steps=2,
        log_interval=1,
        use_triton=True,
        cuda_graphs=True,
        precision=precision,
        optimizer=optimizer,
    )
    raw["profiler"]["enabled"] = False
    if bags:
        raw["model"]["multi_hot_sizes"] = list(BAGS)
        raw["data"]["multi_hot"] = dataclasses.asdict(UNIFORM)
        raw["parallel"] = {"row_wise_bytes": 1}
    config.write_text(json.dumps(raw))

    def dlrm_train(nproc: int, run: str, *args: str) -> None:
        launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run"]
        launcher += [] if nproc == 1 else ["--standalone", f"--nproc-per-node={nproc}"]
        command = [
            *launcher,
            "-m",
            "dlrm.train",
            "--config",
            str(config),
            "--output-dir",
            str(tmp_path / run),
        ]
        # REPO first, the environment's path after it (the GPU image's carried packages are there).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([*command, *args], cwd=REPO, env=env, check=True, timeout=600)

    dlrm_train(1, "start")
    start = str(tmp_path / "start" / "checkpoints" / "last.pt")
    dlrm_train(1, "one", "--resume", start, "--max-steps", "12")
    dlrm_train(2, "two", "--resume", start, "--max-steps", "12")
    torch.testing.assert_close(_losses(tmp_path / "two"), _losses(tmp_path / "one"), rtol=rtol, atol=atol)
    expected = _weights(tmp_path / "one" / "checkpoints" / "last.pt")
    _assert_same_weights(_weights(tmp_path / "two" / "checkpoints" / "last"), expected, rtol, atol)
    plan = json.loads((tmp_path / "two" / "sharding_plan.json").read_text())
    assert plan["replicated"]  # the sample's small tables (b = 128 per GPU: up to 64 rows)
    one, two = (json.loads((tmp_path / run / "metrics.json").read_text()) for run in ("one", "two"))
    for key in ("test_auc", "test_logloss"):
        assert two[key] == pytest.approx(one[key], rel=rtol), key
