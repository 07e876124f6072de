"""`python -m trainer.cli.report <run> [<run> ...] [--out report.html]`: what runs did, from their metrics.jsonl.

A run is a run directory (its `metrics.jsonl`) or the file itself. The command prints a summary table (per run: the
steps, the records, the wall time; per headline metric and run: first, last, min, max and the best value with its
step) and writes one self-contained HTML page: the same table, then a plot of every numeric metric, the runs
overlaid in one colour each: the headline ones first (loss, the held-out figures, lr, tokens/s, MFU), then each family
(`eval/`, `rl/`, `aux/`, ...) under its heading. The plots are inline SVG drawn here (no plotting library); a line of
more than 2,000 points is drawn through each stretch's lowest and highest (`thinned`). A missing
run, an empty `metrics.jsonl` or a line that is not a JSON object with a "step" is one `error: ...` line, exit 2.

The wall time is the span of the run's `main.log` time stamps (Hydra's log: start-up to the last line, relaunches and
the pauses between them included), or what `make pipeline` measured (`stage_chain.json`) when there is one.
"""

from __future__ import annotations

import html
import json
import math
import re
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from trainer.cli.options import OneLineParser

__all__ = ["Run", "read_run", "summary", "page", "main"]

HEADLINE = ("loss", "eval/loss", "eval/success", "eval/kl", "rl/reward", "rl/success", "acceptance_len", "lr",
            "tokens_per_s", "mfu")
"""plotted first, in this order; those but lr are in the summary table (with every `eval/success_e<effort>`)"""
HIGHER_IS_BETTER = ("success", "reward", "acceptance", "tokens_per_s", "mfu")
LOWER_IS_BETTER = ("loss", "kl")
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
           "#bcbd22")
MAX_POINTS = 2000  # drawn per line: a long run's page stays small (`thinned`)
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]")


@dataclass
class Run:
    """One run's metrics: per metric its (step, value) points (a null value, a skipped step's non-finite loss, left
    out), the steps it logged and its wall time in seconds (None: unknown)."""

    name: str
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    wall_s: float | None = None


def _metrics_file(path: Path) -> Path:
    if path.is_dir():
        return path / "metrics.jsonl"
    return path


def _wall_seconds(run_dir: Path) -> float | None:
    chain = run_dir / "stage_chain.json"
    try:
        if chain.is_file():
            return float(json.loads(chain.read_text())["wall_s"])
    except (ValueError, KeyError, TypeError, OSError):
        pass
    try:
        lines = (run_dir / "main.log").read_text(errors="replace").splitlines()
    except OSError:
        return None
    stamps = [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000
              for line in lines if (m := _STAMP.match(line))]
    return stamps[-1] - stamps[0] if len(stamps) > 1 else None


def read_run(path: str | Path) -> Run:
    """The metrics of the run at `path` (a run directory or its metrics.jsonl); ValueError, one line naming the file,
    when there is none, it holds no record or a line is not a record."""
    given = Path(path)
    file = _metrics_file(given)
    if not file.is_file():
        what = "no metrics.jsonl in the run directory" if given.is_dir() else "no such run directory or metrics file"
        raise ValueError(f"{path}: {what}")
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    run = Run(str(path))
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} line {number} is not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{file} line {number} is not a metrics record (a JSON object with an integer \"step\")")
        step = record["step"]
        run.steps.append(step)
        for key, value in record.items():
            if key == "step" or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                run.series.setdefault(key, []).append((step, float(value)))
            elif value is None:
                run.series.setdefault(key, [])
    if not run.steps:
        raise ValueError(f"{file} holds no metrics record")
    run.wall_s = _wall_seconds(file.parent)
    return run


# -- the summary -------------------------------------------------------------------------------------------------------
def _direction(key: str) -> int:
    """+1: higher is better, -1: lower is better, 0: neither (lr, counts)."""
    name = key.rsplit("/", 1)[-1]
    if any(w in name for w in HIGHER_IS_BETTER):
        return 1
    if any(w in name for w in LOWER_IS_BETTER):
        return -1
    return 0


def headline_keys(runs: list[Run]) -> list[str]:
    """The headline metrics any of `runs` logged, in HEADLINE's order, each effort's success after eval/success."""
    present = {k for r in runs for k, points in r.series.items() if points}
    efforts = sorted((k for k in present if re.fullmatch(r"eval/success_e\d+", k)), key=lambda k: int(k[14:]))
    out = []
    for key in HEADLINE:
        if key in present:
            out.append(key)
        if key == "eval/success":
            out += efforts
    return out


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.3e}"
    return f"{v:.4g}" if abs(v) < 100 else f"{v:,.0f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{seconds:.1f}s"


def _columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def summary_rows(runs: list[Run]) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """(per run: name, steps, records, wall time; per headline metric and run: first, last, min, max, best @ step)."""
    overview = [("run", "steps", "records", "wall time")]
    for r in runs:
        overview.append((r.name, f"{min(r.steps)}-{max(r.steps)}", str(len(r.steps)), _duration(r.wall_s)))
    metrics = [("metric", "run", "first", "last", "min", "max", "best (step)")]
    for key in headline_keys(runs):
        if key == "lr":
            continue
        for r in runs:
            points = r.series.get(key)
            if not points:
                continue
            values = [v for _, v in points]
            best = "-"
            sign = _direction(key)
            if sign:
                step, value = max(points, key=lambda p: sign * p[1])  # the first step that reached it
                best = f"{_fmt(value)} ({step})"
            metrics.append((key, r.name, _fmt(values[0]), _fmt(values[-1]), _fmt(min(values)), _fmt(max(values)),
                            best))
    return overview, metrics


def summary(runs: list[Run]) -> str:
    """The table the command prints."""
    overview, metrics = summary_rows(runs)
    text = _columns(overview)
    if len(metrics) > 1:
        text += "\n\n" + _columns(metrics)
    return text


# -- the page ----------------------------------------------------------------------------------------------------------
def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round values spanning [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def thinned(points: list[tuple[int, float]], most: int = MAX_POINTS) -> list[tuple[int, float]]:
    """At most about `most` of `points` for drawing: in each of most / 2 runs of consecutive points its lowest and its
    highest (in step order), so a spike stays visible; the first and last points are kept."""
    if len(points) <= most:
        return points
    size = math.ceil(len(points) / (most // 2))
    out = [points[0]]
    for i in range(0, len(points), size):
        run = points[i:i + size]
        lo, hi = min(run, key=lambda p: p[1]), max(run, key=lambda p: p[1])
        out += sorted({lo, hi})
    out.append(points[-1])
    return sorted(set(out))


def svg_plot(title: str, lines: list[tuple[str, list[tuple[int, float]]]], width: int = 440,
             height: int = 250) -> str:
    """One plot as an inline SVG: each (colour, points) a polyline (a lone point a dot), axes with round ticks."""
    left, right, top, bottom = 64, 12, 26, 34
    points = [p for _, pts in lines for p in pts]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img"><title>{html.escape(title)}</title>',
             f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13" font-weight="bold">'
             f'{html.escape(title)}</text>']
    if not points:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" font-size="12">no finite '
                     'value</text></svg>')
        return "".join(parts)
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.05 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    for t in _ticks(y0, y1):
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#eee"/>'
                     f'<text x="{left - 4}" y="{sy(t) + 4:.1f}" text-anchor="end" font-size="10">{_fmt(t)}</text>')
    for t in _ticks(x0, x1):
        parts.append(f'<text x="{sx(t):.1f}" y="{top + ph + 14}" text-anchor="middle" font-size="10">{t:g}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{height - 4}" text-anchor="middle" font-size="10">step</text>')
    for colour, pts in lines:
        pts = thinned(pts)
        if len(pts) == 1:
            parts.append(f'<circle cx="{sx(pts[0][0]):.1f}" cy="{sy(pts[0][1]):.1f}" r="3" fill="{colour}"/>')
        elif pts:
            coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
            parts.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
    parts.append("</svg>")
    return "".join(parts)


def _family(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else "other"


def _html_table(rows: list[tuple[str, ...]]) -> str:
    head, *body = rows
    return ("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body)
            + "</table>")


def page(runs: list[Run]) -> str:
    """The whole HTML page: the runs' colours, the summary tables, then every metric's plot."""
    colour = {r.name: COLOURS[i % len(COLOURS)] for i, r in enumerate(runs)}
    keys = sorted({k for r in runs for k in r.series})
    headline = [k for k in headline_keys(runs)]
    sections: list[tuple[str, list[str]]] = [("headline", headline)]
    for family in sorted({_family(k) for k in keys if k not in headline}, key=lambda f: (f == "other", f)):
        sections.append((family, [k for k in keys if k not in headline and _family(k) == family]))
    overview, metrics = summary_rows(runs)
    body = ["<h1>Cedar runs</h1>", '<p class="legend">' + " ".join(
        f'<span><i style="background:{colour[r.name]}"></i>{html.escape(r.name)}</span>' for r in runs) + "</p>",
        _html_table(overview)]
    if len(metrics) > 1:
        body.append(_html_table(metrics))
    for title, section_keys in sections:
        if not section_keys:
            continue
        body.append(f"<h2>{html.escape(title)}</h2><div class=\"grid\">")
        body += [svg_plot(k, [(colour[r.name], r.series.get(k, [])) for r in runs]) for k in section_keys]
        body.append("</div>")
    style = ("body{font-family:sans-serif;margin:20px}table{border-collapse:collapse;margin:10px 0}"
             "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right;font-size:13px}"
             ".grid{display:flex;flex-wrap:wrap;gap:8px}.legend span{margin-right:16px}"
             ".legend i{display:inline-block;width:14px;height:4px;margin-right:4px;vertical-align:middle}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Cedar runs</title><style>{style}</style>"
            f"</head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m trainer.cli.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories (or their metrics.jsonl), overlaid in the plots")
    ap.add_argument("--out", default="report.html", help="the HTML page to write (default: report.html)")
    args = ap.parse_args(argv)
    try:
        runs = [read_run(p) for p in args.runs]
        names = [r.name for r in runs]
        if len(set(names)) != len(names):
            raise ValueError(f"a run is given twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
        out = Path(args.out)
        if not out.resolve().parent.is_dir():
            raise ValueError(f"--out {args.out}: directory {out.resolve().parent} does not exist")
        out.write_text(page(runs), encoding="utf-8")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except OSError as e:
        print(f"error: {e.strerror or e}: {e.filename or args.out}", file=sys.stderr, flush=True)
        return 2
    print(summary(runs))
    print(f"\nplots of {sum(len(r.series) for r in runs)} series: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
