"""Benchmark the MLP layer kernels on a GPU: eager PyTorch, torch.compile, bias_act and linear_act.

    python scripts/bench_kernels.py [--configs kaggle,mlperf] [--batches 2048,16384] [--precisions tf32,bf16]

For every MLP layer of configs/<config>.json (K -> N, its activation) and batch B it times the forward and
the forward + backward of:
    eager       act(F.linear(x, W, b))                        PyTorch ops, the baseline
    compile     torch.compile of that function                Inductor (compile time reported apart)
    bias_act    bias_act(F.linear(x, W), b, act)              cuBLAS GEMM + our fused bias+activation kernel
    linear_act  linear_act(x, W, b, act)                      our fused GEMM + bias + activation kernel
    cuda_bias_act  bias_act_cuda(F.linear(x, W), b, act)      the same with the CUDA C++ add-bias-activation
                (not in the default --paths; give it to compare with bias_act)
each two ways (median of CUDA-event timings, triton.testing.do_bench): "launch", called from Python as an
eager training loop does (host launch overhead included), and "graph", replays of a CUDA graph of the same
calls (GPU time only, what a graph-captured training step pays).

`--what blocks` times the other MLP blocks (`model.mlp_block`) instead, on the same layers but the logit
layer (rows in scripts/results/blocks.csv):
    eager       the block in PyTorch ops: F.layer_norm -> F.linear -> F.gelu(tanh), or
                F.linear -> gate(z[:, 0::2], z[:, 1::2])
    compile     torch.compile of that function
    triton      our fused kernel: kernels.ln_linear_gelu / kernels.gated_linear

`--what lora` times the LoRA layer act(x W^T + s (x A^T) B^T + b) (W, b frozen; gradients for x, A, B) on
the same layers, per rank of `--lora-ranks` (rows in scripts/results/lora.csv): eager (the PyTorch
expression), compile of it, triton (kernels.lora_linear).

`--what mlp` times each config's bottom and top MLP whole, as the model runs them (`dlrm.model.mlp.MLP`,
rows in scripts/results/mlp.csv): eager (kernel "torch"), compile of it, bias_act, and linear_act, whose
layers run as one autograd node (kernels.linear_act.linear_act_stack). The bottom MLP's input is data (no
gradient), the top MLP's is not.

`--what attention` times the attention interaction (`model.interaction` "attention") at each batch, per
(heads, dim) of `--attention-shapes` (rows in scripts/results/attention.csv), two ways:
    op "attention"    softmax(QK^T / sqrt(d)) V with a key mask on [B, heads, 27, d] (q, k, v views of one
                      [B, 27, 3, heads, d] projection, as the model makes them; ~20% of keys masked):
                      eager F.scaled_dot_product_attention(attn_mask=bool), compile of it, compile-ops
                      (torch.compile of the plain ops: matmul, masked_fill, softmax, matmul: what Inductor
                      fuses on its own, the baseline our kernel must beat), triton
                      kernels.attention.masked_attention
    op "interaction"  the whole InteractionArch (model.attention.layers layers: projections, attention,
                      residual, relu) over dense [B, 16] and embedded [B, 26, 16]: kernel "torch", compile
                      of it, kernel "triton"
Precisions: tf32 (fp32 tensors, TF32 matmuls allowed for every path) and bf16. Inputs rotate over several
buffer sets so the L2 cache does not hold them between repeats. Every path reads a layer's input x in the
layout the model hands it over (`model_layout`): the top MLP's first layer reads the dot interaction's
output, [B, 367] in rows 16 bytes apart (368 fp32 values), the bottom MLP's first layer contiguous dense
features [B, 13]. (Rows before 2026-11-26 fed a contiguous [B, 367] to every path.)

It first measures the two ceilings on this GPU: device-to-device copy bandwidth (bytes read + written) and
the GEMM rate (8192^3 matmul) per precision, and reports each row's TFLOP/s as a % of that rate. The
bias_act rows also report GB/s against the copy bandwidth. Every row is appended to
scripts/results/kernels.csv; the summary (sum over a config's layers, ratio to eager and compile in the
same run) is printed last.
"""

from pathlib import Path

import click
import torch
import torch.nn.functional as F
from bench_kernels_attention import run_attention
from bench_timing import DTYPES, PASSES, ROTATE, graph_ms, measure_ceilings, time_passes
from results_csv import append_rows, provenance

from dlrm.config import load_config
from dlrm.data.schema import NUM_DENSE
from dlrm.model.dlrm import InteractionArch
from kernels.activations import act_ref
from kernels.bias_act import bias_act
from kernels.gemm.layout import aligned_copy, aligned_width
from kernels.linear_act import linear_act

RESULTS = Path(__file__).parent / "results" / "kernels.csv"
BLOCK_RESULTS = Path(__file__).parent / "results" / "blocks.csv"
BLOCKS = ("ln_linear_gelu", "gated:sigmoid_tanh", "gated:geglu", "gated:swiglu")
BLOCK_PATHS = ("eager", "compile", "triton")
ATTENTION_SHAPES = "2x16,2x32,4x32,8x16"  # heads x dim
LORA_RESULTS = Path(__file__).parent / "results" / "lora.csv"
MLP_RESULTS = Path(__file__).parent / "results" / "mlp.csv"
CONFIG_DIR = Path(__file__).parents[1] / "configs"
PATHS = ("eager", "compile", "bias_act", "linear_act")
ATTENTION_PATHS = ("eager", "compile", "compile-ops", "triton")


def mlp_stacks(config: str) -> list[tuple[str, int, tuple[int, ...], str]]:
    """(name, K, widths, last activation) of the bottom and top MLPs of configs/<config>.json."""
    model = load_config(CONFIG_DIR / f"{config}.json").model
    top_in = InteractionArch(model.embedding_dim, model.interaction).out_features
    return [
        ("bottom", NUM_DENSE, tuple(model.bottom_mlp), "relu"),
        ("top", top_in, tuple(model.top_mlp), "identity"),
    ]


def mlp_layers(config: str) -> list[tuple[int, int, str]]:
    """(K, N, activation) of every MLP layer of configs/<config>.json, bottom MLP then top MLP."""
    layers = []
    for _, k, widths, last in mlp_stacks(config):
        for i, n in enumerate(widths):
            layers.append((k, n, last if i == len(widths) - 1 else "relu"))
            k = n
    return layers


def model_layout(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] copied into the layout the model hands a layer of input width K: rows 16 bytes apart when K
    is the interaction's output width (wider than the NUM_DENSE dense features, and not 16-byte aligned:
    the dot interaction kernel writes its rows padded, kernels/interaction.py), else x itself."""
    k = x.shape[1]
    if k <= NUM_DENSE or aligned_width(k, x.dtype) == k:
        return x
    return aligned_copy(x)


def _layer_fns(path: str, act: str):
    """(forward fn(x, W, b), compile seconds) for one path."""
    if path == "eager":
        return (lambda x, w, b: act_ref(F.linear(x, w, b), act)), 0.0
    if path == "bias_act":
        return (lambda x, w, b: bias_act(F.linear(x, w), b, act)), 0.0
    if path == "cuda_bias_act":
        from kernels.cuda.bias_act import bias_act_cuda

        return (lambda x, w, b: bias_act_cuda(F.linear(x, w), b, act)), 0.0
    if path == "linear_act":
        return (lambda x, w, b: linear_act(x, w, b, act)), 0.0
    torch._dynamo.reset()  # each layer compiles afresh: the lambda's code object is shared between layers
    return torch.compile(lambda x, w, b: act_ref(F.linear(x, w, b), act), dynamic=False), None


def bench_layer(path: str, m: int, k: int, n: int, act: str, dtype: torch.dtype) -> dict[str, float]:
    """Median ms of one layer on one path: forward and forward+backward, each timed as launched from
    Python ("launch", host overhead included) and as CUDA-graph replays ("graph", GPU time only);
    plus compile seconds for the compile path."""
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    sets = []
    for _ in range(ROTATE):
        x = model_layout(torch.randn(m, k, device="cuda", dtype=dtype, generator=g)).requires_grad_()
        w = (torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k**0.5).requires_grad_()
        b = torch.randn(n, device="cuda", dtype=dtype, generator=g).requires_grad_()
        dy = torch.randn(m, n, device="cuda", dtype=dtype, generator=g)
        sets.append((x, w, b, dy))
    fn, compile_s = _layer_fns(path, act)
    return time_passes(fn, sets, compile_s is None)


def _block_fn(path: str, block: str):
    """fn(x, *params) of one MLP block (`BLOCKS`) on one path (`BLOCK_PATHS`)."""
    from kernels.gated_linear import gate_ref, gated_linear
    from kernels.ln_linear_gelu import ln_linear_gelu

    kind, _, gate = block.partition(":")
    if path == "triton":
        if kind == "ln_linear_gelu":
            return ln_linear_gelu
        return lambda x, w, b: gated_linear(x, w, b, gate)

    if kind == "ln_linear_gelu":

        def eager(x, gamma, beta, w, b):
            a = F.layer_norm(x, (x.shape[1],), gamma, beta, 1e-5)
            return F.gelu(F.linear(a, w, b), approximate="tanh")
    else:

        def eager(x, w, b):
            z = F.linear(x, w, b)
            return gate_ref(z[:, 0::2], z[:, 1::2], gate)

    if path == "eager":
        return eager
    torch._dynamo.reset()
    return torch.compile(eager, dynamic=False)


def bench_block(path: str, block: str, m: int, k: int, n: int, dtype: torch.dtype) -> dict[str, float]:
    """Median ms of one block K -> N on one path, as `bench_layer` times a layer."""
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    sets = []
    wide = 2 if block.startswith("gated") else 1
    for _ in range(ROTATE):
        x = model_layout(torch.randn(m, k, device="cuda", dtype=dtype, generator=g)).requires_grad_()
        w = (torch.randn(wide * n, k, device="cuda", dtype=dtype, generator=g) / k**0.5).requires_grad_()
        b = torch.randn(wide * n, device="cuda", dtype=dtype, generator=g).requires_grad_()
        dy = torch.randn(m, n, device="cuda", dtype=dtype, generator=g)
        if wide == 1:
            gamma = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(dtype).requires_grad_()
            beta = (0.1 * torch.randn(k, device="cuda", generator=g)).to(dtype).requires_grad_()
            sets.append((x, gamma, beta, w, b, dy))
        else:
            sets.append((x, w, b, dy))
    return time_passes(_block_fn(path, block), sets, path == "compile")


def run_blocks(configs, batches, precisions, blocks, paths, ceilings, common) -> None:
    """`--what blocks`: every block on every layer of the configs' MLPs but the logit layer; rows to
    BLOCK_RESULTS, and per (config, precision, batch, block) the sums over the layers with their ratios."""
    rows = []
    print(
        "\nMLP blocks, sum over each config's layers but the logit layer, ms (ratio = eager / path), "
        + common["device"]
    )
    print(f"{'config':<8}{'prec':<6}{'B':>7}  {'block':<20}{'pass':<15}" + "".join(f"{p:>20}" for p in paths))
    for config in configs:
        layers = mlp_layers(config)[:-1]  # the logit layer stays a plain Linear
        for precision in precisions:
            peak = ceilings[f"gemm_tflops_{precision}"]
            for m in batches:
                for block in blocks:
                    wide = 2 if block.startswith("gated") else 1
                    totals = {(p, ps): 0.0 for p in paths for ps in PASSES}
                    for k, n, _ in layers:
                        times = {p: bench_block(p, block, m, k, n, DTYPES[precision]) for p in paths}
                        for path, t in times.items():
                            for ps in PASSES:
                                totals[(path, ps)] += t[ps]
                                flops = (6 if ps.endswith("bwd") else 2) * m * wide * n * k
                                tflops = flops / t[ps] / 1e9
                                rows.append(dict(
                                    common, config=config, block=block, layer=f"{k}->{n}", batch=m,
                                    precision=precision, path=path, **{"pass": ps}, ms=round(t[ps], 5),
                                    tflops=round(tflops, 2), pct_gemm_peak=round(100 * tflops / peak, 2),
                                    ratio_vs_eager=round(times[paths[0]][ps] / t[ps], 3),
                                    compile_s=round(t["compile_s"], 2),
                                ))  # fmt: skip
                    _print_totals(f"{config:<8}{precision:<6}{m:>7}  {block:<20}", totals, paths)
                    if "compile" in paths and "triton" in paths:
                        ratio = totals[("compile", "graph fwd+bwd")] / totals[("triton", "graph fwd+bwd")]
                        print(f"{'':<41}triton graph fwd+bwd speed-up over compile: {ratio:.2f}x")
                    append_rows(BLOCK_RESULTS, rows)  # as it goes: a call's time limit keeps what ran
                    rows = []


def _print_totals(prefix: str, totals: dict, paths: list[str]) -> None:
    """One line per pass: each path's summed ms and its speed-up over the first path (eager)."""
    for ps in PASSES:
        base = totals[(paths[0], ps)]
        cells = "".join(f"{totals[(p, ps)]:>10.4f} ({base / totals[(p, ps)]:>5.2f}x)" for p in paths)
        print(f"{prefix}{ps:<15}{cells}")


def _lora_fn(path: str, act: str):
    from kernels.lora_linear import lora_linear

    if path == "triton":
        return lambda x, w, b, a, bl: lora_linear(x, w, b, a, bl, 0.5, act)

    def eager(x, w, b, a, bl):
        return act_ref(F.linear(x, w, b) + 0.5 * F.linear(F.linear(x, a), bl), act)

    if path == "eager":
        return eager
    torch._dynamo.reset()
    return torch.compile(eager, dynamic=False)


def bench_lora(path: str, m: int, k: int, n: int, r: int, act: str, dtype: torch.dtype) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n + r)
    sets = []
    for _ in range(ROTATE):
        x = model_layout(torch.randn(m, k, device="cuda", dtype=dtype, generator=g)).requires_grad_()
        w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k**0.5  # frozen
        b = torch.randn(n, device="cuda", dtype=dtype, generator=g)  # frozen
        a = (torch.randn(r, k, device="cuda", dtype=dtype, generator=g) / k**0.5).requires_grad_()
        bl = torch.randn(n, r, device="cuda", dtype=dtype, generator=g).requires_grad_()
        sets.append((x, w, b, a, bl, torch.randn(m, n, device="cuda", dtype=dtype, generator=g)))
    return time_passes(_lora_fn(path, act), sets, path == "compile")


def run_lora(configs, batches, precisions, ranks, paths, common) -> None:
    """`--what lora`: rows to LORA_RESULTS; per (config, precision, batch, rank) the sums over the layers."""
    rows = []
    print(f"\nLoRA layers, sum over each config's layers, ms (ratio = eager / path), {common['device']}")
    print(f"{'config':<8}{'prec':<6}{'B':>7}  {'r':>4}  {'pass':<15}" + "".join(f"{p:>20}" for p in paths))
    for config in configs:
        for precision in precisions:
            for m in batches:
                for r in ranks:
                    totals = {(p, ps): 0.0 for p in paths for ps in PASSES}
                    for k, n, act in mlp_layers(config):
                        times = {p: bench_lora(p, m, k, n, r, act, DTYPES[precision]) for p in paths}
                        for path, t in times.items():
                            for ps in PASSES:
                                totals[(path, ps)] += t[ps]
                                rows.append(dict(
                                    common, config=config, layer=f"{k}->{n}", rank=r, act=act, batch=m,
                                    precision=precision, path=path, **{"pass": ps}, ms=round(t[ps], 5),
                                    ratio_vs_eager=round(times[paths[0]][ps] / t[ps], 3),
                                    compile_s=round(t["compile_s"], 2),
                                ))  # fmt: skip
                    _print_totals(f"{config:<8}{precision:<6}{m:>7}  {r:>4}  ", totals, paths)
                    append_rows(LORA_RESULTS, rows)  # as it goes: a call's time limit keeps what ran
                    rows = []


def bench_mlp(path: str, m: int, name: str, k: int, widths: tuple[int, ...], last: str, dtype: torch.dtype):
    """Median ms of one whole MLP on one path (`time_passes`); its parameters' gradients are cleared
    before each forward, as an optimizer's zero_grad(set_to_none) does."""
    from dlrm.model.mlp import MLP

    torch.manual_seed(0)
    kernel = path if path in ("bias_act", "linear_act") else "torch"
    mlp = MLP(k, widths, "relu", last, kernel=kernel).to("cuda", dtype)
    params = list(mlp.parameters())
    g = torch.Generator(device="cuda").manual_seed(m * 7 + k)
    sets = []
    for _ in range(ROTATE):
        x = model_layout(torch.randn(m, k, device="cuda", dtype=dtype, generator=g))
        x.requires_grad_(name == "top")
        sets.append((x, *params, torch.randn(m, widths[-1], device="cuda", dtype=dtype, generator=g)))
    module = mlp
    if path == "compile":
        torch._dynamo.reset()
        module = torch.compile(mlp, dynamic=False)
    return time_passes(lambda x, *_: module(x), sets, path == "compile")


def run_mlp(configs, batches, precisions, paths, common) -> None:
    """`--what mlp`: rows to MLP_RESULTS; per (config, precision, batch, MLP) each path's time and ratio."""
    print(f"\nwhole MLPs, ms (ratio = eager / path), {common['device']}")
    print(f"{'config':<8}{'prec':<6}{'B':>7}  {'mlp':<8}{'pass':<15}" + "".join(f"{p:>20}" for p in paths))
    for config in configs:
        for precision in precisions:
            for m in batches:
                for name, k, widths, last in mlp_stacks(config):
                    times = {p: bench_mlp(p, m, name, k, widths, last, DTYPES[precision]) for p in paths}
                    rows = [
                        dict(
                            common, config=config, mlp=name, layers="-".join(map(str, (k, *widths))), batch=m,
                            precision=precision, path=path, **{"pass": ps}, ms=round(t[ps], 5),
                            ratio_vs_eager=round(times[paths[0]][ps] / t[ps], 3),
                            compile_s=round(t["compile_s"], 2),
                        )
                        for path, t in times.items()
                        for ps in PASSES
                    ]  # fmt: skip
                    totals = {(p, ps): times[p][ps] for p in paths for ps in PASSES}
                    _print_totals(f"{config:<8}{precision:<6}{m:>7}  {name:<8}", totals, paths)
                    append_rows(MLP_RESULTS, rows)


def bench_bias_act_bandwidth(
    m: int, n: int, dtype: torch.dtype, copy_gbps: float, kernel: str = "triton"
) -> tuple[float, float]:
    """Bandwidth of bias_act alone (`kernel` "triton", or "cuda": the CUDA C++ twin) as % of copy: forward
    reads x, b and writes y; backward reads dy, x, b and writes dx. Timed as CUDA-graph replays (GPU time,
    what a graph-captured step pays), like the layers' "graph" passes."""
    if kernel == "cuda":
        from kernels.cuda.bias_act import bias_act_cuda_bwd as bias_act_bwd
        from kernels.cuda.bias_act import bias_act_cuda_fwd as bias_act_fwd
    else:
        from kernels.bias_act import bias_act_bwd, bias_act_fwd

    x, dy = torch.randn(m, n, device="cuda", dtype=dtype), torch.randn(m, n, device="cuda", dtype=dtype)
    b = torch.randn(n, device="cuda", dtype=dtype)
    size = x.element_size()
    fwd_gbps = (2 * m * n + n) * size / graph_ms(lambda: bias_act_fwd(x, b, "relu")) / 1e6
    bwd_gbps = (3 * m * n + n) * size / graph_ms(lambda: bias_act_bwd(dy, x, b, "relu")) / 1e6
    return 100 * fwd_gbps / copy_gbps, 100 * bwd_gbps / copy_gbps


def _print_summary(summary: list, path_list: list[str], gpu: str) -> None:
    print(f"\nsum over each config's MLP layers, ms (ratio = eager / path, same run), {gpu}")
    print(f"{'config':<8}{'prec':<6}{'B':>7}  {'pass':<15}" + "".join(f"{p:>20}" for p in path_list))
    for config, precision, m, totals in summary:
        for ps in PASSES:
            base = totals.get(("eager", ps), float("nan"))
            cells = "".join(f"{totals[(p, ps)]:>10.4f} ({base / totals[(p, ps)]:>5.2f}x)" for p in path_list)
            print(f"{config:<8}{precision:<6}{m:>7}  {ps:<15}{cells}")
    if "compile" in path_list and "linear_act" in path_list:
        ratios = [
            f"{c}/{p}/B={m}/{ps}: {t[('compile', ps)] / t[('linear_act', ps)]:.2f}x"
            for c, p, m, t in summary
            for ps in ("launch fwd+bwd", "graph fwd+bwd")
        ]
        print("linear_act fwd+bwd speed-up over compile: " + ", ".join(ratios))


@click.command(context_settings={"show_default": True})
@click.option("--configs", default="kaggle", help="Comma-separated names of configs/*.json (kaggle, mlperf).")
@click.option("--batches", default="2048,16384", help="Comma-separated batch sizes B (= M).")
@click.option("--precisions", default="tf32,bf16", help="Comma-separated: tf32, bf16.")
@click.option(
    "--paths", default=None, help="Comma-separated paths to time; eager first for ratios. [default: all]"
)
@click.option(
    "--what",
    type=click.Choice(["layers", "mlp", "blocks", "attention", "lora"]),
    default="layers",
    help="layers: the linear_act paths (kernels.csv); mlp: whole MLPs on those paths (mlp.csv); blocks: "
    "the model.mlp_block kernels (blocks.csv); attention: the attention interaction (attention.csv); lora: "
    "the LoRA layer (lora.csv).",
)
@click.option("--blocks", default=",".join(BLOCKS), help="With --what blocks: comma-separated blocks.")
@click.option(
    "--attention-shapes", default=ATTENTION_SHAPES, help="With --what attention: comma-separated HEADSxDIM."
)
@click.option("--lora-ranks", default="4,16", help="With --what lora: comma-separated adapter ranks.")
def main(configs, batches, precisions, paths, what, blocks, attention_shapes, lora_ranks):
    """Time the MLP layer paths on this GPU and append the rows to scripts/results/kernels.csv."""
    if not torch.cuda.is_available():
        raise click.UsageError("bench_kernels.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    gpu = torch.cuda.get_device_name()
    ceilings = measure_ceilings()
    gemm = ", ".join(f"GEMM {p} {ceilings[f'gemm_tflops_{p}']:.0f} TFLOP/s" for p in DTYPES)
    print(f"{gpu}: copy {ceilings['copy_gbps']:.0f} GB/s, {gemm}")
    common = provenance(gpu)
    if what == "blocks":
        run_blocks(
            configs.split(","), [int(b) for b in batches.split(",")], precisions.split(","),
            blocks.split(","), (paths or ",".join(BLOCK_PATHS)).split(","), ceilings, common,
        )  # fmt: skip
        return
    if what == "lora":
        run_lora(
            configs.split(","), [int(b) for b in batches.split(",")], precisions.split(","),
            [int(r) for r in lora_ranks.split(",")], (paths or ",".join(BLOCK_PATHS)).split(","), common,
        )  # fmt: skip
        return
    if what == "mlp":
        run_mlp(
            configs.split(","), [int(b) for b in batches.split(",")], precisions.split(","),
            (paths or ",".join(PATHS)).split(","), common,
        )  # fmt: skip
        return
    if what == "attention":
        run_attention(
            [int(b) for b in batches.split(",")], precisions.split(","), attention_shapes.split(","),
            (paths or ",".join(ATTENTION_PATHS)).split(","), common,
        )  # fmt: skip
        return
    rows, summary = [], []
    path_list = (paths or ",".join(PATHS)).split(",")
    for config in configs.split(","):
        for precision in precisions.split(","):
            peak = ceilings[f"gemm_tflops_{precision}"]
            for m in (int(b) for b in batches.split(",")):
                totals = {(p, ps): 0.0 for p in path_list for ps in PASSES}
                for k, n, act in mlp_layers(config):
                    flops = {ps: (6 if ps.endswith("bwd") else 2) * m * n * k for ps in PASSES}
                    times = {path: bench_layer(path, m, k, n, act, DTYPES[precision]) for path in path_list}
                    base = times[path_list[0]]
                    for path, t in times.items():
                        for ps in PASSES:
                            totals[(path, ps)] += t[ps]
                            tflops = flops[ps] / t[ps] / 1e9
                            rows.append(dict(
                                common, config=config, layer=f"{k}->{n}", act=act, batch=m,
                                precision=precision, path=path, **{"pass": ps}, ms=round(t[ps], 5),
                                tflops=round(tflops, 2),
                                pct_gemm_peak=round(100 * tflops / peak, 2),
                                ratio_vs_eager=round(base[ps] / t[ps], 3), compile_s=round(t["compile_s"], 2),
                            ))  # fmt: skip
                summary.append((config, precision, m, totals))
    fwd_pct, bwd_pct = bench_bias_act_bandwidth(65536, 512, torch.bfloat16, ceilings["copy_gbps"])
    print(f"bias_act alone, M=65536 N=512 bf16: forward {fwd_pct:.0f}%, backward {bwd_pct:.0f}% of copy BW")
    for ps, pct in (("fwd", fwd_pct), ("bwd", bwd_pct)):
        rows.append(dict(common, config="-", layer="65536x512", act="relu", batch=65536, precision="bf16",
                         path="bias_act_alone", **{"pass": ps}, pct_copy_bw=round(pct, 1)))  # fmt: skip
    if "cuda_bias_act" in path_list:  # the CUDA C++ twin alone, same shape (target: within 10% of Triton's)
        cuda_fwd, cuda_bwd = bench_bias_act_bandwidth(
            65536, 512, torch.bfloat16, ceilings["copy_gbps"], "cuda"
        )
        print(f"bias_act_cuda alone: forward {cuda_fwd:.0f}%, backward {cuda_bwd:.0f}% of copy BW "
              f"(time / Triton's: {fwd_pct / cuda_fwd:.2f}x, {bwd_pct / cuda_bwd:.2f}x)")  # fmt: skip
        for ps, pct in (("fwd", cuda_fwd), ("bwd", cuda_bwd)):
            rows.append(dict(common, config="-", layer="65536x512", act="relu", batch=65536,
                             precision="bf16", path="cuda_bias_act_alone", **{"pass": ps},
                             pct_copy_bw=round(pct, 1)))  # fmt: skip

    append_rows(RESULTS, rows)
    _print_summary(summary, path_list, gpu)


if __name__ == "__main__":
    main()
