"""The train split's loader, as the config's `data.loader` selects it (dlrm.config_sections.DataConfig)."""

from pathlib import Path

import torch

from dlrm.config import DataConfig
from dlrm.data.bags import BagMaker
from dlrm.data.binary import binary_dir
from dlrm.data.binary_loader import BinaryLoader
from dlrm.data.dataset import BatchLoader, ParquetDataset, open_split, split_paths
from dlrm.data.resident import ResidentLoader
from dlrm.data.streaming import StreamingLoader

TrainLoader = BatchLoader | ResidentLoader | StreamingLoader | BinaryLoader
# Loaders that read the split themselves and keep their position in a state_dict (checkpointed).
STATEFUL_LOADERS = (StreamingLoader, BinaryLoader)


def make_train_loader(
    cfg: DataConfig,
    data_dir: Path,
    seed: int,
    device: torch.device,
    train_set: ParquetDataset | None = None,
    rank: int = 0,
    world_size: int = 1,
    bags: BagMaker | None = None,
) -> TrainLoader:
    """The loader of `data_dir`'s train split per `cfg`: "memory" -> BatchLoader, "gpu_resident" ->
    ResidentLoader, "streaming" -> StreamingLoader, "binary" -> BinaryLoader.

    Args:
        train_set: the split already in memory, for "memory" and "gpu_resident" (read here when None);
            "streaming" and "binary" read their files themselves.
        rank, world_size: this process's part of the data (W = world_size processes, dlrm.parallel).
            `cfg.batch_size` is the global batch B; each rank's batches have B / W rows. "memory" and
            "gpu_resident": every rank draws the same epoch order and takes its B / W rows of each
            global batch; "streaming" and "binary": each rank reads a disjoint part of the rows, in
            batches of B / W.
        bags: bags made on the fly from each batch's one-hot ids (dlrm.data.bag_source.loader_bags).
    Raises:
        FileNotFoundError, ValueError: as dlrm.data.dataset.open_split / split_paths, and from the loaders
            (W must divide the batch: dlrm.parallel.run.check_world says so first, naming the key).
    """
    # The loaders that read their files themselves take this rank's share of the global batch.
    streamed = {
        "rank": rank,
        "world_size": world_size,
        "shuffle": cfg.shuffle,
        "seed": seed,
        "drop_last": cfg.drop_last,
        "device": device,
        "bags": bags,
    }
    if cfg.loader == "streaming":
        return StreamingLoader(
            split_paths(data_dir, "train"),
            cfg.batch_size // world_size,
            shuffle_buffer=cfg.shuffle_buffer,
            prefetch=cfg.prefetch,
            **streamed,
        )
    if cfg.loader == "binary":
        return BinaryLoader(
            binary_dir(data_dir, "train"),
            cfg.batch_size // world_size,
            window_rows=cfg.shuffle_buffer,
            **streamed,
        )
    train_set = train_set if train_set is not None else open_split(data_dir, "train")
    loader = ResidentLoader if cfg.loader == "gpu_resident" else BatchLoader
    return loader(
        train_set,
        cfg.batch_size,
        shuffle=cfg.shuffle,
        seed=seed,
        drop_last=cfg.drop_last,
        device=device,
        rank=rank,
        world_size=world_size,
        bags=bags,
    )
