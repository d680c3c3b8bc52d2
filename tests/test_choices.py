"""The choice lists of dlrm.choices against their users: the config's defaults, the model's checks, and the
kernel-level lists that kernels/ keeps for itself (kernels never import dlrm)."""

import pytest

from dlrm import choices
from dlrm.config import RunConfig, replace
from dlrm.model.dlrm import InteractionArch
from dlrm.model.mlp import _TORCH_GATES, MLP

# config key -> its choice list
KEYS = {
    "data.loader": choices.LOADERS,
    "model.arch": choices.ARCHS,
    "model.hashing": choices.HASHINGS,
    "model.interaction": choices.INTERACTIONS,
    "model.mlp_block": choices.MLP_BLOCKS,
    "model.gate": choices.GATES,
    "model.pooling": choices.POOLINGS,
    "train.optimizer": choices.OPTIMIZERS,
    "train.device": choices.DEVICES,
    "train.precision": choices.PRECISIONS,
    "train.compile_mode": choices.COMPILE_MODES,
    "train.triton_mlp_kernel": choices.TRITON_MLP_KERNELS,
    "train.on_nonfinite": choices.ON_NONFINITE,
    "train.select_on": choices.SELECT_ON,
}


@pytest.mark.parametrize("key", KEYS)
def test_config_default_is_a_choice_and_others_are_refused(key):
    section, name = key.split(".")
    default = getattr(getattr(RunConfig(), section), name)
    assert default in KEYS[key]
    with pytest.raises(ValueError, match=rf"^{key}: expected one of .*got 'nonsense'$"):
        replace(RunConfig(), section, **{name: "nonsense"})


def test_kernel_lists_take_every_config_choice():
    from kernels.embedding import OPTIMIZERS as EMBEDDING_OPTIMIZERS
    from kernels.embedding_bag import POOLINGS as BAG_POOLINGS
    from kernels.gated_linear import GATES as KERNEL_GATES

    assert set(choices.GATES) <= set(KERNEL_GATES)
    assert set(choices.OPTIMIZERS) <= set(EMBEDDING_OPTIMIZERS)
    assert set(choices.POOLINGS) <= set(BAG_POOLINGS)


def test_model_takes_every_choice():
    assert set(_TORCH_GATES) == set(choices.GATES)
    for interaction in choices.INTERACTIONS:
        assert InteractionArch(4, interaction, num_sparse=2).interaction == interaction
    for block in choices.MLP_BLOCKS:
        for kernel in choices.MLP_KERNELS:
            MLP(3, (4, 1), block=block, kernel=kernel)  # raises ValueError for an unknown one
