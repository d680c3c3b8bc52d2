"""CUDA graph capture of the training step (dlrm.graphs): the replayed step trains exactly like the plain
one. GPU only (CUDA graphs need CUDA); the config checks and which step is captured when (on fake graphs)
run everywhere."""

import contextlib
import functools
import threading

import pytest
import torch
from loguru import logger

from dlrm import graphs
from dlrm.config import DataConfig, LrScheduleConfig, ModelConfig, RunConfig, TrainConfig, replace, validate
from dlrm.data.dataset import Batch
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.graphs import GraphedForward, GraphedTrainStep
from dlrm.lr_schedule import LearningRates
from dlrm.metrics import evaluate, forward_logits
from dlrm.model import DLRM
from dlrm.model.tables import build_vocabularies
from dlrm.optim import RunOptimizer
from dlrm.staging import PendingSave
from dlrm.step import REDUCE_OVERHEAD_MAX_BATCH, resolve_compile_mode, resolve_cuda_graphs, train_step

SMALL = ModelConfig(embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1), max_rows=100)


def test_config_requires_triton_or_compile():
    """The whole-step graph runs our kernels, or torch.compile's dense part with the "torch_fused" tables
    (one id a feature): never kernel "torch"'s sparse gradients."""
    with pytest.raises(
        ValueError,
        match=r"train.use_triton: expected true \(--use-triton\), or train.use_torch_compile .*got False",
    ):
        validate(RunConfig(train=TrainConfig(cuda_graphs=True)))
    for optimizer in ("sgd", "adagrad"):
        validate(RunConfig(train=TrainConfig(cuda_graphs=True, use_triton=True, optimizer=optimizer)))
    compiled = validate(RunConfig(train=TrainConfig(cuda_graphs=True, use_torch_compile=True)))
    assert compiled.sparse_kernel == "torch_fused"
    assert replace(compiled, "train", cuda_graphs=False).sparse_kernel == "torch"
    bags = ModelConfig(multi_hot_sizes=(2,) * NUM_SPARSE)
    with pytest.raises(
        ValueError, match=r"model.multi_hot_sizes: expected one id a feature with train.cuda_graphs"
    ):
        validate(RunConfig(model=bags, train=TrainConfig(cuda_graphs=True, use_torch_compile=True)))


CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(
    ("train", "device", "expected", "logged"),
    [
        ({"use_triton": True}, CUDA, True, None),
        ({"use_triton": True}, CPU, False, None),
        ({}, CUDA, False, None),
        ({"use_triton": True, "optimizer": "adagrad"}, CUDA, True, None),
        (
            {"use_triton": True, "compile_mode": "reduce-overhead"},
            CUDA,
            False,
            "train.compile_mode: expected 'auto' or 'default' with train.cuda_graphs",
        ),
        ({"use_triton": True, "cuda_graphs": False}, CUDA, False, None),
        ({"use_torch_compile": True}, CUDA, True, None),
        ({"use_torch_compile": True}, CPU, False, None),
        (
            {"use_torch_compile": True, "compile_mode": "reduce-overhead"},
            CUDA,
            False,
            "train.compile_mode: expected 'auto' or 'default' with train.cuda_graphs",
        ),
    ],
)
@pytest.mark.parametrize("ranks", [1, 2])
def test_use_triton_takes_the_cuda_graph_by_default_where_it_works(train, device, expected, logged, ranks):
    """--use-triton: on one GPU or many alike. --use-torch-compile alone: on one GPU (its "torch_fused"
    tables do not shard), one line saying so on many."""
    from loguru import logger

    if ranks > 1 and train.get("use_torch_compile") and device == CUDA:
        expected, logged = False, "it runs on one rank, not 2"
    lines: list[str] = []
    handler = logger.add(lines.append, format="{message}")
    try:
        cfg = resolve_cuda_graphs(validate(RunConfig(train=TrainConfig(**train))), device, ranks)
    finally:
        logger.remove(handler)
    assert cfg.train.cuda_graphs is expected
    notes = [line for line in lines if "without the whole-step CUDA graph" in line]
    assert len(notes) == (logged is not None)
    if logged is not None:
        assert logged in notes[0]


def test_compiles_whole_step_graph_is_refused_on_many_ranks():
    cfg = validate(RunConfig(train=TrainConfig(use_torch_compile=True, cuda_graphs=True)))
    assert resolve_cuda_graphs(cfg, CUDA, 1) is cfg
    with pytest.raises(
        ValueError, match="train.cuda_graphs: expected false or null with --use-torch-compile on 2"
    ):
        resolve_cuda_graphs(cfg, CUDA, 2)


@pytest.mark.parametrize(
    ("train", "device", "batch", "expected"),
    [
        ({"use_torch_compile": True}, CUDA, 128, "default"),  # the whole-step graph
        ({"use_torch_compile": True, "cuda_graphs": False}, CUDA, 128, "reduce-overhead"),
        (
            {"use_torch_compile": True, "cuda_graphs": False},
            CUDA,
            REDUCE_OVERHEAD_MAX_BATCH,
            "reduce-overhead",
        ),
        ({"use_torch_compile": True, "cuda_graphs": False}, CUDA, REDUCE_OVERHEAD_MAX_BATCH + 1, "default"),
        ({"use_torch_compile": True}, CPU, 128, "default"),
        ({"use_torch_compile": True, "use_triton": True}, CUDA, 128, "default"),  # the whole-step graph
        ({"use_torch_compile": True, "use_triton": True, "cuda_graphs": False}, CUDA, 128, "default"),
        ({"use_torch_compile": True, "compile_mode": "default"}, CUDA, 128, "default"),
        ({"use_torch_compile": True, "compile_mode": "reduce-overhead"}, CUDA, 1 << 20, "reduce-overhead"),
        ({}, CUDA, 128, "reduce-overhead"),  # decided, though nothing compiles: no line
    ],
)
def test_compile_mode_auto_takes_inductors_graphs_where_they_measured_faster(train, device, batch, expected):
    """ "auto" becomes a mode torch.compile takes, with one line naming it when the run compiles; a mode
    given stays."""
    from loguru import logger

    lines: list[str] = []
    handler = logger.add(lines.append, format="{message}")
    try:
        cfg = validate(RunConfig(data=DataConfig(batch_size=batch), train=TrainConfig(**train)))
        cfg = resolve_compile_mode(resolve_cuda_graphs(cfg, device), device)
    finally:
        logger.remove(handler)
    assert cfg.train.compile_mode == expected
    notes = [line for line in lines if "torch.compile mode" in line]
    auto = "compile_mode" not in train and train.get("use_torch_compile", False)
    assert len(notes) == auto and all(f"torch.compile mode {expected} " in line for line in notes)


class FakeGraph:
    """A CUDA graph on the CPU: a replay calls `on_replay(graph)`; the capture records what it reads."""

    on_replay = None

    def replay(self):
        FakeGraph.on_replay(self)


@pytest.fixture
def fake_graphs(monkeypatch):
    """CUDA graphs, streams and capture faked on the CPU (which has none): returns the list that holds the
    graph being captured while a capture runs."""
    capturing = []

    @contextlib.contextmanager
    def fake_capture(graph, stream=None, capture_error_mode="global"):
        capturing.append(graph)
        yield
        capturing.pop()

    class FakeStream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    return capturing


def test_each_batch_size_is_warmed_once_then_captured_then_replayed(fake_graphs, monkeypatch):
    """Warm-up steps run uncaptured; a batch size new after them (an epoch's partial batch) runs uncaptured
    once, is captured the next time, then replays; every replay reads the batch it was given (fake graphs:
    the CPU has no CUDA graphs, and a fake replay runs the recorded step on the static inputs)."""
    calls, capturing = [], fake_graphs

    def replay(graph):
        calls.append(("replay", len(graph.batch.label), graph.batch.dense[0, 0].item()))

    monkeypatch.setattr(FakeGraph, "on_replay", staticmethod(replay))

    def step_fn(model, optimizer, batch):
        if capturing:
            capturing[-1].batch = batch  # what the graph reads when replayed
            calls.append(("capture", len(batch.label)))
        else:
            calls.append(("uncaptured", len(batch.label), batch.dense[0, 0].item()))
        return torch.zeros(())

    model, optimizer = torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    step = GraphedTrainStep(model, optimizer, step_fn, warmup=2)
    sizes = [8, 8, 8, 8, 3, 8, 3, 8, 3]
    for i, rows in enumerate(sizes):
        step(
            model,
            optimizer,
            Batch(torch.full((rows, NUM_DENSE), float(i)), torch.zeros(rows, 2), torch.zeros(rows)),
        )
    assert calls == [
        ("uncaptured", 8, 0.0),
        ("uncaptured", 8, 1.0),
        ("capture", 8),
        ("replay", 8, 2.0),
        ("replay", 8, 3.0),
        ("uncaptured", 3, 4.0),
        ("replay", 8, 5.0),
        ("capture", 3),
        ("replay", 3, 6.0),
        ("replay", 8, 7.0),
        ("replay", 3, 8.0),
    ]
    assert set(step.captured) == {8, 3} and step.graph is step.captured[8].graph


def test_each_eval_batch_size_is_warmed_once_then_captured_then_replayed(fake_graphs, monkeypatch):
    """GraphedForward as GraphedTrainStep but with no warm-up steps: a size runs uncaptured once, is
    captured the next time, then replays on the inputs of each call (fake graphs, as above)."""
    calls, capturing = [], fake_graphs

    def replay(graph):
        calls.append(("replay", len(graph.dense), graph.dense[0, 0].item()))
        graph.logits.copy_(graph.dense[:, 0])  # what the recorded forward computes

    monkeypatch.setattr(FakeGraph, "on_replay", staticmethod(replay))

    def forward(dense, sparse):
        logits = torch.full((len(dense),), float("nan"))
        if capturing:  # recording computes nothing: the replays fill the logits
            capturing[-1].dense, capturing[-1].logits = dense, logits
            calls.append(("capture", len(dense)))
        else:
            calls.append(("uncaptured", len(dense), dense[0, 0].item()))
            logits.copy_(dense[:, 0])
        return logits

    graphed = GraphedForward(forward)
    for i, rows in enumerate([8, 8, 8, 3, 3, 8]):
        logits = graphed(torch.full((rows, NUM_DENSE), float(i)), torch.zeros(rows, 2))
        assert logits.tolist() == [float(i)] * rows
    assert calls == [
        ("uncaptured", 8, 0.0),
        ("capture", 8),
        ("replay", 8, 1.0),
        ("replay", 8, 2.0),
        ("uncaptured", 3, 3.0),
        ("capture", 3),
        ("replay", 3, 4.0),
        ("replay", 8, 5.0),
    ]


def _cuda_batches(n: int) -> list[Batch]:
    """`n` random batches of 64 rows on the GPU, the same for every call."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return [
        Batch(
            torch.rand(64, NUM_DENSE, device="cuda", generator=g),
            torch.randint(-1, 1000, (64, NUM_SPARSE), device="cuda", generator=g),
            (torch.rand(64, device="cuda", generator=g) < 0.3).float(),
        )
        for _ in range(n)
    ]


def _small_triton_dlrm(**options) -> DLRM:
    """SMALL on the GPU with the Triton kernels and 37-row tables (the graph tests' model)."""
    return DLRM(
        SMALL, table_rows=[37] * NUM_SPARSE, mlp_kernel="linear_act", sparse_kernel="triton", **options
    ).cuda()


def _assert_same_runs(run: tuple[list[float], dict], expected: tuple[list[float], dict]) -> None:
    """Two runs' (losses, named tensors) agree to 1e-5 relative, 1e-6 absolute."""
    torch.testing.assert_close(run[0], expected[0], rtol=1e-5, atol=1e-6)
    for key, value in expected[1].items():
        torch.testing.assert_close(run[1][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.gpu
@pytest.mark.parametrize(("compiled", "algorithm"), [(False, "sgd"), (True, "sgd"), (False, "adagrad")])
def test_graphed_steps_match_plain_steps(compiled, algorithm):
    """Replayed steps train as plain ones: losses, weights, and Adagrad's accumulators (dense and fused)."""
    from dlrm.step import compile_dense_part

    cfg = RunConfig(model=SMALL, train=TrainConfig(use_triton=True, lr=0.1, optimizer=algorithm))
    batches = _cuda_batches(8)
    # A partial batch runs uncaptured, the next one of its size is captured and replayed, and so are the
    # full batches around them.
    batches += [Batch(*(t[:10] for t in batches[0])), batches[1], Batch(*(t[10:20] for t in batches[2]))]
    batches += [batches[3], Batch(*(t[20:30] for t in batches[4]))]
    runs = {}
    for graphed in (False, True):
        torch.manual_seed(0)
        model = _small_triton_dlrm()
        optimizer = RunOptimizer(model, cfg.train)
        if compiled:
            compile_dense_part(model)
        step = GraphedTrainStep(model, optimizer, train_step) if graphed else train_step
        losses = [step(model, optimizer, b).item() for b in batches]
        sums = [optimizer.state[p]["sum"] for p in model.dense_parameters() if "sum" in optimizer.state[p]]
        assert len(sums) == (len(list(model.dense_parameters())) if algorithm == "adagrad" else 0)
        state = {**model.state_dict(), "embedding_state": model.sparse_arch.optimizer_state.clone()}
        runs[graphed] = (losses, state | {f"sum{i}": s.clone() for i, s in enumerate(sums)})
        if graphed:
            assert set(step.captured) == {64, 10}
    _assert_same_runs(runs[True], runs[False])


@pytest.mark.gpu
def test_a_capture_survives_another_threads_device_to_host_copies():
    """A background checkpoint's writer copies device memory to the host (dlrm.checkpoint, on its thread's
    default stream) while training goes on: the steps captured meanwhile (the first, and a new batch size's)
    still record and replay (CUDA's global capture mode fails a capture on any other thread's copy)."""
    cfg = RunConfig(model=SMALL, train=TrainConfig(use_triton=True, lr=0.1))
    model = _small_triton_dlrm()
    optimizer = RunOptimizer(model, cfg.train)
    step = GraphedTrainStep(model, optimizer, train_step)
    batches = _cuda_batches(6)
    batches += [Batch(*(t[:10] for t in batches[0])), batches[1], Batch(*(t[10:20] for t in batches[2]))]
    source = torch.randn(2**22, device="cuda")
    buffer = torch.empty(2**22, pin_memory=True)
    stop, copies = threading.Event(), []

    def write():
        while not stop.is_set():
            buffer.copy_(source, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            copies.append(1)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        losses = torch.stack([step(model, optimizer, b).clone() for b in batches])
        torch.cuda.synchronize()
    finally:
        stop.set()
        writer.join()
    assert set(step.captured) == {64, 10} and len(copies) > 0
    assert torch.isfinite(losses).all()


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["sgd", "adagrad"])
def test_tables_on_a_side_stream_train_as_in_line(algorithm):
    """DLRM(overlap_sparse=True) looks up and updates its tables on a side stream (forward and, through
    autograd's stream semantics, backward), the fork and join captured in the step's graph: its replayed
    steps give the losses, weights and fused Adagrad state of plain in-line steps."""
    cfg = RunConfig(model=SMALL, train=TrainConfig(use_triton=True, lr=0.1, optimizer=algorithm))
    batches = _cuda_batches(8)
    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = _small_triton_dlrm(overlap_sparse=overlap)
        optimizer = RunOptimizer(model, cfg.train)
        step = GraphedTrainStep(model, optimizer, train_step) if overlap else train_step
        losses = [step(model, optimizer, b).item() for b in batches]
        torch.cuda.synchronize()
        runs[overlap] = (losses, {**model.state_dict(), "state": model.sparse_arch.optimizer_state.clone()})
    _assert_same_runs(runs[True], runs[False])


@pytest.mark.gpu
def test_graph_replays_follow_the_lr_schedule():
    """A schedule that changes the rates at every step (warm-up, decay to 0) trains the same replayed as
    plain: the replays read the lr tensors written before each of them; the last steps (factor 0) leave
    the weights unchanged."""
    schedule = LrScheduleConfig(warmup_steps=4, decay_start_step=5, decay_steps=4)
    cfg = RunConfig(model=SMALL, train=TrainConfig(use_triton=True, lr=0.1, lr_schedule=schedule))
    batches = _cuda_batches(11)
    runs = {}
    for graphed in (False, True):
        torch.manual_seed(0)
        model = _small_triton_dlrm()
        optimizer = RunOptimizer(model, cfg.train)
        lrs = LearningRates(cfg.train.lr_schedule, optimizer)
        step = GraphedTrainStep(model, optimizer, train_step) if graphed else train_step
        states = []
        for k, batch in enumerate(batches, start=1):
            lrs.set(k)
            step(model, optimizer, batch)
            states.append({key: v.clone() for key, v in model.state_dict().items()})
        runs[graphed] = states
        if graphed:
            assert step.graph is not None
    for key, value in runs[False][-1].items():
        torch.testing.assert_close(runs[True][-1][key], value, rtol=1e-5, atol=1e-6, msg=key)
        assert torch.equal(runs[True][-1][key], runs[True][8][key]), key  # steps 10 and 11: factor 0


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graphed_evaluation_matches_launched_evaluation(precision):
    """Evaluations through GraphedForward give the launched forward's metrics, also after training steps
    changed the weights in place (the graph reads the current weights) and with a partial last batch."""
    cfg = RunConfig(model=SMALL, train=TrainConfig(use_triton=True, lr=0.1))
    torch.manual_seed(0)
    model = _small_triton_dlrm()
    optimizer = RunOptimizer(model, cfg.train)
    train_batches = _cuda_batches(4)
    eval_batches = _cuda_batches(3) + [Batch(*(t[:20] for t in _cuda_batches(1)[0]))]
    graphed = GraphedForward(functools.partial(forward_logits, model, precision))
    device = torch.device("cuda")
    for batch in train_batches:
        train_step(model, optimizer, batch, precision=precision)
        launched = evaluate(model, eval_batches, device, precision)
        replayed = evaluate(model, eval_batches, device, precision, graphed)
        for key in ("auc", "logloss", "ne", "samples"):
            assert replayed[key] == pytest.approx(launched[key], rel=1e-6, abs=1e-7), key
    assert set(graphed.captured) == {64}


def _tensor_addresses(model: torch.nn.Module) -> dict[str, int]:
    """Every parameter's and buffer's (non-persistent ones too) storage address, by name."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name: tensor.data_ptr() for name, tensor in named}


@pytest.mark.parametrize("sparse_kernel", ["torch", "triton"])
def test_loading_weights_keeps_every_tensor_a_graph_reads_where_it_was(sparse_kernel):
    """A captured graph (training step, evaluation forward) reads the model's tensors by address, so loading
    the best weights before the test evaluation must write into them: every parameter and buffer keeps its
    address, the vocabulary lookup included (rebuilt after the load), and holds the loaded values."""
    cfg = ModelConfig(**{**SMALL.__dict__, "hashing": "vocab", "first_order": True})
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(-1, 60, (40, NUM_SPARSE), generator=g)
    models = []
    for seed, offset in ((0, 0), (1, 1000)):  # other weights and other vocabularies of the same sizes
        torch.manual_seed(seed)
        vocabularies = build_vocabularies(ids + offset, 100)
        models.append(DLRM(cfg, vocabularies=vocabularies, sparse_kernel=sparse_kernel).eval())
    live, best = models
    addresses = _tensor_addresses(live)
    assert {"sparse_arch.vocab_keys", "sparse_arch.vocab_starts"} <= set(addresses)
    live.load_state_dict(best.state_dict())
    assert _tensor_addresses(live) == addresses
    loaded = {**dict(live.named_parameters()), **dict(live.named_buffers())}
    for name, tensor in [*best.named_parameters(), *best.named_buffers()]:
        assert torch.equal(loaded[name], tensor), name
    probe = ids[:9] + 1000  # ids of `best`'s vocabularies: rows that `live`'s old lookup would not find
    assert torch.equal(live.sparse_arch.hash_ids(probe), best.sparse_arch.hash_ids(probe))


def test_a_capture_waits_for_the_background_save_being_written_and_says_so():
    """A CUDA graph capture never overlaps a background save's writing (dlrm.staging.CAPTURE_LOCK): the
    writer's page-locked allocations would fail it. It waits for the writing to end, with a log line; with
    no save running it goes on at once, silently."""
    release, written, lines = threading.Event(), threading.Event(), []

    def write():
        release.wait(20)
        written.set()

    sink = logger.add(lines.append, format="{message}")
    try:
        pending = PendingSave(write, "x")
        threading.Timer(0.3, release.set).start()
        with graphs._no_save_running():
            assert written.is_set()  # the writing ended first
        with graphs._no_save_running():
            pass
    finally:
        logger.remove(sink)
    pending.wait()
    assert sum("waits for the checkpoint being written" in line for line in lines) == 1
