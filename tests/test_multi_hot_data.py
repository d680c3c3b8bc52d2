"""Multi-hot data on the CPU: the bags (dlrm.data.bags), the tool (dlrm.data.multi_hot), bags on the fly in
the loaders (data.multi_hot) and the parquet and binary round trips with exact resume."""

import json

import pytest
import torch
from click.testing import CliRunner

from dlrm.config import from_dict, validate
from dlrm.data import multi_hot as multi_hot_cli
from dlrm.data.bag_source import loader_bags
from dlrm.data.bags import MLPERF_SIZES, BagMaker, bag_starts, id_ranges, make_bags
from dlrm.data.binary import binary_dir, write_binary
from dlrm.data.binary_loader import BinaryLoader
from dlrm.data.dataset import BatchLoader, open_split, split_paths
from dlrm.data.output import load_metadata
from dlrm.data.streaming import StreamingLoader

SIZES = (3, 1, 2, 1, 5, *([1] * 20), 4)  # small bags: fast, and every kind of feature


@pytest.fixture(scope="module")
def bagged(criteo_sample, tmp_path_factory):
    """The sample written with pareto bags of SIZES (seed 3) by the tool, and its binary splits."""
    out = tmp_path_factory.mktemp("multi_hot") / "bagged"
    multi_hot_cli.write_multi_hot(criteo_sample, out, SIZES, "pareto", 3)
    write_binary(out, ["train"])
    return out


def one_hot_ids(n: int = 2000) -> torch.Tensor:
    ids = torch.randint(-1, 2**32, (n, 26), generator=torch.Generator().manual_seed(0))
    ids[:10] = ids[10:20]  # repeated ids
    return ids


@pytest.mark.parametrize("distribution", ["uniform", "pareto"])
def test_bags_hold_the_id_then_draws_fixed_per_id_and_seed(distribution):
    ids = one_hot_ids()
    ranges = [7 + f for f in range(26)]
    bags = make_bags(ids, MLPERF_SIZES, ranges, distribution, seed=0)
    assert bags.shape == (len(ids), sum(MLPERF_SIZES)) and bags.dtype == torch.int64
    starts = bag_starts(MLPERF_SIZES)
    assert torch.equal(bags[:, starts], ids)
    for f, (start, k) in enumerate(zip(starts, MLPERF_SIZES, strict=True)):
        drawn = bags[:, start + 1 : start + k]
        assert drawn.numel() == 0 or (drawn.min() >= 0 and drawn.max() < ranges[f])
    assert torch.equal(bags[:10], bags[10:20])  # the same id, the same bag
    assert torch.equal(make_bags(ids, MLPERF_SIZES, ranges, distribution, seed=0), bags)
    assert not torch.equal(make_bags(ids, MLPERF_SIZES, ranges, distribution, seed=1), bags)
    one_hot = [1] * 26
    assert make_bags(ids, one_hot, ranges, distribution, 0) is ids  # no copy for one-hot sizes


def test_pareto_draws_are_skewed_like_the_references():
    ids = torch.arange(20_000).reshape(-1, 1).expand(-1, 26).contiguous()
    bags = make_bags(ids, [2] * 26, [10**6] * 26, "pareto", 0)
    zero = (bags[:, 1::2] == 0).double().mean().item()
    # numpy's pareto(a=0.25) floors to 0 with probability 1 - 2^-0.25 = 0.159.
    assert abs(zero - (1 - 2**-0.25)) < 0.01
    uniform = make_bags(ids, [2] * 26, [10**6] * 26, "uniform", 0)[:, 1::2].double()
    assert abs(uniform.mean().item() / 10**6 - 0.5) < 0.01


def test_bad_bag_arguments_raise_one_line():
    ids = one_hot_ids(20)
    with pytest.raises(ValueError, match="sizes: expected 26 integers >= 1"):
        make_bags(ids, [2] * 25, [9] * 26, "uniform", 0)
    with pytest.raises(ValueError, match="unknown bag distribution 'zipf'"):
        make_bags(ids, [2] * 26, [9] * 26, "zipf", 0)


def test_tool_and_on_the_fly_bags_are_the_same_in_every_loader(criteo_sample, bagged):
    metadata = load_metadata(bagged)
    assert metadata["multi_hot"] == {"sizes": list(SIZES), "distribution": "pareto", "seed": 3}
    maker = BagMaker(SIZES, id_ranges(load_metadata(criteo_sample)), "pareto", 3)
    written = open_split(bagged, "val")
    assert written.sparse.shape == (1000, sum(SIZES))
    one_hot = open_split(criteo_sample, "val")
    assert torch.equal(written.sparse, maker(one_hot.sparse))
    assert torch.equal(written.dense, one_hot.dense) and torch.equal(written.label, one_hot.label)
    on_the_fly = torch.cat([b.sparse for b in BatchLoader(one_hot, 300, bags=maker)])
    assert torch.equal(on_the_fly, written.sparse)
    streamed = StreamingLoader(split_paths(criteo_sample, "val"), 300, bags=maker)
    assert torch.equal(torch.cat([b.sparse for b in streamed]), written.sparse)


def test_binary_split_of_bags_reads_back_and_resumes_exactly(criteo_sample, bagged):
    parquet = open_split(bagged, "train")
    settings = {"batch_size": 256, "window_rows": 1024, "chunk_rows": 512}
    whole = list(BinaryLoader(binary_dir(bagged, "train"), **settings))
    assert torch.equal(torch.cat([b.sparse for b in whole]), parquet.sparse)
    shuffled = {"shuffle": True, "seed": 5, **settings}
    epoch = [b.sparse for b in BinaryLoader(binary_dir(bagged, "train"), **shuffled)]
    first = BinaryLoader(binary_dir(bagged, "train"), **shuffled)
    iterator = iter(first)
    for _ in range(5):  # into the second window
        next(iterator)
    resumed = BinaryLoader(binary_dir(bagged, "train"), **shuffled)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    rest = [b.sparse for b in resumed]
    assert len(rest) == len(epoch) - 5
    assert all(torch.equal(a, b) for a, b in zip(rest, epoch[5:], strict=True))
    # The one-hot binary split with bags made on the fly: the same batches as the written bags.
    write_binary(criteo_sample, ["train"])
    maker = BagMaker(SIZES, id_ranges(load_metadata(criteo_sample)), "pareto", 3)
    fly = [b.sparse for b in BinaryLoader(binary_dir(criteo_sample, "train"), bags=maker, **shuffled)]
    assert all(torch.equal(a, b) for a, b in zip(fly, epoch, strict=True))


def test_the_run_checks_the_datas_bags_against_the_model(criteo_sample, bagged):
    def cfg(**model):
        return validate(from_dict({"model": model}))

    assert loader_bags(cfg(multi_hot_sizes=list(SIZES)), bagged) is None  # read as written
    assert loader_bags(cfg(), criteo_sample) is None
    with pytest.raises(ValueError, match=r"model.multi_hot_sizes: None, but .*metadata.json holds bags"):
        loader_bags(cfg(), bagged)
    with pytest.raises(ValueError, match="holds one id per feature"):
        loader_bags(cfg(multi_hot_sizes=list(SIZES)), criteo_sample)
    fly = validate(
        from_dict(
            {"model": {"multi_hot_sizes": list(SIZES)}, "data": {"multi_hot": {"distribution": "uniform"}}}
        )
    )
    assert isinstance(loader_bags(fly, criteo_sample), BagMaker)
    with pytest.raises(ValueError, match="data.multi_hot: .* holds bags already"):
        loader_bags(fly, bagged)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"model": {"pooling": "max"}}, "model.pooling: expected one of"),
        ({"model": {"multi_hot_sizes": [0] * 26}}, "model.multi_hot_sizes: expected 26 integers >= 1"),
        ({"data": {"multi_hot": {"distribution": "pareto"}}}, "model.multi_hot_sizes: expected bag sizes"),
        ({"model": {"multi_hot_sizes": [2] * 26, "first_order": True}}, "model.first_order: expected False"),
        ({"model": {"multi_hot_sizes": [2] * 26, "interaction": "attention"}}, "model.interaction"),
    ],
)
def test_config_refuses_bad_multi_hot_settings(raw, message):
    with pytest.raises(ValueError, match=message):
        validate(from_dict(raw))


def test_cli_writes_atomically_and_reports_bad_input(criteo_sample, bagged, tmp_path):
    runner = CliRunner()
    out = tmp_path / "out"
    args = ["--data", str(criteo_sample), "--output-dir", str(out), "--sizes", ",".join(map(str, SIZES))]
    result = runner.invoke(multi_hot_cli.main, [*args, "--distribution", "pareto", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert torch.equal(open_split(out, "test").sparse, open_split(bagged, "test").sparse)
    assert not list(tmp_path.glob(".out.tmp-*"))  # the temporary directory is gone
    for bad, message in (
        (["--data", str(bagged), "--output-dir", str(tmp_path / "x")], "holds bags already"),
        ([*args[:4], "--sizes", "1,2"], "--sizes: expected 26 integers"),
        (["--data", str(tmp_path / "none"), "--output-dir", str(tmp_path / "y")], "metadata.json not found"),
    ):
        result = runner.invoke(multi_hot_cli.main, bad)
        assert result.exit_code == 2 and message in result.output, result.output
        assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_streaming_parquet_bags_resume_exactly(bagged):
    """The written parquet bags through the streaming loader: the rows read back, and a resume mid-epoch
    gives the rest of the uninterrupted epoch."""
    settings = {"batch_size": 300, "shuffle": True, "seed": 2, "shuffle_buffer": 1000}
    epoch = [b.sparse for b in StreamingLoader(split_paths(bagged, "train"), **settings)]
    assert torch.equal(torch.cat(epoch).sort(0).values, open_split(bagged, "train").sparse.sort(0).values)
    first = StreamingLoader(split_paths(bagged, "train"), **settings)
    iterator = iter(first)
    for _ in range(7):
        next(iterator)
    resumed = StreamingLoader(split_paths(bagged, "train"), **settings)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    rest = [b.sparse for b in resumed]
    assert len(rest) == len(epoch) - 7
    assert all(torch.equal(a, b) for a, b in zip(rest, epoch[7:], strict=True))
