"""DLRM model pieces against brute-force references."""

import pytest
import torch

from dlrm.config import ModelConfig
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.model import DLRM, model_from_checkpoint
from dlrm.model.dlrm import InteractionArch, SparseArch
from dlrm.model.tables import build_vocabularies, resolve_table_rows

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
