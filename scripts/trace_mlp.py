"""List the GPU kernels one training step of the bottom MLP launches, per MLP kernel choice.

    python scripts/trace_mlp.py [--config kaggle] [--batch 16384] [--trace-dir DIR]

Profiles forward + backward of the config's DenseArch (bottom MLP) at batch B with torch.profiler and prints
the CUDA kernels in launch order for each of "torch", "bias_act" and "linear_act". With linear_act the
forward is one fused launch per layer with no elementwise kernel in between. With --trace-dir the
Chrome traces (*.json, open in Perfetto) are written there.
"""

from pathlib import Path

import click
import torch
from torch.profiler import ProfilerActivity, profile

from dlrm.choices import MLP_KERNELS
from dlrm.config import ModelConfig, load_config
from dlrm.data.schema import NUM_DENSE
from dlrm.model.dlrm import DenseArch

CONFIG_DIR = Path(__file__).parents[1] / "configs"


def kernels_of_step(kernel: str, cfg: ModelConfig, batch: int, trace: Path | None) -> list[str]:
    """CUDA kernel names of one forward + backward of DenseArch(cfg) using MLP kernel `kernel`."""
    torch.manual_seed(0)
    arch = DenseArch(cfg, kernel).cuda()
    x = torch.rand(batch, NUM_DENSE, device="cuda")
    for _ in range(3):  # warm-up: JIT and autotuning stay out of the profile
        arch(x).sum().backward()
    arch.zero_grad(set_to_none=True)  # as the training loop does: no gradient accumulation kernels
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        arch(x).sum().backward()
        torch.cuda.synchronize()
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace / f"bottom_mlp_{kernel}.json"))
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)  # fmt: skip
    return [e.name for e in events]


@click.command(context_settings={"show_default": True})
@click.option("--config", default="kaggle", help="Name of a configs/*.json file.")
@click.option("--batch", type=click.IntRange(min=1), default=16384)
@click.option("--trace-dir", type=click.Path(path_type=Path), default=None)
def main(config, batch, trace_dir):
    """Print the GPU kernels of one bottom-MLP training step per MLP kernel choice."""
    if not torch.cuda.is_available():
        raise click.UsageError("trace_mlp.py needs a CUDA GPU")
    cfg = load_config(CONFIG_DIR / f"{config}.json").model
    widths = cfg.bottom_mlp
    for kernel in MLP_KERNELS:
        names = kernels_of_step(kernel, cfg, batch, trace_dir)
        print(f"\n{kernel}: {len(names)} kernels, bottom MLP 13-{'-'.join(map(str, widths))}, B={batch}")
        for name in names:
            print(f"  {name[:110]}")


if __name__ == "__main__":
    main()
