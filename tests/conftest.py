"""Test set-up: run Triton kernels in the CPU interpreter when no GPU is present.

TRITON_INTERPRET must be set before any kernel is decorated, so this runs before tests import kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """Hand a test's cached CUDA blocks back to the driver after it: pytest-xdist workers share one GPU
    (`make test-gpu`), and memory one worker's caching allocator keeps after a large test (the kaggle
    tables at D=128 take 16 GiB) is memory the others cannot have."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def load_script(name: str):
    """scripts/<name>.py as a module, imported with scripts/ on sys.path as the scripts import their
    neighbours (results_csv, bench_train, ...)."""
    import importlib.util
    import sys

    scripts = str(REPO / "scripts")
    sys.path.insert(0, scripts)
    try:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(scripts)
    return module


SAMPLE_TSV = REPO / "data" / "day_0_head10k.tsv.gz"


@pytest.fixture(scope="session")
def criteo_sample(tmp_path_factory):
    """The shipped 10,000 real Criteo rows, preprocessed once per test session: 8,000 train, 1,000 val,
    1,000 test."""
    from dlrm.data.preprocess import preprocess

    out = tmp_path_factory.mktemp("criteo") / "sample"
    preprocess([SAMPLE_TSV], out, eval_fraction=0.2)
    return out


@pytest.fixture
def initial_weights(monkeypatch) -> list[dict[str, torch.Tensor]]:
    """Each training run's weights as its optimizer is built, before its first step, in the order the runs
    start: fp32 CPU copies of the floating-point state_dict entries, keyed as in a checkpoint."""
    from dlrm.run import setup as run_setup

    kept, run_optimizer = [], run_setup.RunOptimizer

    def keep(model, train):
        state = model.state_dict()
        kept.append({k: v.detach().float().cpu().clone() for k, v in state.items() if v.is_floating_point()})
        return run_optimizer(model, train)

    monkeypatch.setattr(run_setup, "RunOptimizer", keep)
    return kept
