"""Benchmark the sparse-side kernels on a GPU against this project's eager PyTorch path.

    python scripts/bench_sparse.py [--batch 16384] [--dims 16,128] [--optimizers sgd,adagrad]

At the Kaggle config's 26 cardinalities (33.8M rows in all) and batch B, for each embedding dim D:
    embedding fwd          our table-batched lookup (hashing included) vs SparseArch(kernel="torch")
                           (26 nn.Embedding lookups + stack), and GB/s as % of the copy bandwidth for the
                           bytes it must move: ids read, B*F rows of D read, [B, F, D] written, index written
    embedding step         forward + backward + optimizer update: ours (update fused into backward) vs eager
                           (26 sparse-gradient tables, loss.backward, torch.optim step, zero_grad)
    interaction fwd+bwd    kernels.interaction vs InteractionArch(kernel="torch") (bmm + index + cat)
    loss fwd(+bwd)         kernels.loss vs F.binary_cross_entropy_with_logits, and vs a copy of the logits
Ids: "uniform" over each table's rows, and "skewed" (row = rows * u**4, many repeats of the first rows,
closer to Criteo's heavy-tailed ids). Timings: median of CUDA-event timings (triton.testing.do_bench),
"launch" as called from Python (host overhead included) and, for our kernels, "graph" (replays of a CUDA
graph of the calls: GPU time only). The eager embedding step is not graph-capturable (sparse gradients), so
its ratios are against its launch time. Rows are appended to scripts/results/sparse.csv.
"""

import itertools
from pathlib import Path

import click
import torch
import torch.nn.functional as F
from bench_timing import graph_ms, measure_ceilings, median_ms
from results_csv import append_rows, provenance

from dlrm.data.schema import NUM_SPARSE
from dlrm.model.dlrm import InteractionArch
from dlrm.model.sparse import SparseArch
from kernels.interaction import dot_interaction
from kernels.loss import bce_with_logits

RESULTS = Path(__file__).parent / "results" / "sparse.csv"
KAGGLE_ROWS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306, 10,
    5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip
ROTATE = 4


def _ids(b: int, skew: str, rows: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    u = torch.rand(b, NUM_SPARSE, device="cuda", generator=g, dtype=torch.float64)
    if skew == "skewed":
        u = u**4
    # Raw ids such that (id + 1) % rows lands on the drawn row.
    return (u * rows).long().clamp_max(rows - 1) - 1


def _rotating_calls(arch: SparseArch, ids: list, grads: list, update) -> tuple:
    """(fwd, step) of `arch` for timing, each call on the next of the ROTATE batches of `ids`: fwd a
    no-grad forward; step a forward, backward with that batch's `grads` and then `update()`."""
    it = iter(range(10**9))

    def fwd():
        with torch.no_grad():
            arch(ids[next(it) % ROTATE])

    def step():
        i = next(it) % ROTATE
        arch(ids[i]).backward(grads[i])
        update()

    return fwd, step


def _time_ours(d: int, optimizer: str, ids: list, grads: list) -> dict[str, float]:
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialize the 33.8M rows on the GPU, not the CPU
        ours = SparseArch(d, KAGGLE_ROWS, kernel="triton")
    ours.configure_optimizer(optimizer, 0.01)  # the update runs inside backward
    fwd, step = _rotating_calls(ours, ids, grads, lambda: None)
    return {
        "fwd launch": median_ms(fwd),
        "fwd graph": graph_ms(fwd),
        "step launch": median_ms(step),
        "step graph": graph_ms(step),
    }


def _time_eager(d: int, optimizer: str, ids: list, grads: list) -> dict[str, float]:
    torch.manual_seed(0)
    with torch.device("cuda"):
        eager = SparseArch(d, KAGGLE_ROWS, kernel="torch")
    # torch.optim has no row-wise Adagrad: its eager baseline is torch's (elementwise) Adagrad.
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adagrad)(eager.parameters(), lr=0.01)

    def update():
        opt.step()
        opt.zero_grad(set_to_none=True)

    fwd, step = _rotating_calls(eager, ids, grads, update)
    # The eager forward (no_grad) replays as a graph too; its step cannot be captured (the sparse gradients
    # are coalesced with a host sync), so graph replays of our step have no eager twin to compare with.
    return {
        "eager fwd launch": median_ms(fwd),
        "eager fwd graph": graph_ms(fwd),
        "eager step launch": median_ms(step),
    }


def bench_embedding(b: int, d: int, optimizer: str, skew: str, copy_gbps: float) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(d)
    rows = torch.tensor(KAGGLE_ROWS, device="cuda")
    ids = [_ids(b, skew, rows, g) for _ in range(ROTATE)]
    grads = [torch.randn(b, NUM_SPARSE, d, device="cuda", generator=g) for _ in range(ROTATE)]
    result = _time_ours(d, optimizer, ids, grads)
    torch.cuda.empty_cache()
    result.update(_time_eager(d, optimizer, ids, grads))
    torch.cuda.empty_cache()
    # Bytes the forward must move: ids in, rows gathered, output out, index out (saved for backward).
    fwd_bytes = b * NUM_SPARSE * (8 + 2 * d * 4 + 8)
    pct = 100 * fwd_bytes / result["fwd graph"] / 1e6 / copy_gbps
    out = []
    for name, ms in result.items():
        kind, timing = name.split()[-2:]
        base = result.get(f"eager {kind} {timing}")  # launches against launches, graphs against graphs
        out.append({
            "op": f"embedding {kind}", "path": "eager" if name.startswith("eager") else "triton",
            "timing": timing, "dim": d, "optimizer": optimizer, "ids": skew, "ms": round(ms, 5),
            "ratio_vs_eager": round(base / ms, 2) if base else "",
            "pct_copy_bw": round(pct, 1) if name == "fwd graph" else "",
        })  # fmt: skip
    return out


def bench_interaction(b: int, d: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(d)
    sets = [
        (
            torch.randn(b, d, device="cuda", generator=g).requires_grad_(),
            torch.randn(b, NUM_SPARSE, d, device="cuda", generator=g).requires_grad_(),
            torch.randn(b, d + NUM_SPARSE * (NUM_SPARSE + 1) // 2, device="cuda", generator=g),
        )
        for _ in range(ROTATE)
    ]
    eager = InteractionArch(d).cuda()
    it = iter(range(10**9))

    def step(fn):
        def run():
            dense, emb, dout = sets[next(it) % ROTATE]
            dense.grad = emb.grad = None
            fn(dense, emb).backward(dout)

        return run

    times = {
        ("eager", "launch"): median_ms(step(eager)),
        ("eager", "graph"): graph_ms(step(eager)),
        ("triton", "launch"): median_ms(step(dot_interaction)),
        ("triton", "graph"): graph_ms(step(dot_interaction)),
    }
    return [
        {"op": "interaction fwd+bwd", "path": p, "timing": t, "dim": d, "ms": round(ms, 5),
         "ratio_vs_eager": round(times[("eager", t)] / ms, 2)}
        for (p, t), ms in times.items()
    ]  # fmt: skip


def bench_loss(b: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(b)
    logits = torch.randn(b, device="cuda", generator=g).requires_grad_()
    labels = torch.randint(0, 2, (b,), device="cuda", generator=g).float()
    copy_dst = torch.empty_like(logits)

    def step(fn):
        def run():
            logits.grad = None
            fn(logits, labels).backward()

        return run

    times = {
        ("copy of logits", "graph"): graph_ms(lambda: copy_dst.copy_(logits.detach())),
        ("eager", "graph"): graph_ms(step(F.binary_cross_entropy_with_logits)),
        ("triton", "graph"): graph_ms(step(bce_with_logits)),
    }
    with torch.no_grad():
        times[("triton fwd", "graph")] = graph_ms(lambda: bce_with_logits(logits, labels))
    copy = times[("copy of logits", "graph")]
    return [
        {"op": "loss fwd+bwd" if p in ("eager", "triton") else "loss fwd", "path": p, "timing": t,
         "ms": round(ms, 5), "ratio_vs_eager": round(times[("eager", "graph")] / ms, 2),
         "x_copy_time": round(ms / copy, 2)}
        for (p, t), ms in times.items()
    ]  # fmt: skip


@click.command(context_settings={"show_default": True})
@click.option("--batch", default=16384, help="Batch size B.")
@click.option("--dims", default="16,128", help="Comma-separated embedding dims D.")
@click.option("--optimizers", default="sgd,adagrad,rowwise_adagrad", help="Embedding optimizers to time.")
@click.option("--skews", default="uniform,skewed", help="Id distributions: uniform, skewed.")
@click.option("--ops", default="embedding,interaction,loss", help="Comma-separated ops to time.")
def main(batch, dims, optimizers, skews, ops):
    """Time the embedding, interaction and loss kernels on this GPU; rows go to scripts/results/sparse.csv."""
    if not torch.cuda.is_available():
        raise click.UsageError("bench_sparse.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    copy_gbps = measure_ceilings()["copy_gbps"]
    print(f"{gpu}: copy {copy_gbps:.0f} GB/s, B={batch}, Kaggle cardinalities ({sum(KAGGLE_ROWS):,} rows)")
    rows = []
    ops = ops.split(",")
    for d in (int(x) for x in dims.split(",")):
        if "embedding" in ops:
            for optimizer, skew in itertools.product(optimizers.split(","), skews.split(",")):
                rows += bench_embedding(batch, d, optimizer, skew, copy_gbps)
        if "interaction" in ops:
            rows += bench_interaction(batch, d)
    if "loss" in ops:
        rows += bench_loss(batch)
    common = provenance(gpu)
    for r in rows:
        print("  ".join(f"{k}={v}" for k, v in r.items() if v != ""))
    append_rows(RESULTS, [dict(common, config="kaggle", batch=batch, **r) for r in rows])


if __name__ == "__main__":
    main()
