"""GPU-resident loader: the whole split in device memory, shuffled by a device permutation per epoch, each
batch one device gather (or slice): no host work per step beyond launching those kernels.

Letters: B batch, N rows of the split; 13 dense features (N_dense), 26 sparse features (F).

    loader = ResidentLoader(open_split("data/criteo_kaggle", "train"), batch_size=65536, shuffle=True,
                            device=torch.device("cuda"))
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:                                   # Batch(dense, sparse, label) on the device
            ...

The split costs N * 264 bytes of device memory (dense 13 x 4, sparse 26 x 8, label 4), plus N * 8 for the
permutation; use the streaming loader (dlrm.data.streaming) for splits that do not fit.
"""

import math

import torch
from torch import Tensor

from dlrm.data.dataset import BatchLoader, ParquetDataset

# Bytes per row of the epoch's permutation (int64), on the device beside the split's tensors.
_PERMUTATION_BYTES = 8


def row_bytes(dataset: ParquetDataset) -> int:
    """Device bytes per row of `dataset` once resident: its dense, sparse and label values as they are
    held (264 for float32 dense, int64 sparse, float32 labels) plus the permutation's entry."""
    tensors = (dataset.dense, dataset.sparse, dataset.label)
    return sum(t.element_size() * math.prod(t.shape[1:]) for t in tensors) + _PERMUTATION_BYTES


class ResidentLoader(BatchLoader):
    """Iterates a dataset held in device memory in mini-batches of `batch_size` rows: a BatchLoader whose
    rows are copied to `device` once and whose epoch order is drawn on the device.

    Args:
        dataset: the rows (a ParquetDataset); its tensors are copied to `device` once.
        batch_size: rows per batch (B); the last batch is smaller unless `drop_last`.
        shuffle: visit rows in the order of `torch.randperm` on the device, from a device generator seeded
            with seed + epoch (see `set_epoch`): deterministic for a seed, epoch and device type.
        seed: base seed of the shuffle.
        drop_last: leave out the last batch if it has fewer than `batch_size` rows.
        device: where the split lives and batches are delivered.
        rank, world_size: this rank's part of each global batch of `batch_size` rows (as BatchLoader).
        bags: bags made from each batch's one-hot ids (as BatchLoader).
    Batches: Batch(dense [B, 13] float32, sparse [B, 26] int64, label [B] float32) on `device`; without
    shuffling they are views of the resident tensors: do not modify them in place.
    Raises:
        ValueError: batch_size < 1, or the split does not fit in the GPU's free memory.
    """

    def place(self, dataset: ParquetDataset, device: torch.device) -> ParquetDataset:
        """`dataset` copied to `device` once (BatchLoader's constructor calls it).

        Raises:
            ValueError: the split does not fit in the GPU's free memory.
        """
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            needed = dataset.num_rows * row_bytes(dataset)
            if needed > free:
                raise ValueError(
                    f"the split ({dataset.num_rows} rows, {needed / 2**30:.1f} GiB) does not fit in the "
                    f"{free / 2**30:.1f} GiB free on {device}: use the streaming loader"
                )
        return dataset.to(device)

    def permutation(self) -> Tensor:
        """[N] int64 row order of the current epoch, drawn on the device (no host work, no copy)."""
        generator = torch.Generator(device=self.device).manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_rows, generator=generator, device=self.device)
