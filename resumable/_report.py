"""
``resumable report``'s page (docs/report.md): rendered here so that it reads with scripts
off; everything from the state is escaped text; a Content-Security-Policy allows only the
page's own style and script (by hash).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import html
import os
from collections.abc import Sequence
from typing import Any

from ._render import duration
from ._report_data import collect
from ._units import human_size

WIDTH = 960  # the timeline's drawing width (viewBox units; it scales with the page)
LABEL = 190  # the label column
PLOT = WIDTH - LABEL - 10  # the timeline's bars
ROW = 24
TOP = 26  # room for the time axis
OUTCOMES = ("ran", "skipped", "failed", "interrupted", "running")

_CSS = """
:root{--ink:#1d2733;--soft:#5b6775;--line:#dfe4ea;--bg:#f7f8fa;--accent:#2f6fdb;
font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--ink)}
.ran,.completed{--c:#2f6fdb}.failed{--c:#d43d3d}.interrupted,.killed{--c:#e07b24}.running{--c:#1f9d74}
.skipped{--c:#aab3bd}.retry{--c:#e6a700}
*{box-sizing:border-box}
body{margin:0;background:var(--bg)}
main{max-width:1100px;margin:0 auto;padding:24px 28px 60px}
h1{font-size:24px;margin:0 0 4px;word-break:break-all}
h2{font-size:18px;margin:36px 0 10px;padding-bottom:6px;border-bottom:1px solid var(--line)}
h3{font-size:15px;margin:18px 0 6px}
.sub{color:var(--soft);margin:0 0 16px;word-break:break-all}
.badge{display:inline-block;padding:0 8px;border-radius:10px;font-size:12px;font-weight:600;
color:#fff;vertical-align:middle;background:var(--c,var(--soft))}
h1 .badge,h3 .badge{margin-left:8px}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(140px,1fr));gap:10px;margin:10px 0}
.card,.panel{background:#fff;border:1px solid var(--line);border-radius:8px;padding:10px 12px;margin:10px 0}
.card{margin:0}
.card b{display:block;font-size:22px;font-variant-numeric:tabular-nums}
.card span{color:var(--soft);font-size:12px}
nav{position:sticky;top:0;background:var(--bg);padding:8px 0;z-index:2;border-bottom:1px solid var(--line)}
nav a{color:var(--accent);text-decoration:none;margin-right:16px;font-weight:500}
svg{display:block;width:100%;height:auto}
svg text{font:12px system-ui,sans-serif;fill:var(--ink)}
svg .axis{fill:var(--soft);font-size:11px}
svg .grid{stroke:var(--line)}
svg .lane{fill:#f2f4f7}
.bar rect,.bar path{fill:var(--c)}.bar path{stroke:#fff}
.bar .group{fill:#a9c3ef}.bar .hist{fill:#2f6fdb;opacity:.75}svg .unknown{fill:url(#hatch)}
.legend span{display:inline-flex;align-items:center;margin-right:14px;color:var(--soft);font-size:12px}
.legend i{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:5px;background:var(--c)}
.legend .retry{transform:rotate(45deg) scale(.8)}
.legend .unknown{background:repeating-linear-gradient(45deg,#e07b24 0 3px,#fff 3px 6px)}
table{border-collapse:collapse;width:100%;background:#fff;font-size:13px}
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid var(--line);vertical-align:top}
th{background:#eef1f5;font-weight:600;white-space:nowrap}
.scroll{overflow-x:auto}
.sortable th{cursor:pointer}.sortable th:after{content:" \\2195";color:var(--soft);font-size:11px}
th.asc:after{content:" \\2191"}th.desc:after{content:" \\2193"}
.num{text-align:right;font-variant-numeric:tabular-nums}
td.slot{font-family:ui-monospace,Menlo,Consolas,monospace;overflow-wrap:anywhere;min-width:160px;max-width:280px}
tr.o-failed td{background:#fdf0f0}tr.o-interrupted td{background:#fdf5ec}
tr.first td{background:#fff6d6;box-shadow:inset 3px 0 #e6a700}
.muted,.note{color:var(--soft)}
.note{font-size:13px;margin:4px 0}
.key{background:#eef1f5;border-radius:4px;padding:0 4px}
pre{background:#0f1720;color:#e6edf3;padding:10px 12px;border-radius:6px;overflow:auto;font-size:12px;
white-space:pre-wrap;word-break:break-word;max-height:420px;margin:4px 0}
div.value{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;color:var(--soft);max-width:220px;
white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
td.why{min-width:280px}
details summary{cursor:pointer;color:var(--accent)}
.tools{display:flex;gap:10px;align-items:center;margin:8px 0}
.tools input,.tools select{font:inherit;padding:4px 8px;border:1px solid var(--line);border-radius:6px}
.tools input{flex:1}
.err{border-left:4px solid #d43d3d}
"""

_JS = """
(function(){
  function value(tr, i){
    var c = tr.children[i];
    return c ? (c.getAttribute('data-v') || c.textContent) : '';
  }
  document.querySelectorAll('table.sortable').forEach(function(table){
    var heads = table.querySelectorAll('th');
    heads.forEach(function(th, i){
      th.addEventListener('click', function(){
        var numeric = th.classList.contains('num'), asc = !th.classList.contains('asc');
        heads.forEach(function(h){ h.classList.remove('asc', 'desc'); });
        th.classList.add(asc ? 'asc' : 'desc');
        var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
        rows.sort(function(a, b){
          var x = value(a, i), y = value(b, i), r;
          if (numeric) { r = (parseFloat(x.replace(/,/g, '')) || 0) - (parseFloat(y.replace(/,/g, '')) || 0); }
          else { r = x < y ? -1 : x > y ? 1 : 0; }
          return asc ? r : -r;
        });
        rows.forEach(function(r){ body.appendChild(r); });
      });
    });
  });
  var rows = document.getElementById('steps-table').tBodies[0].rows;
  var text = document.getElementById('steps-filter');
  var outcome = document.getElementById('steps-outcome');
  function filter(){
    var q = text.value.toLowerCase(), o = outcome.value, n = 0;
    Array.prototype.forEach.call(rows, function(tr){
      var ok = (!o || tr.getAttribute('data-outcome') === o) &&
               (!q || tr.textContent.toLowerCase().indexOf(q) >= 0);
      tr.hidden = !ok; if (ok) n += 1;
    });
    document.getElementById('steps-shown').textContent = n + ' of ' + rows.length + ' listed slots shown';
  }
  text.addEventListener('input', filter);
  outcome.addEventListener('change', filter);
  document.querySelector('.tools').hidden = false;
  filter();
  document.documentElement.setAttribute('data-ready', String(Math.round(performance.now())));
})();
"""


def e(value: object) -> str:
    """Text from the state, safe in an element or a quoted attribute."""
    return html.escape("" if value is None else str(value), quote=True)


def _hash(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def _clock(t: float | None, *, date: bool = False, ms: bool = False) -> str:
    if t is None:
        return "?"
    stamp = dt.datetime.fromtimestamp(t, dt.UTC)
    text = stamp.strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S")
    if ms:
        text += f".{stamp.microsecond // 1000:03d}"
    return text + (" UTC" if date else "")


def _between(lo: float | None, hi: float | None) -> str:
    """``between A and B``, with milliseconds when both fall in the same second."""
    same = lo is not None and hi is not None and int(lo) == int(hi)
    return f"between {_clock(lo, ms=same)} and {_clock(hi, ms=same)}"


def render(data: dict[str, Any]) -> str:
    """The whole page for the data :func:`resumable._report_data.collect` gathered."""
    css, js = _CSS.strip(), _JS.strip()
    csp = (
        f"default-src 'none'; style-src '{_hash(css)}'; script-src '{_hash(js)}'; img-src 'none'; "
        "connect-src 'none'; font-src 'none'; frame-src 'none'; base-uri 'none'; form-action 'none'"
    )
    sections = (_header, _nav, _timelines, _story, _steps, _batches, _compare, _error)
    body = "".join(section(data) for section in sections)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        '<meta name="referrer" content="no-referrer">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{e(data['pipeline'])} · resumable report</title><style>{css}</style></head>\n<body>"
        '<svg width="0" height="0" aria-hidden="true"><defs><pattern id="hatch" width="6" '
        'height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="6" height="6" '
        'fill="#fbe3cf"/><rect width="3" height="6" fill="#e07b24"/></pattern></defs></svg>'
        f"<main>{body}</main>\n"
        f"<script>{js}</script>\n</body></html>\n"
    )


def _header(data: dict[str, Any]) -> str:
    state, counts = data["state"], data["counts"]
    runs = data["runs"]
    first = runs[0]["start"] if runs else None
    last = runs[-1]["end"] if runs else None
    cards = [
        ("completed", f"{state['completed']:,}", f"of {state['slots']:,} slots completed"),
        ("ran", f"{counts['ran']:,}", "slots ran"),
        ("skipped", f"{counts['skipped']:,}", "slots skipped (stored)"),
        ("failed", f"{counts['failed']:,}", "slots failed or killed"),
        ("retried", f"{counts['retried']:,}", "slots retried"),
        ("saved", duration(counts["saved_s"]) or "0s", "saved by skips (what they took)"),
    ]
    card_html = "".join(
        f'<div class="card" data-count="{k}"><b>{e(v)}</b><span>{e(label)}</span></div>'
        for k, v, label in cards
    )
    return (
        f'<header><h1>{e(data["pipeline"])}<span class="badge {e(data["status"])}" id="status">'
        f"{e(data['status'])}</span></h1>"
        f'<p class="sub">{e(data["location"])} · {data["runs_total"]:,} run(s) · {_clock(first, date=True)} → '
        f"{_clock(last, date=True)} · counts over {e(data['which'])}</p>"
        f'<div class="cards">{card_html}</div></header>'
    )


def _nav(data: dict[str, Any]) -> str:
    links = {"timeline": "Timeline", "runs": "Runs", "steps": "Steps"}
    optional = {"batches": "Batches", "compare": "Comparison", "error": "Last error"}
    links |= {k: label for k, label in optional.items() if data[k]}
    return "<nav>" + "".join(f'<a href="#{k}">{label}</a>' for k, label in links.items()) + "</nav>"


_LEGEND = [(k, k) for k in ("ran", "failed", "interrupted", "running")]
_LEGEND += [("retry", "retried attempt"), ("unknown", "killed: end unknown")]


def _timelines(data: dict[str, Any]) -> str:
    legend = "".join(f'<span><i class="{k}"></i>{t}</span>' for k, t in _LEGEND)
    out = [f'<section id="timeline"><h2>Timeline</h2><p class="legend">{legend}</p>']
    if data["timelines_left_out"]:
        out.append(
            f'<p class="note">{data["timelines_left_out"]:,} older run(s) not drawn (pass --run N).</p>'
        )
    if not data["timelines"]:
        out.append('<p class="note">No run in the event log yet.</p>')
    out.extend(_timeline(tl) for tl in data["timelines"])
    out.append("</section>")
    return "".join(out)


def _bar_title(bar: dict[str, Any]) -> str:
    lines = [f"{bar['slot']}: {bar['outcome']}"]
    if bar["reason"]:
        lines.append(f"why it ran: {bar['reason']}" + (f" ({bar['detail']})" if bar["detail"] else ""))
    span = f"from +{duration(bar['s'])} to +{duration(bar['e'])}"
    if bar["open"]:
        lines += [span, "its end was not recorded: the process stopped while it ran"]
    else:
        lines.append(f"{span} ({duration(bar['e'] - bar['s'])})")
    if bar["attempts"] > 1:
        lines.append(f"{bar['attempts']} attempts")
    for _, kind, message in bar["retries"]:
        lines.append(f"retried after {kind}: {message}")
    if bar.get("error"):
        lines.append(f"failed: {bar['error'][0]}: {bar['error'][1]}")
    if bar.get("parent"):
        lines.append(f"called inside {bar['parent']}")
    return "\n".join(lines)


def _label(text: str, size: int = 26) -> str:
    return text if len(text) <= size else text[: size - 1] + "…"


def _ticks(  # noqa: PLR0913 - the span, the plot's box, where the labels go
    span: float, x0: float, width: float, y: float, height: float, *, text_y: float | None = None
) -> str:
    """A time axis: six grid lines over the plot, labelled above it (or at *text_y*)."""
    out = []
    for i in range(6):
        x = x0 + width * i / 5
        out.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + height}"/>')
        anchor = "start" if i == 0 else ("end" if i == 5 else "middle")
        out.append(
            f'<text class="axis" x="{x:.1f}" y="{y - 6 if text_y is None else text_y}" text-anchor="{anchor}">'
            f"+{duration(span * i / 5) or '0s'}</text>"
        )
    return "".join(out)


def _svg(classes: str, label: str, height: float, axis: float) -> str:
    """A timeline's opening tag and its time axis (*axis* seconds wide)."""
    head = f'<svg class="{classes}" viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{e(label)}">'
    return head + _ticks(axis, LABEL, PLOT, TOP, height - TOP - 4)


def _timeline(tl: dict[str, Any]) -> str:
    span = tl["span"]
    unknown = tl["unknown_until"]
    # a killed run's axis shows the interval its end is in, up to a quarter more of the run
    axis = max(span, min(unknown, span * 1.25)) if unknown is not None else span
    scale = PLOT / axis  # the span is never 0
    rows = tl["rows"]
    height = TOP + ROW * max(1, len(rows)) + 8
    parts = [_svg("timeline", f"timeline of run {tl['run']}", height, axis)]
    details = []
    for i, row in enumerate(rows):
        y = TOP + i * ROW
        name = row["step"] + (f" ×{row['count']:,}" if row["keyed"] else "")
        parts.append(f'<rect class="lane" x="{LABEL}" y="{y + 3}" width="{PLOT}" height="{ROW - 6}" rx="3"/>')
        parts.append(
            f'<text class="label" x="{LABEL - 8}" y="{y + ROW / 2 + 4}" text-anchor="end">{e(_label(name))}'
            f"<title>{e(name)}</title></text>"
        )
        if row["keyed"]:
            parts.append(_group(row, y, scale, span))
            details.append(_expanded(row, tl, scale))
        else:
            parts.extend(_bar(bar, y, scale, ROW) for bar in row["bars"])
    if unknown is not None:
        x1, x2 = LABEL + span * scale, LABEL + min(unknown, axis) * scale
        title = (
            f"run {tl['run']} was killed: it ended {_between(tl['start'] + span, tl['start'] + unknown)} "
            "(the exact time is unknown)"
        )
        parts.append(
            f'<rect class="unknown" x="{x1:.1f}" y="{TOP}" width="{max(x2 - x1, 3):.1f}" '
            f'height="{height - TOP - 4}" opacity="0.55"><title>{e(title)}</title></rect>'
        )
    parts.append("</svg>")
    if names := ", ".join(f"{k} ×{v:,}" if v > 1 else k for k, v in sorted(tl["skipped"].items())):
        details.insert(0, f'<p class="note">Skipped (stored by an earlier run): {e(_label(names, 400))}</p>')
    return (
        f'<div class="panel run-timeline" data-run="{tl["run"]}"><h3>{_run_title(tl)}</h3>'
        f"{''.join(parts)}{''.join(details)}</div>"
    )


def _run_title(tl: dict[str, Any]) -> str:
    status = tl["status"]
    end = tl["start"] + tl["span"]
    if tl["unknown_until"] is not None:
        when = f"{_clock(tl['start'])} → {_between(end, tl['start'] + tl['unknown_until'])}"
    else:
        when = f"{_clock(tl['start'])} → {_clock(end)} ({duration(tl['span'])})"
    return f'Run {tl["run"]} <span class="badge {e(status)}">{e(status)}</span> <span class="muted">{when}</span>'


def _bar(bar: dict[str, Any], y: float, scale: float, row: float) -> str:
    x = LABEL + bar["s"] * scale
    w = max((bar["e"] - bar["s"]) * scale, 2.0)
    title = e(_bar_title(bar))
    out = [
        (
            f'<g class="bar" data-slot="{e(bar["slot"])}"><rect class="{bar["outcome"]}" x="{x:.1f}" y="{y + 5}" '
            f'width="{w:.1f}" height="{row - 10}" rx="2"><title>{title}</title></rect>'
        )
    ]
    if bar["open"]:
        out.append(
            f'<rect class="unknown" x="{x + w - 2:.1f}" y="{y + 5}" width="8" height="{row - 10}">'
            f"<title>{title}</title></rect>"
        )
    for when, kind, message in bar["retries"]:
        rx = LABEL + when * scale
        out.append(
            f'<path class="retry" d="M{rx:.1f} {y + 4} l5 {row / 2 - 4} l-5 {row / 2 - 4} l-5 {-(row / 2 - 4)} z">'
            f"<title>{e(bar['slot'])}: attempt failed with {e(kind)}: {e(message)}; retried</title></path>"
        )
    out.append("</g>")
    return "".join(out)


def _group(row: dict[str, Any], y: float, scale: float, span: float) -> str:
    """A keyed step's slots on one row: when they ran, how many ended when, which failed or retried."""
    lo, hi = row["span"]
    title = f"{row['step']}: {row['count']:,} slot(s) ran here, {row['failed']:,} failed, {row['retried']:,} retried"
    out = [
        f'<g class="bar group-bar" data-step="{e(row["step"])}"><title>{e(title)}</title>',
        (
            f'<rect class="group" x="{LABEL + lo * scale:.1f}" y="{y + 5}" '
            f'width="{max((hi - lo) * scale, 2.0):.1f}" height="{ROW - 10}" rx="2"/>'
        ),
    ]
    peak, width = max(row["hist"]) or 1, span * scale / len(row["hist"])
    for i, n in enumerate(row["hist"]):
        if n:
            h = (ROW - 10) * n / peak
            out.append(
                f'<rect class="hist" x="{LABEL + i * width:.1f}" y="{y + ROW - 5 - h:.1f}" '
                f'width="{max(width - 0.5, 0.5):.1f}" height="{h:.1f}"/>'
            )
    for b in row["bars"]:
        if b["outcome"] in {"failed", "interrupted"} or b["retries"]:
            cls = "failed" if b["outcome"] in {"failed", "interrupted"} else "retry"
            out.append(
                f'<rect class="{cls}" x="{LABEL + b["s"] * scale:.1f}" y="{y + 2}" width="3" height="{ROW - 4}"/>'
            )
    out.append("</g>")
    return "".join(out)


def _expanded(row: dict[str, Any], tl: dict[str, Any], scale: float) -> str:
    """A keyed step's slots, one lane per slot running at the same time (a <details>)."""
    bars = row["bars"]  # in the order they started
    lanes: list[float] = []  # where the last bar of each lane ends
    placed = []
    for b in bars:
        i = next((i for i, end in enumerate(lanes) if end <= b["s"]), len(lanes))  # the first free lane
        lanes[i : i + 1] = [b["e"]]
        placed.append((i, b))
    lane_row = 18
    height = TOP + lane_row * max(1, len(lanes)) + 6
    parts = [_svg("timeline keyed", f"slots of {row['step']}", height, PLOT / scale)]
    parts.extend(
        f'<text class="axis" x="{LABEL - 8}" y="{TOP + i * lane_row + 13}" text-anchor="end">lane {i + 1}</text>'
        for i in range(len(lanes))
    )
    parts.extend(_bar(b, TOP + i * lane_row, scale, lane_row) for i, b in placed)
    parts.append("</svg>")
    more = row["count"] - len(bars)
    note = (
        f'<p class="note">{more:,} more slot(s) not drawn one by one (the row above shows them all).</p>'
        if more
        else ""
    )
    return (
        f'<details class="keyed-step" data-step="{e(row["step"])}"><summary>{e(row["step"])}: '
        f"{row['count']:,} slot(s) in run {tl['run']}, one lane per slot running at once</summary>"
        f"{''.join(parts)}{note}</details>"
    )


def _story(data: dict[str, Any]) -> str:
    rows = []
    for r in data["runs"]:
        if r["end_max"] is not None:
            ended = f"killed {_between(r['end'], r['end_max'])}"
        elif r["status"] == "running":
            ended = f"running (last event {_clock(r['end'])})"
        else:
            ended = _clock(r["end"])
        took = None if r["end"] is None or r["start"] is None else r["end"] - r["start"]
        story = []
        if r["skipped"]:
            src = ", ".join(str(n) for n in r["skipped_from"]) or "an earlier run"
            story.append(f"resumed: skipped {r['skipped']:,} slot(s) computed in run(s) {src}")
        if r["saved_unknown"]:
            story.append(f"time saved not known for {r['saved_unknown']:,} skip(s)")
        rows.append(
            f'<tr data-run="{r["run"]}"><td class="num" data-v="{r["run"]}">{r["run"]}</td>'
            f"<td>{_clock(r['start'], date=True)}</td><td>{e(ended)}</td>"
            f'<td class="num" data-v="{took or 0}">{duration(took)}</td>'
            f'<td><span class="badge {e(r["status"])}">{e(r["status"])}</span></td>'
            f'<td class="num">{r["ran"]:,}</td><td class="num">{r["skipped"]:,}</td>'
            f'<td class="num">{r["failed"]:,}</td><td class="num">{r["retried"]:,}</td>'
            f'<td class="num" data-v="{r["saved_s"]}">{duration(r["saved_s"])}</td><td>{e("; ".join(story))}</td></tr>'
        )
    numeric = ["Run", "Took", "Ran", "Skipped", "Failed", "Retried", "Saved"]
    heads = ["Run", "Started", "Ended", "Took", "Status", *numeric[2:], "What happened"]
    return (
        '<section id="runs"><h2>Runs: the resume story</h2><p class="note">Each rerun skips the slots whose '
        "stored output matches their code and arguments; the time saved is what those slots took when "
        f"they ran.</p>{_table('runs-table', heads, rows, numeric)}</section>"
    )


def _table(table_id: str | None, heads: list[str], rows: list[str], numeric: Sequence[str] = ()) -> str:
    """A table, sortable if it has an id."""
    th = "".join(f'<th class="num">{h}</th>' if h in numeric else f"<th>{h}</th>" for h in heads)
    table = f'<table class="sortable" id="{table_id}">' if table_id else "<table>"
    return f"{table}<thead><tr>{th}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _why_cell(row: dict[str, Any]) -> str:
    if row["outcome"] == "skipped":
        made = f" (computed in run {row['computed_in']})" if row["computed_in"] else ""
        return f"skipped: its stored output matches its code and arguments{e(made)}"
    reason = row["reason"] or "unknown"
    text = e(reason) + (f' <span class="muted">({e(row["detail"])})</span>' if row["detail"] else "")
    if row["error"]:
        text += f'<br><span class="muted">{e(row["error"][0])}: {e(row["error"][1])}</span>'
    return text + _changes(row["changes"])


def _changes(changes: list[dict[str, Any]]) -> str:
    """The arguments that changed, and the code and values that did (with diffs, folded)."""
    code = [c for c in changes if c["kind"] != "parameter"]
    params = [c["name"] for c in changes if c["kind"] == "parameter"]
    text = f'<br><span class="muted">arguments changed: {e(", ".join(params))}</span>' if params else ""
    if code:
        items = []
        for c in code:
            if c["kind"] == "value":
                items.append(
                    f"<div>value {e(c['name'])}: {e(c['old'] or '(none)')} → {e(c['new'] or '(none)')}</div>"
                )
            else:
                head = f"{c['kind']} {c['name']}" if c["kind"] != "code" else "its own code"
                diff = f'<pre class="diff">{e(c["diff"])}</pre>' if c.get("diff") else ""
                items.append(f"<div>{e(head)} changed{diff}</div>")
        names = ", ".join(c["name"] for c in code)
        text += f"<details><summary>what changed: {e(_label(names, 60))}</summary>{''.join(items)}</details>"
    return text


def _steps(data: dict[str, Any]) -> str:
    rows = []
    for r in data["slots"]:
        outcome = r["outcome"]
        value = r["value"] or ""
        if r["key"] is not None and r["key"] != r["slot"].partition("/")[2]:  # an escaped key
            name = f'<span title="{e(r["slot"])}">{e(r["step"])} <span class="key">{e(_label(r["key"], 120))}</span></span>'
        else:
            name = e(r["slot"])
        parent = f'<br><span class="muted">inside {e(r["parent"])}</span>' if r["parent"] else ""
        rows.append(
            f'<tr class="o-{e(outcome)}" data-outcome="{e(outcome)}" data-slot="{e(r["slot"])}">'
            f'<td class="slot">{name}{parent}</td>'
            f'<td><span class="badge {e(outcome)}">{e(outcome)}</span></td>'
            f'<td class="why">{_why_cell(r)}</td>'
            f'<td class="num" data-v="{r["run"]}">{r["run"]}</td>'
            f'<td class="num" data-v="{r["computed_in"] or 0}">{r["computed_in"] or ""}</td>'
            f'<td class="num" data-v="{r["duration"] or 0}">{duration(r["duration"])}</td>'
            f'<td class="num" data-v="{r["bytes"] or 0}">{human_size(r["bytes"]) if r["bytes"] else ""}</td>'
            f'<td class="num" data-v="{r["attempts"] or 0}">{r["attempts"] or ""}</td>'
            f'<td><div class="value" title="{e(value)}">{e(value[:80])}</div></td></tr>'
        )
    numeric = ["Run", "Computed in", "Duration", "Size", "Tries"]
    heads = ["Slot", "Outcome", "Why", *numeric, "Output (summary)"]
    options = "".join(f'<option value="{o}">{o}</option>' for o in OUTCOMES)
    total = sum(g["slots"] for g in data["groups"])
    listed = len(data["slots"])
    note = (
        f'<p class="note">{listed:,} of {total:,} slots listed (unkeyed, failed and a sample of each keyed '
        "step); every slot is counted in the table below.</p>"
        if listed < total
        else ""
    )
    groups = [
        f'<tr data-step="{e(g["step"])}"><td class="slot">{e(g["step"])}</td><td class="num">{g["slots"]:,}</td>'
        + "".join(f'<td class="num">{g["outcomes"].get(o, 0):,}</td>' for o in OUTCOMES)
        + f"<td>{e(', '.join(f'{k} ×{v:,}' for k, v in sorted(g['reasons'].items())))}</td></tr>"
        for g in data["groups"]
    ]
    return (
        '<section id="steps"><h2>Steps</h2>'
        '<div class="tools" hidden><input id="steps-filter" type="search" placeholder="filter slots, reasons, errors…" '
        f'aria-label="filter"><select id="steps-outcome" aria-label="outcome"><option value="">any outcome</option>'
        f'{options}</select><span id="steps-shown" class="muted"></span></div>{note}'
        f'<div class="scroll">{_table("steps-table", heads, rows, numeric)}</div><h3>Per step</h3>'
        f"{_table('groups-table', ['Step', 'Slots', *OUTCOMES, 'Why they ran'], groups, ['Slots', *OUTCOMES])}"
        "</section>"
    )


def _batches(data: dict[str, Any]) -> str:
    if not data["batches"]:
        return ""
    out = ['<section id="batches"><h2>Batches</h2>']
    numeric = ["Run", "Rows done", "Resumed", "Computed", "Failed rows"]
    for b in data["batches"]:
        total = f"{b['total']:,}" if b["total"] is not None else "unknown"
        rows = []
        for r in b["runs"]:
            resumed, computed = "not recorded", ""
            if r["resumed"] is not None:
                resumed, computed = f"{r['resumed']:,}", f"{r['done'] - r['resumed']:,}"
            f = r["failure"] or {}
            failure = f"row {e(f.get('row'))}: {e(f.get('type'))}: {e(f.get('message'))}" if f else ""
            rows.append(
                f'<tr><td class="num">{r["run"]}</td><td class="num">{r["done"]:,}</td><td class="num">{resumed}</td>'
                f'<td class="num">{computed}</td><td class="num">{r["failures"]:,}</td><td>{failure}</td></tr>'
            )
        out.append(
            f'<div class="panel batch" data-batch="{e(b["batch"])}"><h3>{e(b["batch"])} '
            f'<span class="muted">{total} rows, committed every {e(b["every"])}</span></h3>'
            f"{_rate_chart(b)}{_table(None, [*numeric, 'A failure'], rows, numeric)}</div>"
        )
    out.append("</section>")
    return "".join(out)


_RUN_COLOURS = ("#2f6fdb", "#1f9d74", "#e07b24", "#8e5bd9", "#d43d3d", "#5b6775")


def _rates(run: dict[str, Any]) -> list[tuple[float, float]]:
    """(seconds since the run started, rows per second since the previous record) of one run."""
    rates = []
    prev_t, prev_n = 0.0, run["resumed"]  # the first rate counts from the resumed rows, if known
    for t, n, _ in run["points"]:
        if prev_n is not None and t > prev_t:
            rates.append((t, (n - prev_n) / (t - prev_t)))
        prev_t, prev_n = t, n
    return rates


def _rate_chart(batch: dict[str, Any]) -> str:
    series = [(r["run"], rates) for r in batch["runs"] if (rates := _rates(r))]
    if not series:
        return '<p class="note">Not enough progress records to draw rows per second.</p>'
    width, height, left, top, bottom = WIDTH, 190, 70, 34, 26
    tmax = max(t for _, rs in series for t, _ in rs) or 1.0
    rmax = max(v for _, rs in series for _, v in rs) or 1.0
    plot_w, plot_h = width - left - 16, height - top - bottom
    parts = [f'<svg class="rate" viewBox="0 0 {width} {height}" role="img" aria-label="rows per second">']
    for i in range(5):
        y = top + plot_h * i / 4
        parts.append(f'<line class="grid" x1="{left}" x2="{width - 16}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(
            f'<text class="axis" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_num(rmax * (4 - i) / 4)}</text>'
        )
    parts.append(_ticks(tmax, left, plot_w, top, plot_h, text_y=height - 8))
    for idx, (run, rates) in enumerate(series):
        colour = _RUN_COLOURS[idx % len(_RUN_COLOURS)]
        points = [(left + t / tmax * plot_w, top + plot_h * (1 - v / rmax), t, v) for t, v in rates]
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y, _, _ in points)
        parts.append(
            f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="2"><title>run {run}</title></polyline>'
        )
        parts.extend(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}">'
            f"<title>run {run}: {_num(v)} rows/s at +{duration(t)}</title></circle>"
            for x, y, t, v in points
        )
        x = width - 16 - 80 * (len(series) - idx)  # its legend, right-aligned above the plot
        parts.append(f'<rect x="{x}" y="8" width="12" height="12" rx="2" fill="{colour}"/>')
        parts.append(f'<text class="axis" x="{x + 17}" y="18">run {run}</text>')
    parts.append("</svg>")
    return '<p class="note">Rows per second since each run started, one line per run.</p>' + "".join(parts)


def _num(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}"


def _compare(data: dict[str, Any]) -> str:
    cmp = data["compare"]
    if cmp is None:
        return ""
    first = cmp["first"]
    rows = []
    explain = "The two states hold the same outputs."
    for r in cmp["rows"]:
        is_first = r["slot"] == first
        anchor = ' id="first-divergence"' if is_first else ""
        rows.append(
            f'<tr class="{"first" if is_first else ""}" data-verdict="{e(r["verdict"])}" data-slot="{e(r["slot"])}"'
            f'{anchor}><td class="slot">{e(r["slot"])}</td>'
            f"<td>{_side(r['a'])}</td><td>{_side(r['b'])}</td><td>{e(r['verdict'])}{_changes(r['changes'])}</td></tr>"
        )
        if is_first:
            explain = f"First divergence: {r['slot']}: {_verdict_text(r)}."
    return (
        '<section id="compare"><h2>Comparison</h2>'
        f'<p class="panel" id="first-divergence-text"><b>{e(cmp["a"])} → {e(cmp["b"])}</b>: '
        f"{cmp['same']:,} of {cmp['total']:,} slots hold the same output. {e(explain)}</p>"
        f"{_table('compare-table', ['Slot', e(cmp['a']), e(cmp['b']), 'Verdict'], rows)}</section>"
    )


def _side(version: dict[str, Any] | None) -> str:
    if version is None:
        return '<span class="muted">absent</span>'
    return f"run {version['run'] or '?'} · {e(version['fingerprint'])}"


_VERDICTS = {
    "added": "it was computed only after the earlier state",
    "removed": "it was forgotten (reset or rolled back) since",
    "unreadable": "its output is missing or damaged on one side",
    "output differs": "the same code and arguments gave a different output",
}


def _verdict_text(row: dict[str, Any]) -> str:
    if row["verdict"] == "code changed":
        names = ", ".join(c["name"] for c in row["changes"]) or "its code"
        return f"its code changed ({names}), so it ran again"
    if row["verdict"] == "inputs changed":
        return f"its arguments changed (fingerprint {row['a']['fingerprint']} → {row['b']['fingerprint']})"
    return _VERDICTS[row["verdict"]]


def _error(data: dict[str, Any]) -> str:
    err = data["error"]
    if err is None:
        return ""
    where = f" in step {err['step']}" if err.get("step") else ""
    when = f" (run {err['run']})" if err.get("run") is not None else ""
    resolved = (
        '<p class="note">A later run got past it: the state holds no error now.</p>'
        if err["resolved"]
        else ""
    )
    return (
        f'<section id="error"><h2>Last error</h2><div class="panel err">{resolved}'
        f"<p><b>{e(err['type'])}</b>{e(where)}{e(when)}: {e(err['message'])}</p>"
        f"<pre>{e(err['traceback'])}</pre></div></section>"
    )


def write_file(path: str | os.PathLike[str], data: bytes) -> str:
    """Write *data* to *path* atomically; returns the absolute path."""
    target = os.path.abspath(os.fspath(path))
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    return target


def report(  # noqa: PLR0913 - what to show, and where the state is
    store: Any, secret: bytes | None, path: str | os.PathLike[str], *, run: int | str = "all",
    compare: int | str | None = None, root: Any = None, session: str | None = None,
) -> str:  # fmt: skip
    """Write the report of *store* (session *session* of *root*) to *path*; reads only."""
    data = collect(store, secret, run=run, compare=compare, root=root, session=session)
    return write_file(path, render(data).encode())
