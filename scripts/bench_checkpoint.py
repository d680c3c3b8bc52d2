"""Checkpoints the size of the tables, measured on real `dlrm.train` runs: the preflight's refusal, the host
memory and the step time of background saves, and resuming bit-exactly on N ranks and, resharded, on one.

    python scripts/bench_checkpoint.py --nproc 2 [--config configs/dlrm_dcnv2.json] [--max-rows 12000000] \
        [--data /tmp/bench_checkpoint_data] [--work /tmp/bench_checkpoint] [--repeat-whole]

Data: synthetic rows shaped as Criteo 1TB's (python -m dlrm.data.synthetic --cardinalities terabyte, then
python -m dlrm.data.binary when the config's loader is "binary"), generated into `--data` when it holds none:
as many train rows as the longest run's steps need, so that no run reaches the end of an epoch (whose
evaluation would add a save).

1. refusal: `torchrun --nproc-per-node N -m dlrm.train --config CONFIG --use-triton` on the config's full
   tables, into a run directory whose disk cannot hold the checkpoints that train.checkpoint_policy keeps (a
   disk of up to a few hundred GiB, for dlrm_dcnv2's 195 GiB checkpoints; on a larger one, or with
   `--refusal-free-gib`, each rank is started with shutil.disk_usage reporting that much free, as
   tests/test_checkpoint_saving.py does). Rows: the exit status of every rank, the number of `error:` lines,
   the seconds from the launch to the refusal.
2. save: a run "save" of `--max-rows` rows per table on N ranks, evaluating every `--save-at` steps and
   stopping at `--steps` (train.checkpoint_policy "best_and_last", saves in the background, a log line per
   step): the first evaluation writes last and best in the background while training goes on; the one at
   `--steps` writes last (and best if better) at the end. The launcher samples each rank's VmRSS
   (/proc/<pid>/status) every 20 ms. Rows per rank: the peak host RSS during the saves against the peak of
   the training's own before the first save (target: within 4 GiB); for the run: each save's duration and
   the seconds training was held by it, and (once phase 3's uninterrupted run has run) the median step time
   (the loop's own ms/step of each log line) of the steps whose iteration overlaps a background save
   against the same steps of the uninterrupted run, which has no save beside them (target: within 1.2x).
   The save and resume runs read their data with `--loader` (default "memory", whose batches are the same
   on any number of ranks; "binary" goes on after a resharded resume in the new number of ranks' order, so
   its losses differ from the whole run's; "streaming" resumes on N ranks only, one line otherwise).
3. resume: an uninterrupted run "whole" of `--steps` + `--resume-steps` steps (train.checkpoint_policy
   "last_only"), and the save run's last checkpoint resumed for `--resume-steps` steps on N ranks
   ("resumed-N") and, resharded, in one process on one GPU ("resumed-1", after "resharded-1" below, so that
   `--deadline-s` cuts it first: only a resharded load can be bit-exact). Rows per resumed run: the largest
   absolute difference of the weights (every model tensor of the final checkpoints, read tensor by tensor) and
   of the per-step losses (TensorBoard's train/loss) from the whole run's, against 0 (bit-exact); on N ranks
   also how many of DCP's data files have the whole run's sha256. On N > 1 ranks, "resharded-1" loads the save
   run's checkpoint into one process and saves it there with no step between: its model tensors against the
   checkpoint's, bit for bit (a resumed one-process run's steps sum in another order than N ranks', so only
   the load can be exact). With `--repeat-whole`, a second uninterrupted run "whole-again" (as many steps and
   GPU-seconds again; after the resumes, so that `--deadline-s` cuts it first) is compared with "whole" the
   same way: the run-to-run noise of the runs' kernels, against which a resumed run's difference reads (0
   where every kernel sums in a fixed order; a kernel of atomic adds makes two runs differ by ulps from the
   first step on, and training compounds them: a resumed run cannot be closer to "whole" than that). The whole
   runs launch the save run's kernels (`--kernel-choices` its last checkpoint), as a resume does: GEMMs tuned
   by timing choose apart run to run on a busy GPU, and two choices sum in different orders.

Each run starts once the page cache's writes of the runs before it are on disk (os.sync, its seconds
printed), so that no run's steps, the uninterrupted run's baseline among them, run beside an earlier run's
writeback of its checkpoints.

The checkpoints the runs keep at once (the save run's 3 by its preflight, then the save run's last, the whole
run's last and a resumed run's 2, or whole-again's 2) must fit on `--work`'s disk: `--max-rows` is lowered
to the largest cap that fits, with a line saying so (`--no-fit-disk` keeps it and lets the preflight
refuse). Rows go to scripts/results/checkpoint.csv (`--results`): machine, config, nproc, max_rows, the
state's GiB, what, value, unit, baseline and its value, target, whether it is met, a note. Each run's log
is kept in `--work`/<run>.log; the checkpoints are deleted at the end unless `--keep`. A run still going at
`--deadline-s` after the start is killed and the rows measured until then are kept, as they are when the
benchmark itself is stopped by SIGTERM (e.g. `timeout`) or Ctrl-C, which kill the run going on.
"""

import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import torch
from results_csv import append_rows, provenance

from dlrm.config import RunConfig, apply_overrides, load_config
from dlrm.model.tables import resolve_table_rows
from dlrm.run.checkpoints import HEADER_BYTES, HEADER_SHARE, checkpoints_at_once

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "checkpoint.csv"
GIB = 2**30
RSS_TARGET_GIB = 4.0  # issue 45: peak host RSS per rank during a save within 4 GB of the training's own
STEP_TARGET = 1.2  # issue 45: a step while a background save runs within 1.2x of one without
SAMPLE_S = 0.02  # the RSS sampler's period
# Each rank reports this much free on its disk (shutil.disk_usage, the preflight's measure): run before
# dlrm.train by `python -c`, as tests/test_checkpoint_saving.py's LITTLE_FREE_SPACE.
FAKE_FREE = """
import shutil
_real = shutil.disk_usage
shutil.disk_usage = lambda path: _real(path)._replace(free={free})
import runpy
runpy.run_module("dlrm.train", run_name="__main__")
"""

STEP_LINE = re.compile(r"step (\d+) \| loss [-\d.naif]+(?: \| [\d,]+ samples/s \| ([\d.]+) ms/step)?")
EVAL_LINE = re.compile(r"step (\d+) \| val auc .* \| ([\d.]+) s$")
WRITING_LINE = re.compile(r"step (\d+): writing checkpoint (\S+)(?: and \S+)? in the background")
WRITTEN_LINE = re.compile(
    r"step (\d+): checkpoint (\S+)(?: and \S+)? \(written in the background in ([\d.]+) s\)"
)
SYNC_LINE = re.compile(r"step (\d+): checkpoint (\S+)(?: and \S+)?$")
PREFLIGHT_LINE = re.compile(r"checkpoints: ([\d,.]+) (GiB|MiB) each")


# ---------------------------------------------------------------------------------------------------------
# Launching dlrm.train and watching its ranks


@dataclass
class Launch:
    """One `dlrm.train` job as the launcher saw it: its exit status, each output line with the time it
    arrived (time.monotonic), each rank's VmRSS samples [(time, bytes)], its wall time."""

    name: str
    code: int = 0
    lines: list[tuple[float, str]] = field(default_factory=list)
    rss: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    ranks: dict[int, int] = field(default_factory=dict)  # pid -> rank
    start: float = 0.0
    wall_s: float = 0.0
    timed_out: bool = False

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def errors(self) -> list[str]:
        return [line for _, line in self.lines if line.startswith("error: ")]

    def rank_codes(self, nproc: int) -> list[int]:
        """Each rank's exit status: the process's own in one process; under torchrun those its agent
        reports for failed ranks (`rank : k ... exitcode : x`), 0 for the others."""
        if nproc == 1:
            return [self.code]
        codes, rank = [0] * nproc, None
        for _, line in self.lines:
            if m := re.match(r"\s*rank\s*:\s*(\d+)", line):
                rank = int(m.group(1))
            elif (m := re.match(r"\s*exitcode\s*:\s*(-?\d+)", line)) and rank is not None and rank < nproc:
                codes[rank], rank = int(m.group(1)), None
        return codes


def _children(pid: int) -> dict[int, int]:
    """{pid: parent pid} of every process under `pid` (from /proc/*/stat)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                found[child] = ppid
                frontier.append(child)
    return found


def _rank_of(pid: int) -> int | None:
    """The RANK in process `pid`'s environment (a torchrun rank), else None."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _sample_rss(proc: subprocess.Popen, nproc: int, launch: Launch, done: threading.Event) -> None:
    """Every SAMPLE_S until `done`: each rank's VmRSS into launch.rss (ranks: the process itself in one
    process; the processes under torchrun with RANK in their environment) into launch.ranks."""
    ranks = launch.ranks
    while not done.is_set():
        if len(ranks) < nproc:
            if nproc == 1:
                ranks[proc.pid] = 0
            else:
                for pid in _children(proc.pid):
                    rank = _rank_of(pid)
                    if rank is not None and pid not in ranks:
                        ranks[pid] = rank
        now = time.monotonic()
        for pid, rank in ranks.items():
            rss = _rss_bytes(pid)
            if rss is not None:
                launch.rss.setdefault(rank, []).append((now, rss))
        done.wait(SAMPLE_S)


def launch(
    name: str, nproc: int, args: list, work: Path, env: dict, deadline: float, fake_free: int | None = None
) -> Launch:
    """Run `dlrm.train` with `args` on `nproc` ranks (torchrun --standalone; one process: python -m
    dlrm.train) once the page cache's writes are on disk (os.sync), its output to work/<name>.log and its
    key lines to stdout; with `fake_free`, every rank sees that many bytes free on its disk. At `deadline`
    (time.monotonic) its ranks and torchrun are killed (SIGKILL, by pid) and the Launch says `timed_out`."""
    python = [sys.executable]
    if fake_free is not None:
        train = ["-c", FAKE_FREE.format(free=fake_free)]
        runner = python if nproc == 1 else [*python, "-m", "torch.distributed.run", "--no-python"]
    else:
        train = ["-m", "dlrm.train"]
        runner = python if nproc == 1 else [*python, "-m", "torch.distributed.run"]
    if nproc > 1:
        runner = [*runner, "--standalone", "--nproc-per-node", str(nproc)]
        if fake_free is not None:
            runner.append(sys.executable)
    command = [*runner, *train, *map(str, args)]
    shown = command if fake_free is None else [*runner, "-c", "<FAKE_FREE>", *map(str, args)]
    print(f"[{name}] {' '.join(shown)}", flush=True)
    # Earlier runs' checkpoints still in the page cache are written back first (sync waits for it): a run
    # started beside their writeback has slower steps, and the uninterrupted run's steps are a baseline.
    flushing = time.monotonic()
    os.sync()
    print(f"[{name}] earlier writes flushed to disk in {time.monotonic() - flushing:.1f} s", flush=True)
    result = Launch(name)
    log = (work / f"{name}.log").open("w")
    log.write(" ".join(map(str, command)) + "\n")
    result.start = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        start_new_session=True,
    )  # fmt: skip
    done = threading.Event()
    sampler = threading.Thread(target=_sample_rss, args=(proc, nproc, result, done), daemon=True)
    sampler.start()

    def kill_at_deadline() -> None:
        if done.wait(max(0.0, deadline - time.monotonic())):
            return
        result.timed_out = True
        _kill(proc.pid, result.ranks)

    killer = threading.Thread(target=kill_at_deadline, daemon=True)
    killer.start()
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            result.lines.append((time.monotonic(), line))
            log.write(line + "\n")
            if _worth_showing(line):
                print(f"[{name}] {line}", flush=True)
    except BaseException:  # the bench itself stopped (SIGTERM, Ctrl-C): its run goes with it
        _kill(proc.pid, result.ranks)
        raise
    result.code = proc.wait()
    result.wall_s = time.monotonic() - result.start
    done.set()
    sampler.join()
    killer.join()
    log.close()
    late = " (killed at the deadline, --deadline-s)" if result.timed_out else ""
    print(f"[{name}] exit {result.code} after {result.wall_s:.1f} s{late}", flush=True)
    return result


def _kill(leader: int, ranks: dict[int, int]) -> None:
    """SIGKILL to the session `leader` heads (a launch: torchrun or the one process, and everything they
    started, e.g. Inductor's compile workers, which hold the run's stdout open) and to each rank of `ranks`
    (pid -> rank) with its own process group, if it made one."""
    for pid in (leader, *ranks):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:  # gone, or no group of its own: the process alone
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _worth_showing(line: str) -> bool:
    message = line.split(" - ", 1)[-1]
    keys = (
        "error",
        "checkpoint",
        "val auc",
        "first step",
        "test (",
        "done:",
        "resuming",
        "WARNING",
        "exitcode",
    )
    return any(key in message for key in keys) and not STEP_LINE.search(message)


# ---------------------------------------------------------------------------------------------------------
# What a run's log and samples say


@dataclass
class Save:
    """A checkpoint the run wrote: its step; when the loop started it (the line before: its evaluation's, or
    the last step's); when the loop went on ("writing ... in the background"; None: written at once); its
    "checkpoint ..." line; its writing's seconds (the logged background time, or end - start)."""

    step: int
    start: float
    queued: float | None
    end: float
    seconds: float


def saves(run: Launch) -> list[Save]:
    """The checkpoints the run wrote, from rank 0's log."""
    out, last_line, queued = [], run.start, {}
    for t, line in run.lines:
        if m := WRITING_LINE.search(line):
            queued[int(m.group(1))] = (last_line, t)
        elif m := WRITTEN_LINE.search(line):
            step = int(m.group(1))
            start, at = queued.pop(step, (t, t))
            out.append(Save(step, start, at, t, float(m.group(3))))
        elif m := SYNC_LINE.search(line.split(" - ", 1)[-1]):
            out.append(Save(int(m.group(1)), last_line, None, t, t - last_line))
        if STEP_LINE.search(line) or EVAL_LINE.search(line):
            last_line = t
    return out


def steps(run: Launch) -> list[tuple[float, int, float | None]]:
    """(time, step, ms/step of the loop's log line: None for a step timed apart) of each step line."""
    out = []
    for t, line in run.lines:
        if m := STEP_LINE.search(line):
            out.append((t, int(m.group(1)), float(m.group(2)) if m.group(2) else None))
    return out


def peak(samples: list[tuple[float, int]], start: float, end: float) -> int | None:
    inside = [rss for t, rss in samples if start <= t <= end]
    return max(inside) if inside else None


def checkpoint_gib(run: Launch) -> float | None:
    """The size of a checkpoint, as the preflight logged it."""
    for _, line in run.lines:
        if m := PREFLIGHT_LINE.search(line):
            value = float(m.group(1).replace(",", ""))
            return value if m.group(2) == "GiB" else value / 1024
    return None


def losses(run_dir: Path) -> dict[int, float]:
    """{step: train/loss} of the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train/loss")}


# ---------------------------------------------------------------------------------------------------------
# Comparing checkpoints tensor by tensor (never a whole checkpoint in memory)


class Weights:
    """The model tensors of a checkpoint, read one at a time: a sharded directory through DCP (no process
    group), a .pt file memory-mapped."""

    def __init__(self, path: Path):
        self.path = path
        if path.is_dir():
            import torch.distributed.checkpoint as dcp

            self._dcp = dcp
            self._reader = dcp.FileSystemReader(path)
            metadata = self._reader.read_metadata().state_dict_metadata
            self.meta = {
                k: md for k, md in metadata.items() if k.startswith("model/") and hasattr(md, "size")
            }
            self.names = sorted(k.removeprefix("model/") for k in self.meta)
        else:
            try:
                self._state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # not memory-mappable: read whole
                self._state = torch.load(path, map_location="cpu", weights_only=True)
            self.names = sorted(self._state["model"])

    def __getitem__(self, name: str) -> torch.Tensor:
        if not self.path.is_dir():
            return self._state["model"][name]
        md = self.meta[f"model/{name}"]
        state = {f"model/{name}": torch.empty(md.size, dtype=md.properties.dtype)}
        self._dcp.load(state, storage_reader=self._dcp.FileSystemReader(self.path), no_dist=True)
        return state[f"model/{name}"]


def compare_weights(path: Path, reference: Path) -> tuple[float, int, int]:
    """(largest absolute difference, tensors bitwise equal, tensors) of the model tensors of checkpoint
    `path` against `reference`'s (inf where their names or shapes differ)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, theirs = Weights(path), Weights(reference)
        if ours.names != theirs.names:
            return math.inf, 0, len(theirs.names)
        worst, equal = 0.0, 0
        for name in theirs.names:
            a, b = ours[name], theirs[name]
            if a.shape != b.shape or a.dtype != b.dtype:
                return math.inf, equal, len(theirs.names)
            if torch.equal(a, b):
                equal += 1
            elif a.is_floating_point():
                worst = max(worst, (a.float() - b.float()).abs().max().item())
            else:
                worst = math.inf
    return worst, equal, len(theirs.names)


def same_files(path: Path, reference: Path) -> tuple[int, int]:
    """(DCP data files of sharded checkpoint `path` whose sha256 in meta.json is `reference`'s, files)."""
    ours, theirs = (json.loads((p / "meta.json").read_text())["sha256"] for p in (path, reference))
    data = [name for name in theirs if name.endswith(".distcp")]
    return sum(ours.get(name) == theirs[name] for name in data), len(data)


# ---------------------------------------------------------------------------------------------------------
# Sizes


def state_bytes(cfg: RunConfig) -> int:
    """A checkpoint's bytes, estimated from the config (and its data's metadata.json where the config
    names no table_rows): the capped tables in fp32 and their optimizer state (Adagrad: as much again;
    row-wise Adagrad: one value a row), the dense part left out; plus the preflight's allowance for headers
    (dlrm.run.checkpoints)."""
    m = cfg.model
    metadata = {} if m.table_rows else json.loads((Path(cfg.data.path) / "metadata.json").read_text())
    rows = sum(resolve_table_rows(m, metadata))
    per_row = m.embedding_dim * 4
    per_row += {"adagrad": m.embedding_dim * 4, "rowwise_adagrad": 4}.get(cfg.train.optimizer, 0)
    tensors = rows * per_row
    return tensors + HEADER_BYTES + int(HEADER_SHARE * tensors)


def fit_rows(cfg: RunConfig, cap: int, free: int, at_once: int) -> int:
    """The largest cap on rows per table, at most `cap`, whose `at_once` checkpoints fit in `free` bytes
    (0 when none does)."""

    def fits(rows: int) -> bool:
        return at_once * state_bytes(_capped(cfg, rows)) <= free

    if fits(cap):
        return cap
    lo, hi = 0, cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo - lo % 100_000 if lo > 100_000 else lo


def _capped(cfg: RunConfig, max_rows: int) -> RunConfig:
    return apply_overrides(cfg, [f"model.max_rows={max_rows}"])


def write_config(cfg: RunConfig, path: Path, overrides: list[str]) -> Path:
    path.write_text(json.dumps(apply_overrides(cfg, overrides).to_dict(), indent=2))
    return path


def ensure_data(data: Path, rows: int, cardinalities: str, binary: bool, env: dict) -> None:
    """Synthetic rows in `data` (at least `rows`; generated anew when fewer), their binary splits too."""
    metadata = data / "metadata.json"
    have = sum(json.loads(metadata.read_text()).get("rows", {}).values()) if metadata.is_file() else 0
    if have < rows:
        command = [
            sys.executable,
            "-m",
            "dlrm.data.synthetic",
            "--rows",
            str(rows),
            "--output-dir",
            str(data),
            "--cardinalities",
            cardinalities,
            "--eval-fraction",
            "0.1",
            "--overwrite",
        ]
        print(f"[data] {' '.join(command)}", flush=True)
        subprocess.run(command, cwd=REPO, env=env, check=True)
    if binary and not (data / "binary" / "train" / "format.json").is_file():
        command = [sys.executable, "-m", "dlrm.data.binary", "--data", str(data)]
        print(f"[data] {' '.join(command)}", flush=True)
        subprocess.run(command, cwd=REPO, env=env, check=True)


# ---------------------------------------------------------------------------------------------------------
# The phases


class OutOfTime(Exception):
    """The invocation's --deadline-s came before a run could start or end."""


class Bench:
    """The invocation's settings and the rows measured so far."""

    def __init__(self, nproc, config_name, cfg, max_rows, work, env, train_flags, deadline, repeat_whole):
        self.nproc, self.config_name, self.cfg, self.max_rows = nproc, config_name, cfg, max_rows
        self.work, self.env, self.train_flags, self.deadline = work, env, train_flags, deadline
        self.repeat_whole = repeat_whole  # --repeat-whole
        self.rows: list[dict] = []
        self.state_gib = state_bytes(_capped(cfg, max_rows)) / GIB
        self.during_save: dict[int, float] = {}  # the save run's steps beside a background save: ms

    def row(self, what, value, unit, baseline="", baseline_value="", target="", meets="", note="", **where):
        row = {
            "config": self.config_name,
            "nproc": where.get("nproc", self.nproc),
            "max_rows": where.get("max_rows", self.max_rows),
            "state_gib": _round(float(where.get("state_gib", self.state_gib))),
            "what": what,
            "value": _round(value),
            "unit": unit,
            "baseline": baseline,
            "baseline_value": _round(baseline_value),
            "target": target,
            "meets": {True: "yes", False: "no"}.get(meets, meets),
            "note": note,
        }
        self.rows.append(row)
        shown = f"{row['value']} {unit}" + (f" vs {baseline} {row['baseline_value']}" if baseline else "")
        print(
            f"  {what} (nproc {row['nproc']}): {shown}" + (f" [{target}: {row['meets']}]" if target else "")
        )

    def run(self, name: str, nproc: int, args: list, fake_free: int | None = None) -> Launch:
        """`launch` with the invocation's flags, killed at its deadline (OutOfTime, after a row saying so)."""
        if time.monotonic() >= self.deadline:
            raise OutOfTime(f"no time left for {name} (--deadline-s)")
        result = launch(
            name, nproc, [*args, *self.train_flags], self.work, self.env, self.deadline, fake_free
        )
        if result.timed_out:
            self.row(
                f"{name}_killed_at_deadline",
                result.wall_s,
                "s",
                nproc=nproc,
                note=f"--deadline-s reached; its log: {self.work}/{name}.log",
            )
            raise OutOfTime(f"{name} was killed at the deadline (--deadline-s)")
        return result


def _stopped(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:,.1f} MiB"


def _round(value):
    """A float to 6 significant digits (CSV), anything else as it is."""
    return float(f"{value:.6g}") if isinstance(value, float) and math.isfinite(value) else value


def refusal(bench: Bench, config: Path, free_gib: float | None) -> None:
    """Phase 1: the config's full tables into a run directory whose disk cannot hold their checkpoints."""
    full = load_config(config)
    need = checkpoints_at_once(full.train) * state_bytes(full)
    run_dir = bench.work / "refused"
    free = shutil.disk_usage(bench.work).free
    fake = None
    if free_gib is not None:
        fake = int(free_gib * GIB)
    elif free >= need:  # this disk could hold them: report a smaller one to the ranks
        fake = need // 4
    seen = fake if fake is not None else free
    note_free = f"{_size(seen)} free ({'reported to the ranks' if fake is not None else 'the real disk'})"
    result = bench.run("refusal", bench.nproc, ["--config", config, "--output-dir", run_dir], fake)
    errors = result.errors()
    error_s = next((t - result.start for t, line in result.lines if line.startswith("error: ")), math.nan)
    first_step = any("first step" in line for _, line in result.lines)
    codes = result.rank_codes(bench.nproc)
    where = {"max_rows": full.model.max_rows, "state_gib": state_bytes(full) / GIB}
    note = f"{note_free}; {len(errors)} error line(s): {errors[0] if errors else '(none)'}"
    bench.row(
        "refusal_exit_code",
        max(codes, key=abs),
        "max over ranks",
        target="2 from every rank",
        meets=all(c == 2 for c in codes) and not first_step,
        note=f"ranks {codes}; {note}",
        **where,
    )
    bench.row(
        "refusal_error_lines",
        len(errors),
        "lines",
        target="1",
        meets=len(errors) == 1,
        note=f"launcher exit {result.code}; run directory left: {run_dir.exists()}",
        **where,
    )
    bench.row(
        "refusal_s",
        error_s,
        "s from launch to the error line",
        note=f"all ranks gone after {result.wall_s:.1f} s; before the first step: {not first_step}",
        **where,
    )


def save_run(bench: Bench, config: Path, stop: int) -> Path:
    """Phase 2: the run whose saves are measured; returns its last checkpoint."""
    run_dir = bench.work / "save"
    result = bench.run(
        "save", bench.nproc, ["--config", config, "--output-dir", run_dir, "--max-steps", stop]
    )
    if result.code != 0:
        raise click.ClickException(f"the save run failed (exit {result.code}): see {bench.work}/save.log")
    if gib := checkpoint_gib(result):
        bench.state_gib = gib
    written = saves(result)
    # Each step's loop iteration, from the step line before it to its own: (start, end, step, ms/step).
    timed, since = [], result.start
    for t, step, ms in steps(result):
        if ms is not None:
            timed.append((since, t, step, ms))
        since = t
    first = written[0].start if written else math.inf
    background = [(s.queued, s.end) for s in written if s.queued is not None]
    for s in written:
        kind = "in the background" if s.queued is not None else "at once"
        bench.row(
            f"save_s_step_{s.step}",
            s.seconds,
            "s writing",
            baseline="checkpoint_gib",
            baseline_value=bench.state_gib,
            note=f"written {kind}, {bench.state_gib / s.seconds if s.seconds else math.nan:.2f} GiB/s",
        )
        held = (s.queued if s.queued is not None else s.end) - s.start
        bench.row(
            f"save_held_s_step_{s.step}",
            held,
            "s the loop waited (evaluation and snapshot included)",
            note="from the evaluation's line to the loop going on",
        )

    # A step is "during" a background save when its iteration overlaps the save's window: a save shorter
    # than one step still has the step it ran beside.
    def overlaps(t0: float, t: float) -> bool:
        return any(t0 < b and a < t for a, b in background)

    bench.during_save = {step: ms for t0, t, step, ms in timed if overlaps(t0, t)}
    first_step = next((t for t, step, _ in steps(result) if step >= 2), result.start)
    for rank in sorted(result.rss):
        samples = result.rss[rank]
        own = peak(samples, first_step, first)
        during_save = max(
            (p for s in written if (p := peak(samples, s.start, s.end)) is not None), default=None
        )
        if own is None or during_save is None:
            bench.row(f"rss_peak_during_save_rank{rank}", math.nan, "GiB", note="no samples in the windows")
            continue
        more = (during_save - own) / GIB
        bench.row(
            f"rss_peak_during_save_rank{rank}",
            during_save / GIB,
            "GiB",
            baseline="rss_peak_training_before_first_save",
            baseline_value=own / GIB,
            target=f"<= baseline + {RSS_TARGET_GIB:g} GiB",
            meets=more <= RSS_TARGET_GIB,
            note=f"+{more:.2f} GiB; {len(samples)} samples every {SAMPLE_S * 1000:.0f} ms; whole run "
            f"peak {max(r for _, r in samples) / GIB:.2f} GiB",
        )
    shutil.rmtree(run_dir / "checkpoints" / "best", ignore_errors=True)  # (its step, if not last's: disk)
    for name in ("best.pt",):
        (run_dir / "checkpoints" / name).unlink(missing_ok=True)
    return run_dir / "checkpoints" / ("last" if bench.nproc > 1 else "last.pt")


def resume(bench: Bench, config: Path, start: Path, stop: int, more: int) -> None:
    """Phase 3: the uninterrupted run, `start` resumed on N ranks and in one process, then (--repeat-whole)
    the uninterrupted run again."""
    end = stop + more
    whole_dir = bench.work / "whole"
    args = ["--config", config, "--output-dir", whole_dir, "--max-steps", end, "--kernel-choices", start]
    whole = bench.run("whole", bench.nproc, args)
    if whole.code != 0:
        raise click.ClickException(
            f"the uninterrupted run failed (exit {whole.code}): see {bench.work}/whole.log"
        )
    step_time_row(bench, whole)
    reference = whole_dir / "checkpoints" / ("last" if bench.nproc > 1 else "last.pt")
    expected = losses(whole_dir)
    for nproc in sorted({bench.nproc, 1}, reverse=True):
        if nproc != bench.nproc:  # the load's bit-exact row (a target) before the steps' (never exact)
            reshard(bench, config, start, stop)
        name = f"resumed-{nproc}"
        run_dir = bench.work / name
        args = ["--config", config, "--output-dir", run_dir, "--resume", start, "--max-steps", end]
        result = bench.run(name, nproc, args)
        how = f"resharded from {bench.nproc} ranks" if nproc != bench.nproc else "same ranks"
        if result.code != 0:
            errors = result.errors()
            bench.row(
                "resume_exit_code",
                result.code,
                "exit status",
                target="0",
                meets=False,
                nproc=nproc,
                note=f"{how}; {errors[0] if errors else f'see {bench.work}/{name}.log'}",
            )
            continue
        last = run_dir / "checkpoints" / ("last" if nproc > 1 else "last.pt")
        same, files = same_files(last, reference) if nproc > 1 and bench.nproc > 1 else (0, -1)
        if same == files:  # every data file of DCP's the same bytes: weights and optimizer state alike
            worst, note = (
                0.0,
                f"all {files} DCP data files with the same sha256 (weights and optimizer state)",
            )
        else:
            worst, equal, count = compare_weights(last, reference)
            note = f"{equal} of {count} model tensors bitwise equal"
            note += f"; {same} of {files} DCP data files with the same sha256" if files > 0 else ""
        note += f"; {how}; steps {stop + 1}-{end}"
        if not bench.repeat_whole:
            note += "; two uninterrupted runs not compared (--repeat-whole)"
        if nproc != bench.nproc:
            note += (
                " (one process sums the dense gradients of the global batch in another order than "
                f"{bench.nproc} ranks' all-reduce of theirs: ulps apart, as tests/test_parallel.py allows)"
            )
        got = losses(run_dir)
        diffs = [abs(got[s] - expected[s]) for s in range(stop + 1, end + 1) if s in got and s in expected]
        loss_note = (
            f"{len(diffs)} steps ({stop + 1}-{end}) of TensorBoard's train/loss; {how}; "
            f"load and {more} steps: {result.wall_s:.1f} s wall"
        )
        _against_whole_rows(bench, "resume", worst, diffs, more, note, loss_note, nproc=nproc)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # (disk for the next one)
    # Last: the resumes are what the targets ask for, the second uninterrupted run the noise they read
    # against, so --deadline-s cuts it first.
    if bench.repeat_whole:
        repeat_whole(bench, config, start, reference, expected, end)


def reshard(bench: Bench, config: Path, start: Path, stop: int) -> None:
    """The N ranks' checkpoint `start` loaded into one process and saved there with no step between
    (dlrm.train resumed into another run directory at its last step: evaluated, then saved): its model
    tensors against `start`'s, bit for bit. The resumed runs' rows cannot say this for one process, whose
    steps sum in another order than N ranks'."""
    name, run_dir = "resharded-1", bench.work / "resharded-1"
    args = ["--config", config, "--output-dir", run_dir, "--resume", start, "--max-steps", stop]
    result = bench.run(name, 1, args)
    last = run_dir / "checkpoints" / "last.pt"
    if result.code != 0 or not last.is_file():
        errors = result.errors()
        bench.row(
            "reshard_exit_code", result.code, "exit status", target="0", meets=False, nproc=1,
            note=errors[0] if errors else f"no {last}; see {bench.work}/{name}.log",
        )  # fmt: skip
        return
    worst, equal, count = compare_weights(last, start)
    bench.row(
        "reshard_weights_max_abs_diff", worst, "max |w - w_saved|",
        baseline=f"{bench.nproc} ranks' checkpoint", baseline_value=0.0, target="0 (bit-exact)",
        meets=worst == 0.0, nproc=1,
        note=f"{equal} of {count} model tensors bitwise equal; loaded into one process and saved at step "
        f"{stop}, no step between; load and save: {result.wall_s:.1f} s wall",
    )  # fmt: skip
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # (disk for the next one)


def step_time_row(bench: Bench, whole: Launch) -> None:
    """The median ms of the save run's steps whose iteration overlapped a background save against the
    uninterrupted run's same steps: the same batches and work with no save beside them (it evaluates at the
    same steps and writes its one checkpoint at its end). The save run's other steps are no baseline: the
    first ones pay for autotuning and graph captures."""
    alone = {step: ms for _, step, ms in steps(whole) if ms is not None}
    pairs = [(ms, alone[step]) for step, ms in sorted(bench.during_save.items()) if step in alone]
    if not pairs:
        bench.row(
            "step_ms_during_background_save",
            math.nan,
            "ms median",
            note=f"{len(bench.during_save)} steps during a background save, none of them timed in the "
            "uninterrupted run",
        )
        return
    during, without = (statistics.median(p[i] for p in pairs) for i in (0, 1))
    bench.row(
        "step_ms_during_background_save",
        during,
        "ms median",
        baseline="step_ms_same_steps_uninterrupted",
        baseline_value=without,
        target=f"<= {STEP_TARGET}x",
        meets=during / without <= STEP_TARGET,
        note=f"ratio {during / without:.3f}; steps {min(bench.during_save)}-{max(bench.during_save)} "
        f"({len(pairs)}); max {max(p[0] for p in pairs):.2f} vs {max(p[1] for p in pairs):.2f} ms",
    )


def repeat_whole(
    bench: Bench, config: Path, start: Path, reference: Path, expected: dict[int, float], end: int
) -> None:
    """`--repeat-whole`: a second uninterrupted run of `end` steps with the kernels of checkpoint `start`'s
    run, compared with the first (`reference`, its `expected` losses): the run-to-run noise the resumed
    runs' rows read against."""
    name, run_dir = "whole-again", bench.work / "whole-again"
    args = ["--config", config, "--output-dir", run_dir, "--max-steps", end, "--kernel-choices", start]
    result = bench.run(name, bench.nproc, args)
    if result.code != 0:
        raise click.ClickException(f"{name} failed (exit {result.code}): see {bench.work}/{name}.log")
    last = run_dir / "checkpoints" / ("last" if bench.nproc > 1 else "last.pt")
    worst, equal, count = compare_weights(last, reference)
    got = losses(run_dir)
    diffs = [abs(got[s] - expected[s]) for s in range(1, end + 1) if s in got and s in expected]
    first = next((s for s in range(1, end + 1) if got.get(s) != expected.get(s)), None)
    note = f"a second uninterrupted run of the same config, steps 1-{end}: run-to-run noise"
    _against_whole_rows(
        bench, "repeat", worst, diffs, end, f"{note}; {equal} of {count} model tensors bitwise equal",
        f"{note}; {len(diffs)} steps of TensorBoard's train/loss; first differing step: {first}",
    )  # fmt: skip
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # (disk for the resumed runs)


def _against_whole_rows(
    bench: Bench, what: str, worst: float, diffs: list[float], steps: int, weights_note: str, loss_note: str,
    **where,
) -> None:  # fmt: skip
    """The two rows of a run compared with the uninterrupted one, against 0 (bit-exact): `what`_weights_
    max_abs_diff (`worst`) and `what`_loss_max_abs_diff (the largest of the per-step `diffs`; NaN unless all
    `steps` steps were compared)."""
    loss_diff = max(diffs) if len(diffs) == steps else math.nan
    for name, value, unit, note in (
        ("weights", worst, "max |w - w_whole|", weights_note),
        ("loss", loss_diff, "max |loss - loss_whole| per step", loss_note),
    ):
        bench.row(
            f"{what}_{name}_max_abs_diff", value, unit, baseline="uninterrupted run", baseline_value=0.0,
            target="0 (bit-exact)", meets=value == 0.0, note=note, **where,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--nproc", type=click.IntRange(min=1), default=2, help="Ranks (GPUs) of the runs (torchrun).")
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=REPO / "configs" / "dlrm_dcnv2.json",
    help="Run config (the refusal's full tables).",
)
@click.option(
    "--max-rows",
    type=click.IntRange(min=1),
    default=12_000_000,
    help="model.max_rows of the save and resume runs (12M: ~61 GiB of state with dlrm_dcnv2).",
)
@click.option(
    "--fit-disk/--no-fit-disk",
    default=True,
    help="Lower --max-rows to the largest cap whose checkpoints fit on --work's disk.",
)
@click.option(
    "--data",
    type=click.Path(path_type=Path),
    default=Path("/tmp/bench_checkpoint_data"),
    help="Synthetic data (generated when it holds too few rows).",
)
@click.option(
    "--cardinalities",
    type=click.Choice(["terabyte", "kaggle"]),
    default="terabyte",
    help="dlrm.data.synthetic --cardinalities.",
)
@click.option(
    "--work",
    type=click.Path(path_type=Path),
    default=Path("/tmp/bench_checkpoint"),
    help="Run directories and logs (emptied first).",
)
@click.option("--save-at", type=click.IntRange(min=2), default=15, help="Evaluate every N steps.")
@click.option("--steps", type=click.IntRange(min=3), default=30, help="Steps of the save run.")
@click.option("--resume-steps", type=click.IntRange(min=1), default=8, help="Steps after the resume.")
@click.option(
    "--loader",
    type=click.Choice(["memory", "gpu_resident", "binary", "streaming"]),
    default="memory",
    help="data.loader of the save and resume runs (the refusal keeps the config's); memory reads the same "
    "batches on any number of ranks, binary goes on in the new number of ranks' order, streaming resumes on "
    "its own number of ranks only.",
)
@click.option("--phases", default="refusal,save,resume", help="Comma-separated: refusal, save, resume.")
@click.option(
    "--refusal-free-gib",
    type=float,
    default=None,
    help="Free space each rank of the refusal sees [default: the disk's, unless it fits]",
)
@click.option("--use-triton/--no-use-triton", default=True, help="dlrm.train --use-triton.")
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Config overrides for every run."
)
@click.option("--results", type=click.Path(path_type=Path), default=RESULTS, help="CSV the rows go to.")
@click.option(
    "--repeat-whole",
    is_flag=True,
    help="Also run the uninterrupted run a second time and compare the two: the run-to-run noise the resumes "
    "read against (as many steps and GPU-seconds again).",
)
@click.option("--keep", is_flag=True, help="Keep the checkpoints (deleted at the end by default).")
@click.option(
    "--deadline-s",
    type=click.FloatRange(min=1),
    default=450.0,
    help="Seconds for the whole invocation: a run still going then is killed, the rows so far kept.",
)
def main(
    nproc,
    config_path,
    max_rows,
    fit_disk,
    data,
    cardinalities,
    work,
    save_at,
    steps,
    resume_steps,
    loader,
    phases,
    refusal_free_gib,
    use_triton,
    overrides,
    results,
    repeat_whole,
    keep,
    deadline_s,
):
    """Measure checkpoints of large tables on real training runs; rows to scripts/results/checkpoint.csv."""
    phases = [p.strip() for p in phases.split(",") if p.strip()]
    unknown = set(phases) - {"refusal", "save", "resume"}
    if unknown:
        raise click.UsageError(f"--phases: unknown {sorted(unknown)}")
    if "resume" in phases and "save" not in phases:
        raise click.UsageError("--phases: resume needs save (it resumes the save run's checkpoint)")
    if not save_at < steps:
        raise click.UsageError("--steps must be above --save-at: the first save runs while training goes on")
    signal.signal(signal.SIGTERM, _stopped)  # as Ctrl-C: the `finally` below keeps the rows measured
    started = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    for entry in work.iterdir():  # the runs of an earlier invocation (their checkpoints fill the disk)
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    # torchrun sets one thread per rank otherwise: the tables' initial rows are drawn on the CPU by
    # torch.get_num_threads() threads (dlrm.model.sparse.init_tables).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))

    base = apply_overrides(
        load_config(config_path), [f"data.path={data}", "profiler.enabled=false", *overrides]
    )
    end = steps + resume_steps
    batch = base.data.batch_size
    # Train rows for every run's steps and one batch more (no run reaches an epoch's end), at 90% of rows.
    rows = math.ceil((end + 1) * batch / 0.9) + 1000
    ensure_data(data, rows, cardinalities, "binary" in (base.data.loader, loader), env)
    free = shutil.disk_usage(work).free
    at_once = 4 if "resume" in phases else 3  # (the module docstring)
    if fit_disk and ("save" in phases):
        fitted = fit_rows(base, max_rows, int(0.95 * free), at_once)
        if fitted < max_rows:
            print(
                f"--max-rows {max_rows}: {at_once} checkpoints of "
                f"{_size(state_bytes(_capped(base, max_rows)))} do not fit in the {_size(free)} free on "
                f"{work}; measuring at {fitted} rows per table "
                f"({state_bytes(_capped(base, fitted)) / GIB:.1f} GiB each) (--no-fit-disk keeps it)",
                flush=True,
            )
            max_rows = fitted
        if max_rows < 1:
            raise click.ClickException(
                f"{work}: {free / GIB:.1f} GiB free holds no checkpoint of this config"
            )
    train_flags = ["--use-triton" if use_triton else "--no-use-triton"]
    bench = Bench(
        nproc, config_path.stem, base, max_rows, work, env, train_flags, started + deadline_s,
        repeat_whole=repeat_whole and "resume" in phases,
    )  # fmt: skip
    run_overrides = [
        f"model.max_rows={max_rows}",
        "train.log_interval=1",
        f"train.eval_interval={save_at}",
        "train.evals_per_epoch=null",
        "train.checkpoint_every_s=null",
        "train.checkpoint_interval=null",
        "train.epochs=1",
        f"data.loader={loader}",
    ]
    full_config = write_config(base, work / "full.json", [])
    save_config = write_config(
        base, work / "save.json", [*run_overrides, 'train.checkpoint_policy="best_and_last"']
    )
    whole_config = write_config(
        base, work / "whole.json", [*run_overrides, 'train.checkpoint_policy="last_only"']
    )
    try:
        if "refusal" in phases:
            refusal(bench, full_config, refusal_free_gib)
        if "save" in phases:
            start = save_run(bench, save_config, steps)
            if "resume" in phases:
                resume(bench, whole_config, start, steps, resume_steps)
    except OutOfTime as err:
        raise click.ClickException(f"{err}: the rows measured before it are kept") from None
    finally:
        if bench.rows:
            device = (
                f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
                if torch.cuda.is_available()
                else "cpu"
            )  # (asked only now: the launcher holds no CUDA context while the runs need the GPUs)
            common = provenance(device) | {"cpus": os.cpu_count()}
            append_rows(results, [common | row for row in bench.rows])
            print(f"{len(bench.rows)} rows -> {results} ({time.monotonic() - started:.0f} s)")
        if not keep:
            for run_dir in work.iterdir():
                if run_dir.is_dir():
                    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


if __name__ == "__main__":
    main()
