"""The report's plots: matplotlib figures rendered to PNG and embedded in the page as base64, so
the page needs no network and no files beside it. Each function returns {"caption", "png"}."""
from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")        # no display: render to memory only
import matplotlib.pyplot as plt  # noqa: E402

_DPI = 96


def _png(fig, caption: str) -> dict:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight")
    plt.close(fig)
    return {"caption": caption, "png": base64.b64encode(buf.getvalue()).decode("ascii")}


def bar_chart(values: dict, ylabel: str, caption: str, top: int = 20) -> dict:
    items = sorted(values.items(), key=lambda kv: -kv[1])[:top]
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.bar([k for k, _ in items], [v for _, v in items], color="#4c72b0")
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", labelrotation=60, labelsize=8)
    ax.set_title(caption, fontsize=10)
    return _png(fig, caption)


def timeline(tasks, times: dict, sms: int, step_us: float, caption: str, width: int = 1200) -> dict:
    """One row per SM, each task drawn from its predicted start to end, coloured by body kind.
    Rasterized into a `width`-column image (one column = step / width) instead of one patch per
    task: a slice schedule has thousands of tasks and patches take seconds to draw."""
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    kinds = sorted({t.body_kind for t in tasks})
    palette = [plt.get_cmap("tab20")(i) for i in range(20)] + [plt.get_cmap("tab20b")(i) for i in range(20)]
    colors = ["#ffffff"] + [palette[i % len(palette)] for i in range(len(kinds))]
    img = np.zeros((sms, width), dtype=np.int16)
    scale = width / max(step_us, 1e-9)
    for t in tasks:
        a, b = times[t.id]
        lo = min(width - 1, int(a * scale))
        img[t.sm, lo:max(lo + 1, int(np.ceil(b * scale)))] = kinds.index(t.body_kind) + 1
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.imshow(img, aspect="auto", interpolation="nearest", cmap=ListedColormap(colors), vmin=0, vmax=len(kinds),
              extent=(0, step_us, sms - 0.5, -0.5))
    ax.set_xlabel("predicted time in the step (us)")
    ax.set_ylabel("SM")
    ax.legend(handles=[Patch(color=colors[i + 1], label=k) for i, k in enumerate(kinds)], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_title(caption, fontsize=10)
    return _png(fig, caption)


def sm_load(loads: list[float], step_us: float, caption: str) -> dict:
    fig, ax = plt.subplots(figsize=(10, 2.5))
    ax.bar(range(len(loads)), loads, width=1.0, color="#55a868")
    ax.axhline(step_us, color="#c44e52", linewidth=1, label=f"predicted step {step_us:.0f} us")
    ax.set_xlabel("SM")
    ax.set_ylabel("busy us")
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(caption, fontsize=10)
    return _png(fig, caption)


def numerics(series: dict, tol: float, caption: str) -> dict:
    """`series`: label -> (steps, errors, near-tie steps): error per step, near-ties marked apart."""
    from matplotlib.ticker import MaxNLocator
    fig, ax = plt.subplots(figsize=(8, 3))
    for label, (steps, errs, ties) in series.items():
        line, = ax.plot(steps, [max(e, 1e-9) for e in errs], marker="o", label=label)
        if ties:
            ax.scatter([s for s, _ in ties], [max(e, 1e-9) for _, e in ties], marker="x", s=60,
                       color=line.get_color(), label=f"{label}: routing near-tie (apart)")
    ax.axhline(tol, color="#c44e52", linestyle="--", linewidth=1, label=f"tolerance {tol:g}")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("decode step")
    ax.set_ylabel("logits rel. L2 error")
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(caption, fontsize=10)
    return _png(fig, caption)


def speed(kinds: list[str], measured: list[float], roofline: list[float], baseline: list[float] | None,
          caption: str) -> dict:
    """Grouped bars per op kind (or per batch): measured, roofline and baseline microseconds."""
    import numpy as np
    x = np.arange(len(kinds))
    w = 0.27
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.bar(x - w, measured, w, label="fusec measured", color="#4c72b0")
    ax.bar(x, roofline, w, label="HBM roofline", color="#8c8c8c")
    if baseline is not None:
        ax.bar(x + w, baseline, w, label="baseline", color="#dd8452")
    ax.set_xticks(x, kinds, fontsize=8)
    ax.set_ylabel("us")
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(caption, fontsize=10)
    return _png(fig, caption)
