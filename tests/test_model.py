"""DLRM model pieces against brute-force references."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dlrm.config import ModelConfig
from dlrm.data.schema import MISSING_CATEGORY, NUM_DENSE, NUM_SPARSE
from dlrm.model import DLRM, model_from_checkpoint, sparse
from dlrm.model.dlrm import InteractionArch
from dlrm.model.sparse import SparseArch, init_tables
from dlrm.model.tables import build_vocabularies, resolve_table_rows, shared_row_shares, shared_rows_warning

REPO = Path(__file__).resolve().parents[1]
SMALL = ModelConfig(embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1), max_rows=50)


def _ids(generator: torch.Generator, rows: int) -> torch.Tensor:
    ids = torch.randint(0, 2**32, (rows, NUM_SPARSE), generator=generator)
    ids[::5, 3] = -1  # missing values
    return ids


def test_dot_interaction_equals_brute_force_loop():
    g = torch.Generator().manual_seed(0)
    batch, dim = 3, 5
    dense, embedded = torch.randn(batch, dim, generator=g), torch.randn(batch, NUM_SPARSE, dim, generator=g)
    arch = InteractionArch(dim, "dot")
    out = arch(dense, embedded)
    vectors = [dense] + [embedded[:, f] for f in range(NUM_SPARSE)]
    products = [(vectors[i] * vectors[j]).sum(1) for i in range(len(vectors)) for j in range(i)]
    expected = torch.cat([dense, torch.stack(products, dim=1)], dim=1)
    assert arch.out_features == dim + 351 == out.shape[1]
    torch.testing.assert_close(out, expected)


def test_cat_interaction_width():
    arch = InteractionArch(4, "cat")
    out = arch(torch.randn(2, 4), torch.randn(2, NUM_SPARSE, 4))
    assert out.shape == (2, 4 * (NUM_SPARSE + 1)) and arch.out_features == out.shape[1]


def test_modulus_hashing_is_x_plus_one_mod_rows():
    rows = [7 + f for f in range(NUM_SPARSE)]
    arch = SparseArch(4, rows, "modulus")
    ids = _ids(torch.Generator().manual_seed(1), 10)
    hashed = arch.hash_ids(ids)
    for f in range(NUM_SPARSE):
        assert hashed[:, f].tolist() == [(x + 1) % rows[f] for x in ids[:, f].tolist()]
    out = arch(ids)
    assert out.shape == (10, NUM_SPARSE, 4)
    torch.testing.assert_close(out[4, 2], arch.embeddings[2].weight[hashed[4, 2]])


def test_vocab_hashing_is_exact_with_shared_oov_row():
    train_ids = _ids(torch.Generator().manual_seed(2), 40)
    vocabularies = build_vocabularies(train_ids, max_rows=1000)
    arch = SparseArch(4, hashing="vocab", vocabularies=vocabularies)
    hashed = arch.hash_ids(train_ids)
    for f in range(NUM_SPARSE):
        known = sorted(set(train_ids[:, f].tolist()))
        assert hashed[:, f].tolist() == [known.index(x) for x in train_ids[:, f].tolist()]
        assert arch.table_rows[f] == len(known) + 1
    unseen = torch.full((2, NUM_SPARSE), 2**33)
    assert (arch.hash_ids(unseen) == torch.tensor(arch.table_rows) - 1).all()


def test_vocab_rows_of_one_lookup_equal_each_features_own():
    """The one-array lookup against each feature's own sorted vocabulary: ids present, absent, missing
    (-1), -2 and outside [-1, 2^58 - 1); a feature with an empty vocabulary; a feature whose only id is
    another's."""
    g = torch.Generator().manual_seed(5)
    vocabularies = [
        torch.randint(-1, 2**32, (int(n),), generator=g).unique()
        for n in torch.randint(1, 60, (26,), generator=g)
    ]
    vocabularies[3] = torch.zeros(0, dtype=torch.int64)
    vocabularies[4] = vocabularies[5][:1].clone()
    queries = torch.stack([v[torch.randint(0, max(len(v), 1), (50,), generator=g)] if len(v) else
                           torch.zeros(50, dtype=torch.int64) for v in vocabularies], dim=1)  # fmt: skip
    queries[::3] = torch.randint(-1, 2**32, (len(queries[::3]), 26), generator=g)
    # Out of range, each an id of another feature shifted by whole key ranges: a lookup without the range
    # check would find it there.
    queries[1, :4] = torch.tensor([-1, -2, int(vocabularies[1][0]) - 2**58, int(vocabularies[19][0]) + 2**62])
    arch = SparseArch(4, hashing="vocab", vocabularies=vocabularies)
    got = arch.hash_ids(queries)
    for f, vocab in enumerate(vocabularies):
        known = vocab.tolist()
        want = [known.index(x) if x in known else len(known) for x in queries[:, f].tolist()]
        assert got[:, f].tolist() == want, f


def test_vocab_lookup_follows_loaded_vocabularies():
    """A model built on placeholders (as from a checkpoint) hashes with the loaded vocabularies; with every
    vocabulary empty every id is out of vocabulary."""
    ids = _ids(torch.Generator().manual_seed(3), 30)
    trained = SparseArch(4, hashing="vocab", vocabularies=build_vocabularies(ids, max_rows=1000))
    placeholders = [torch.zeros(rows - 1, dtype=torch.int64) for rows in trained.table_rows]
    loaded = SparseArch(4, hashing="vocab", vocabularies=placeholders)
    loaded.load_state_dict(trained.state_dict())
    assert torch.equal(loaded.hash_ids(ids), trained.hash_ids(ids))
    empty = SparseArch(4, hashing="vocab", vocabularies=build_vocabularies(ids, 1000, min_frequency=10**6))
    assert (empty.hash_ids(ids) == 0).all() and empty.table_rows == [1] * NUM_SPARSE


def test_vocab_cap_keeps_most_frequent_ids():
    ids = torch.zeros(30, NUM_SPARSE, dtype=torch.int64)
    ids[:20] = 5  # most frequent
    ids[20:26] = 9
    ids[26:] = torch.arange(4).unsqueeze(1) + 100  # four singletons
    vocab = build_vocabularies(ids, max_rows=3)[0]
    assert vocab.tolist() == [5, 9]


def test_table_rows_from_metadata_capped():
    metadata = {"categorical": {f"C{f + 1}": {"cardinality": 10 * f} for f in range(NUM_SPARSE)}}
    rows = resolve_table_rows(SMALL, metadata)
    assert rows == [min(10 * f + 1, 50) for f in range(NUM_SPARSE)]
    with pytest.raises(ValueError, match="C1"):
        resolve_table_rows(SMALL, {"categorical": {}})


def _sharing(ids: np.ndarray, rows: int) -> float:
    """The share of `ids` (distinct, >= 0) whose row (x + 1) % rows holds another id or the missing id."""
    row = (np.append(ids, MISSING_CATEGORY) + 1) % rows
    held = np.bincount(row, minlength=rows)
    return float((held[row[:-1]] > 1).mean())


def test_shared_row_shares_count_the_ids_that_share_a_row():
    """Against counting the rows of actual ids: contiguous ids [0, n) exactly (0 where they fit the rows);
    n ids drawn from [0, 4n) (a split that has not seen all of a column's contiguous ids) and 32-bit hashes
    on average over draws (200,000 ids of each case, within 0.01)."""
    cases = [(3, 3), (5, 3), (10, 7), (7, 8), (7, 9), (1000, 1001), (1000, 600), (2000, 1500)]
    rng = np.random.default_rng(0)
    for kind in ("contiguous", "subset", "hashes"):
        table_rows = [m for _, m in cases] + [1] * (NUM_SPARSE - len(cases))
        cfg = ModelConfig(**{**SMALL.__dict__, "table_rows": tuple(table_rows), "max_rows": 10_000})
        categorical = {f"C{f + 1}": {"cardinality": 0} for f in range(NUM_SPARSE)}
        draws = []
        for f, (n, _) in enumerate(cases):
            repeats = max(200, 200_000 // n)
            if kind == "contiguous":
                draws.append([np.arange(n)])
            elif kind == "subset":
                draws.append([rng.choice(4 * n, n, replace=False) for _ in range(repeats)])
            else:  # distinct but for a chance below 1e-3 a draw
                draws.append(list(rng.integers(0, 2**32, (repeats, n))))
            categorical[f"C{f + 1}"] = {"cardinality": n, "max_id": int(max(d.max() for d in draws[-1]))}
        shares = shared_row_shares(cfg, {"categorical": categorical})
        for f, ((n, m), ids) in enumerate(zip(cases, draws, strict=True)):
            counted = np.mean([_sharing(d, m) for d in ids])
            tolerance = 1e-12 if kind == "contiguous" else 0.01
            assert shares[f"C{f + 1}"] == pytest.approx(counted, abs=tolerance), (kind, n, m)
        assert shares[f"C{NUM_SPARSE}"] == 0.0  # no ids
        if kind == "contiguous":  # (7, 8), (7, 9), (1000, 1001): ids 0 .. n - 1 and the missing one fit
            assert shares["C3"] > 0 and shares["C4"] == shares["C5"] == shares["C6"] == 0.0
    categorical = {c: {"cardinality": 50, "max_id": 49} for c in categorical}
    assert shared_rows_warning(SMALL, {"categorical": categorical}) is None  # max_rows 50: ids 0..49 need 51
    categorical["C7"] = {"cardinality": 50}  # raw hashes: about 1 - 1/e share
    warning = shared_rows_warning(SMALL, {"categorical": categorical})
    assert "in 1 of 26 tables" in warning and "(C7 64%)" in warning
    vocab = ModelConfig(**{**SMALL.__dict__, "hashing": "vocab"})
    assert shared_rows_warning(vocab, {"categorical": categorical}) is None


@pytest.mark.parametrize("hashing", ["modulus", "vocab"])
def test_dlrm_logits_and_checkpoint_round_trip(hashing):
    g = torch.Generator().manual_seed(3)
    cfg = ModelConfig(**{**SMALL.__dict__, "hashing": hashing})
    ids = _ids(g, 16)
    if hashing == "vocab":
        model = DLRM(cfg, vocabularies=build_vocabularies(ids, cfg.max_rows))
    else:
        model = DLRM(cfg, table_rows=[11] * NUM_SPARSE)
    dense = torch.rand(16, NUM_DENSE, generator=g)
    logits = model(dense, ids)
    assert logits.shape == (16,) and logits.dtype == torch.float32
    rebuilt = model_from_checkpoint(cfg, model.sparse_arch.table_rows, model.state_dict())
    torch.testing.assert_close(rebuilt(dense, ids), logits)


def test_embedding_gradients_are_sparse():
    model = DLRM(SMALL, table_rows=[13] * NUM_SPARSE)
    model(torch.rand(4, NUM_DENSE), _ids(torch.Generator().manual_seed(4), 4)).sum().backward()
    assert all(p.grad.is_sparse for p in model.embedding_parameters())
    assert not any(p.grad.is_sparse for p in model.dense_parameters())


@pytest.mark.parametrize(
    ("optimizer", "hashing"), [("sgd", "modulus"), ("adagrad", "modulus"), ("sgd", "vocab")]
)
@pytest.mark.parametrize("fused", ["triton", "torch_fused"])
def test_triton_sparse_kernels_train_like_eager(optimizer, hashing, fused):
    """Same seed -> same initial weights and state_dict keys; three steps with the embedding update fused
    into backward (kernels.embedding; "torch_fused": dlrm.model.fused_update, with torch's interaction
    and loss) and the interaction/loss kernels end at eager's weights."""
    g = torch.Generator().manual_seed(5)
    cfg = ModelConfig(**{**SMALL.__dict__, "hashing": hashing})
    ids = [_ids(g, 24) for _ in range(3)]
    kwargs = {"vocabularies": build_vocabularies(ids[0], cfg.max_rows)} if hashing == "vocab" else {}
    kwargs.setdefault("table_rows", [7, 1, 50] + [13] * (NUM_SPARSE - 3))
    models, optimizers = {}, {}
    for kernel in ("torch", fused):
        torch.manual_seed(0)
        model = DLRM(cfg, sparse_kernel=kernel, **kwargs)
        groups = [{"params": model.dense_parameters()}]
        if kernel == fused:
            model.sparse_arch.configure_optimizer(optimizer, 0.1)
        else:
            groups.append({"params": model.embedding_parameters()})
        models[kernel] = model
        optimizers[kernel] = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adagrad)(groups, lr=0.1)
    eager, triton = models["torch"].state_dict(), models[fused].state_dict()
    assert eager.keys() == triton.keys() and all(torch.equal(eager[k], triton[k]) for k in eager)
    initial = eager["sparse_arch.embeddings.2.weight"].clone()
    for step_ids in ids:
        dense = torch.rand(24, NUM_DENSE, generator=g)
        labels = (torch.rand(24, generator=g) < 0.5).float()
        for kernel, model in models.items():
            optimizers[kernel].zero_grad()
            model.loss(model(dense, step_ids), labels).backward()
            optimizers[kernel].step()
    eager, triton = models["torch"].state_dict(), models[fused].state_dict()
    assert not torch.equal(eager["sparse_arch.embeddings.2.weight"], initial)  # the tables did train
    # atol 1e-5: the interaction kernel sums its dot products in another fp32 order than bmm, and Adagrad
    # divides each gradient by its own running norm, which turns that rounding in small gradients into
    # differences of a few 1e-6 in the weights after three steps (seen 3.7e-6).
    for key in eager:
        torch.testing.assert_close(triton[key], eager[key], rtol=1e-5, atol=1e-5, msg=key)


def test_both_sparse_kernels_draw_fb_dlrms_uniform_tables_alike_for_a_seed():
    rows = [4, 100, 10_000] + [9] * (NUM_SPARSE - 3)
    torch.manual_seed(3)
    eager = SparseArch(8, table_rows=rows)
    torch.manual_seed(3)
    triton = SparseArch(8, table_rows=rows, kernel="triton")
    for f, n in enumerate(rows):
        table = eager.embeddings[f].weight
        assert torch.equal(triton.weights[sum(rows[:f]) : sum(rows[: f + 1])], table)
        bound = (1.0 / n) ** 0.5
        assert table.abs().max() <= bound and table.abs().max() > 0.9 * bound  # the whole range, no wider
        assert table.requires_grad


def test_tables_are_the_seeds_alone_in_any_split_and_leave_the_global_generator(monkeypatch):
    """init_tables draws table f's rows block by block, each block from a generator of (seed, f, block):
    the pieces of a table split anywhere (row shards of ranks) hold its rows, the global torch generator
    is untouched (so the MLPs drawn after the tables start the same with tables built elsewhere), and
    another seed gives other tables. Blocks of 5 rows here, so that pieces begin and end inside them."""
    monkeypatch.setattr(sparse, "INIT_BLOCK_ROWS", 5)
    rows = [3, 17, 40] + [9] * (NUM_SPARSE - 3)
    state = torch.random.get_rng_state()
    whole = SparseArch(4, table_rows=rows, seed=11)
    assert torch.equal(torch.random.get_rng_state(), state)
    tables = [table.weight.detach() for table in whole.embeddings]
    cuts = {0: [0, 3], 1: [0, 4, 5, 12, 17], 2: [0, 1, 7, 22, 40]}  # rows [cut_i, cut_i+1) per piece
    pieces = [
        (torch.full((b - a, 4), float("nan")), f, rows[f], a)
        for f, bounds in cuts.items()
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    init_tables(pieces, 11)
    for values, f, _, first in pieces:
        assert torch.equal(values, tables[f][first : first + len(values)]), (f, first)
    other = SparseArch(4, table_rows=rows, seed=12)
    assert not torch.equal(other.embeddings[1].weight, tables[1])
    # The tables' bounds: FB-DLRM's U(-sqrt(1/rows_f), sqrt(1/rows_f)).
    assert all(t.abs().max() <= (1.0 / n) ** 0.5 for t, n in zip(tables, rows, strict=True))


def test_checkpoints_move_between_sparse_kernels():
    torch.manual_seed(1)
    eager = DLRM(SMALL, table_rows=[9] * NUM_SPARSE)
    triton = DLRM(SMALL, table_rows=[9] * NUM_SPARSE, sparse_kernel="triton")
    triton.load_state_dict(eager.state_dict())
    assert torch.equal(triton.sparse_arch.weights[9:18], eager.sparse_arch.embeddings[1].weight)
    back = DLRM(SMALL, table_rows=[9] * NUM_SPARSE)
    back.load_state_dict(triton.state_dict())
    expected = eager.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in back.state_dict().items())
    assert triton.embedding_parameters() == []
    ids = _ids(torch.Generator().manual_seed(2), 3)
    with pytest.raises(ValueError, match="call configure_optimizer before training"):
        triton.sparse_arch(ids)
    with torch.no_grad():
        assert torch.equal(triton.sparse_arch(ids), eager.sparse_arch(ids))
    with pytest.raises(ValueError, match="configure_optimizer is for kernels"):
        eager.sparse_arch.configure_optimizer("sgd", 0.1)


def test_triton_sparse_path_falls_back_to_pytorch_without_triton(tmp_path):
    """On a CPU without the interpreter the custom ops run their PyTorch references, and train the same."""
    code = (
        "import torch; from tests.test_model import test_triton_sparse_kernels_train_like_eager as t; "
        "from kernels.launch import INTERPRETED; assert not INTERPRETED; "
        "t('adagrad', 'modulus', 'triton'); t('sgd', 'vocab', 'triton')"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr


def test_min_frequency_sends_rare_ids_to_the_oov_row():
    ids = torch.zeros(30, NUM_SPARSE, dtype=torch.int64)
    ids[:20] = 5
    ids[20:23] = 9  # seen 3 times
    ids[23:25] = 7  # seen twice
    ids[25:] = torch.arange(5).unsqueeze(1) + 100  # five singletons
    assert build_vocabularies(ids, max_rows=1000, min_frequency=3)[0].tolist() == [5, 9]
    assert build_vocabularies(ids, max_rows=1000, min_frequency=2)[0].tolist() == [5, 7, 9]
    assert len(build_vocabularies(ids, max_rows=1000)[0]) == 8
