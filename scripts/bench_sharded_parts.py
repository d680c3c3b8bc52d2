"""Two parts of the sharded embedding step, timed on one GPU (no process group needed):

    python scripts/bench_sharded_parts.py [--batch 65536]

1. Placing the vectors received from 2 ranks into embedded [b, F, D] (F = 26 tables, 13 from each rank),
   forward and backward: index_add over the (sample, table) rows (its backward is an index_select),
   ToTableOrder's PyTorch reference (strided copies per table) and ToTableOrder (kernels.table_order's
   kernels, what dlrm.parallel.sharded runs); kaggle (D=16, fp32) and mlperf (D=128, bf16) shapes.
2. Each rank's lookups, forward and backward with SGD fused (our Triton kernel, W*b ids per table, uniform
   over the table), for the Kaggle tables on 2 ranks placed by bytes alone and by the planner (bytes and
   lookups).
Prints ms per call (CUDA events, launched from Python: includes launch time) and the three largest CUDA
kernels of one profiled call (their GPU time). CUDA only.
"""

import click
import torch
from torch.profiler import ProfilerActivity, profile

from dlrm.data.synthetic_rows import KAGGLE_CARDINALITIES
from dlrm.parallel.planner import Shard, ShardingPlan, plan_tables
from dlrm.parallel.sharded import ShardedSparseArch, ToTableOrder
from kernels.table_order import ColumnOrder

# The plan greedy-by-bytes made for the Kaggle tables on 2 ranks (rank 1: the 3 tables as large as the rest).
BYTES_ONLY_RANK1 = (3, 11, 20)


def timed(fn, label: str, iters: int = 20) -> None:
    """Print fn's ms per call and its three largest kernels (us, one profiled call)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:60]] = kernels.get(e.name[:60], 0.0) + e.time_range.elapsed_us()
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:3]
    print(
        f"{label:<46}{start.elapsed_time(end) / iters:8.3f} ms  kernels: "
        + "; ".join(f"{name} {us:.0f} us" for name, us in top),
        flush=True,
    )


def placement(b: int, d: int, dtype: torch.dtype) -> None:
    """Part 1 at one shape."""
    tables = len(KAGGLE_CARDINALITIES)
    blocks = [list(range(0, tables, 2)), list(range(1, tables, 2)), []]  # no replicated tables
    place = {t: (q, j) for q, ts in enumerate(blocks) for j, t in enumerate(ts)}
    columns = [[place[f]] for f in range(tables)]
    order = ColumnOrder([len(ts) for ts in blocks], columns, torch.device("cuda"))
    no_local = torch.empty(b, 0, d, device="cuda", dtype=dtype)
    back = torch.randn(b * tables * d, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn(b, tables, d, device="cuda", dtype=dtype)
    samples = torch.arange(b, device="cuda").unsqueeze(1) * tables
    rows = torch.cat([(samples + torch.tensor(ts, device="cuda")).reshape(-1) for ts in blocks if ts])

    def index_add():
        back.new_zeros(b * tables, d).index_add(0, rows, back.view(-1, d)).view(b, tables, d).backward(grad)

    def strided_copies():
        order._gather_ref(back.detach(), no_local, b, d)
        order._scatter_ref(grad, b, d, 0.5, torch.empty_like(back), no_local)

    def to_table_order():
        ToTableOrder.apply(back, no_local, b, d, order, dtype, 0.5).backward(grad)

    expected = back.new_zeros(b * tables, d).index_add(0, rows, back.view(-1, d)).view(b, tables, d)
    if not torch.equal(ToTableOrder.apply(back, no_local, b, d, order, dtype, 0.5), expected):
        raise RuntimeError("ToTableOrder differs from index_add")
    timed(index_add, f"placement D={d} {str(dtype)[6:]} index_add")
    timed(strided_copies, f"placement D={d} {str(dtype)[6:]} strided copies")
    timed(to_table_order, f"placement D={d} {str(dtype)[6:]} ToTableOrder")


def lookups(b: int) -> None:
    """Part 2."""
    rows = list(KAGGLE_CARDINALITIES)
    by_bytes = [[t for t in range(len(rows)) if t not in BYTES_ONLY_RANK1], list(BYTES_ONLY_RANK1)]
    planned = plan_tables(rows, 16, "sgd", 2)
    by_planner = [[s.table for s in planned.shards_of(q)] for q in range(2)]
    for name, assign in (("bytes only", by_bytes), ("planner", by_planner)):
        shards = tuple(Shard(t, q, 0, rows[t]) for q in range(2) for t in assign[q])
        plan = ShardingPlan(2, 16, "sgd", tuple(rows), shards)
        for q in range(2):
            arch = ShardedSparseArch(plan, q, 16, "modulus", kernel="triton", device="cuda")
            arch.configure_optimizer("sgd", 0.01)
            sizes = torch.tensor([rows[t] for t in assign[q]], device="cuda")
            ids = (torch.rand(2 * b, len(assign[q]), device="cuda", dtype=torch.float64) * sizes).long()
            timed(
                lambda arch=arch, ids=ids: arch._lookup(ids).sum().backward(),
                f"lookups {name}, rank {q} ({len(assign[q])} tables)",
            )


@click.command()
@click.option("--batch", type=click.IntRange(min=1), default=65536, help="b, the batch of each rank.")
def main(batch):
    """Time the sharded step's vector placement and each rank's lookups on this GPU."""
    if not torch.cuda.is_available():
        raise click.UsageError("bench_sharded_parts.py needs a CUDA GPU")
    placement(batch, 16, torch.float32)
    placement(batch, 128, torch.bfloat16)
    lookups(batch)


if __name__ == "__main__":
    main()
