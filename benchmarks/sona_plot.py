"""The learning benchmark's figure as a standalone SVG (no plotting library): two panels.

Left: accuracy on the taught questions and the held-out paraphrases, for the
base and the consolidated adapter with and without EWC, with the validation
perplexity change under each bar group. Right: the instant loop: the share of
facts a session answers right after 1..5 corrections.
"""
from __future__ import annotations

from html import escape

W, H, PAD = 900, 360, 50
COLORS = {"question": "#3b6ea8", "paraphrase": "#e08a2c", "changed": "#8a8a8a"}


def _text(x: float, y: float, s: str, size: int = 12, anchor: str = "middle", weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'font-family="sans-serif">{escape(s)}</text>')


def _axes(x0: float, y0: float, w: float, h: float, title: str) -> list[str]:
    out = [f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 - h}" stroke="#333"/>',
           f'<line x1="{x0}" y1="{y0}" x2="{x0 + w}" y2="{y0}" stroke="#333"/>', _text(x0 + w / 2, y0 - h - 14, title,
                                                                                        13, weight="bold")]
    for k in range(0, 5):
        y = y0 - h * k / 4
        out += [f'<line x1="{x0 - 4}" y1="{y:.1f}" x2="{x0 + w}" y2="{y:.1f}" stroke="#ddd"/>',
                _text(x0 - 8, y + 4, f"{k / 4:.2f}", 10, "end")]
    return out


def draw(result: dict) -> str:
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}">',
             '<rect width="100%" height="100%" fill="white"/>']
    x0, y0, w, h = PAD, H - 70, W / 2 - 2 * PAD, H - 140
    parts += _axes(x0, y0, w, h, f"accuracy, {result['model']} ({result['task']['facts']} facts)")
    groups = [("base", result["base"], None)] + [
        (f"EWC {c['ewc_lambda']:g}" if c["ewc_lambda"] else "no EWC", c,
         100 * (c["validation_ppl"] / result["base"]["validation_ppl"] - 1)) for c in result["consolidation"]]
    gw = w / len(groups)
    for g, (name, scores, rise) in enumerate(groups):
        for k, kind in enumerate(("question", "paraphrase")):
            value = scores[f"{kind}_accuracy"]
            bx = x0 + g * gw + gw * (0.2 + 0.3 * k)
            parts.append(f'<rect x="{bx:.1f}" y="{y0 - h * value:.1f}" width="{gw * 0.28:.1f}" '
                         f'height="{h * value:.1f}" fill="{COLORS[kind]}"/>')
            parts.append(_text(bx + gw * 0.14, y0 - h * value - 4, f"{value:.2f}", 10))
        parts.append(_text(x0 + (g + 0.5) * gw, y0 + 16, name))
        if rise is not None:
            parts.append(_text(x0 + (g + 0.5) * gw, y0 + 32, f"val ppl {rise:+.2f}%", 10))
    x1 = W / 2 + PAD
    parts += _axes(x1, y0, w, h, "instant loop: one session, 1-5 corrections")
    curve = result["instant"]["after_corrections"]
    for kind in ("question", "paraphrase", "changed"):
        points = [(x1 + w * (c - 0.5) / 5, y0 - h * curve[c if c in curve else str(c)][kind]) for c in range(1, 6)]
        parts.append(f'<polyline fill="none" stroke="{COLORS[kind]}" stroke-width="2" points="'
                     + " ".join(f"{x:.1f},{y:.1f}" for x, y in points) + '"/>')
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{COLORS[kind]}"/>' for x, y in points]
    for c in range(1, 6):
        parts.append(_text(x1 + w * (c - 0.5) / 5, y0 + 16, str(c)))
    parts.append(_text(x1 + w / 2, y0 + 32, "corrections", 11))
    legend = [("question", "taught question"), ("paraphrase", "held-out paraphrase"),
              ("changed", "answer changed (instant)")]
    for k, (kind, label) in enumerate(legend):
        lx = PAD + k * 220
        parts += [f'<rect x="{lx}" y="{H - 22}" width="12" height="12" fill="{COLORS[kind]}"/>',
                  _text(lx + 18, H - 12, label, 11, "start")]
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
