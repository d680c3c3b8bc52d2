"""Each rank's share of a many-GPU plan's bag lookups, forward and backward with the fused update, timed one
rank after the other on ONE GPU (no process group: a rank's lookups need only its shards and its ids):

    python scripts/bench_rank_lookups.py [--config dlrm_dcnv2] [--nproc 2] [--batch 65536] \
        [--table-dtype bf16] [--plans planner,planner+split:20]

What sets a sharded step's pace is its slowest rank: the others wait for it in the exchange and the dense
all-reduce. Where a rank's tables look up more ids, or touch more distinct rows (each updated once by the
fused optimizer), its lookups take longer, which one GPU measures rank by rank without the GPUs a run of
`--nproc` ranks needs.

Plans (`--plans`, comma-separated):
- planner: `dlrm.parallel.planner.plan_tables` as `dlrm.train` makes it for the config on `--nproc` ranks
  (its `parallel` section, `--batch` the global batch, bf16 vectors on the wire where the run exchanges
  them: `dlrm.parallel.sharded.exchange_bytes`).
- planner-bytes: the same without its last step, the time balance (`plan_tables(balance_time=False)`).
- changes to the planner's shards after it, joined by "+" (bytes not rebalanced: these price placements):
  split:T cuts table T into `--nproc` row shards of near-equal rows, one a rank (split:T:P0:P1:... with
  P_q percent of its rows on rank q, summing to 100; as
  `dlrm.parallel.sharded_bags` runs a cut, every shard looks up all of T's ids); move:T:Q puts table T,
  held whole by one rank, on rank Q. E.g. `planner+split:20+move:21:1`.

For each rank of each plan: its ShardedSparseArch (`kernel` triton, the config's optimizer, `--table-dtype`;
tables created on the GPU one rank at a time), the global batch's bags of its shards as the ids exchange
gives them ([B, L] rows of the full tables, each column's ids uniform over its table, as
`bench_train.py --ids uniform` draws them; replicated tables are left out: every rank looks up the same),
timed as CUDA-graph replays (`bench_timing.graph_ms`): the forward (ShardedBags.lookup) and the forward with
the backward of a random pooled gradient (the fused update of every touched row). Each row also counts the
rank's lookups, those inside its shards and the distinct rows they touch, and the planner's predicted
forward time (`ShardingPlan.costs`; the printed line adds its predicted backward). Rows go to
scripts/results/rank_lookups.csv. CUDA only.
"""

import dataclasses
from pathlib import Path

import click
import torch
from bench_timing import graph_ms
from results_csv import append_rows, provenance

from dlrm.config import load_config, replace
from dlrm.model.tables import resolve_table_rows
from dlrm.optim import rounding_seed
from dlrm.parallel.planner import TABLE_BYTES, Shard, ShardingPlan, plan_tables
from dlrm.parallel.sharded import ShardedSparseArch, exchange_bytes

RESULTS = Path(__file__).parent / "results" / "rank_lookups.csv"
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
REPEATS = 5  # calls a captured graph replays


def config_plan(cfg, world_size: int, balance_time: bool = True) -> ShardingPlan:
    """The plan `dlrm.train` makes for run config `cfg` on `world_size` ranks (its data.batch_size the
    global batch): dlrm.parallel.sharded.build_sharded_model's call of plan_tables (`balance_time` False:
    the planner without its time balance)."""
    m, par = cfg.model, cfg.parallel
    return plan_tables(
        resolve_table_rows(m, {}), m.embedding_dim, cfg.train.optimizer, world_size, par.row_wise,
        par.row_wise_bytes,
        batch_size=cfg.data.batch_size // world_size, data_parallel_rows=par.data_parallel_rows,
        exchange_bytes_per_value=exchange_bytes(cfg), bag_sizes=m.multi_hot_sizes,
        table_bytes_per_value=TABLE_BYTES[m.table_dtype], balance_time=balance_time,
    )  # fmt: skip


def split_table(plan: ShardingPlan, table: int, percents: list[int] | None = None) -> ShardingPlan:
    """`plan` with table `table`'s shards replaced by one row shard a rank, rank q's rows after rank
    q - 1's: `percents[q]` percent of the rows on rank q (None: near-equal rows; a rank given 0 holds
    none). A replicated table stays replicated: nothing to cut.

    Raises:
        ValueError: `table` is not a table of the plan, or `percents` are not W numbers summing to 100.
    """
    if not 0 <= table < len(plan.table_rows):
        raise ValueError(f"split:{table}: the plan has tables 0 to {len(plan.table_rows) - 1}")
    rows, w = plan.table_rows[table], plan.world_size
    if percents is not None and (len(percents) != w or sum(percents) != 100):
        raise ValueError(f"split:{table}: expected {w} percents summing to 100, got {percents}")
    if table in plan.replicated:
        return plan
    ends = [rows * (q + 1) // w for q in range(w)]
    if percents is not None:
        ends = [rows * sum(percents[: q + 1]) // 100 for q in range(w)]
    cut = [
        Shard(table, q, start, end - start)
        for q, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True))
    ]
    shards = [s for s in plan.shards if s.table != table] + [s for s in cut if s.rows > 0]
    return dataclasses.replace(plan, shards=tuple(sorted(shards, key=lambda s: (s.rank, s.table))))


def rank_ids(plan: ShardingPlan, rank: int, global_batch: int, generator: torch.Generator) -> torch.Tensor:
    """The global batch's bags of `rank`'s shards as the ids exchange hands them over: [B, L] int64 rows of
    the full tables (shard after shard in `plan.shards_of(rank)` order, k_f columns each), every column's
    ids uniform over its table; on `generator`'s device."""
    columns = [
        rows for s in plan.shards_of(rank) for rows in [plan.table_rows[s.table]] * plan.bag_size(s.table)
    ]
    device = generator.device
    if not columns:
        return torch.zeros(global_batch, 0, dtype=torch.int64, device=device)
    uniform = torch.rand(global_batch, len(columns), generator=generator, device=device, dtype=torch.float64)
    return (uniform * torch.tensor(columns, device=device)).long()


def touched(plan: ShardingPlan, rank: int, ids: torch.Tensor) -> tuple[int, int]:
    """(lookups inside `rank`'s shards, distinct rows they touch) of its ids [B, L] (`rank_ids`)."""
    inside = distinct = 0
    col = 0
    for s in plan.shards_of(rank):
        k = plan.bag_size(s.table)
        block = ids[:, col : col + k].reshape(-1)
        mine = block[(block >= s.row_start) & (block < s.row_start + s.rows)]
        inside += mine.numel()
        distinct += torch.unique(mine).numel()
        col += k
    return inside, distinct


def describe(plan: ShardingPlan, rank: int) -> str:
    """`rank`'s shards as ShardingPlan.describe names them: t<f> whole, t<f>[a:b] a row range."""
    return " ".join(
        f"t{s.table}"
        if s.rows == plan.table_rows[s.table]
        else f"t{s.table}[{s.row_start}:{s.row_start + s.rows}]"
        for s in plan.shards_of(rank)
    )


def time_rank(cfg, plan: ShardingPlan, rank: int, global_batch: int, seed: int) -> dict:
    """One rank's lookups on the current GPU: (lookups, inside, distinct rows, fwd ms, fwd+bwd ms)."""
    m, train = cfg.model, cfg.train
    device = torch.device("cuda")
    arch = ShardedSparseArch(
        plan, rank, m.embedding_dim, "modulus", kernel="triton", device=device, seed=seed,
        multi_hot_sizes=m.multi_hot_sizes, pooling=m.pooling, table_dtype=m.table_dtype,
    )  # fmt: skip
    rounding = (
        torch.tensor([rounding_seed(seed, rank), 0], device=device) if m.table_dtype == "bf16" else None
    )
    arch.configure_optimizer(train.optimizer, train.lr, train.adagrad_eps, rounding)
    ids = rank_ids(plan, rank, global_batch, torch.Generator(device).manual_seed(seed + rank))
    inside, distinct = touched(plan, rank, ids)
    out = {"lookups": ids.numel(), "lookups_in_shard": inside, "distinct_rows": distinct}
    if ids.shape[1] == 0:
        return out | {"fwd_ms": 0.0, "fwd_bwd_ms": 0.0}
    with torch.no_grad():
        pooled = arch.bags.lookup(arch, ids)
    grad = torch.randn(pooled.shape, device=device, generator=torch.Generator(device).manual_seed(seed))
    grad = grad.to(pooled.dtype)

    def fwd():
        with torch.no_grad():
            arch.bags.lookup(arch, ids)

    def fwd_bwd():
        arch.bags.lookup(arch, ids).backward(grad)

    out |= {"fwd_ms": round(graph_ms(fwd, REPEATS), 4), "fwd_bwd_ms": round(graph_ms(fwd_bwd, REPEATS), 4)}
    return out


def move_table(plan: ShardingPlan, table: int, rank: int) -> ShardingPlan:
    """`plan` with table `table`, held whole by one rank, on rank `rank` instead.

    Raises:
        ValueError: `table` is not held whole by one rank, or `rank` is not a rank of the plan.
    """
    held = [s for s in plan.shards if s.table == table]
    if len(held) != 1 or held[0].rows != plan.table_rows[table]:
        raise ValueError(f"move:{table}:{rank}: table {table} is not held whole by one rank")
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"move:{table}:{rank}: the plan has ranks 0 to {plan.world_size - 1}")
    shards = [dataclasses.replace(s, rank=rank) if s.table == table else s for s in plan.shards]
    return dataclasses.replace(plan, shards=tuple(sorted(shards, key=lambda s: (s.rank, s.table))))


def plan_named(cfg, world_size: int, name: str) -> ShardingPlan:
    """The plan `name` names (module docstring): "planner" or "planner-bytes", then "+split:T[:P0:P1...]"
    and "+move:T:Q" in order.

    Raises:
        click.BadParameter: another name, or a change the plan does not allow.
    """
    base, *changes = name.split("+")
    if base not in ("planner", "planner-bytes"):
        raise click.BadParameter(
            f"{name!r}: expected planner or planner-bytes, then [+split:T][+move:T:Q]...",
            param_hint="--plans",
        )
    plan = config_plan(cfg, world_size, balance_time=base == "planner")
    for change in changes:
        kind, *args = change.split(":")
        numbers = [int(a) for a in args if a.isdigit()]
        if len(numbers) != len(args) or not (kind == "split" and args or (kind, len(args)) == ("move", 2)):
            raise click.BadParameter(
                f"{change!r}: expected split:T[:P0:P1...] or move:T:Q", param_hint="--plans"
            )
        try:
            if kind == "split":
                plan = split_table(plan, numbers[0], numbers[1:] or None)
            else:
                plan = move_table(plan, *numbers)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--plans") from err
    return plan


@click.command(context_settings={"show_default": True})
@click.option("--config", default="dlrm_dcnv2", help="configs/NAME.json: tables, bags, optimizer, lr.")
@click.option("--nproc", type=click.IntRange(min=2), default=2, help="W, the ranks of the plan.")
@click.option("--batch", type=click.IntRange(min=1), default=65536, help="B, the global batch.")
@click.option("--table-dtype", type=click.Choice(["fp32", "bf16"]), default="bf16", help="model.table_dtype.")
@click.option(
    "--plans",
    default="planner,planner+split:20,planner+split:20+move:21:1",
    help="Comma-separated plans (module docstring).",
)
@click.option("--seed", default=0, help="Tables' initialization, ids and gradients.")
def main(config, nproc, batch, table_dtype, plans, seed):
    """Time each rank's bag lookups (forward, and backward with the fused update) of a plan on this GPU."""
    if not torch.cuda.is_available():
        raise click.UsageError("bench_rank_lookups.py needs a CUDA GPU")
    cfg = load_config(CONFIG_DIR / f"{config}.json")
    cfg = replace(replace(cfg, "train", use_triton=True), "data", batch_size=batch)
    cfg = replace(cfg, "model", table_dtype=table_dtype)
    if cfg.model.multi_hot_sizes is None:
        raise click.UsageError(f"{config}: no model.multi_hot_sizes; this benchmark times bags")
    names = [p.strip() for p in plans.split(",") if p.strip()]
    plans_by_name = {name: plan_named(cfg, nproc, name) for name in names}
    rows = []
    for name, plan in plans_by_name.items():
        predicted = plan.costs(batch // nproc)
        for rank in range(nproc):
            timed = time_rank(cfg, plan, rank, batch, seed)
            predicted_ms = predicted[rank].lookup_us / 1e3
            update_ms = predicted[rank].update_us / 1e3
            torch.cuda.empty_cache()  # the rank's tables, before the next rank's
            row = provenance(torch.cuda.get_device_name()) | {
                "config": config, "world_size": nproc, "global_batch": batch, "table_dtype": table_dtype,
                "optimizer": cfg.train.optimizer, "plan": name, "rank": rank, "shards": describe(plan, rank),
                "predicted_fwd_us": predicted[rank].lookup_us,
            } | timed  # fmt: skip
            print(
                f"{name:<10} rank {rank}: {timed['lookups']:>10,} lookups, "
                f"{timed['distinct_rows']:>10,} distinct rows; fwd {timed['fwd_ms']:8.3f} ms "
                f"(predicted {predicted_ms:.3f}), fwd+bwd {timed['fwd_bwd_ms']:8.3f} ms (predicted "
                f"{predicted_ms + update_ms:.3f})  [{row['shards']}]",
                flush=True,
            )
            rows.append(row)
    append_rows(RESULTS, rows)


if __name__ == "__main__":
    main()
