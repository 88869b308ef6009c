"""``spotlight report RUN_DIR`` on a real (tiny) run, opened in headless Chromium through
Playwright: no page error, no request beyond the file itself, every plot and both sample grids
decoded. Skipped only where no Chromium is installed (``.ci/run`` installs Debian's)."""

from __future__ import annotations

import html
import json
import shutil
from pathlib import Path

import pytest
from tiny_recipe import TINY_MODEL

from spotlight.cli import main
from spotlight.loop import Loop
from spotlight.recipe import load_recipe
from spotlight.run_report import render

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
RUN = [*TINY_MODEL, "run.iterations=2", "run.eval_every=1", "run.eval_seeds=2", "run.eval_samples=2",
       "run.prompts_per_iteration=2", "run.group_size=4", "run.checkpoint_every=100", "run.tensorboard=false"]


def _open(page_path: Path) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page()
            errors, requests = [], []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_path.as_uri(), wait_until="load", timeout=60_000)
            images = page.evaluate(
                "[...document.images].map(i => ({cls: i.className, w: i.naturalWidth, done: i.complete}))")
            headings = page.evaluate("[...document.querySelectorAll('h2')].map(h => h.textContent)")
            return {"errors": errors, "requests": requests, "images": images, "headings": headings,
                    "title": page.title()}
        finally:
            browser.close()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)")
def test_report_renders_in_a_real_browser(tmp_path, capsys):
    recipe = load_recipe("tiny", [*RUN, f'run.out_dir="{tmp_path}"', 'run.name="rep"'])
    Loop(recipe, progress=False).run()
    capsys.readouterr()
    run_dir = tmp_path / "rep"
    assert main(["report", str(run_dir)]) == 0
    page_path = Path(capsys.readouterr().out.strip())
    assert page_path == run_dir / "report.html"
    shown = _open(page_path)
    assert shown["errors"] == []
    assert shown["requests"] == [page_path.as_uri()]  # nothing fetched: every figure is inline
    assert shown["title"] == "Spotlight run rep"
    plots = [i for i in shown["images"] if i["cls"] == "plot"]
    grids = [i for i in shown["images"] if i["cls"] == "grid"]
    assert len(plots) == 2 and len(grids) == 2  # eval curve + time per iteration; base and trained
    assert all(i["done"] and i["w"] > 100 for i in shown["images"])
    assert shown["headings"][0] == "Evaluation" and "Recipe" in shown["headings"]
    text = html.unescape(page_path.read_text())
    assert "[run]" in text and 'name = "rep"' in text and "checkpoint = null" in text  # the recipe as run


def test_spot_panels_from_spot_fields(tmp_path):
    """A runtime run's records carry spot capacity and cost: both panels are drawn."""
    run_dir = tmp_path / "spot"
    run_dir.mkdir()
    records = [{"event": "eval", "iteration": 0, "eval_ode_heldout": 0.5, "eval_ode_heldout_std": 0.01,
                "wall_s": 1.0}]
    for i in range(4):
        records.append({"event": "iteration", "iteration": i, "reward_mean": 0.5 + i / 100, "wall_s": 2.0 + i,
                        "iteration_s": 1.0, "rollout_s": 0.5, "train_s": 0.3, "explore_s": 0.1,
                        "spot_elapsed_s": 1.0 + i, "spot_nodes": 2 - (i > 1), "preemptions": int(i > 1),
                        "cost_usd": 0.01 * (i + 1)})
    records.append({"event": "eval", "iteration": 4, "eval_ode_heldout": 0.6, "eval_ode_heldout_std": 0.01,
                    "wall_s": 7.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page = render(run_dir)
    assert page.count('class="plot"') == 4 and "no spot capacity" not in page
    assert "(1 preemptions)" in page and "+0.100" in page


def test_a_folder_that_is_not_a_run_is_one_line(tmp_path, capsys):
    for folder, why in ((tmp_path, "no metrics.jsonl"), (tmp_path / "nowhere", "does not exist")):
        assert main(["report", str(folder)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and why in err, err
    (tmp_path / "metrics.jsonl").write_text('{"event": "something else"}\n')
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no iteration or evaluation" in capsys.readouterr().err
