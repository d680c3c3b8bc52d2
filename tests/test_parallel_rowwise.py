"""train.optimizer "rowwise_adagrad" on many gloo ranks (CPU, real processes): the sharded tables keep one
fp32 accumulator a row, updated as one process updates it, written into sharded checkpoints as [rows_f]
ShardedTensors on the plan's row ranges, resharded when another number of ranks loads them, and counted in
a checkpoint's bytes."""

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from dlrm.checkpoint import load_checkpoint
from dlrm.config import replace
from dlrm.parallel import checkpoint as sharded_checkpoint
from dlrm.parallel.run import check_world
from dlrm.run.loop import train
from tests.test_parallel import (
    ATOL,
    BAGS,
    RTOL,
    UNIFORM,
    _assert_same_weights,
    _config,
    _losses,
    _sharded_tables_match_one_table_batch,
    _spawn,
    _weights,
)

# (name, model overrides, data overrides) of the runs compared with one process: every table split by rows
# over the ranks, one id a feature with first-order terms (their D = 1 tables take row-wise Adagrad too),
# and bags made on the fly (sizes 1-4), mean-pooled.
RUNS = [
    ("one_hot", {"first_order": True}, {}),
    ("bags", {"multi_hot_sizes": BAGS, "pooling": "mean"}, {"multi_hot": UNIFORM}),
]
# The accumulators (up to 3e-3 here) sum squared gradients that W ranks compute in other orders (the
# dense all-reduce, GEMMs over B/W rows): measured 2.5e-6 relative at most after 4 steps. The weights differ
# from one process's by at most 4.8e-7, within test_parallel.py's RTOL and ATOL.
STATE_RTOL, STATE_ATOL = 1e-5, 1e-13
# The state_dict names of the tables before "<f>.weight": the embeddings, the first-order terms.
TABLE_PREFIXES = ("sparse_arch.embeddings.", "first_order.tables.embeddings.")


def _run_config(data_dir, name: str, max_steps: int):
    _, model, data = next(run for run in RUNS if run[0] == name)
    cfg = _config(data_dir, optimizer="rowwise_adagrad", lr=0.05, max_steps=max_steps)
    cfg = replace(cfg, "parallel", row_wise_bytes=1)
    cfg = replace(cfg, "model", **model) if model else cfg
    return replace(cfg, "data", **data) if data else cfg


def _table_states(path: Path) -> dict[str, torch.Tensor]:
    """{table name: row-wise Adagrad's accumulator [rows_f] fp32} of a sharded checkpoint directory (read
    whole) or a one-process .pt of kernel "torch" (its optimizer's row-wise group: the embeddings, then the
    first-order tables where the model has them)."""
    if path.is_dir():
        sums = sharded_checkpoint.load_full(path)["optimizer_by_name"]
        return {k: v for k, v in sums.items() if k.startswith(TABLE_PREFIXES)}
    optimizer = load_checkpoint(path)["optimizer"]
    (group,) = [g for g in optimizer["param_groups"] if g.get("rowwise")]
    names = [f"{prefix}{f}.weight" for prefix in TABLE_PREFIXES for f in range(26)][: len(group["params"])]
    return {
        name: optimizer["state"][index]["sum"] for name, index in zip(names, group["params"], strict=True)
    }


def _assert_same_states(actual: dict, expected: dict, rtol=STATE_RTOL, atol=STATE_ATOL) -> None:
    assert actual.keys() == expected.keys() and len(expected) in (26, 52)  # with first-order tables: 52
    for key, value in expected.items():
        assert actual[key].shape == value.shape and value.ndim == 1, key  # one value a row
        torch.testing.assert_close(actual[key], value, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


def test_many_ranks_take_rowwise_adagrad(criteo_sample):
    check_world(_run_config(criteo_sample, "one_hot", 6), 2)  # no refusal


def test_rowwise_adagrad_on_two_ranks_trains_as_one_process_and_its_state_reshards(criteo_sample, tmp_path):
    """From the same one-process step-2 checkpoint (.pt, its [rows] state split over the ranks' row
    shards), 2 ranks train steps 3..6 of the same global batches as one process, one-hot and with bags: the
    same losses, final weights and accumulators. The sharded tables alone (kernels "triton" and "torch",
    one-hot and bags, some rows on each rank) update as one process. 2 ranks' checkpoint at step 4 reloads
    on 3 ranks bit for bit, and resumed on 3 ranks and on 1 process goes on to the one-process step-6
    weights and accumulators. The checkpoint's bytes count 4 a row for the state."""
    jobs2, jobs3, reference = [], [], {}
    for name, *_ in RUNS:
        start = tmp_path / f"{name}-start"
        train(_run_config(criteo_sample, name, 2), start)
        start_ckpt = start / "checkpoints" / "last.pt"
        reference[name] = tmp_path / f"{name}-1"
        train(_run_config(criteo_sample, name, 6), reference[name], start_ckpt)
        jobs2.append((train, (_run_config(criteo_sample, name, 6), tmp_path / f"{name}-2", start_ckpt)))
    start_ckpt = tmp_path / "one_hot-start" / "checkpoints" / "last.pt"
    half = tmp_path / "half-2"
    jobs2.append((train, (_run_config(criteo_sample, "one_hot", 4), half, start_ckpt)))
    half_ckpt = half / "checkpoints" / "last"
    jobs3.append((train, (_run_config(criteo_sample, "one_hot", 4), tmp_path / "reloaded-3", half_ckpt)))
    jobs3.append((train, (_run_config(criteo_sample, "one_hot", 6), tmp_path / "resumed-3", half_ckpt)))
    # (kernel, bags) on the embedding alone; row-wise Adagrad replicates no table (data_parallel_rows 0).
    for kernel, bags in (("triton", None), ("torch", None), ("torch", BAGS)):
        jobs2.append((_sharded_tables_match_one_table_batch, (kernel, "rowwise_adagrad", False, 0, bags)))
    jobs3.append((_sharded_tables_match_one_table_batch, ("torch", "rowwise_adagrad", True)))
    _spawn(2, jobs2)
    _spawn(3, jobs3)
    train(_run_config(criteo_sample, "one_hot", 6), tmp_path / "resumed-1", half_ckpt)

    for name, *_ in RUNS:
        run, expected = tmp_path / f"{name}-2", reference[name]
        torch.testing.assert_close(_losses(run), _losses(expected), rtol=RTOL, atol=ATOL, msg=name)
        last, expected_last = run / "checkpoints" / "last", expected / "checkpoints" / "last.pt"
        _assert_same_weights(_weights(last), _weights(expected_last))
        _assert_same_states(_table_states(last), _table_states(expected_last))

    reloaded = tmp_path / "reloaded-3" / "checkpoints" / "last"
    _assert_same_weights(_weights(reloaded), _weights(half_ckpt), 0, 0)
    _assert_same_states(_table_states(reloaded), _table_states(half_ckpt), 0, 0)
    expected_last = reference["one_hot"] / "checkpoints" / "last.pt"
    for last in (
        tmp_path / "resumed-3" / "checkpoints" / "last",
        tmp_path / "resumed-1" / "checkpoints" / "last.pt",
    ):
        _assert_same_weights(_weights(last), _weights(expected_last))
        _assert_same_states(_table_states(last), _table_states(expected_last))

    # The accumulators are stored as [rows_f], in the plan's row shards (every table split over both ranks;
    # the first-order tables on the same plan).
    plan = json.loads((half / "sharding_plan.json").read_text())
    stored = dcp.FileSystemReader(half_ckpt).read_metadata().state_dict_metadata
    for prefix in TABLE_PREFIXES:
        for f, rows in enumerate(plan["table_rows"]):
            state = stored[f"optim/{prefix}{f}.weight"]
            shards = sorted((s["row_start"], s["rows"]) for s in plan["shards"] if s["table"] == f)
            assert state.size == torch.Size([rows]) and len(shards) == 2
            assert sorted((c.offsets[0], c.sizes[0]) for c in state.chunks) == shards
    # Every tensor of the checkpoint, each written once: the tables (D = 8 fp32 values a row, first-order
    # D = 1) and their accumulators (one fp32 value a row each), the dense part and its Adagrad sums, the
    # rounding count.
    whole = sharded_checkpoint.load_full(half_ckpt)
    rows = sum(plan["table_rows"])
    dense = sum(
        t.numel() * t.element_size()
        for entries in (whole["model"], whole["optimizer_by_name"])
        for k, t in entries.items()
        if not k.startswith(TABLE_PREFIXES)
    )
    assert plan["checkpoint_bytes"] == rows * (8 * 4 + 4) + rows * (1 * 4 + 4) + dense + 8


def test_a_rank_without_rows_still_names_its_tables_optimizer_state():
    """The triton tables' Adagrad state of a rank the plan gives no rows is [0, D] (row-wise: [0]): still
    the optimizer's state, whose checkpoint keys every rank must name alike (DCP plans them together), not
    SGD's nothing."""
    from types import SimpleNamespace

    for optimizer, state in (("adagrad", torch.zeros(0, 4)), ("rowwise_adagrad", torch.zeros(0))):
        arch = SimpleNamespace(kernel="triton", optimizer=(optimizer, 1e-8), optimizer_state=state)
        assert sharded_checkpoint._embedding_state(arch, None) is state
    sgd = SimpleNamespace(kernel="triton", optimizer=("sgd", 0.0), optimizer_state=torch.zeros(0))
    assert sharded_checkpoint._embedding_state(sgd, None) is None
