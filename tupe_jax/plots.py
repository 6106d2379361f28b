"""Small matplotlib helpers (Agg backend, PNG files written atomically)."""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig: Any, path: str, dpi: int = 110) -> str:
    """Write `fig` to `path` via a temporary file and rename, then close it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.{os.getpid()}.tmp.png")
    try:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight")
        os.replace(tmp, path)
    except BaseException:   # a folder of that name, a full disk: the earlier file stays, and no temporary one
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        plt.close(fig)
    return path


def loss_curve(history: Sequence[Mapping[str, Any]], path: str, title: str = "",
               eval_history: Sequence[Mapping[str, Any]] = ()) -> str:
    """Training loss (and validation loss, if given) against step."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([m["step"] for m in history], [m["loss"] for m in history], label="train loss")
    if eval_history:
        ax.plot([m["step"] for m in eval_history], [m["eval_loss"] for m in eval_history], "o-",
                label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)
