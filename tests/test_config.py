"""Config loading: shipped configs load, and bad keys or values name the key."""

import json
from pathlib import Path

import pytest

from dlrm.config import LrScheduleConfig, RunConfig, apply_overrides, from_dict, load_config

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig) and cfg.name == path.stem


def test_main_config_is_the_fb_dlrm_kaggle_architecture():
    m = load_config(Path(__file__).parents[1] / "configs" / "main.json").model
    assert (m.embedding_dim, m.bottom_mlp, m.top_mlp) == (16, (512, 256, 64, 16), (512, 256, 1))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"modle": {}}, "modle: unknown key"),
        ({"model": {"embeding_dim": 4}}, "model.embeding_dim: unknown key"),
        ({"model": {"embedding_dim": 0, "bottom_mlp": [0]}}, "model.embedding_dim"),
        (
            {"model": {"embedding_dim": 8}},
            r"model.bottom_mlp: expected a last width equal to model.embedding_dim",
        ),
        ({"model": {"top_mlp": [64, 2]}}, "model.top_mlp: expected a last width of 1"),
        ({"model": {"hashing": "md5"}}, "model.hashing: expected one of"),
        (
            {"model": {"mlp_block": "ln"}},
            r"model.mlp_block: expected one of \('linear_act', 'ln_linear_gelu'",
        ),
        ({"model": {"gate": "glu"}}, r"model.gate: expected one of \('sigmoid_tanh', 'geglu', 'swiglu'\)"),
        (
            {"model": {"interaction": "self"}},
            r"model.interaction: expected one of \('dot', 'cat', 'attention', 'dcn'\)",
        ),
        ({"model": {"dcn": {"low_rank": 0}}}, "model.dcn.low_rank: expected a positive integer"),
        ({"model": {"dcn": {"layers": 0}}}, "model.dcn.layers: expected a positive integer"),
        (  # tiny.json's width: 27 vectors of D = 8; a rank of the width or more is no low-rank layer
            {
                "model": {
                    "embedding_dim": 8,
                    "bottom_mlp": [8],
                    "interaction": "dcn",
                    "dcn": {"low_rank": 216},
                }
            },
            r"^model.dcn.low_rank: expected an integer below the cross network's width 216 \(27 vectors x "
            r"model.embedding_dim 8\), got 216$",
        ),
        (
            {"model": {"multi_hot_sizes": [1] * 20 + [10**9] + [1] * 5}},
            "^model.multi_hot_sizes: expected bags of at most 65,536 ids, got 1,000,000,000 for C21$",
        ),
        (  # every bag at the maximum: a batch of 128 holds 218M ids, an eval batch of 4,096 too many
            {"model": {"multi_hot_sizes": [65536] * 26}},
            r"^model.multi_hot_sizes: expected at most 2,147,483,647 ids a batch, got "
            r"data.eval_batch_size 4,096 x 1,703,936 ids a sample = 6,979,321,856 \(lower "
            r"data.eval_batch_size or the bag sizes\)$",
        ),
        ({"model": {"attention": {"head": 2}}}, "model.attention.head: unknown key"),
        ({"model": {"attention": {"dim": 0}}}, r"model.attention.dim: expected an integer in 1..256"),
        ({"model": {"attention": {"layers": 0}}}, "model.attention.layers: expected a positive integer"),
        ({"model": {"attention": [2]}}, "model.attention: expected a JSON object"),
        ({"model": {"lora": {"rank": 200}}}, r"model.lora.rank: expected an integer in 0..128"),
        (
            {"model": {"lora": {"rank": 2, "alpha": 0}}},
            "model.lora.alpha: expected a positive number or null",
        ),
        ({"model": {"lora": {"base": "x.pt"}}}, "model.lora.base: expected null without adapters"),
        (
            {"model": {"lora": {"rank": 2}, "mlp_block": "gated"}},
            "model.mlp_block: expected 'linear_act' with",
        ),
        ({"model": {"table_rows": [10, 10]}}, "model.table_rows"),
        ({"train": {"lr": "fast"}}, "train.lr: expected a number"),
        ({"train": {"optimizer": "adam"}}, "train.optimizer"),
        ({"train": {"select_on": "ne"}}, r"train.select_on: expected one of \('logloss', 'auc'\), got 'ne'"),
        ({"train": {"epochs": 1.5}}, "train.epochs: expected an integer"),
        ({"data": {"shuffle": "yes"}}, "data.shuffle: expected true or false"),
        ({"data": []}, "data: expected a JSON object"),
        (
            {"data": {"loader": "disk"}},
            r"data.loader: expected one of \('memory', 'gpu_resident', 'streaming', 'binary'\)",
        ),
        ({"data": {"shuffle_buffer": -1}}, r"data.shuffle_buffer: expected an integer >= 0 \(rows\), got -1"),
        ({"data": {"shuffle_buffer": 1.5}}, "data.shuffle_buffer: expected an integer"),
        (
            {"data": {"loader": "binary", "shuffle_buffer": 0}, "model": {"hashing": "modulus"}},
            r'data.shuffle_buffer: expected an integer >= 1 with data.loader "binary" \(the rows of a '
            r"window\), got 0",
        ),
        ({"data": {"prefetch": -2}}, r"data.prefetch: expected an integer >= 0 \(batches\), got -2"),
        (
            {"data": {"loader": "streaming"}, "model": {"hashing": "vocab"}},
            r"data.loader: expected 'memory' or 'gpu_resident' with model.hashing 'vocab' \(or set "
            r"model.hashing 'modulus'\), got 'streaming'",
        ),
        (
            {"train": {"compile_mode": "max-autotune"}},
            r"train.compile_mode: expected one of \('auto', 'default'",
        ),
        (
            {"train": {"use_triton": True, "cuda_graphs": True, "compile_mode": "reduce-overhead"}},
            "train.compile_mode: expected 'auto' or 'default' with train.cuda_graphs, got 'reduce-overhead'",
        ),
        ({"profiler": {"active": 0}}, "profiler.active"),
        ({"train": {"lr_schedule": {"warmup": 5}}}, "train.lr_schedule.warmup: unknown key"),
        ({"train": {"lr_schedule": 5}}, "train.lr_schedule: expected a JSON object"),
        (
            {"train": {"lr_schedule": {"warmup_steps": -1}}},
            r"train.lr_schedule.warmup_steps: expected an integer >= 0 \(0: no warm-up\), got -1",
        ),
        (
            {"train": {"lr_schedule": {"warmup_steps": 2.5}}},
            "train.lr_schedule.warmup_steps: expected an integer",
        ),
        (
            {"train": {"lr_schedule": {"decay_steps": -3}}},
            "train.lr_schedule.decay_steps: expected an integer >= 0",
        ),
        (
            {"train": {"lr_schedule": {"decay_steps": 10}}},
            "train.lr_schedule.decay_start_step: expected the step where the 10 decay steps start, got None",
        ),
        (
            {"train": {"lr_schedule": {"warmup_steps": 100, "decay_start_step": 50, "decay_steps": 10}}},
            r"train.lr_schedule.decay_start_step: expected an integer >= warmup_steps "
            r"\(100\) or null, got 50",
        ),
        (
            {"train": {"lr_schedule": {"decay_start_step": 50}}},
            "train.lr_schedule.decay_steps: expected a positive integer with decay_start_step set, got 0",
        ),
        ({"model": {"arch": "wide"}}, r"model.arch: expected one of \('dlrm', 'logistic'\), got 'wide'"),
        ({"model": {"first_order": "yes"}}, "model.first_order: expected true or false"),
        (
            {"model": {"arch": "logistic", "embedding_dim": 8}},
            "model.embedding_dim: expected its default 16 with model.arch 'logistic'",
        ),
        ({"model": {"arch": "logistic", "interaction": "cat"}}, "model.interaction: expected its default"),
        ({"model": {"arch": "logistic", "lora": {"rank": 4}}}, "model.lora.rank: expected its default 0"),
        ({"model": {"arch": "logistic", "attention": {"heads": 4}}}, "model.attention.heads: expected its"),
        (
            {"model": {"arch": "logistic"}, "train": {"triton_mlp_kernel": "bias_act"}},
            "train.triton_mlp_kernel: expected its default 'linear_act' with model.arch 'logistic'",
        ),
        (
            {"model": {"arch": "logistic"}, "train": {"precision": "bf16"}},
            "train.precision: expected 'fp32' or 'tf32' with model.arch 'logistic'",
        ),
    ],
)
def test_bad_values_name_the_key(raw, message):
    with pytest.raises(ValueError, match=message):
        from_dict(raw)


def test_a_dcn_rank_below_the_width_and_bags_of_the_maximum_size_load():
    model = {"embedding_dim": 8, "bottom_mlp": [8], "interaction": "dcn", "dcn": {"low_rank": 215}}
    assert from_dict({"model": model}).model.dcn.low_rank == 215
    bags = {"model": {"multi_hot_sizes": [65536] + [1] * 25}, "data": {"eval_batch_size": 4096}}
    assert from_dict(bags).model.multi_hot_sizes[0] == 65536


def test_load_config_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train": {"seed": "x"}}))
    with pytest.raises(ValueError, match=r"bad.json: train.seed"):
        load_config(bad)
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "name": }')
    with pytest.raises(ValueError, match=r"broken.json: invalid JSON at line 2"):
        load_config(broken)
    with pytest.raises(ValueError, match="not found"):
        load_config(tmp_path / "missing.json")


def test_lr_schedule_defaults_to_constant_and_loads():
    assert RunConfig().train.lr_schedule == LrScheduleConfig(0, None, 0)
    raw = {"warmup_steps": 10, "decay_start_step": 30, "decay_steps": 20}
    assert from_dict({"train": {"lr_schedule": raw}}).train.lr_schedule == LrScheduleConfig(10, 30, 20)
    # The warm-up may end where the decay starts (MLPerf allows it too).
    from_dict({"train": {"lr_schedule": {"warmup_steps": 10, "decay_start_step": 10, "decay_steps": 5}}})


def test_loader_keys_default_and_load():
    assert (RunConfig().data.loader, RunConfig().data.shuffle_buffer, RunConfig().data.prefetch) == (
        "memory",
        1_000_000,
        4,
    )
    data = from_dict({"data": {"loader": "streaming", "shuffle_buffer": 0, "prefetch": 0}}).data
    assert (data.loader, data.shuffle_buffer, data.prefetch) == ("streaming", 0, 0)
    assert from_dict({"data": {"loader": "gpu_resident"}, "model": {"hashing": "vocab"}}).data.loader == (
        "gpu_resident"
    )


def test_min_frequency_needs_vocab_hashing():
    with pytest.raises(ValueError, match="model.hashing: expected 'vocab' with model.min_frequency > 1"):
        from_dict({"model": {"min_frequency": 3}})
    with pytest.raises(ValueError, match="model.min_frequency: expected an integer >= 1"):
        from_dict({"model": {"hashing": "vocab", "min_frequency": 0}})
    assert from_dict({"model": {"hashing": "vocab", "min_frequency": 3}}).model.min_frequency == 3


def test_overrides_set_dotted_keys_as_json_or_strings():
    cfg = apply_overrides(
        RunConfig(),
        [
            "train.lr=0.05",
            "train.optimizer=adagrad",  # not JSON: a plain string
            "model.embedding_dim=32",
            "model.bottom_mlp=[64, 32]",
            "train.max_steps=null",
            "train.cuda_graphs=false",
            'model.attention={"heads": 4}',  # an object sets the keys it names and keeps the others
            "name=other",
        ],
    )
    assert (cfg.train.lr, cfg.train.optimizer, cfg.train.max_steps, cfg.train.cuda_graphs) == (
        0.05,
        "adagrad",
        None,
        False,
    )
    assert (cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.name) == (32, (64, 32), "other")
    assert (cfg.model.attention.heads, cfg.model.attention.dim) == (4, RunConfig().model.attention.dim)
    assert apply_overrides(cfg, ["train.lr=0.2", "train.lr=0.3"]).train.lr == 0.3  # in order
    assert apply_overrides(cfg, []) == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.lr"], r"--set train.lr: expected KEY=VALUE"),
        (["train.rate=1"], r"--set train.rate=1: train.rate: unknown key \(train has optimizer, lr, "),
        (["trian.lr=1"], r"--set trian.lr=1: trian.lr: unknown key \(the config has name, data, "),
        (["train.lr.x=1"], r"--set train.lr.x=1: train.lr.x: unknown key \(train.lr is a value"),
        (["train.lr=fast"], r"^--set train.lr=fast: train.lr: expected a number, got 'fast'$"),
        (["train.optimizer=adam"], r"^--set train.optimizer=adam: train.optimizer: expected one of"),
        # A key the overrides do not name: all of them are named (any may be the one to change).
        (
            ["train.lr=0.2", "model.embedding_dim=32"],
            r"^--set train.lr=0.2 --set model.embedding_dim=32: model.bottom_mlp: expected a last width",
        ),
        (["data.batch_size=0"], r"^--set data.batch_size=0: data.batch_size: expected a positive integer"),
    ],
)  # fmt: skip
def test_bad_overrides_name_the_override_and_the_key(overrides, message):
    with pytest.raises(ValueError, match=message) as err:
        apply_overrides(RunConfig(), overrides)
    assert "\n" not in str(err.value)


def test_the_large_batch_recipe_is_kaggles_model():
    """configs/kaggle_large_batch.json changes the optimization only (docs/quality.md: the batch, Adagrad
    and its rate, the evaluations); the model is kaggle.json's."""
    configs = Path(__file__).parents[1] / "configs"
    kaggle, large = (load_config(configs / name) for name in ("kaggle.json", "kaggle_large_batch.json"))
    assert large.model == kaggle.model and large.data.path == kaggle.data.path
    assert large.data.batch_size == 65536 and large.train.optimizer == "adagrad"
