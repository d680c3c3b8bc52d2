"""The DCN cross layer's kernels compiled for a Hopper GPU on any machine, no GPU needed: registers, spills
and shared memory per tuned config, and the order of the forward epilogue's global loads and stores.

    python scripts/cross_registers.py [--dtype bf16|fp32] [--arch 90] [--tiles 128x256,64x64]
    python scripts/cross_registers.py --kernel hopper [--dtype bf16]

Compiles ``kernels.cross._cross_fwd_kernel`` with ``triton.compile`` for the target (sm_90a by default)
in every tuning config (kernels.gemm.tuning's Hopper tiles, the operands' reduction chunk), with the
specialization a launch at the MLPerf shape gets (pointers and N, K, M bucket and the row stride divisible
by 16), then runs the bundled ``ptxas -v`` for registers a thread and spill bytes and ``nvdisasm`` for the
kernel's SASS. It
prints one line a config: registers, spill stores (bytes), shared memory (bytes), and the sequence of the
kernel's global loads (L) and stores (S) after its main loop, runs collapsed (`8L 8S` for eight loads then
eight stores). This is what backs the register and spill statements of kernels/cross.py and
docs/model-and-kernels.md; speed needs the GPU (scripts/bench_cross.py).

`--kernel hopper` compiles ``kernels.cross_hopper``'s Gluon kernels instead, the forward, each variant of
the backward (ACCUMULATE, FOLD_DXL) and the dz / dh kernel, each in its setting (tiles, stages, epilogue
sub-tile, warps and register split), and prints a line each: registers, spills and shared memory (their
stores go through TMA: no epilogue order): what backs that module's shared-memory and register statements.
"""

import itertools
import os
import re
import subprocess
import tempfile

import click
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from kernels import cross, cross_hopper
from kernels.gemm import tuning

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# The kernel's arguments in order; the divisible ones as a launch at the MLPerf shape specializes them
# (N = 3456, K = r = 512, M bucket 65536, row stride N; 16-byte aligned tensors).
ARGS = (
    "h_desc",
    "u_desc",
    "x0_desc",
    "xl_desc",
    "out_desc",
    "zb_desc",
    "b_ptr",
    "out_ptr",
    "zb_ptr",
    "M",
    "N",
    "K",
    "M_BUCKET",
    "stride",
)
DIVISIBLE = ("b_ptr", "out_ptr", "zb_ptr", "N", "K", "M_BUCKET", "stride")
CONSTEXPRS = ("TMA_STORE", "DOT_FP32", "INPUT_PRECISION", "BLOCK_M", "BLOCK_N", "BLOCK_K")
# The Hopper kernels' register split, each launched with the kernels.cross_hopper setting of the same name.
HOPPER_REGS = ("CONSUMER_REGS", "PRODUCER_REGS")
# The backward kernel's variants: (ACCUMULATE, FOLD_DXL).
HOPPER_BWD = ((False, False), (True, False), (False, True), (True, True))
GLUON_DTYPES = {"bf16": gl.bfloat16, "fp16": gl.float16}


def compile_config(
    dtype: str, arch: int, block_m: int, block_n: int, block_k: int, warps: int, stages: int
) -> tuple[str, str, int]:
    """(ptx, a temporary cubin file's path, shared memory bytes) of the kernel in one config."""
    ty = {"bf16": "bf16", "fp32": "fp32"}[dtype]
    signature = {
        "h_desc": f"tensordesc<{ty}[{block_m},{block_k}]>",
        "u_desc": f"tensordesc<{ty}[{block_n},{block_k}]>",
        # x0, x_l, out and zb: the epilogue's quarters of the tile's columns (kernels/cross.py)
        **{name: f"tensordesc<{ty}[{block_m},{block_n // 4}]>" for name in ARGS[2:6]},
        **{name: f"*{ty}" for name in ARGS[6:9]},
        **{name: "i32" for name in ARGS[9:]},
        **{name: "constexpr" for name in CONSTEXPRS},
    }
    constexprs = {"TMA_STORE": True, "DOT_FP32": False, "INPUT_PRECISION": "tf32", "BLOCK_M": block_m,
                  "BLOCK_N": block_n, "BLOCK_K": block_k}  # fmt: skip
    attrs = {(ARGS.index(name),): [["tt.divisibility", 16]] for name in DIVISIBLE}
    source = ASTSource(cross._cross_fwd_kernel.fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    return kernel.asm["ptx"], f.name, kernel.metadata.shared


def compile_hopper(
    dtype: str, arch: int, kernel: str, accumulate: bool = False, fold_dxl: bool = False
) -> tuple[str, int]:
    """(ptx, shared memory bytes) of one of ``kernels.cross_hopper``'s kernels, `kernel` "fwd", "bwd" (with
    ACCUMULATE, FOLD_DXL) or "dz", in its setting for `dtype` ("bf16" or "fp16"), specialized as a launch at
    the MLPerf shape (b and the partial sums 16-byte aligned, N, K and R = r multiples of 16; M is not
    specialized)."""
    block_k = cross_hopper.BLOCK_K

    def descriptor(block: list[int]) -> str:
        layout = gl.NVMMASharedLayout.get_default_for(block, GLUON_DTYPES[dtype])
        return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"

    options = {"num_warps": 4, "maxnreg": cross_hopper.MAXNREG}
    if kernel == "dz":
        function = cross_hopper._cross_dz_ws_kernel
        block_m, block_r, stages = cross_hopper.DZ_TILE
        chunk = descriptor([block_m, block_k])
        operands = {"g_desc": chunk, "x0_desc": chunk, "u_desc": descriptor([block_k, block_r])}
        operands |= {"dz_desc": chunk, "dh_desc": chunk, "part_ptr": "*fp32"}
        sizes, constexprs = ("M", "N", "R"), {"STAGES": stages, "PRODUCER_REGS": cross_hopper.PRODUCER_REGS}
        options["num_warps"] = cross_hopper.DZ_WARPS
    else:
        backward = kernel == "bwd"
        function = cross_hopper._cross_bwd_ws_kernel if backward else cross_hopper._cross_fwd_ws_kernel
        block_m, block_n, epi_n, stages, slots = cross_hopper.TILES[3 if accumulate else 2]
        epilogue = descriptor([block_m, epi_n])
        a_block = descriptor([block_m, block_k])
        if backward:
            operands = {"dh_desc": a_block, "v_desc": descriptor([block_k, block_n])}
            operands |= {f"{name}_desc": epilogue for name in ("g", "zb", "acc", "dxl", "dx0")}
            flags = {"ACCUMULATE": accumulate, "FOLD_DXL": fold_dxl}
        else:
            operands = {"h_desc": a_block, "u_desc": descriptor([block_n, block_k])}
            operands |= {f"{name}_desc": epilogue for name in ("x0", "xl", "out", "zb")} | {
                "b_ptr": f"*{dtype}"
            }
            flags = {}
        sizes = ("M", "N", "K")
        constexprs = flags | {"STAGES": stages, "SLOTS": slots}
        constexprs |= {name: getattr(cross_hopper, name) for name in HOPPER_REGS}
    signature = operands | dict.fromkeys(sizes, "i32") | dict.fromkeys(constexprs, "constexpr")
    assert list(signature) == function.arg_names, f"the kernel takes {function.arg_names}"
    divisible = [name for name in ("b_ptr", "part_ptr", "N", "K", "R") if name in signature]
    attrs = {(function.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = GluonASTSource(function, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return compiled.asm["ptx"], compiled.metadata.shared


def registers(ptx: str, arch: int) -> tuple[int, int]:
    """(registers a thread, spill store bytes) of `ptx`, from ptxas -v."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    report = subprocess.run(
        [os.path.join(BIN, "ptxas"), f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull],
        capture_output=True, text=True, check=True,
    ).stderr  # fmt: skip
    os.unlink(f.name)
    used = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return int(used.group(1)), int(spills.group(1)) if spills else 0


def epilogue_order(cubin: str) -> str:
    """The global loads (L) and stores (S) after the kernel's last tensor-core instruction, runs collapsed."""
    sass = subprocess.run(
        [os.path.join(BIN, "nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True
    )
    ops = []
    for line in sass.stdout.splitlines():
        if "GMMA" in line:
            ops = []  # the epilogue starts after the last one
        elif "LDG" in line or "STG" in line:
            ops.append("L" if "LDG" in line else "S")
    return " ".join(f"{len(list(run))}{op}" for op, run in itertools.groupby(ops))


@click.command()
@click.option(
    "--kernel",
    type=click.Choice(["triton", "hopper"]),
    default="triton",
    show_default=True,
    help="kernels.cross's Triton kernel, or kernels.cross_hopper's Gluon kernels (bf16 / fp16, sm_90a).",
)
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True)
@click.option("--arch", type=int, default=90, show_default=True, help="Compute capability, e.g. 90.")
@click.option("--tiles", default=None, help="Only these tiles, e.g. 128x256,64x64 [default: every config's].")
def main(kernel: str, dtype: str, arch: int, tiles: str | None) -> None:
    """Print each config's registers, spills, shared memory and epilogue order (module docstring)."""
    if kernel == "hopper":
        if dtype == "fp32":
            raise click.BadParameter("the Hopper kernel takes bf16 or fp16", param_hint="--dtype")
        for name, accumulate, fold_dxl in (
            [("fwd", False, False)] + [("bwd", *v) for v in HOPPER_BWD] + [("dz", False, False)]
        ):
            ptx, shared = compile_hopper(dtype, arch, name, accumulate, fold_dxl)
            used, spilled = registers(ptx, arch)
            if name == "bwd":
                name += f" ACCUMULATE={accumulate:d} FOLD_DXL={fold_dxl:d}"
            click.echo(f"hopper {name} {dtype}: {used} registers, {spilled} B spilled, {shared} B shared")
        return
    if dtype == "fp16":
        raise click.BadParameter("the Triton kernel's configs are for bf16 or fp32", param_hint="--dtype")
    block_k = tuning._RED_BY_ELEMENT_SIZE[2 if dtype == "bf16" else 4]
    shapes = [s for s in tuning._GPU_SHAPES if tiles is None or f"{s[0]}x{s[1]}" in tiles.split(",")]
    if not shapes:
        raise click.BadParameter(f"no tuned config has tiles {tiles}", param_hint="--tiles")
    for block_m, block_n, warps, stages in shapes:
        ptx, cubin, shared = compile_config(dtype, arch, block_m, block_n, block_k, warps, stages)
        used, spilled = registers(ptx, arch)
        order = epilogue_order(cubin)
        os.unlink(cubin)
        click.echo(
            f"{block_m}x{block_n}x{block_k} warps {warps} stages {stages}: "
            f"{used} registers, {spilled} B spilled, {shared} B shared | {order}"
        )


if __name__ == "__main__":
    main()
