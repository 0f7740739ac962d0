"""The HTML report of ``nnrt bench`` and ``nnrt demo --report``: one
self-contained file (plotly's JavaScript inlined once, no CDN, works
offline) with a summary table and charts.

Latency axes are logarithmic: one page holds a 1 ms detector and a 500 ms
background model, and a linear axis would flatten the small one to its
baseline (the old demo chart showed "0" and "313 ms" and nothing else).
"""
from __future__ import annotations

import html
import time
from dataclasses import dataclass, field

from .machine import MachineInfo
from .results import ERROR, MISS, OK, STAGES, Case, ShareSeries, StressResult

_PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf"]
_STAGE_COLORS = {"app + transport": "#9467bd", "queue + parked": "#ff7f0e",
                 "on device": "#1f77b4"}
_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em 2em;color:#222;max-width:1400px}
h1{font-size:1.5em;margin-bottom:.2em} h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.88em;margin:.5em 0}
td,th{padding:3px 9px;border-bottom:1px solid #e4e4e4;text-align:right;white-space:nowrap}
th{background:#f4f4f4} td:first-child,th:first-child,td.l{text-align:left}
.note{color:#555;font-size:.9em} .bad{color:#b00;font-weight:600} .good{color:#070}
code{background:#f4f4f4;padding:1px 4px}
table.wrap td{white-space:normal;text-align:left;vertical-align:top}
"""


@dataclass
class Page:
    """Everything one report shows. ``cases`` are the series (bench cases or
    demo models); ``share`` the per-app share of each device over time."""

    title: str
    intro: str = ""
    command: str = ""
    machine: MachineInfo | None = None
    cases: list[Case] = field(default_factory=list)
    share: list[ShareSeries] = field(default_factory=list)
    stress: list[StressResult] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)     # extra lines under the summary


def _ms(v) -> str:
    return "–" if v is None else f"{v * 1e3:.2f}"


def _esc(v) -> str:
    return html.escape(str(v))


def _table(header: list[str], rows: list[list[str]], raw: bool = False, css: str = "") -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c if raw else _esc(c)}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table class='{css}'><tr>{head}</tr>{body}</table>"


def _log_ticks(values_ms: list[float]) -> dict:
    """Ticks 1-2-5 per decade over the data, labelled in plain ms (plotly's
    default log ticks print bare mantissas such as "2" for 200 ms)."""
    values = [v for v in values_ms if v > 0]
    if not values:
        return {}
    import math
    lo, hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    ticks = [m * 10.0 ** e for e in range(lo, hi + 1) for m in (1, 2, 5)]
    ticks = [t for t in ticks if min(values) / 2.5 <= t <= max(values) * 2.5]
    return dict(tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])


def _label(case: Case) -> str:
    return case.label


class _Figures:
    """Turns plotly figures into HTML fragments; the first one carries the
    library, inlined."""

    def __init__(self):
        self._first = True

    def html(self, fig, height: int) -> str:
        fig.update_layout(height=height, margin=dict(l=70, r=30, t=50, b=60),
                          template="plotly_white", font=dict(size=12),
                          legend=dict(orientation="h", yanchor="top", y=-0.15, x=0))
        out = fig.to_html(full_html=False, include_plotlyjs=self._first,
                          config={"displaylogo": False, "responsive": True})
        self._first = False
        return out


def _summary(page: Page) -> str:
    rows = []
    for c in page.cases:
        s = c.stats()
        if c.error is not None:
            rows.append([_esc(c.model), _esc(c.device), _esc(c.mode), "–", "–", "–", "–", "–",
                         "–", "–", f'<span class="bad">{_esc(c.error)}</span>'])
            continue
        missed = f'<span class="bad">{s.misses}</span>' if s.misses else "0"
        errs = f'<span class="bad">{s.errors}</span>' if s.errors else "0"
        dl = "–" if c.deadline is None else f"{c.deadline * 1e3:.1f}"
        rows.append([_esc(c.model), _esc(c.device), _esc(c.mode), str(s.runs), _ms(s.p50),
                     _ms(s.p90), _ms(s.p99), _ms(s.max),
                     "–" if s.throughput is None else f"{s.throughput:.1f}",
                     f"{dl} / {missed} / {errs}", str(c.preemptions)])
    return _table(["model / series", "device / app", "mode / priority", "runs", "p50 ms",
                   "p90 ms", "p99 ms", "max ms", "runs/s", "deadline ms / misses / errors",
                   "preemptions"], rows, raw=True)


def _details(page: Page) -> str:
    rows = []
    for c in page.cases:
        s = c.stats()
        stages = " · ".join(f"{k} {_ms(s.stages.get(k))}" for k in STAGES) if s.stages else "–"
        place = ", ".join(f"{d}: {n}" for d, n in c.placement.items()) or "–"
        acc = []
        for a in c.accuracy:
            diff = ", ".join(f"{d:.3g}" for d in a.max_diff)
            top1 = "" if a.top1_match is None else (" · top-1 same" if a.top1_match
                                                    else " · top-1 differs")
            cls = "good" if a.within_tolerance else "bad"
            acc.append(f'<span class="{cls}">{_esc(a.against)}: {diff} '
                       f'{"" if a.unit == "abs" else _esc(a.unit)}{top1}</span>')
        rows.append([_esc(c.label), stages, _esc(place), "<br>".join(acc) or "–"])
    return _table(["case", "mean per stage (ms)", "operations ran on",
                   "accuracy: max difference per output"], rows, raw=True, css="wrap")


def _distribution(figs: _Figures, cases: list[Case]) -> str:
    import plotly.graph_objects as go
    fig = go.Figure()
    for k, c in enumerate(cases):
        ok = [s.latency * 1e3 for s in c.samples if s.status == OK]
        if ok:
            fig.add_trace(go.Box(x=ok, name=_label(c), orientation="h", boxpoints="outliers",
                                 marker_color=_PALETTE[k % len(_PALETTE)], showlegend=False))
    fig.update_xaxes(type="log", title="latency per execution (ms, log scale)",
                     **_log_ticks([s.latency * 1e3 for c in cases for s in c.samples]))
    fig.update_yaxes(autorange="reversed", automargin=True)
    fig.update_layout(title="Latency distribution (box: quartiles; whiskers 1.5 IQR; dots: outliers)")
    return figs.html(fig, 120 + 42 * max(1, len(cases)))


def _over_time(figs: _Figures, cases: list[Case]) -> str:
    import plotly.graph_objects as go
    fig = go.Figure()
    deadlines = sorted({c.deadline for c in cases if c.deadline is not None})
    for k, c in enumerate(cases):
        color = _PALETTE[k % len(_PALETTE)]
        ok = [s for s in c.samples if s.status == OK]
        fig.add_trace(go.Scattergl(x=[s.t for s in ok], y=[s.latency * 1e3 for s in ok],
                                   mode="markers+lines" if len(ok) < 400 else "markers",
                                   marker=dict(size=4, color=color), line=dict(width=1),
                                   name=_label(c)))
        bad = [s for s in c.samples if s.status != OK]
        if bad:
            fig.add_trace(go.Scattergl(
                x=[s.t for s in bad], y=[s.latency * 1e3 for s in bad], mode="markers",
                marker=dict(symbol="x", size=9, color="#d00", line=dict(width=1)),
                name=f"{_label(c)}: {sum(s.status == MISS for s in bad)} deadline misses, "
                     f"{sum(s.status == ERROR for s in bad)} errors"))
    end = max((s.t for c in cases for s in c.samples), default=1.0)
    for d in deadlines:
        # A line trace, not add_hline: plotly places shape annotations on a
        # log axis in log10 units, which stretches the axis to 1e33.
        fig.add_trace(go.Scatter(x=[0, end], y=[d * 1e3, d * 1e3], mode="lines",
                                 line=dict(color="#d00", dash="dash", width=1.5),
                                 name=f"deadline {d * 1e3:.1f} ms"))
    fig.update_yaxes(type="log", title="latency (ms, log scale)",
                     **_log_ticks([s.latency * 1e3 for c in cases for s in c.samples]
                                  + [d * 1e3 for d in deadlines]))
    fig.update_xaxes(title="time since start (s)")
    fig.update_layout(title="Latency over time (✕ = deadline miss or error, at the time it "
                            "was reported)")
    # The legend sits under the plot: grow with it so the plot keeps its height.
    return figs.html(fig, 420 + 22 * ((len(cases) + 2) // 3))


def _stages(figs: _Figures, cases: list[Case]) -> str:
    import plotly.graph_objects as go
    with_stages = [c for c in cases if c.stats().stages]
    if not with_stages:
        return "<p class='note'>No per-stage timing (the drivers did not measure it).</p>"
    fig = go.Figure()
    labels = [_label(c) for c in with_stages]
    for name in STAGES:
        ms = [c.stats().stages[name] * 1e3 for c in with_stages]
        fig.add_trace(go.Bar(y=labels, x=ms, name=name, orientation="h",
                             marker_color=_STAGE_COLORS[name],
                             text=[f"{v:.2f} ms" for v in ms], textposition="inside",
                             insidetextanchor="middle", hovertemplate="%{y}<br>" + name +
                             ": %{x:.3f} ms<extra></extra>"))
    fig.update_layout(barmode="stack", barnorm="percent",
                      title="Where the time goes (mean per stage; bar = 100 % of the mean execution, "
                            "labels in ms)")
    fig.update_xaxes(title="share of the execution (%)", range=[0, 100])
    fig.update_yaxes(autorange="reversed", automargin=True)
    return figs.html(fig, 140 + 40 * len(with_stages))


def _share(figs: _Figures, series: ShareSeries) -> str:
    import plotly.graph_objects as go
    fig = go.Figure()
    for k, (app, values) in enumerate(sorted(series.shares.items())):
        fig.add_trace(go.Scatter(x=series.times, y=[v * 100 for v in values], name=app,
                                 stackgroup="share", mode="lines",
                                 line=dict(width=0.5, color=_PALETTE[k % len(_PALETTE)])))
    fig.update_yaxes(title="share of the device (%)", range=[0, 100])
    fig.update_xaxes(title=f"time since start (s), {series.bin_seconds:g} s bins")
    fig.update_layout(title=f"Each app's share of {series.device} over time (white: idle)")
    return figs.html(fig, 380)


def _machine(figs: _Figures, machine: MachineInfo) -> str:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    text = (f"<p>{_esc(machine.cpu)}, {machine.cpus} CPUs, Linux {_esc(machine.kernel)}, "
            f"Python {_esc(machine.python)}, numpy {_esc(machine.numpy)}.<br>"
            f"Load average {machine.load_start[0]:.2f} at the start, "
            f"{machine.load_end[0]:.2f} at the end; all CPUs busy {machine.busy:.0%} of the "
            f"time; <b>stolen by the host {machine.steal:.1%}</b>. "
            f"{'A load above the CPU count means the timings include waiting for a CPU.' if machine.load_end[0] > machine.cpus else ''}</p>")
    if not machine.samples:
        return text
    s = machine.samples
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=[p.t for p in s], y=[p.busy * 100 for p in s],
                             name="CPU busy (%)", line=dict(color="#1f77b4")), secondary_y=False)
    fig.add_trace(go.Scatter(x=[p.t for p in s], y=[p.steal * 100 for p in s],
                             name="stolen by the host (%)", line=dict(color="#d62728")),
                  secondary_y=False)
    fig.add_trace(go.Scatter(x=[p.t for p in s], y=[p.load1 for p in s],
                             name="load average (1 min)", line=dict(color="#7f7f7f", dash="dot")),
                  secondary_y=True)
    fig.add_hline(y=machine.cpus, line=dict(color="#7f7f7f", width=1), secondary_y=True,
                  annotation_text=f"load = {machine.cpus} CPUs", annotation_position="top left")
    fig.update_yaxes(title="% of all CPUs", range=[0, 105], secondary_y=False)
    fig.update_yaxes(title="load average", rangemode="tozero", secondary_y=True)
    fig.update_xaxes(title="time since start (s)")
    fig.update_layout(title="The machine during the run")
    return text + figs.html(fig, 330)


def _stress_table(results: list[StressResult]) -> str:
    rows = []
    for r in results:
        cls = "good" if r.verdict == "SUCCESS" else "bad"
        tail = f"<pre>{_esc(r.last_output)}</pre>" if r.last_output else ""
        rows.append([_esc(r.model), _esc(r.device), f'<span class="{cls}">{r.verdict}</span>',
                     str(r.runs), f"{r.seconds:.1f}", f'<div class="l">{_esc(r.detail)}{tail}</div>'])
    return _table(["model", "device", "verdict", "runs", "seconds", "detail / last output"],
                  rows, raw=True, css="wrap")


def render(page: Page) -> str:
    figs = _Figures()
    parts = [f"<h1>{_esc(page.title)}</h1>",
             f"<p class='note'>{time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
             + (f" · <code>{_esc(page.command)}</code>" if page.command else "") + "</p>"]
    if page.intro:
        parts.append(f"<p>{page.intro}</p>")
    if page.cases:
        parts += ["<h2>Summary</h2>", _summary(page)]
    parts += [f"<p>{_esc(f)}</p>" for f in page.facts]
    if page.stress:
        parts += ["<h2>Stress test</h2>", _stress_table(page.stress)]
    timed = [c for c in page.cases if c.samples]
    if timed:
        parts += ["<h2>Latency</h2>", _distribution(figs, timed), _over_time(figs, timed),
                  "<h2>Per-stage cost</h2>",
                  "<p class='note'>From the timings nnrt measures: <i>on device</i> is the "
                  "scheduler's account of the execution's run time; <i>queue + parked</i> the "
                  "rest of the driver's time (waiting for a slot, preempted spells); <i>app + "
                  "transport</i> everything else (runtime staging, socket or burst ring, the "
                  "app's event loop).</p>", _stages(figs, timed)]
    if any(c.placement or c.accuracy for c in page.cases):
        parts += ["<h2>Placement, stages and accuracy</h2>", _details(page)]
    for series in page.share:
        if series.shares:
            parts += ["<h2>Sharing the device</h2>", _share(figs, series)]
    if page.machine is not None:
        parts += ["<h2>Machine</h2>", _machine(figs, page.machine)]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{_esc(page.title)}"
            f"</title><style>{_CSS}</style></head><body>{''.join(parts)}</body></html>")


def write(path: str, page: Page) -> None:
    with open(path, "w") as f:
        f.write(render(page))


def write_bench_report(path: str, result) -> None:
    """The report of a ``run_bench`` result."""
    write(path, Page("nnrt bench", command=result.command, machine=result.machine,
                     cases=result.cases))


def write_stress_report(path: str, results: list[StressResult], command: str = "") -> None:
    write(path, Page("nnrt bench --stress", command=command, stress=results))
