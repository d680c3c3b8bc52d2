"""A real-browser check of what `make tensorboard` shows for a run (`make test-browser`).

Trains configs/tiny.json on the preprocessed sample into a temporary runs/ directory, starts TensorBoard
(with the torch-tb-profiler plugin) on it, and in headless Chromium (Playwright for Python driving the
operating system's /usr/bin/chromium; Playwright's own browser download is not needed) checks that:
- the Scalars tab shows train/loss, val/auc (the periodic evaluations), test/auc (the selected weights') and
  the profile/<stage>_ms scalars of the run,
- the Text tab shows the profile table of the stages,
- the PYTORCH_PROFILER tab lists the run and its trace, and its overview counts DataLoader time (read from
  the plugin's API: the overview page draws with Google Charts from www.gstatic.com, which an offline
  machine cannot load).
It saves a screenshot of each (small PNGs, for the README) and exits with 1 on the first failed check.

    .venv/bin/python scripts/check_tensorboard.py [--data data/criteo_sample] \\
        [--screenshots scripts/results/screenshots] [--chromium /usr/bin/chromium] [--port 6017]
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("data", "embedding", "bottom_mlp", "interaction", "top_mlp", "loss", "backward", "optimizer")
VIEWPORT = {"width": 1100, "height": 720}
TIMEOUT_MS = 60_000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO / "data" / "criteo_sample")
    parser.add_argument("--screenshots", type=Path, default=REPO / "scripts" / "results" / "screenshots")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--port", type=int, default=6017)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright  # the optional [browser] dependency

    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp) / "runs"
        train_tiny(args.data, runs / "tiny", Path(tmp) / "tiny.json")
        server = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "tensorboard"),
                "--logdir",
                str(runs),
                "--port",
                str(args.port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://localhost:{args.port}"
            wait_for_run(url)
            args.screenshots.mkdir(parents=True, exist_ok=True)
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(
                    executable_path=args.chromium, headless=True, args=["--no-sandbox"]
                )
                page = browser.new_page(viewport=VIEWPORT)
                page.set_default_timeout(TIMEOUT_MS)
                check_scalars(page, url, args.screenshots / "tensorboard_scalars.png")
                check_text(page, url, args.screenshots / "tensorboard_text.png")
                check_profiler(page, url, args.screenshots / "tensorboard_profiler.png")
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"browser check passed; screenshots in {args.screenshots}")
    return 0


def train_tiny(data: Path, run_dir: Path, config_path: Path) -> None:
    """configs/tiny.json on `data` into `run_dir` (CPU; a few seconds)."""
    config = json.loads((REPO / "configs" / "tiny.json").read_text())
    config["data"]["path"] = str(data.resolve())
    config_path.write_text(json.dumps(config))
    subprocess.run(
        [sys.executable, "-m", "dlrm.train", "--config", str(config_path), "--output-dir", str(run_dir)]
        + ["--device", "cpu", "--quiet"],
        cwd=REPO,
        check=True,
    )


def wait_for_run(url: str, timeout_s: float = 120) -> None:
    """Until TensorBoard serves the run's scalars and the profiler plugin lists it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            tags = json.load(urllib.request.urlopen(f"{url}/data/plugin/scalars/tags", timeout=5))
            runs = json.load(urllib.request.urlopen(f"{url}/data/plugin/pytorch_profiler/runs", timeout=5))
            if "profile/embedding_ms" in tags.get("tiny", {}) and "tiny" in runs.get("runs", []):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"TensorBoard at {url} did not serve the run within {timeout_s:.0f} s")
        time.sleep(1)


def check_scalars(page, url: str, screenshot: Path) -> None:
    page.goto(f"{url}/#scalars&tagFilter=train%2Floss%7Cval%2Fauc%7Ctest%2Fauc%7Cprofile%2Fembedding_ms")
    for tag in ("train/loss", "val/auc", "test/auc", "profile/embedding_ms"):
        page.get_by_text(tag, exact=True).first.wait_for()
    page.wait_for_timeout(1500)  # let the charts draw
    page.screenshot(path=str(screenshot))
    print("scalars: train/loss, val/auc, test/auc, profile/embedding_ms shown")


def check_text(page, url: str, screenshot: Path) -> None:
    page.goto(f"{url}/#text")
    page.get_by_text("host ms/step").first.wait_for()
    for stage in STAGES:
        page.locator("td", has_text=stage).first.wait_for()
    page.locator("table", has_text="host ms/step").first.screenshot(path=str(screenshot))
    print("text: the profile table lists every stage")


def check_profiler(page, url: str, screenshot: Path) -> None:
    api = f"{url}/data/plugin/pytorch_profiler"
    (worker,) = json.load(urllib.request.urlopen(f"{api}/workers?run=tiny&view=Overview", timeout=30))
    page.goto(f"{url}/#pytorch_profiler")
    frame = page.frame_locator("iframe").first
    for text in ("tiny", "Overview", worker):  # the run, its views and its trace's worker in the selectors
        frame.get_by_text(text, exact=True).first.wait_for()
    page.wait_for_timeout(1500)
    page.screenshot(path=str(screenshot))
    # The overview's charts load Google Charts from www.gstatic.com, which an offline machine cannot reach:
    # its numbers are checked through the plugin's API instead.
    (span,) = json.load(urllib.request.urlopen(f"{api}/spans?run=tiny&worker={worker}", timeout=30))
    overview = json.load(urllib.request.urlopen(f"{api}/overview?run=tiny&worker={worker}&span={span}"))
    parts = {part["name"]: part["value"] for part in overview["performance"][0]["children"]}
    if not parts.get("DataLoader"):
        raise SystemExit(f"profiler overview: no DataLoader time in the step breakdown {parts}")
    print(f"profiler: the run's trace is listed (worker {worker}); its overview shows DataLoader {parts}")


if __name__ == "__main__":
    sys.exit(main())
