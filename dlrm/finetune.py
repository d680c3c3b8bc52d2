"""`python -m dlrm.finetune`: continue a trained model on (new) data with low-rank adapters (LoRA), or fold a
fine-tuned model's adapters into its weights.

    python -m dlrm.finetune --checkpoint RUN/checkpoints/best.pt [--config C] --lora-rank r [--lora-alpha a]
        [--freeze-embeddings] [--set KEY=VALUE ...] [--output-dir DIR] [--max-steps N] [--use-triton]
        [--device D]
    python -m dlrm.finetune --checkpoint FINETUNED/checkpoints/best.pt --merge --output merged.pt

Fine-tuning trains the run config C (default: the checkpoint's own) with `model.lora` set: the model starts
from the checkpoint's weights and table layout, every MLP layer gets adapters act(x W^T + (alpha / r)
(x A^T) B^T + b) (B = 0 at the start, so the first step sees the base model), and only the adapters train,
and the embedding tables unless `--freeze-embeddings`. It is an ordinary run of the training loop
(`dlrm.train`): logs, evaluations, checkpoints (which record `model.lora`), `--resume`. With `--use-triton`
the adapted layers run on the fused kernel `kernels/lora_linear.py`.

`--merge` writes a plain checkpoint: W + (alpha / r) B A in place of each layer's W, the adapters and
`model.lora` gone, a fresh optimizer state; `dlrm.evaluate` and `dlrm.train --resume` read it like any.
"""

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import click

from dlrm.atomic import check_output_file
from dlrm.checkpoint import load_checkpoint, save_checkpoint
from dlrm.choices import DEVICES
from dlrm.cli_options import command, path_option, set_option
from dlrm.config import LoraConfig, RunConfig, apply_overrides, from_dict, load_config, replace
from dlrm.errors import cli_errors
from dlrm.model import model_from_checkpoint
from dlrm.optim import RunOptimizer
from dlrm.run.loop import train


def finetune_config(
    checkpoint: Path,
    config: RunConfig | None,
    rank: int,
    alpha: float | None = None,
    freeze_embeddings: bool = False,
    overrides: Sequence[str] = (),
) -> RunConfig:
    """The run config of a fine-tuning run: `config` (default: the checkpoint's) with the `overrides`
    ("KEY=VALUE", dlrm.config.apply_overrides) and `model.lora` set.

    Raises:
        ValueError: a checkpoint that is missing, has adapters already, or whose model the config's differs
            from (naming the key); a bad override.
    """
    state = load_checkpoint(checkpoint)
    theirs = from_dict(state["config"]).model
    if theirs.lora.rank:
        raise ValueError(
            f"{checkpoint}: has adapters already (model.lora.rank {theirs.lora.rank}): --merge it first"
        )
    cfg = apply_overrides(config or from_dict(state["config"]), overrides)
    for key in (f.name for f in dataclasses.fields(theirs)):
        if key != "lora" and getattr(cfg.model, key) != getattr(theirs, key):
            raise ValueError(
                f"{checkpoint}: trained with model.{key} = {getattr(theirs, key)!r}, the config has "
                f"{getattr(cfg.model, key)!r}"
            )
    lora = LoraConfig(rank=rank, alpha=alpha, base=str(checkpoint), freeze_embeddings=freeze_embeddings)
    return replace(cfg, "model", lora=lora)


def merge_checkpoint(checkpoint: Path, output: Path) -> dict:
    """Fold a fine-tuned checkpoint's adapters into its weights and write a plain checkpoint to `output`;
    returns what was written.

    Raises:
        ValueError: a checkpoint without adapters.
    """
    state = load_checkpoint(checkpoint)
    cfg = from_dict(state["config"])
    lora = cfg.model.lora
    if not lora.rank:
        raise ValueError(f"{checkpoint}: has no adapters to merge (model.lora.rank 0)")
    scale = (lora.alpha if lora.alpha is not None else lora.rank) / lora.rank
    merged = {k: v for k, v in state["model"].items() if ".lora_" not in k}
    for arch in ("dense_arch", "over_arch"):
        i = 0
        while f"{arch}.mlp.lora_a.{i}" in state["model"]:
            a, b = state["model"][f"{arch}.mlp.lora_a.{i}"], state["model"][f"{arch}.mlp.lora_b.{i}"]
            key = f"{arch}.mlp.layers.{i}.weight"
            merged[key] = (merged[key].float() + scale * (b.float() @ a.float())).to(merged[key].dtype)
            i += 1
    plain = replace(cfg, "model", lora=LoraConfig())
    model = model_from_checkpoint(plain.model, state["table_rows"], merged)
    # A fresh dense optimizer state: the merged weights had none of their own. The tables' fused update
    # states stay those of `checkpoint`.
    dense = RunOptimizer(model, plain.train).dense
    written = {k: v for k, v in state.items() if k not in ("model", "config", "optimizer", "loader")}
    written.update(
        model=model.state_dict(), config=plain.to_dict(), optimizer=dense.state_dict(), loader=None
    )
    save_checkpoint(output, **written)
    return written


@command
@path_option("--checkpoint", required=True, help="A run's best.pt or last.pt.")
@path_option(
    "--config", "config_path", help="Run config of the fine-tuning (data, train); default: the checkpoint's."
)
@set_option
@click.option("--lora-rank", type=click.IntRange(1, 128), default=None, help="Adapter rank r.")
@click.option("--lora-alpha", type=float, default=None, help="Scale numerator: adapters add (alpha / r) B A.")
@click.option("--freeze-embeddings", is_flag=True, help="Keep the embedding tables fixed too.")
@click.option("--merge", is_flag=True, help="Fold a fine-tuned CHECKPOINT's adapters into W; write --output.")
@path_option("--output", help="With --merge: the file to write.")
@path_option("--output-dir", help="The fine-tuning run's dir.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None, help="Overrides train.max_steps.")
@click.option(
    "--use-triton/--no-use-triton",
    default=None,
    help="Our Triton kernels (the fused LoRA layer among them) [default: the config's].",
)
@click.option("--device", type=click.Choice(DEVICES), default=None)
def main(
    checkpoint, config_path, overrides, lora_rank, lora_alpha, freeze_embeddings, merge, output, output_dir,
    max_steps, use_triton, device,
):  # fmt: skip
    """Fine-tune CHECKPOINT with LoRA adapters, or (--merge) fold a fine-tuned checkpoint's adapters in."""
    with cli_errors():  # bad input: one line, exit 2 (dlrm/errors.py)
        if merge:
            if overrides:
                raise ValueError("--set: not with --merge (it writes the fine-tuned run's own config)")
            if output is None:
                raise ValueError("--merge needs --output FILE")
            check_output_file(output, "--output", [checkpoint])
            merge_checkpoint(checkpoint, output)
            click.echo(f"wrote {output}")
            return
        if lora_rank is None:
            raise ValueError("--lora-rank is required to fine-tune (or give --merge)")
        config = load_config(config_path) if config_path is not None else None
        cfg = finetune_config(checkpoint, config, lora_rank, lora_alpha, freeze_embeddings, overrides)
        flags = {"max_steps": max_steps, "device": device, "use_triton": use_triton}
        cfg = replace(cfg, "train", **{k: v for k, v in flags.items() if v is not None})
        train(cfg, output_dir)


if __name__ == "__main__":
    main()
