"""Loss-curve PNG of the demo: matplotlib when importable, else a tiny built-in PNG writer.

:func:`write_loss_plot` draws, per optimizer, the training loss (nats/token) vs step smoothed
with a trailing moving average (matplotlib also shows the raw curve faintly) and the held-out loss
as markers joined by a dotted line, plus the entropy floor as a labelled dashed horizontal line; a
note in the picture states the smoothing window and the held-out set. The built-in backend draws
on :class:`dmuon.tools.canvas.Canvas` (an RGB grid with a 3x5 bitmap font, encoded as an 8-bit RGB
PNG; no dependency beyond ``zlib``).
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

from dmuon.tools.canvas import PNG_SIGNATURE, Canvas, encode_png, nice_ticks

__all__ = ["write_loss_plot", "smooth", "encode_png", "PNG_SIGNATURE"]
_COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]
_FLOOR_COLOR = (90, 90, 90)


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average: ``out[i] = mean(values[max(0, i-window+1) : i+1])``."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def write_loss_plot(path: str, curves: Mapping[str, Sequence[float]], floor: float, *,
                    held_out: Optional[Mapping[str, Sequence[Sequence[float]]]] = None,
                    eval_sequences: Optional[int] = None,
                    title: str = "", backend: str = "auto") -> str:
    """Write the loss-curve PNG to ``path``.

    Args:
      path: output file (``.png``).
      curves: ``{label: per-step training losses}`` (nats/token).
      floor: the entropy-rate floor (dashed line).
      held_out: ``{label: [(step, held-out loss), ...]}`` for the same labels (None: none drawn).
      eval_sequences: size of the held-out set, for the note (None: not stated).
      title: figure title.
      backend: ``"auto"`` (matplotlib if importable, else built-in), ``"matplotlib"`` or ``"builtin"``.

    Returns:
      The backend used: ``"matplotlib"`` or ``"builtin"``.
    """
    if backend not in ("auto", "matplotlib", "builtin"):
        raise ValueError(f"backend must be 'auto', 'matplotlib' or 'builtin', got {backend!r}")
    if backend in ("auto", "matplotlib"):
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt  # noqa: F401
        except ImportError:
            if backend == "matplotlib":
                raise
        else:
            _plot_matplotlib(path, curves, floor, title, held_out or {}, eval_sequences)
            return "matplotlib"
    _plot_builtin(path, curves, floor, title, held_out or {}, eval_sequences)
    return "builtin"


def _window(n: int) -> int:
    return max(1, n // 50)


def _note(curves: Mapping[str, Sequence[float]], held_out: Mapping, eval_sequences) -> str:
    """The picture's statement of what is drawn."""
    n = max((len(v) for v in curves.values()), default=1)
    w = _window(n)
    s = f"train: trailing mean over {w} steps" if w > 1 else "train: not smoothed"
    if held_out:
        s += ", held-out: dots" + (f" ({eval_sequences} sequences)" if eval_sequences else "")
    return s


def _floor_label(floor: float) -> str:
    return f"entropy floor {floor:.3f} (best possible)"


def _plot_matplotlib(path: str, curves: Mapping[str, Sequence[float]], floor: float,
                     title: str, held_out: Mapping, eval_sequences) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for i, (label, ys) in enumerate(curves.items()):
        c = tuple(v / 255 for v in _COLORS[i % len(_COLORS)])
        xs = range(1, len(ys) + 1)
        ax.plot(xs, ys, color=c, alpha=0.25, linewidth=0.8)
        ax.plot(xs, smooth(ys, _window(len(ys))), color=c, linewidth=2, label=f"{label}, train")
        pts = held_out.get(label)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=c, linestyle=":",
                    marker="o", markersize=4, label=f"{label}, held-out")
    ax.axhline(floor, color=tuple(v / 255 for v in _FLOOR_COLOR), linestyle="--",
               label=_floor_label(floor))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(f"{title}\n{_note(curves, held_out, eval_sequences)}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------------- built-in
def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v - round(v)) < 1e-9 else f"{v:.2f}".rstrip("0")


def _plot_builtin(path: str, curves: Mapping[str, Sequence[float]], floor: float,
                  title: str, held_out: Mapping, eval_sequences) -> None:
    W, H = 800, 500
    L, R, T, B = 70, 20, 40, 50           # margins
    cv = Canvas(W, H)
    smoothed = {k: smooth(list(v), _window(len(v))) for k, v in curves.items() if len(v)}
    n = max((len(v) for v in smoothed.values()), default=1)
    vals = [y for v in smoothed.values() for y in v if math.isfinite(y)] + [floor]
    vals += [p[1] for k in smoothed for p in held_out.get(k, ()) if math.isfinite(p[1])]
    y_lo, y_hi = min(vals), max(vals)
    pad = 0.05 * max(y_hi - y_lo, 1e-6)
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def X(step: float) -> float:
        return L + (step - 1) / max(1, n - 1) * (W - L - R)

    def Y(v: float) -> float:
        return T + (y_hi - v) / (y_hi - y_lo) * (H - T - B)

    grid = (230, 230, 230)
    for v in nice_ticks(y_lo, y_hi, 8):
        cv.line(L, Y(v), W - R, Y(v), grid)
        cv.text(L - 6, round(Y(v)) - 5, _fmt(v), anchor="right")
    for s in nice_ticks(1, n):
        cv.line(X(s), T, X(s), H - B, grid)
        cv.text(round(X(s)), H - B + 8, _fmt(s), anchor="center")
    cv.line(L, T, L, H - B, (0, 0, 0))
    cv.line(L, H - B, W - R, H - B, (0, 0, 0))
    cv.text((L + W - R) // 2, H - 18, "step", anchor="center")
    cv.text(8, T - 24, "loss (nats/token)", anchor="left")
    if title:
        cv.text((L + W - R) // 2, 12, title, anchor="center")
    cv.text(W - R, T - 12, _note(curves, held_out, eval_sequences), c=(80, 80, 80), anchor="right")
    cv.line(L, Y(floor), W - R, Y(floor), _FLOOR_COLOR, width=2, dash=6)
    cv.text(L + 6, round(Y(floor)) - 14, _floor_label(floor), c=_FLOOR_COLOR)
    for i, (label, ys) in enumerate(smoothed.items()):
        c = _COLORS[i % len(_COLORS)]
        pts = [(X(k + 1), Y(y)) for k, y in enumerate(ys) if math.isfinite(y)]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            cv.line(x0, y0, x1, y1, c, width=2)
        ho = [(X(p[0]), Y(p[1])) for p in held_out.get(label, ()) if math.isfinite(p[1])]
        for (x0, y0), (x1, y1) in zip(ho, ho[1:]):
            cv.line(x0, y0, x1, y1, c, width=1, dash=2)
        for x, y in ho:
            cv.rect(round(x) - 3, round(y) - 3, round(x) + 3, round(y) + 3, c)
    # legend (top right)
    labels = [f"{k}, train" for k in smoothed] + [_floor_label(floor)]
    lx, ly = W - R - 8 - 8 * max(len(s) for s in labels) - 34, T + 10
    cv.rect(lx - 6, ly - 6, W - R - 4, ly + 16 * len(labels) - 2, (250, 250, 250))
    for i, lab in enumerate(labels):
        c = _COLORS[i % len(_COLORS)] if i < len(smoothed) else _FLOOR_COLOR
        cv.line(lx, ly + 16 * i + 5, lx + 24, ly + 16 * i + 5, c, width=2,
                dash=6 if i == len(smoothed) else 0)
        cv.text(lx + 32, ly + 16 * i, lab)
    with open(path, "wb") as f:
        f.write(cv.png())
