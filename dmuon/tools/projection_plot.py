"""Timeline PNG of projected steps (:func:`dmuon.tools.projection.project_step`).

One band per design, three rows each: the compute stream (forward, backward and optimizer
phases in different colors) and the shard and replicate links (one color per lane); a time axis
in milliseconds. Drawn with the built-in PNG writer (:class:`dmuon.tools.canvas.Canvas`), so
it needs no plotting library.
"""
from __future__ import annotations

from typing import Sequence

from dmuon.tools.canvas import Canvas, nice_ticks
from dmuon.tools.projection import StepProjection

__all__ = ["write_timeline_png", "COLORS"]

COLORS = {
    "forward": (66, 133, 244), "backward": (52, 168, 83), "optimizer": (251, 140, 0),
    "fsdp_all_gather": (120, 144, 156), "fsdp_reduce_scatter": (84, 110, 122),
    "fsdp_replicate": (176, 190, 197), "unshard": (171, 71, 188), "reduce": (233, 30, 99),
    "replicate": (255, 202, 40), "split": (0, 172, 193),
}
_ROWS = ("compute", "shard", "replicate")


def write_timeline_png(path: str, projections: Sequence[StepProjection], *, title: str = "") -> None:
    """Write the timelines of ``projections`` (same setup, several designs) to ``path``."""
    W, L, R, T = 1400, 150, 20, 40
    row_h, band_gap = 16, 26
    H = T + len(projections) * (3 * (row_h + 4) + band_gap) + 90
    cv = Canvas(W, H)
    span = max(p.step for p in projections) or 1.0

    def X(t: float) -> int:
        return L + round(t / span * (W - L - R))

    if title:
        cv.text(W // 2, 10, title, anchor="center")
    y = T
    for p in projections:
        cv.text(8, y, f"{p.design} {p.step * 1e3:.1f} MS")
        for k, row in enumerate(_ROWS):
            y0 = y + 14 + k * (row_h + 4)
            cv.text(L - 8, y0 + 4, row, anchor="right")
            cv.rect(L, y0, W - R, y0 + row_h, (245, 245, 245))
            for op in p.timeline:
                if op.resource != row or op.end <= op.start:
                    continue
                color = COLORS[op.phase] if row == "compute" else COLORS.get(op.lane, (0, 0, 0))
                cv.rect(X(op.start), y0, max(X(op.start), X(op.end) - 1), y0 + row_h, color)
        for t in (p.forward, p.forward + p.backward):
            cv.line(X(t), y + 12, X(t), y + 14 + 3 * (row_h + 4), (0, 0, 0), dash=3)
        y += 14 + 3 * (row_h + 4) + band_gap
    for v in nice_ticks(0.0, span * 1e3, 10):
        cv.line(X(v / 1e3), y - band_gap + 4, X(v / 1e3), y - band_gap + 10, (0, 0, 0))
        cv.text(X(v / 1e3), y - band_gap + 14, f"{v:g}", anchor="center")
    cv.text((L + W - R) // 2, y + 4, "MS", anchor="center")
    x = 8
    for name, c in COLORS.items():
        cv.rect(x, y + 30, x + 12, y + 42, c)
        cv.text(x + 16, y + 33, name.replace("_", " "))
        x += 28 + 8 * len(name)
        if x > W - 200:
            x, y = 8, y + 20
    with open(path, "wb") as f:
        f.write(cv.png())
