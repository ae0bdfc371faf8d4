"""Chart of bench_defaults.py's last run: each configuration's step against our 1F1B, per
model and link, wall-clock medians (with the spread over rounds) beside CPU-time replays.

    python bench/chart_defaults.py [bench/figures/defaults.json] [bench/figures/defaults.png]

The machine that ran it was shared, so the wall bars are noisy; the CPU replay (each action's
CPU time, replayed through the schedule) is the steadier of the two.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ["defaults", "auto", "varuna", "1f1b", "gpipe", "varuna-zb", "1f1b-zb",
         "pipelining 1F1B", "eager m"]


def main(source: Path, target: Path) -> None:
    rows = json.loads(source.read_text())
    cells = sorted({(r["model"], r["link"]) for r in rows})
    fig, axes = plt.subplots(1, len(cells), figsize=(4.2 * len(cells), 4.2), sharey=True)
    for ax, (model, link) in zip(axes, cells):
        here = {r["variant"]: r for r in rows if r["model"] == model and r["link"] == link}
        base = here["1f1b"]
        names = [n for n in ORDER if n in here]
        wall = [here[n]["ms"] / base["ms"] for n in names]
        cpu = [(here[n].get("cpu_ms") or float("nan")) / (base.get("cpu_ms") or float("nan"))
               for n in names]
        low = [w * (1 - min(here[n].get("spread", 0.0), 0.99) / 2) for n, w in zip(names, wall)]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], wall, 0.4, label="wall (median of rounds)",
               yerr=[[w - lo for w, lo in zip(wall, low)], [0] * len(wall)], capsize=2)
        ax.bar([i + 0.2 for i in x], cpu, 0.4, label="CPU-time replay")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(x), names, rotation=60, ha="right", fontsize=8)
        title = "GPT, 16k head" if model == "gpt" else "uniform MLP"
        ax.set_title(f"{title}, link {link}", fontsize=9)
    axes[0].set_ylabel("step / our 1F1B's")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    print(f"wrote {target}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0]) if args else Path("bench/figures/defaults.json"),
         Path(args[1]) if len(args) > 1 else Path("bench/figures/defaults.png"))
