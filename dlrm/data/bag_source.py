"""Where a run's bags come from: the data's own columns (written by `python -m dlrm.data.multi_hot`) or
made on the fly by the loaders (`data.multi_hot`), checked against the model's `model.multi_hot_sizes`;
and, for scoring a trained run (dlrm.evaluate, dlrm.predict), the same bags from either kind of input
(`RunBags`)."""

from pathlib import Path

from loguru import logger
from torch import Tensor

from dlrm.config import RunConfig
from dlrm.data.bags import BagMaker, id_ranges, is_one_hot
from dlrm.data.output import load_metadata
from dlrm.data.schema import NUM_SPARSE


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


def scoring_bags(cfg: RunConfig, data_dir: Path | str) -> "RunBags":
    """The RunBags that score the model of `cfg` on a data directory (dlrm.evaluate, dlrm.predict), its
    ids checked first against the model: one-hot data (bags made as the run made them, over the data's
    id ranges), or bags of `model.multi_hot_sizes`, read as written. Unlike training, data that holds bags
    is read under a run that made its bags on the fly (`data.multi_hot`) too: `python -m
    dlrm.data.multi_hot` writes the bags that `data.multi_hot` makes; a warning says so when the data's bags
    were drawn otherwise (another distribution or seed).

    Raises:
        ValueError: the data holds bags that the model does not take (naming metadata.json and the sizes),
            or one id per feature for a model that read bags written in its data (no `data.multi_hot`).
        FileNotFoundError: no metadata.json.
    """
    source = Path(data_dir) / "metadata.json"
    metadata = load_metadata(data_dir)
    bags = RunBags(cfg, data_dir)
    data_sizes = data_bag_sizes(metadata)
    if is_one_hot(data_sizes):
        if bags.sizes is not None:
            bags.bag_maker()  # the id ranges and data.multi_hot, checked before any batch
        return bags
    model_sizes, made = cfg.model.multi_hot_sizes, cfg.data.multi_hot
    if bags.sizes != data_sizes:
        raise ValueError(
            f"model.multi_hot_sizes: {list(model_sizes) if model_sizes else None}, but {source} holds bags "
            f"of sizes {list(data_sizes)}: give the run's data, one-hot or with bags of the model's sizes"
        )
    written = metadata["multi_hot"]
    drawn = (written.get("distribution"), written.get("seed"))
    if made.distribution is not None and drawn != (made.distribution, made.seed):
        logger.warning(
            "{}: bags drawn with distribution {} seed {}, the run made its bags with {} seed {} "
            "(data.multi_hot): scoring on other bags than the run's",
            source,
            *drawn,
            made.distribution,
            made.seed,
        )
    return bags


class RunBags:
    """The ids that the model of a run takes, from the ids that an input holds, for scoring (dlrm.evaluate,
    dlrm.predict): a callable [n, C] int64 -> [n, S] int64 on the ids' device (S = the sum of
    `model.multi_hot_sizes`, F = 26 for a one-hot model).

    - Ids in the model's layout pass as they are: one-hot ids [n, F] of a one-hot model, or bags [n, S]
      (read from data written by `python -m dlrm.data.multi_hot` or `dlrm.data.synthetic --multi-hot`).
    - One-hot ids [n, F] of a multi-hot model get the bags the run made on the fly (`data.multi_hot`: its
      distribution and seed, over the id ranges of the train cardinalities in `ranges_dir`/metadata.json,
      read at the first such batch): the bags it trained and evaluated on.

    Args:
        cfg: the run's config.
        ranges_dir: the data directory whose metadata.json holds the id ranges: the data being scored
            when it has one, else the run's own `data.path`.
    Raises (when called):
        ValueError: ids in neither layout; one-hot ids of a run that read bags written in its data (no
            `data.multi_hot`); FileNotFoundError: no metadata.json in `ranges_dir`.
    """

    def __init__(self, cfg: RunConfig, ranges_dir: Path | str) -> None:
        sizes = cfg.model.multi_hot_sizes
        self.sizes = None if is_one_hot(sizes) else tuple(sizes)
        self.columns = NUM_SPARSE if self.sizes is None else sum(self.sizes)
        self.made, self.ranges_dir, self.data_path = cfg.data.multi_hot, Path(ranges_dir), cfg.data.path
        self.maker: BagMaker | None = None

    def __call__(self, sparse: Tensor) -> Tensor:
        if sparse.shape[1] == self.columns:
            return sparse
        if self.sizes is None:
            raise ValueError(
                f"the model takes one id per feature [B, {NUM_SPARSE}] (model.multi_hot_sizes unset), got "
                f"bags {list(sparse.shape)}: give one-hot data"
            )
        if sparse.shape[1] != NUM_SPARSE:
            raise ValueError(
                f"expected one-hot ids [B, {NUM_SPARSE}] or bags [B, {self.columns}] (model.multi_hot_sizes "
                f"{list(self.sizes)}), got {list(sparse.shape)}"
            )
        return self.bag_maker()(sparse)

    def bag_maker(self) -> BagMaker:
        """The BagMaker of the run's `data.multi_hot` over the id ranges of `ranges_dir`."""
        if self.maker is None:
            if self.made.distribution is None:
                raise ValueError(
                    f"the run read bags written in its data ({self.data_path}; data.multi_hot unset), and "
                    f"the input holds one id per feature: give bags of sizes {list(self.sizes)} (python -m "
                    "dlrm.data.multi_hot --sizes ... with the distribution and seed of the run's data)"
                )
            source = self.ranges_dir / "metadata.json"
            ranges = id_ranges(load_metadata(self.ranges_dir), str(source))
            self.maker = BagMaker(self.sizes, ranges, self.made.distribution, self.made.seed)
        return self.maker
