"""One self-contained HTML page of cards: inline CSS and JS, no network, untrusted text as text.

Safety, by construction: the summary is rendered here with `html.escape`; the cards' data travel
as JSON inside `<script type="application/json">` with `<`, `>` and `&` written as \\u escapes (no
text can close the element), and the page's script builds every card with `textContent` and
`createElement` only - it never parses data as HTML, so a `<script>`, an `<img onerror>` or a
`javascript:` link in a document renders as the characters it is. A Content-Security-Policy allows
only this page's own script (by its sha256) and inline styles, and no network source at all.

Scale: cards render in pages of 50 as they are asked for (filters and search run over the data,
not the DOM), so a 10,000-record run opens as fast as a 50-record one plus parsing its JSON
(benchmarks/bench_report.py).
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
from importlib import resources

from d2r_edge.view.cards import NLI_KEYS

# the page's own style and script ship beside this module (package data); the script's sha256 is the CSP's
_CSS = resources.files(__package__).joinpath("page.css").read_text(encoding="utf-8")
_JS = resources.files(__package__).joinpath("page.js").read_text(encoding="utf-8")


_FILTERS = [("repaired", "repaired"), ("changed", "answer changed"), ("fixed", "wrong \u2192 right"),
            ("broken", "right \u2192 wrong"), ("wrong", "final wrong"), ("right", "final right"),
            ("untrusted", "untrusted"), ("over", "over budget"), ("error", "error")]


def _json_for_script(obj) -> str:
    """JSON that cannot end its <script> element or open a comment there (\\u escapes for < > &)."""
    text = json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _fmt(v, digits: int = 3, scale: float = 1.0, unit: str = "") -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}{unit}"


def _bars_svg(counts: dict[str, int], width: int = 360) -> str:
    """A horizontal bar chart as inline SVG (labels escaped)."""
    if not counts:
        return ""
    top = max(counts.values()) or 1
    rows = []
    for i, (name, n) in enumerate(counts.items()):
        w = int((width - 170) * n / top)
        y = i * 20
        rows.append(f'<text x="0" y="{y + 13}" font-size="11">{html.escape(str(name))}</text>'
                    f'<rect x="160" y="{y + 3}" width="{max(w, 1)}" height="12" fill="#6c8ebf"/>'
                    f'<text x="{164 + w}" y="{y + 13}" font-size="11">{int(n)}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{20 * len(counts)}" role="img">'
            + "".join(rows) + "</svg>")


def _summary_html(s: dict) -> str:
    e = html.escape
    boxes = [("records", str(s["records"])), ("repaired", str(s["repaired"])),
             ("answer changed", str(s["changed"])),
             ("wrong \u2192 right / right \u2192 wrong", f'{s["wrong_to_right"]} / {s["right_to_wrong"]}'),
             ("accuracy first \u2192 final", "-" if s["first_accuracy"] is None else
              f'{s["first_accuracy"]:.3f} \u2192 {s["final_accuracy"]:.3f} ({s["graded"]} graded)'),
             ("query time p50 / p95", f'{_fmt(s["total_s_p50"], 0, 1e3)} / {_fmt(s["total_s_p95"], 0, 1e3, " ms")}'),
             ("repair time p50 / p95", f'{_fmt(s["repair_s_p50"], 0, 1e3)} / {_fmt(s["repair_s_p95"], 0, 1e3, " ms")}'),
             ("repair memory p50 / p95", f'{_fmt(s["repair_mib_p50"], 2)} / {_fmt(s["repair_mib_p95"], 2, 1, " MiB")}'),
             ("over budget", f'{s["over_budget"]} of {s["repaired"]} repairs'), ("errors", str(s["errors"]))]
    if s.get("trust_judged"):
        cov = s["trusted"] / s["trust_judged"]
        err = "" if s["trusted_error"] is None else f', wrong {s["trusted_error"]:.3f}'
        trust = (f'{s["trusted"]} of {s["trust_judged"]} ({cov:.1%}){err}; certified error <= '
                 f'{_fmt(s["trust_epsilon"], 2)}; {s["abstained"]} abstained')
        boxes.insert(4, ("trusted (coverage)", trust))
    out = ['<section class="summary">']
    out += [f'<div class="box"><b>{e(v)}</b><span>{e(k)}</span></div>' for k, v in boxes]
    out.append('</section><section class="summary">')
    out.append(f'<div class="box"><span>failure types</span>{_bars_svg(s["failures"])}</div>')
    if s["arms_by_failure"]:
        rows = "".join(f"<tr><td>{e(f)}</td><td>{e(', '.join(f'{a} {n}' for a, n in arms.items()))}</td></tr>"
                       for f, arms in s["arms_by_failure"].items())
        out.append(f'<div class="box"><span>arms picked per failure type</span><table>'
                   f'<tr><th>failure</th><th>arm (times)</th></tr>{rows}</table></div>')
    out.append("</section>")
    return "".join(out)


def render_page(cards: list[dict], summary: dict, *, title: str, note: str = "", live: str | None = None,
                poll_ms: int = 4000) -> str:
    """The whole page as one string. `live`: a same-origin URL the page polls for fresh cards (serve --ui)."""
    data = {"cards": cards, "failures": summary["failures"], "nli": list(NLI_KEYS),
            "live": live, "poll_ms": poll_ms}
    script_hash = base64.b64encode(hashlib.sha256(_JS.encode("utf-8")).digest()).decode()
    csp = (f"default-src 'none'; script-src 'sha256-{script_hash}'; style-src 'unsafe-inline'; "
           "img-src data:; base-uri 'none'; form-action 'none'" + ("; connect-src 'self'" if live else ""))
    checks = "".join(f'<label><input type="checkbox" id="f-{k}"> {html.escape(label)}</label>' for k, label in _FILTERS)
    return (
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>{html.escape(title)}</h1><p>{html.escape(note)}</p></header><main>"
        f"{_summary_html(summary)}"
        '<div class="controls"><input type="search" id="q" placeholder="search query, answers, gold, id" '
        'aria-label="search"><select id="failure" aria-label="failure type"><option value="">every failure type'
        f"</option></select>{checks}<span id=\"count\" class=\"meta\"></span></div>"
        '<div id="cards"></div><button id="more" hidden>show more</button></main>'
        f'<script type="application/json" id="d2r-data">{_json_for_script(data)}</script>'
        f"<script>{_JS}</script></body></html>"
    )
