"""Where a run's bags come from: the data's own columns (written by `python -m dlrm.data.multi_hot`) or
made on the fly by the loaders (`data.multi_hot`), checked against the model's `model.multi_hot_sizes`."""

from pathlib import Path

from dlrm.config import RunConfig
from dlrm.data.bags import BagMaker, id_ranges, is_one_hot
from dlrm.data.output import load_metadata


def data_bag_sizes(metadata: dict) -> tuple[int, ...] | None:
    """The bag sizes of a data directory's rows (its metadata's "multi_hot"), None for one-hot data."""
    bags = metadata.get("multi_hot")
    return None if bags is None else tuple(bags["sizes"])


def loader_bags(cfg: RunConfig, data_dir: Path | str) -> BagMaker | None:
    """The loaders' `bags` for `data_dir` under `cfg`: a BagMaker when `data.multi_hot` makes bags on the
    fly, else None (the ids as read: one-hot, or the data's own bags).

    Raises:
        ValueError: the data's bags and `model.multi_hot_sizes` differ, or `data.multi_hot` asks for bags
            of data that holds bags already (naming the key and metadata.json).
    """
    source = Path(data_dir) / "metadata.json"
    metadata = load_metadata(data_dir)
    model_sizes, made = cfg.model.multi_hot_sizes, cfg.data.multi_hot
    data_sizes = data_bag_sizes(metadata)
    if made.distribution is not None:
        if not is_one_hot(data_sizes):
            raise ValueError(
                f"data.multi_hot: {source} holds bags already (sizes {list(data_sizes)}); set "
                "data.multi_hot.distribution null to read them"
            )
        return BagMaker(model_sizes, id_ranges(metadata, str(source)), made.distribution, made.seed)
    if is_one_hot(model_sizes) != is_one_hot(data_sizes) or (
        not is_one_hot(model_sizes) and tuple(model_sizes) != data_sizes
    ):
        found = "one id per feature" if is_one_hot(data_sizes) else f"bags of sizes {list(data_sizes)}"
        raise ValueError(
            f"model.multi_hot_sizes: {list(model_sizes) if model_sizes else None}, but {source} holds "
            f"{found}; set it to match, or make bags on the fly with data.multi_hot"
        )
    return None
