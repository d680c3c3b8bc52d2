"""Evaluation and model selection (the protocol of dlrm.data.splits): during training the val split is
scored, the best val evaluation (by train.select_on: logloss or AUC) kept as checkpoints/best.pt, and
early stopping counts evaluations since it; when the run ends, best.pt's weights are scored once on the
test split."""

import math
import time
from pathlib import Path

from loguru import logger

from dlrm.data.dataset import BatchLoader, load_metadata, open_split
from dlrm.data.splits import REPORT, SELECT
from dlrm.parallel.evaluation import ShardedEvalSplit
from dlrm.run.checkpoints import save_best, wait_for_checkpoint
from dlrm.run.nonfinite import check_finite, weights_finite
from dlrm.run.setup import check_rows
from dlrm.run.state import Interval, Run, RunState


def evaluate_split(run: Run, loader: BatchLoader | ShardedEvalSplit, split: str) -> dict[str, float]:
    """{"auc", "logloss", "ne", "samples"} of the current weights on `split`, read through `loader`
    (the strategy's `split_loader`). Many ranks: every rank must call it (collectives); each scores its
    part and all get the metrics of the whole split. Raises ValueError as dlrm.metrics.evaluate."""
    precision, forward = run.cfg.train.precision, run.eval_forward
    return run.strategy.evaluate(run.model, loader, run.device, precision, forward, run.progress, split)


def evaluate_and_select(run: Run, state: RunState, interval: Interval) -> bool:
    """Evaluate on the val split, log it, keep the best as checkpoints/best.pt; True when early stopping
    says stop. The evaluation's and the checkpoint's time are kept out of the interval's throughput. The
    losses since the last log line are checked first (NonFiniteLoss), and a non-finite evaluation never
    becomes best. The test split is never read here (see `evaluate_selected`). The caller charges its time
    to "eval" (dlrm.run.timing); best.pt's write is charged to "checkpoint", the logging to "log"."""
    check_finite(run, state, interval)
    eval_start = time.perf_counter()
    result = evaluate_split(run, run.val_loader, SELECT)
    # The evaluation alone (its result is on the host, so its GPU work is done); best.pt's write is apart.
    eval_time = time.perf_counter() - eval_start
    state.evals += 1
    state.eval_s += eval_time
    state.first_eval_s = eval_time if state.first_eval_s is None else state.first_eval_s
    state.last_eval, state.last_eval_step = result, state.step
    spent = state.time_spent
    with spent.part("log"):
        for key in ("auc", "logloss", "ne"):
            run.writer.add_scalar(f"{SELECT}/{key}", result[key], state.step)
        logger.info(
            "step {} | val auc {:.4f} logloss {:.4f} ne {:.4f} | {:.2f} s",
            state.step,
            result["auc"],
            result["logloss"],
            result["ne"],
            eval_time,
        )
    # AUC can look finite (a rank statistic) on NaN logits: the logloss and the weights tell.
    finite = all(math.isfinite(result[key]) for key in ("auc", "logloss", "ne")) and weights_finite(run.model)
    if not finite:
        logger.warning("step {}: the evaluation is not finite; not a candidate for best.pt", state.step)
    if finite and (state.best is None or better(result, state.best, run.cfg.train.select_on)):
        state.best, state.evals_since_best = {**result, "step": state.step}, 0
        with spent.part("checkpoint"):
            save_best(run, state)  # last.pt at this step, best.pt the same file (train.checkpoint_policy)
    else:
        state.evals_since_best += 1
    interval.start += time.perf_counter() - eval_start
    patience = run.cfg.train.patience
    if patience is not None and state.evals_since_best >= patience:
        logger.info("early stop: no better val {} in {} evaluations", run.cfg.train.select_on, patience)
        return True
    return False


def better(result: dict[str, float], best: dict[str, float], select_on: str) -> bool:
    """Whether evaluation `result` beats `best` on `select_on` (train.select_on): a lower "logloss" or a
    higher "auc". Ties keep the earlier weights."""
    if select_on == "logloss":
        return result["logloss"] < best["logloss"]
    return result["auc"] > best["auc"]


def evaluate_selected(run: Run, state: RunState) -> dict | None:
    """Evaluate the selected weights, best.pt's (the best val evaluation), once on the test split; log it
    and write test/auc, test/logloss, test/ne at the best step. The current weights when they are those
    (no step since the best evaluation), else best.pt's model state loaded into the model (training is
    over). Many ranks: every rank calls it; the same path as the val evaluation. The caller charges its time
    to "eval" (dlrm.run.timing); the wait for a background save and the loading of best.pt's weights are
    charged to "checkpoint", the logging to "log".

    Returns:
        {"auc", "logloss", "ne", "samples"}, or None when no val evaluation was finite (no best.pt) or the
        checkpoint with the best weights is gone or holds another step (a warning says which).
    Raises:
        ValueError: the test split cannot be read, or is of one class only (dlrm.metrics.evaluate).
        OSError: the checkpoint written in the background failed (dlrm.run.checkpoints.wait_for_checkpoint),
            which every run waits for here.
    """
    spent = state.time_spent
    with spent.part("checkpoint"):
        wait_for_checkpoint(run)
    if state.best is None:
        logger.warning("no finite val evaluation, so no best.pt: no test evaluation")
        return None
    best_step = state.best["step"]
    with spent.part("checkpoint"):
        loaded = state.step == best_step or load_best_weights(run, state)
    if not loaded:
        return None
    data_dir = Path(run.cfg.data.path)
    test_set = open_split(data_dir, REPORT)
    check_rows(data_dir, load_metadata(data_dir), REPORT, test_set.num_rows)
    start = time.perf_counter()
    result = evaluate_split(run, run.strategy.split_loader(test_set, run.cfg, run.device), REPORT)
    with spent.part("log"):
        for key in ("auc", "logloss", "ne"):
            run.writer.add_scalar(f"{REPORT}/{key}", result[key], best_step)
        logger.info(
            "test (weights of step {}, selected on val) | auc {:.4f} logloss {:.4f} ne {:.4f} | {:.2f} s",
            best_step,
            result["auc"],
            result["logloss"],
            result["ne"],
            time.perf_counter() - start,
        )
    return result


def load_best_weights(run: Run, state: RunState) -> bool:
    """Load the model weights of `state.best_checkpoint` (this run's best.pt, or the resumed run's) into
    the model, through the path a resume takes (a sharded checkpoint on many ranks: a collective; its
    optimizer state comes along, unused). False, with a warning, when it is missing or holds another
    step than `state.best` (a resumed run's directory whose best.pt moved on)."""
    path, step = state.best_checkpoint, state.best["step"]
    policy = run.cfg.train.checkpoint_policy
    if path is None and policy != "best_and_last":
        logger.warning(
            "train.checkpoint_policy {!r} keeps no best checkpoint: the weights of step {} are gone, no test "
            "evaluation",
            policy,
            step,
        )
        return False
    if path is None or not path.exists():
        logger.warning("{}: not found, so the weights of step {} are gone: no test evaluation", path, step)
        return False
    checkpoint = run.strategy.read_checkpoint(path)
    held = (checkpoint.get("best") or {}).get("step")
    if held != step:
        logger.warning("{} holds the best of step {}, not of step {}: no test evaluation", path, held, step)
        return False
    run.strategy.load_checkpoint(path, checkpoint, run.model, run.optimizer, with_optimizer=False)
    logger.info("loaded the weights of step {} from {} for the test evaluation", step, path)
    return True
