"""`python -m trainer.cli.report` on fake runs: the summary table's figures (first, last, min, max, the best value and
its step in the metric's direction, steps, records, wall time from main.log or stage_chain.json), a self-contained
HTML page with one plot per metric and one line per run in each, headline plots first and families under their
headings, a skipped step's null left out; a missing run, an empty or corrupt metrics.jsonl is one line, exit 2."""

import json
import os
import re

import pytest

from tests.fork_server import run_module
from tests.trainer.harness import REPO
from trainer.cli import report


def _run(path, records, log_lines=()):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if log_lines:
        (path / "main.log").write_text("".join(line + "\n" for line in log_lines))
    return path


@pytest.fixture
def runs(tmp_path):
    a = _run(tmp_path / "A", [
        {"step": 0, "eval/loss": 5.0},
        {"step": 1, "loss": 6.0, "lr": 1e-4, "tokens_per_s": 100.0, "mfu": 0.01, "aux/indexer_kl": 0.5},
        {"step": 2, "loss": None, "lr": 2e-4, "tokens_per_s": 300.0, "mfu": 0.03, "aux/indexer_kl": 0.4},
        {"step": 3, "loss": 4.0, "lr": 3e-4, "tokens_per_s": 200.0, "mfu": 0.02, "aux/indexer_kl": 0.3},
        {"step": 3, "eval/loss": 4.5},
    ], ["[2026-12-07 10:00:00,000][trainer.train][INFO] - parallel layout: {}",
        "[2026-12-07 10:01:30,500][trainer.progress][INFO] - step 3/3"])
    b = _run(tmp_path / "B", [
        {"step": 0, "eval/success": 0.1, "eval/success_e20": 0.0, "eval/success_e80": 0.2},
        {"step": 1, "loss": 0.3, "lr": 1e-4, "rl/reward": 0.2, "rl/success": 0.25},
        {"step": 2, "loss": 0.2, "lr": 1e-4, "rl/reward": 0.6, "rl/success": 0.5},
        {"step": 2, "eval/success": 0.4, "eval/success_e20": 0.3, "eval/success_e80": 0.5},
    ])
    (b / "stage_chain.json").write_text(json.dumps({"wall_s": 754.0}))
    return a, b


def _cli(*args, cwd=REPO):
    return run_module("trainer.cli.report", list(map(str, args)), cwd=cwd, env=dict(os.environ), timeout=120)


def test_read_run_skips_nulls_and_times_the_run(runs):
    a = report.read_run(runs[0])
    assert a.series["loss"] == [(1, 6.0), (3, 4.0)]  # step 2's null (a skipped step) left out
    assert a.series["eval/loss"] == [(0, 5.0), (3, 4.5)]
    assert a.steps == [0, 1, 2, 3, 3]
    assert a.wall_s == pytest.approx(90.5)
    assert report.read_run(runs[1]).wall_s == 754.0  # what the pipeline measured
    assert report.read_run(runs[0] / "metrics.jsonl").series == a.series  # the file itself


def test_summary_figures(runs):
    overview, metrics = report.summary_rows([report.read_run(p) for p in runs])
    a, b = str(runs[0]), str(runs[1])
    assert overview[1:] == [(a, "0-3", "5", "1m 30s"), (b, "0-2", "4", "12m 34s")]
    rows = {(r[0], r[1]): r[2:] for r in metrics[1:]}
    assert rows[("loss", a)] == ("6", "4", "4", "6", "4 (3)")  # lower is better
    assert rows[("loss", b)] == ("0.3", "0.2", "0.2", "0.3", "0.2 (2)")
    assert rows[("eval/loss", a)] == ("5", "4.5", "4.5", "5", "4.5 (3)")
    assert rows[("tokens_per_s", a)] == ("100", "200", "100", "300", "300 (2)")  # higher is better
    assert rows[("rl/reward", b)] == ("0.2", "0.6", "0.2", "0.6", "0.6 (2)")
    assert rows[("eval/success_e80", b)] == ("0.2", "0.5", "0.2", "0.5", "0.5 (2)")
    keys = [r[0] for r in metrics[1:]]
    assert "lr" not in keys and ("aux/indexer_kl", a) not in rows  # not headline figures
    assert keys.index("eval/success") < keys.index("eval/success_e20") < keys.index("eval/success_e80")


def test_the_page_plots_every_metric_with_each_run_overlaid(runs, tmp_path):
    out = tmp_path / "report.html"
    r = _cli(*runs, "--out", out)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and str(out) in r.stdout and "best (step)" in r.stdout
    text = out.read_text()
    titles = re.findall(r"<svg[^>]*><title>([^<]*)</title>", text)
    metrics = {"loss", "lr", "tokens_per_s", "mfu", "eval/loss", "aux/indexer_kl", "eval/success", "eval/success_e20",
               "eval/success_e80", "rl/reward", "rl/success"}
    assert sorted(titles) == sorted(metrics)  # one plot each
    assert titles[:5] == ["loss", "eval/loss", "eval/success", "eval/success_e20", "eval/success_e80"]
    assert text.index("<h2>aux</h2>") < text.index("<title>aux/indexer_kl</title>")
    loss_plot = re.search(r"<title>loss</title>.*?</svg>", text, re.S).group(0)
    assert len(re.findall(r"<polyline ", loss_plot)) == 2  # A and B overlaid
    assert len(set(re.findall(r'stroke="(#[0-9a-f]{6})" stroke-width', loss_plot))) == 2
    for x, y in (tuple(map(float, p.split(","))) for pts in re.findall(r'points="([^"]+)"', text)
                 for p in pts.split()):
        assert 0 <= x <= 440 and 0 <= y <= 250
    assert not re.search(r'(src|href)="', text)  # self-contained: nothing loaded from elsewhere


def test_a_single_point_and_a_flat_series_are_drawn(tmp_path):
    run = report.read_run(_run(tmp_path / "one", [{"step": 5, "loss": 2.0, "lr": 0.0}]))
    svg = report.svg_plot("loss", [("#000000", run.series["loss"])])
    assert "<circle " in svg and "nan" not in svg
    flat = report.svg_plot("lr", [("#000000", [(1, 0.0), (2, 0.0)])])
    assert "<polyline " in flat and "nan" not in flat


@pytest.mark.parametrize("content, message", [
    (None, "no such run directory or metrics file"),
    ("", "holds no metrics record"),
    ('{"step": 1, "loss": 2.0}\n{"step": 2, "loss"\n', "line 2 is not valid JSON"),
    ('{"loss": 2.0}\n', "line 1 is not a metrics record"),
])
def test_bad_runs_are_one_line_exit_2(tmp_path, content, message):
    path = tmp_path / "run"
    if content is not None:
        path.mkdir()
        (path / "metrics.jsonl").write_text(content)
    r = _cli(path, "--out", tmp_path / "r.html")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert not (tmp_path / "r.html").exists()


def test_a_run_directory_without_metrics_and_a_bad_out(tmp_path, runs):
    (tmp_path / "empty").mkdir()
    r = _cli(tmp_path / "empty")
    assert r.returncode == 2 and r.stderr == f"error: {tmp_path / 'empty'}: no metrics.jsonl in the run directory\n"
    r = _cli(runs[0], "--out", tmp_path / "no" / "r.html")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "does not exist" in r.stderr


def test_a_bad_option_is_one_line_exit_2(runs):
    r = _cli(runs[0], "--outt", "x.html")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: unrecognized arguments")
    r = _cli()
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "runs" in r.stderr


def test_a_long_series_is_thinned_keeping_its_spike():
    points = [(i, 1.0) for i in range(1, 100_001)]
    points[54_321] = (54_322, 50.0)  # one spike
    drawn = report.thinned(points)
    assert len(drawn) <= 2002 and drawn[0] == points[0] and drawn[-1] == points[-1]
    assert (54_322, 50.0) in drawn and [p[0] for p in drawn] == sorted(p[0] for p in drawn)
