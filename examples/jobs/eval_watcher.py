"""Watch a trainer's checkpoint folder and log every new checkpoint, CPU only.

    python examples/jobs/eval_watcher.py /ckpt/checkpoints [--interval 10] [--log evals.jsonl]

The auxiliary task of `rl-with-eval-watcher.yaml`: it mounts the trainer's checkpoint volume read-only and
polls it. A checkpoint is a folder `step-NNNNNN` with a `tandem.json` (step, weight version, trigger,
metrics, creation time); folders still being written end in `.partial` and are skipped, so every folder
seen is complete. For each new one it prints a JSON line (and appends it to `--log` when given) with the
step and the metrics the trainer recorded. Swap `report` for a real evaluation (load the Hugging Face
files in the folder, score a held-out set) to make it an evaluator. SIGTERM or SIGINT ends it after the
folder is scanned once more, so the trainer's final checkpoint is reported before the scheduler's
termination delay runs out.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

METADATA_FILE = "tandem.json"
PARTIAL_SUFFIX = ".partial"


def new_checkpoints(root: Path, seen: set[str]) -> list[tuple[Path, dict[str, Any]]]:
    """Complete checkpoint folders under `root` not in `seen`, oldest step first, with their metadata."""
    found: list[tuple[int, Path, dict[str, Any]]] = []
    if not root.is_dir():
        return []
    for folder in root.glob("step-*"):
        if folder.name in seen or folder.name.endswith(PARTIAL_SUFFIX) or not folder.is_dir():
            continue
        try:
            meta = json.loads((folder / METADATA_FILE).read_text())
        except (OSError, ValueError):
            continue  # not a Tandem checkpoint, or written before metadata existed: look again next time
        if not isinstance(meta, dict):
            continue
        found.append((int(meta.get("step", -1)), folder, meta))
    found.sort(key=lambda item: item[0])
    return [(folder, meta) for _, folder, meta in found]


def report(folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    metrics = meta.get("metrics") or {}
    return {
        "checkpoint": folder.name,
        "step": meta.get("step"),
        "weight_version": meta.get("weight_version"),
        "trigger": meta.get("trigger"),
        "reward_mean": metrics.get("reward/mean"),
        "metrics": metrics,
        "age_s": round(time.time() - float(meta.get("create_time", time.time())), 1),
    }


def watch(root: Path, interval: float, log: Path | None, stop: threading.Event) -> int:
    seen: set[str] = set()
    print(json.dumps({"watching": str(root), "interval_s": interval}), flush=True)
    while True:
        stopping = stop.is_set()  # read before the scan: a stop during it still gets one more look
        for folder, meta in new_checkpoints(root, seen):
            seen.add(folder.name)
            line = json.dumps(report(folder, meta), sort_keys=True)
            print(line, flush=True)
            if log is not None:
                with log.open("a") as out:
                    out.write(line + "\n")
        if stopping:
            print(json.dumps({"stopped": True, "checkpoints": len(seen)}), flush=True)
            return 0
        stop.wait(interval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "checkpoints", type=Path, help="the trainer's checkpoint folder (<output>/checkpoints)"
    )
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between scans")
    parser.add_argument("--log", type=Path, help="also append each report to this JSON-lines file")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return watch(args.checkpoints, args.interval, args.log, stop)


if __name__ == "__main__":
    sys.exit(main())
