"""The gated-learning benchmark's figure as a standalone SVG (no plotting library), and a PNG of it.

Left: per variant (the ablations), after one correction: accuracy on the question
and its held-out paraphrase, and the share of other questions (same session) and of
the same question in another session whose answer changed. Right: after
consolidation, a fresh session's accuracy and the untaught questions changed, with
the instant update's p50 latency and the perplexity change written under it.
"""
from __future__ import annotations

from html import escape
from pathlib import Path

W, H, PAD = 1200, 430, 50
SERIES = [("question_accuracy", "question", "#3b6ea8"), ("paraphrase_accuracy", "held-out paraphrase", "#e08a2c"),
          ("others_changed", "other questions changed", "#c23b3b"),
          ("other_session_changed", "other session changed", "#8a8a8a")]


def _text(x: float, y: float, s: str, size: int = 12, anchor: str = "middle", weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'font-family="sans-serif">{escape(s)}</text>')


def _axes(x0: float, y0: float, w: float, h: float, title: str) -> list[str]:
    out = [f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 - h}" stroke="#333"/>',
           f'<line x1="{x0}" y1="{y0}" x2="{x0 + w}" y2="{y0}" stroke="#333"/>',
           _text(x0 + w / 2, y0 - h - 14, title, 13, weight="bold")]
    for k in range(5):
        y = y0 - h * k / 4
        out += [f'<line x1="{x0 - 4}" y1="{y:.1f}" x2="{x0 + w}" y2="{y:.1f}" stroke="#ddd"/>',
                _text(x0 - 8, y + 4, f"{k / 4:.2f}", 10, "end")]
    return out


def _bars(x0: float, y0: float, h: float, width: float, values: list[tuple[float, str]]) -> list[str]:
    out = []
    for k, (v, color) in enumerate(values):
        top = h * max(0.0, min(1.0, v))
        out += [f'<rect x="{x0 + k * width:.1f}" y="{y0 - top:.1f}" width="{width - 2:.1f}" height="{top:.1f}" '
                f'fill="{color}"/>', _text(x0 + k * width + width / 2, y0 - top - 3, f"{v:.2f}", 8)]
    return out


def _label(x: float, y: float, words: str, size: int = 10) -> list[str]:
    out, line = [], ""
    for word in words.split():
        if len(line) + len(word) > 16 and line:
            out.append(line)
            line = ""
        line = f"{line} {word}".strip()
    return [_text(x, y + 13 * k, s, size) for k, s in enumerate(out + [line])]


def draw(result: dict) -> str:
    variants = result["variants"]
    x0, y0, h = PAD + 20, H - 110, H - 190
    w = 760
    parts = _axes(x0, y0, w, h, f"{result['model']}: one correction per fact (fresh session each)")
    group = w / max(1, len(variants))
    for g, (name, v) in enumerate(variants.items()):
        gx = x0 + g * group + 10
        parts += _bars(gx, y0, h, (group - 20) / len(SERIES), [(v[key], c) for key, _, c in SERIES])
        parts += _label(gx + (group - 20) / 2, y0 + 16, f"{v['label']} (n={v['facts']}, p50 {v['update_ms']['p50']:.0f} ms)")
    for k, (_, label, color) in enumerate(SERIES):
        parts += [f'<rect x="{x0 + 10 + k * 190}" y="{H - 22}" width="12" height="12" fill="{color}"/>',
                  _text(x0 + 28 + k * 190, H - 12, label, 11, "start")]
    c = result.get("consolidation")
    if c:
        cx, cw = x0 + w + 90, 260
        parts += _axes(cx, y0, cw, h, f"after consolidating {c['examples']} patterns")
        parts += _bars(cx + 20, y0, h, 70, [(c["question_accuracy"], SERIES[0][2]),
                                            (c["paraphrase_accuracy"], SERIES[1][2]),
                                            (c["controls_changed"], SERIES[2][2])])
        parts += _label(cx + cw / 2, y0 + 16, f"untaught changed {c['controls_changed']:.2f}; val ppl "
                        f"{100 * c['validation_ppl_rise']:+.2f}% (adapter on every token); {c['seconds']:.0f} s")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}">'
            f'<rect width="{W}" height="{H}" fill="white"/>' + "".join(parts) + "</svg>\n")


def to_png(svg: Path) -> Path | None:
    """A PNG of the SVG through playwright's Chromium (None when playwright or the browser is missing)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    png = svg.with_suffix(".png")
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium" if Path("/usr/bin/chromium").exists()
                                        else None, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": W, "height": H})
            page.set_content(svg.read_text(encoding="utf-8"))
            page.screenshot(path=str(png), clip={"x": 0, "y": 0, "width": W, "height": H})
            browser.close()
    except Exception:  # noqa: BLE001 (the figure's SVG is the result; the PNG a convenience)
        return None
    return png
