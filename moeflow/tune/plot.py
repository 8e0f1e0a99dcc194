"""The plot `moeflow tune` writes beside its run configuration: predicted TPOT per ranked configuration, the bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..artifacts import PLOT_METADATA, atomic_write
from ..registry import host_miss


def plot_ranking(ranked: list[dict[str, Any]], bound_tpot_s: float, path: str | Path, *, title: str = "", top: int = 30) -> Path:
    """Horizontal bars of the best `top` configurations' predicted TPOT (ms), best at the top, and the bound line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ranked[:top]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.28 * len(rows)))
    y = list(range(len(rows)))[::-1]
    host = [host_miss(r) for r in rows]  # miss=cpu: the bound of copies does not hold for it
    ax.barh(y, [r["predicted_tpot_s"] * 1e3 for r in rows], color=["tab:green" if h else "tab:blue" for h in host])
    ax.set_yticks(y, [r["label"] for r in rows], fontsize=8)
    bound = f"bound {bound_tpot_s * 1e3:.1f} ms" + (" (copying every miss)" if any(host) else "")
    ax.axvline(bound_tpot_s * 1e3, color="tab:red", linestyle="--", label=bound)
    ax.set_xlabel("predicted TPOT (ms)")
    ax.set_title(title or "moeflow tune")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    p = Path(path)
    with atomic_write(p, "wb") as fh:
        fig.savefig(fh, format="png", dpi=100, metadata=PLOT_METADATA)  # marks it moeflow's (`artifact_kind`)
    plt.close(fig)
    return p
