"""A job's progress on disk, next to its checkpoints: `metrics.jsonl` (one JSON object per step, appended as
the step ends) and `checkpoints/reward.png` (the reward curve, redrawn every few steps and at the end).

The events service has the same figures as `train.step` events; these files are for a researcher looking at
the output folder, and for tools that read a run without a mesh. The plot is drawn with matplotlib's Agg
backend off the event loop; a plot that fails to draw is logged and never stops training.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("tandem.trainer")
PLOT_EVERY = 10  # steps between redraws of the reward plot
CURVES = (  # (metric, label) drawn on the reward plot when present
    ("reward/mean", "train reward (mean)"),
    ("eval/reward_mean", "eval reward (mean)"),
)


class Progress:
    def __init__(self, output_dir: Path, job: str) -> None:
        self.metrics_file = output_dir / "metrics.jsonl"
        self.plot_file = output_dir / "checkpoints" / "reward.png"
        self.job = job
        self.rows: list[dict[str, Any]] = []
        if self.metrics_file.is_file():  # a resumed job continues the file and the curve
            for line in self.metrics_file.read_text().splitlines():
                try:
                    self.rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue

    def record(self, step: int, version: int, metrics: Mapping[str, float], *, skipped: bool) -> None:
        """Append one step (a resumed job's repeat of a step replaces nothing: the file is a log)."""
        row: dict[str, Any] = {"step": step, "weight_version": version, "skipped": skipped}
        row.update({k: v for k, v in metrics.items() if math.isfinite(v)})
        self.rows.append(row)
        self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        with self.metrics_file.open("a") as out:
            out.write(json.dumps(row) + "\n")

    def plot_due(self, step: int, last: bool) -> bool:
        return last or step % PLOT_EVERY == 0

    def plot(self) -> Path | None:
        """Draw the reward curve(s) over the steps recorded so far; returns the file, or None when it failed."""
        try:
            import matplotlib  # noqa: PLC0415 - only the trainer process draws

            matplotlib.use("Agg")
            from matplotlib import pyplot  # noqa: PLC0415

            figure, axes = pyplot.subplots(figsize=(7, 4), dpi=100)
            try:
                for metric, label in CURVES:
                    points = [(r["step"], r[metric]) for r in self.rows if metric in r]
                    if points:
                        xs, ys = zip(*points, strict=True)
                        axes.plot(xs, ys, marker="." if metric.startswith("eval") else None, label=label)
                axes.set_xlabel("step")
                axes.set_ylabel("reward")
                axes.set_title(self.job)
                axes.grid(alpha=0.3)
                axes.legend(loc="lower right")
                self.plot_file.parent.mkdir(parents=True, exist_ok=True)
                partial = self.plot_file.with_name(self.plot_file.name + ".partial.png")
                figure.savefig(partial)
                partial.replace(self.plot_file)
            finally:
                pyplot.close(figure)
        except Exception:
            log.warning("could not draw the reward plot", exc_info=True)
            return None
        return self.plot_file
