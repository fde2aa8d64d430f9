"""A small SVG toolkit for the `harts viz` report: strings in, strings out.

Every function returns an SVG (or HTML-safe) fragment as a `str`; the report
joins them. No plan types here: the toolkit draws numbers and labels, and
`harts.tools.viz` decides what they mean.

Invariants: text content (labels, titles, tooltips) always passes through
`esc`, so plan contents cannot break the markup; ids, colours and `extra`
attributes are markup the caller writes. Numbers are written at fixed
precision, so the same inputs give the same bytes. Every plot is one standalone
`<svg>`, `WIDTH` px wide, with no external references.
"""
from __future__ import annotations

import html
import math

import numpy as np

INK, MUTED, GRID = "#222", "#666", "#e4e4e4"
WIDTH = 960                   # every plot's width in px (the page is 1000 px wide)
CHAR_PX = 6.1                 # approximate width of one 11 px sans-serif character


def esc(value) -> str:
    """Any value as text safe inside an element or a quoted attribute."""
    return html.escape(str(value), quote=True)


def fmt(value: float) -> str:
    """A number for a reader: whole values with thousands separators, others to about 3 digits."""
    if isinstance(value, (int, np.integer)) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.2f}" if abs(value) >= 10 else f"{value:.3g}"


def nice_ticks(top: float, count: int = 5, integer: bool = False) -> list[float]:
    """0 .. >= top in 1-2-5 steps."""
    if top <= 0:
        return [0, 1]
    raw = top / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    if integer:
        step = max(1, math.ceil(step))
    n = math.ceil(top / step - 1e-9)
    return [round(k * step, 10) for k in range(n + 1)]


def text(x, y, content, *, size=11, anchor="start", color=INK, weight="normal", rotate=None) -> str:
    transform = f' transform="rotate({rotate} {x:.1f} {y:.1f})"' if rotate is not None else ""
    bold = ' font-weight="bold"' if weight != "normal" else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{color}"'
            f'{bold}{transform}>{esc(content)}</text>')


def rect(x, y, w, h, fill, *, stroke=None, extra="", tip=None) -> str:
    """A rectangle (negative sizes clamp to 0); `tip` becomes its hover text."""
    outline = f' stroke="{stroke}"' if stroke else ""
    body = f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{max(h, 0):.1f}" fill="{fill}"{outline}{extra}'
    return body + (f"><title>{esc(tip)}</title></rect>" if tip else "/>")


def line(x1, y1, x2, y2, color, *, width=1.0, dash=None) -> str:
    dashed = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{color}" '
            f'stroke-width="{width}"{dashed}/>')


def legend(items: list[tuple[str, str]], x_right: float, y: float) -> str:
    """Swatches right-aligned at the top of a plot."""
    parts, x = [], x_right
    for label, color in reversed(items):
        x -= len(label) * CHAR_PX + 8
        parts.append(text(x, y + 9, label, size=11))
        x -= 16
        parts.append(rect(x, y, 12, 12, color, extra=' class="swatch"'))
        x -= 14
    return "".join(parts)


def svg(svg_id: str, height: float, body: list[str], title: str) -> str:
    """One standalone plot: `body` fragments inside a `WIDTH` x `height` canvas."""
    return (f'<svg id="{svg_id}" width="{WIDTH}" height="{height:.0f}" '
            f'viewBox="0 0 {WIDTH} {height:.0f}" role="img" aria-label="{esc(title)}" '
            f'font-family="DejaVu Sans, Helvetica, Arial, sans-serif">{"".join(body)}</svg>')


def message_svg(svg_id: str, message: str) -> str:
    """A short framed note drawn in place of a plot that has nothing to show."""
    body = [rect(0.5, 0.5, WIDTH - 1, 59, "#fafafa", stroke=GRID), text(WIDTH / 2, 35, message, size=13,
                                                                     anchor="middle", color=MUTED)]
    return svg(svg_id, 60, body, message)


def bar_chart(svg_id: str, *, title: str, labels: list[str], series: list[tuple[str, str, np.ndarray]],
              y_label: str, x_label: str, groups: list[tuple[str, int, int]] | None = None,
              refs: tuple[tuple[float, str, str], ...] = (), y_top: float | None = None,
              integer_y: bool = False, tips: list[str] | None = None, height: int = 250) -> str:
    """Stacked bars, optionally in groups (a gap between groups, group labels under the axis)."""
    n = len(labels)
    ml, mr, mt, mb_ = 70, 20, 30, 58 if groups else 46
    pw, ph = WIDTH - ml - mr, height - mt - mb_
    totals = sum((np.asarray(v, dtype=float) for _, _, v in series), np.zeros(n))
    top = y_top if y_top is not None else max([float(totals.max()) if n else 0.0] + [r[0] for r in refs]) * 1.08
    ticks = nice_ticks(top, integer=integer_y)
    top = ticks[-1]
    group_of = np.zeros(n, dtype=np.int64)
    if groups:
        for g, (_, first, count) in enumerate(groups):
            group_of[first:first + count] = g
    gap = 0.8 if groups and len(groups) > 1 else 0.0
    unit = pw / max(n + gap * (group_of[-1] if n else 0), 1)
    bar_w = min(max(unit * 0.8, 1.0), 56.0)

    def x_of(k: int) -> float:
        return ml + (k + gap * group_of[k]) * unit + (unit - bar_w) / 2

    def y_of(v: float) -> float:
        return mt + ph - ph * (v / top if top else 0)

    body = [text(ml, 16, title, size=12, weight="bold")]
    for t in ticks:
        body.append(line(ml, y_of(t), ml + pw, y_of(t), GRID))
        body.append(text(ml - 6, y_of(t) + 4, fmt(t), size=10, anchor="end", color=MUTED))
    for k in range(n):
        base, parts = 0.0, []
        for name, color, values in series:
            v = float(values[k])
            if v > 0:
                parts.append(rect(x_of(k), y_of(base + v), bar_w, y_of(base) - y_of(base + v), color))
            base += v
        tip = tips[k] if tips else f"{labels[k]}: {fmt(base)}"
        body.append(f"<g><title>{esc(tip)}</title>{''.join(parts)}</g>")
    for value, label, color in refs:
        body.append(line(ml, y_of(value), ml + pw, y_of(value), color, width=1.5, dash="6 4"))
        body.append(text(ml + pw - 4, y_of(value) - 5, label, size=10, anchor="end", color=color))
    body.append(line(ml, mt + ph, ml + pw, mt + ph, INK))
    body.append(line(ml, mt, ml, mt + ph, INK))
    every = max(1, math.ceil(max((len(s) for s in labels), default=1) * 6.5 / unit)) if n else 1
    for k in range(0, n, every):
        body.append(text(x_of(k) + bar_w / 2, mt + ph + 14, labels[k], size=10, anchor="middle", color=MUTED))
    if groups:
        g_every = max(1, math.ceil(max(len(g[0]) for g in groups) * 6.5 / max(unit * groups[0][2], 1)))
        for g, (label, first, count) in enumerate(groups):
            if g % g_every:
                continue
            centre = (x_of(first) + x_of(first + count - 1) + bar_w) / 2
            body.append(text(centre, mt + ph + 30, label, size=11, anchor="middle"))
    body.append(text(ml + pw / 2, height - 6, x_label, size=11, anchor="middle"))
    body.append(text(16, mt + ph / 2, y_label, size=11, anchor="middle", rotate=-90))
    if len(series) > 1:
        body.append(legend([(name, color) for name, color, _ in series], ml + pw, 4))
    return svg(svg_id, height, body, title)

