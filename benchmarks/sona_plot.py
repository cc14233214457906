"""The learning benchmark's figure as a standalone SVG (no plotting library): two panels.

Left: accuracy on the taught questions and the held-out paraphrases, for the
base and the consolidated adapter with and without EWC, with the validation
perplexity change under each bar group. Middle: the answers' mean NLL per
token (lower is better). Right: the instant loop: the share of facts a
session answers right after 1..5 corrections, and how often that answer
leaks to another question of the same session.
"""
from __future__ import annotations

from html import escape

W, H, PAD = 1200, 360, 50
COLORS = {"question": "#3b6ea8", "paraphrase": "#e08a2c", "changed": "#8a8a8a", "leaked": "#c23b3b"}


def _text(x: float, y: float, s: str, size: int = 12, anchor: str = "middle", weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'font-family="sans-serif">{escape(s)}</text>')


def _axes(x0: float, y0: float, w: float, h: float, title: str, top: float = 1.0) -> list[str]:
    out = [f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 - h}" stroke="#333"/>',
           f'<line x1="{x0}" y1="{y0}" x2="{x0 + w}" y2="{y0}" stroke="#333"/>', _text(x0 + w / 2, y0 - h - 14, title,
                                                                                        13, weight="bold")]
    for k in range(0, 5):
        y = y0 - h * k / 4
        out += [f'<line x1="{x0 - 4}" y1="{y:.1f}" x2="{x0 + w}" y2="{y:.1f}" stroke="#ddd"/>',
                _text(x0 - 8, y + 4, f"{top * k / 4:.2f}", 10, "end")]
    return out


def draw(result: dict) -> str:
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}">',
             '<rect width="100%" height="100%" fill="white"/>']
    y0, h = H - 70, H - 140
    w = W / 3 - 2 * PAD
    groups = [("base", result["base"], None)] + [
        (f"EWC {c['ewc_lambda']:g}" if c["ewc_lambda"] else "no EWC", c,
         100 * (c["validation_ppl"] / result["base"]["validation_ppl"] - 1)) for c in result["consolidation"]]
    top_nll = max(max(g[1]["question_nll"], g[1]["paraphrase_nll"]) for g in groups)
    panels = [("accuracy", "accuracy", 1.0), ("nll", "answer NLL / token", top_nll)]
    for p, (key, title, top) in enumerate(panels):
        x0 = PAD + p * W / 3
        parts += _axes(x0, y0, w, h, f"{title}, {result['model']} ({result['task']['facts']} facts)", top)
        gw = w / len(groups)
        for g, (name, scores, rise) in enumerate(groups):
            for k, kind in enumerate(("question", "paraphrase")):
                value = scores[f"{kind}_{key}"] / top
                bx = x0 + g * gw + gw * (0.2 + 0.3 * k)
                parts.append(f'<rect x="{bx:.1f}" y="{y0 - h * value:.1f}" width="{gw * 0.28:.1f}" '
                             f'height="{h * value:.1f}" fill="{COLORS[kind]}"/>')
                parts.append(_text(bx + gw * 0.14, y0 - h * value - 4, f"{value * top:.2f}", 10))
            parts.append(_text(x0 + (g + 0.5) * gw, y0 + 16, name))
            if rise is not None:
                parts.append(_text(x0 + (g + 0.5) * gw, y0 + 32, f"val ppl {rise:+.2f}%", 10))
    x1 = 2 * W / 3 + PAD
    parts += _axes(x1, y0, w, h, "instant loop: one session, 1-5 corrections")
    curve = result["instant"]["after_corrections"]
    for kind in ("question", "paraphrase", "changed", "leaked"):
        if kind not in curve[next(iter(curve))]:
            continue
        points = [(x1 + w * (c - 0.5) / 5, y0 - h * curve[c if c in curve else str(c)][kind]) for c in range(1, 6)]
        parts.append(f'<polyline fill="none" stroke="{COLORS[kind]}" stroke-width="2" points="'
                     + " ".join(f"{x:.1f},{y:.1f}" for x, y in points) + '"/>')
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{COLORS[kind]}"/>' for x, y in points]
    for c in range(1, 6):
        parts.append(_text(x1 + w * (c - 0.5) / 5, y0 + 16, str(c)))
    parts.append(_text(x1 + w / 2, y0 + 32, "corrections", 11))
    legend = [("question", "taught question"), ("paraphrase", "held-out paraphrase"),
              ("changed", "answer changed (instant)"), ("leaked", "answer leaked to another question")]
    for k, (kind, label) in enumerate(legend):
        lx = PAD + k * 260
        parts += [f'<rect x="{lx}" y="{H - 22}" width="12" height="12" fill="{COLORS[kind]}"/>',
                  _text(lx + 18, H - 12, label, 11, "start")]
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
