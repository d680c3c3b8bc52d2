"""Every choice list of the run config and the commands, defined once.

dlrm.config validates its keys against these tuples, the model checks its arguments against them and the
commands offer them as `click.Choice`, so adding a choice is one line here (plus the code that does it).
The first entry of a config key's list is not necessarily its default: the dataclasses in dlrm.config hold
the defaults. Kernel-level lists (kernels.activations.ACTIVATIONS, kernels.gated_linear.GATES,
kernels.embedding.OPTIMIZERS) stay with their kernels, which never import dlrm; tests/test_choices.py
checks that every choice here that reaches a kernel is one the kernel takes.
"""

# data
LOADERS = ("memory", "gpu_resident", "streaming", "binary")  # data.loader
SPLITS = ("train", "val", "test")  # the splits of a preprocessed data directory (dlrm.data.splits)
BAG_DISTRIBUTIONS = ("uniform", "pareto")  # data.multi_hot.distribution, the bags' drawn ids (dlrm.data.bags)
SYNTHETIC_IDS = ("hash", "index")  # dlrm.data.synthetic --ids: raw 32-bit hashes or contiguous indices

# model
ARCHS = ("dlrm", "logistic")  # model.arch
HASHINGS = ("modulus", "vocab")  # model.hashing
INTERACTIONS = ("dot", "cat", "attention", "dcn")  # model.interaction
MLP_BLOCKS = ("linear_act", "ln_linear_gelu", "gated")  # model.mlp_block
GATES = ("sigmoid_tanh", "geglu", "swiglu")  # model.gate
POOLINGS = ("sum", "mean")  # model.pooling, of each multi-hot bag (dlrm.model.pooling)

# train
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")  # train.optimizer
DEVICES = ("auto", "cpu", "cuda")  # train.device, --device
PRECISIONS = ("fp32", "tf32", "bf16")  # train.precision, --precision
COMPILE_MODES = ("auto", "default", "reduce-overhead")  # train.compile_mode (auto: dlrm.step)
TRITON_MLP_KERNELS = ("linear_act", "bias_act", "cuda_bias_act")  # train.triton_mlp_kernel
ON_NONFINITE = ("stop", "skip_batch")  # train.on_nonfinite
SELECT_ON = ("logloss", "auc")  # train.select_on
CHECKPOINT_POLICIES = ("best_and_last", "last_only", "none")  # train.checkpoint_policy (dlrm.run.checkpoints)

# How the model runs: its MLP layers (dlrm.model.mlp) and its embeddings, interaction and loss
# (dlrm.model.dlrm); "torch" is plain PyTorch, the others our kernels (RunConfig.mlp_kernel, .sparse_kernel),
# but "torch_fused": plain PyTorch whose table lookups update the tables in their backward
# (dlrm.model.fused_update), as "triton"'s do, so the whole step can be one CUDA graph.
MLP_KERNELS = ("torch", *TRITON_MLP_KERNELS)
SPARSE_KERNELS = ("torch", "torch_fused", "triton")
# The sparse kernels whose tables are table-batched and updated in their lookups' backward (no weight
# gradient, no torch optimizer): SparseArch.configure_optimizer sets their update.
FUSED_UPDATE_KERNELS = ("torch_fused", "triton")

# Scoring a checkpoint (dlrm.scoring: `--backend`, `--precision` of dlrm.evaluate and dlrm.predict);
# "run" takes the run's own.
SCORING_BACKENDS = ("run", "eager", "triton")
SCORING_PRECISIONS = ("run", *PRECISIONS)

# The embedding vectors' dtype on the wire between ranks (parallel.exchange_dtype; dlrm.parallel.sharded).
EXCHANGE_DTYPES = ("auto", "fp32", "bf16")

# The embedding tables' storage (model.table_dtype; dlrm.model.sparse): "bf16" halves their bytes, its
# updates rounded stochastically by the fused kernels (sparse kernel "triton" only).
TABLE_DTYPES = ("fp32", "bf16")
