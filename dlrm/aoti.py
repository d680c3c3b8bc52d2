"""`python -m dlrm.aoti`: a serving program of `python -m dlrm.export` compiled ahead of time with
AOTInductor, and its latency per batch against the program run as it is.

    python -m dlrm.aoti --program model.pt2 --output model.aoti.pt2

The package (`torch._inductor.aoti_compile_and_package`) runs on the device that the program's weights are
on (`dlrm.export --device`), loads with `torch._inductor.aoti_load_package(path)` in a process that has
torch but not this package, and is called like the program: ctr [B] = package(dense_counts [B, 13] float32,
sparse_ids [B, S] int64), S = 26 or, for a multi-hot model, the sum of its bag sizes (dlrm.export).
Compiling needs a C++ compiler (and, for a GPU program, the CUDA toolkit) and takes seconds to minutes.

`dlrm.export --aoti-output` runs this module in a child process: a crash inside AOTInductor (torch 2.11
on an H100 segfaults loading any CUDA package, a plain nn.Linear's too) then ends that process, not the
export, which says so in one line.
"""

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import click
import torch
from loguru import logger

from dlrm.atomic import check_output_file, replacing
from dlrm.cli_options import command, path_option
from dlrm.errors import cli_errors
from dlrm.export import example_inputs, program_columns

LATENCY_BATCHES = (1, 128, 4096)


def program_device(program: torch.export.ExportedProgram) -> torch.device:
    """The device of the program's weights (where it and its package run)."""
    return next(iter(program.state_dict.values())).device


def compile_package(program: torch.export.ExportedProgram, path: Path) -> Callable:
    """AOTInductor package of `program`, written to a temporary name beside `path` and renamed when
    complete; returns it loaded."""
    import torch._inductor

    with replacing(path, suffix=".pt2") as tmp:
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
    return torch._inductor.aoti_load_package(str(path))


@torch.no_grad()
def latency_ms(
    fn: Callable, batch: int, device: torch.device, columns: int, warmup: int = 10, repeats: int = 50
) -> float:
    """Median milliseconds of one call of `fn` on `batch` random raw rows of `columns` sparse ids (CUDA
    events on a GPU)."""
    inputs = example_inputs(batch, device, seed=batch, columns=columns)
    for _ in range(warmup):
        fn(*inputs)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*inputs)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(*inputs)
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


@command
@click.option(
    "--program",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    required=True,
    help="A serving program written by python -m dlrm.export (model.pt2).",
)
@path_option("--output", required=True, help="AOTInductor package to write (.pt2).")
def main(program, output):
    """Compile a dlrm.export program with AOTInductor and print its latency per batch of 1 / 128 / 4096
    rows against the program's."""
    with cli_errors():
        check_output_file(output, "--output", [program])  # before the minutes of compiling
        exported = torch.export.load(str(program))
        device, columns = program_device(exported), program_columns(exported)
        start = time.perf_counter()
        package = compile_package(exported, output)
        took = time.perf_counter() - start
        logger.info("AOTInductor package {} ({:.0f} s to compile, {})", output, took, device)
        module = exported.module()
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        click.echo(f"latency on {name}, ms per batch (median):")
        click.echo("| batch | program | AOTInductor | program / AOTInductor |")
        click.echo("| --- | --- | --- | --- |")
        for batch in LATENCY_BATCHES:
            eager = latency_ms(module, batch, device, columns)
            compiled = latency_ms(package, batch, device, columns)
            click.echo(f"| {batch} | {eager:.3f} | {compiled:.3f} | {eager / compiled:.2f}x |")


if __name__ == "__main__":
    main()
