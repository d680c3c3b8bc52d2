"""`python -m dlrm.export`: a trained checkpoint as a self-contained serving program (torch.export).

    python -m dlrm.export --checkpoint runs/<run>/checkpoints/best.pt --output model.pt2 [--device cpu|cuda] \
        [--aoti-output model.aoti.pt2]

The exported program is the eval-mode model with its input transform and hashing inside:

    ctr = program(dense_counts, sparse_ids)
    dense_counts  [B, 13] float32  raw counts I1..I13 (missing = 0); log(1 + max(x, 0)) is applied inside
    sparse_ids    [B, S]  int64    raw ids, each the 32-bit hex value (missing = -1); hashed inside
    ctr           [B]     float32  click probability, sigmoid of the logit

A one-hot model takes one id per feature, C1..C26: S = 26. A multi-hot model (`model.multi_hot_sizes`, e.g.
configs/main_multi_hot.json and dlrm_dcnv2.json) takes bags: S = the sum of the bag sizes (214 for MLPerf's),
feature-major, feature c's bag in the consecutive columns c, c_1, ..., c_(k-1) (dlrm.data.bags), pooled
inside. They are the columns that `python -m dlrm.data.multi_hot` writes; the bags the run made on the fly
(`data.multi_hot`) are `dlrm.data.bags.make_bags` of the one-hot ids with the run's distribution and seed over
the id ranges of its data's metadata.json.

B is dynamic (1 .. 2**20). `--output` is an ExportedProgram (`torch.export.save`) that loads with
`torch.export.load(path).module()` in a process that has torch but not this package; it holds the weights,
on `--device`, and `dlrm.json` as an extra file: the run config, the input names ("inputs": the 13 dense
and the S sparse column names), "bag_sizes" (the model's bag sizes; null for a one-hot model) and the
checkpoint.
`--aoti-output` also compiles it ahead of time with AOTInductor, in a child process (dlrm.aoti).
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import click
import torch
from loguru import logger
from torch import nn

from dlrm.atomic import check_output_file, replacing
from dlrm.checkpoint import load_checkpoint
from dlrm.cli_options import checkpoint_option, command, path_option
from dlrm.config import from_dict
from dlrm.data.bags import bag_columns, is_one_hot
from dlrm.data.schema import DENSE_COLUMNS, NUM_DENSE, NUM_SPARSE
from dlrm.device import resolve_device
from dlrm.errors import cli_errors
from dlrm.model import DLRM, model_from_checkpoint

MAX_BATCH = 1 << 20
# + --program P --output O; faulthandler: a crash in the compiler prints the Python stack where it happened
AOTI_COMMAND = [sys.executable, "-X", "faulthandler", "-m", "dlrm.aoti"]


class ServingModel(nn.Module):
    """Raw Criteo features -> click probability: dense counts [B, 13] f32 and raw ids [B, S] i64 (S = 26,
    or the sum of the bag sizes `bag_sizes` of a multi-hot model) -> ctr [B] f32. The dense transform is
    the loaders' (log(1 + max(x, 0))); hashing and pooling are the model's own."""

    def __init__(self, model: DLRM, bag_sizes: tuple[int, ...] | None = None):
        super().__init__()
        self.model = model
        self.bag_sizes = None if is_one_hot(bag_sizes) else tuple(bag_sizes)

    @property
    def sparse_columns(self) -> list[str]:
        """The names of the S columns of `sparse_ids` (dlrm.data.bags.bag_columns)."""
        return bag_columns(self.bag_sizes)

    def forward(self, dense_counts: torch.Tensor, sparse_ids: torch.Tensor) -> torch.Tensor:
        dense = torch.log1p(dense_counts.clamp_min(0))
        return torch.sigmoid(self.model(dense, sparse_ids).float())


def serving_model(checkpoint: Path, device: torch.device) -> tuple[ServingModel, dict]:
    """The eval-mode ServingModel of a training checkpoint (any backend) on `device`, and the checkpoint's
    config dict. Raises ValueError for a missing or foreign checkpoint."""
    state = load_checkpoint(checkpoint)
    cfg = from_dict(state["config"]).model
    model = model_from_checkpoint(cfg, state["table_rows"], state["model"])
    # Buffers that are views of one tensor (the interaction's triangle indices) are saved apart, so that
    # each is a whole tensor in the archive.
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.clone())
        # Inductor lowers a dense lookup to a gather kernel; a sparse one (training's gradients) falls back
        # to the proxy executor, and torch 2.11's AOTInductor then crashed loading the CUDA package.
        if isinstance(module, nn.Embedding):
            module.sparse = False
    serving = ServingModel(model, cfg.multi_hot_sizes)
    return serving.requires_grad_(False).to(device).eval(), state["config"]


def example_inputs(
    batch: int, device: torch.device, seed: int = 0, columns: int = NUM_SPARSE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random raw inputs of `batch` rows: counts [batch, 13] in [0, 100) with some missing (0), ids
    [batch, columns] (26, or S for bags) with some -1."""
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randint(0, 100, (batch, NUM_DENSE), generator=generator).float()
    sparse = torch.randint(-1, 1 << 32, (batch, columns), generator=generator)
    return dense.to(device), sparse.to(device)


def program_columns(program: torch.export.ExportedProgram) -> int:
    """S, the columns of an exported program's `sparse_ids` input (its second user input)."""
    inputs = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    return inputs[program.graph_signature.user_inputs[1]].meta["val"].shape[1]


def export_program(model: ServingModel, device: torch.device) -> torch.export.ExportedProgram:
    """torch.export of `model` with a dynamic batch dimension (1 .. MAX_BATCH)."""
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    inputs = example_inputs(8, device, columns=len(model.sparse_columns))
    with torch.no_grad():
        return torch.export.export(model, inputs, dynamic_shapes=({0: batch}, {0: batch}), strict=False)


def save_program(
    program: torch.export.ExportedProgram, path: Path, model: ServingModel, config: dict, checkpoint: Path
) -> None:
    """Write `program` to `path` (atomically) with `dlrm.json` (module docstring) as an extra file."""
    info = {
        "inputs": {"dense_counts": DENSE_COLUMNS, "sparse_ids": model.sparse_columns},
        "bag_sizes": None if model.bag_sizes is None else list(model.bag_sizes),
        "output": "ctr",
        "checkpoint": str(checkpoint),
        "config": config,
    }
    with replacing(path, suffix=".pt2") as tmp:
        torch.export.save(program, str(tmp), extra_files={"dlrm.json": json.dumps(info)})


def compile_in_child(program: Path, package: Path) -> None:
    """`python -m dlrm.aoti --program program --output package` (its output passes through). Raises
    ValueError in one line when it fails or crashes (the program stays, usable without the package)."""
    code = subprocess.run([*AOTI_COMMAND, "--program", str(program), "--output", str(package)]).returncode
    if code < 0:
        raise ValueError(
            f"{package}: AOTInductor crashed ({signal.Signals(-code).name}) compiling or loading it; "
            f"{program} is written and serves without it"
        )
    if code != 0:
        raise ValueError(f"{package}: AOTInductor failed (exit {code}, its error above); {program} written")


@command
@checkpoint_option
@path_option(
    "--output",
    required=True,
    help="ExportedProgram file to write (model.pt2): ctr = program(dense_counts [B,13] f32, sparse_ids [B,S] "
    "i64), S = 26 ids C1..C26, or for a multi-hot model the bags: S = the sum of its bag sizes (214 for "
    "MLPerf's), feature c's bag in columns c, c_1, ... as python -m dlrm.data.multi_hot writes them.",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    help="Where the exported weights live and the program runs.",
)
@path_option(
    "--aoti-output",
    help="Also compile the program with AOTInductor into this package (.pt2) and print its latency per "
    "batch (python -m dlrm.aoti; needs a C++ compiler).",
)
def main(checkpoint_path, output, device, aoti_output):
    """Export a checkpoint as a self-contained torch.export program that maps raw dense counts and raw
    category ids (one per feature, or a multi-hot model's bags) to the click probability (and, with
    --aoti-output, an AOTInductor package of it)."""
    with cli_errors():
        check_output_file(output, "--output", [checkpoint_path])  # before any work
        if aoti_output is not None:
            check_output_file(aoti_output, "--aoti-output", [checkpoint_path, output])
        dev = resolve_device(device)
        model, config = serving_model(checkpoint_path, dev)
        program = export_program(model, dev)
        save_program(program, output, model, config, checkpoint_path)
        logger.info("exported {} -> {} ({})", checkpoint_path, output, dev)
        if aoti_output is not None:
            compile_in_child(output, aoti_output)


if __name__ == "__main__":
    main()
