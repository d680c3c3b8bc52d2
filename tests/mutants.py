"""Mutation check of the training tests: each must fail when the tables or the MLPs stop learning.

Two mutants, each in two scopes:

    frozen_tables  the embedding tables' update is skipped: the fused update of our embedding kernel reads a
                   learning rate of 0, and (scope "all") so does the torch optimizer's table group
    frozen_mlps    the dense optimizer step is skipped: the optimizer's dense group has a learning rate of 0
    scope "all"    every run of a test (eager, torch.compile, --use-triton)
    scope "triton" only runs with --use-triton, so eager, the reference of the comparisons, still learns

Run as a script, it runs the tests below (or those given after `--`, with pytest's own arguments) once
unmutated and once per mutant and scope, in subprocesses, and prints one line per test: every test must
pass unmutated and fail under every mutant (exit status 1 when one does not), then the assertion that
failed under each mutant. Tests skipped here (the GPU ones without a GPU) are left out of the table.

    python -m tests.mutants [-- PYTEST_ARGS...]

Loaded as a pytest plugin (`-p tests.mutants`), it applies the mutant named by the environment variables
DLRM_MUTANT (frozen_tables | frozen_mlps) and DLRM_MUTANT_SCOPE (all | triton) by monkeypatching
dlrm.run.setup.RunOptimizer and kernels.embedding.embedding_lookup for the whole session; without
DLRM_MUTANT it does nothing. No source file is changed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

MUTANTS = ("frozen_tables", "frozen_mlps")
SCOPES = ("all", "triton")
# The tests whose tolerances compare training runs (GPU-marked ones are skipped without a GPU: run this on a
# GPU machine to check them too).
TESTS = [
    "tests/test_train.py::test_backends_give_the_same_loss_curve",
    "tests/test_train.py::test_triton_bf16_and_cuda_graphs_follow_eager",
    "tests/test_train.py::test_every_loader_trains_with_cuda_graphs_like_eager",
    "tests/test_model_options.py::test_backends_agree_on_every_option",
    "tests/test_model_options.py::test_options_on_the_gpu_with_cuda_graphs",
]


def pytest_configure(config) -> None:
    mutant = os.environ.get("DLRM_MUTANT")
    if mutant:
        apply(mutant, os.environ.get("DLRM_MUTANT_SCOPE", "all"))


def apply(mutant: str, scope: str) -> None:
    """Patch the session's training (see the module docstring). Raises ValueError for an unknown name."""
    if mutant not in MUTANTS or scope not in SCOPES:
        raise ValueError(f"DLRM_MUTANT must be one of {MUTANTS} and DLRM_MUTANT_SCOPE one of {SCOPES}")
    import kernels.embedding
    from dlrm.run import setup as run_setup

    run_optimizer = run_setup.RunOptimizer

    def mutated_optimizer(model, train):
        optimizer = run_optimizer(model, train)
        if scope == "all" or train.use_triton:
            # Group 0 holds the dense parameters; group 1, when present, the eager tables (RunOptimizer).
            groups = optimizer.param_groups[:1] if mutant == "frozen_mlps" else optimizer.param_groups[1:]
            for group in groups:
                group["lr"] = 0.0
        return optimizer

    run_setup.RunOptimizer = mutated_optimizer
    if mutant == "frozen_tables":  # our kernel's tables run only under --use-triton: in both scopes
        lookup = kernels.embedding.embedding_lookup

        def frozen_lookup(weights, state, offsets, rows, ids, hashing, optimizer, lr, *args):
            return lookup(weights, state, offsets, rows, ids, hashing, optimizer, lr * 0, *args)

        kernels.embedding.embedding_lookup = frozen_lookup


def _run(tests: list[str], mutant: str | None, scope: str) -> tuple[dict[str, tuple[str, str]], str]:
    """pytest of `tests` in a subprocess under the mutant: (test id -> (PASSED / FAILED / ERROR, the failure's
    first line), pytest's closing summary line). Skipped tests (GPU ones without a GPU) are not listed."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DLRM_MUTANT")}
    env["COLUMNS"] = "400"  # the summary's failure reasons are cut to the terminal's width
    if mutant:
        env |= {"DLRM_MUTANT": mutant, "DLRM_MUTANT_SCOPE": scope}
    command = [sys.executable, "-m", "pytest", "-p", "tests.mutants", "-rA", "-q", "-p", "no:cacheprovider"]
    result = subprocess.run([*command, *tests], capture_output=True, text=True, env=env)
    found = re.findall(r"^(PASSED|FAILED|ERROR) (\S+)(?: - (.*))?$", result.stdout, re.M)
    if not found:
        raise SystemExit(f"pytest ran no test:\n{result.stdout}\n{result.stderr}")
    summary = result.stdout.strip().splitlines()[-1].strip("= ")
    return {test: (outcome, why) for outcome, test, why in found}, summary


def main(argv: list[str]) -> int:
    tests = argv[argv.index("--") + 1 :] if "--" in argv else TESTS
    runs = [(None, "-")] + [(mutant, scope) for mutant in MUTANTS for scope in SCOPES]
    results, wrong = {}, 0
    for mutant, scope in runs:
        start = time.perf_counter()
        results[mutant, scope], summary = _run(tests, mutant, scope)
        seconds = time.perf_counter() - start
        print(f"{mutant or 'unmutated'} (scope {scope}): {summary}; {seconds:.0f} s", flush=True)
    names = [f"{m}/{s}" if m else "unmutated" for m, s in runs]
    print("\n" + " ".join(f"{name:<20}" for name in names) + " test")
    for test in results[None, "-"]:
        row = [results[run].get(test, ("MISSING", ""))[0] for run in runs]
        caught = row == ["PASSED"] + ["FAILED"] * (len(runs) - 1)
        wrong += not caught
        print(" ".join(f"{outcome:<20}" for outcome in row) + f" {test}{'' if caught else '  <- NOT CAUGHT'}")
    print("\nwhat failed under each mutant (the first line of the assertion):")
    for run, name in zip(runs[1:], names[1:], strict=True):
        for test, (outcome, why) in results[run].items():
            print(f"  {name:<20} {outcome} {test.split('::')[-1]}: {why[:150]}")
    print(f"\n{wrong} test(s) passed a mutant or failed unmutated" if wrong else "\nall caught every mutant")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
