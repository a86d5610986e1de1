#!/usr/bin/env python3
"""Reads an fp8train run's TensorBoard event files with TensorBoard's own reader.

Usage: check_tensorboard.py RUN_FOLDER

Loads the run folder with tensorboard's EventAccumulator (what `tensorboard --logdir` uses, which
checks every record's CRC-32C) and checks that each step of metrics.jsonl is there under the
expected tags, at its step, with its value (as a 32-bit float). Then cuts the last record of the
event file short, as a crash mid-write would, and checks that the reader still returns every
step before it. Prints "ok: ..." and exits 0, or exits 1 with the first problem.
"""
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# metrics.jsonl field -> TensorBoard tag
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "lr_multiplier": "train/lr_multiplier",
    "grad_norm": "train/grad_norm",
    "step_seconds": "perf/step_seconds",
    "flops_per_second": "perf/flops_per_second",
    "memory_bytes": "memory/bytes",
    "tokens_per_second": "perf/tokens_per_second",
    "val_loss": "val/loss",
}


def fail(message: str) -> None:
    print(f"FAIL: {message}")
    sys.exit(1)


def scalars(folder: Path) -> dict:
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()["scalars"]}


def main() -> None:
    run = Path(sys.argv[1])
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in steps if "step" in record]
    if not steps:
        fail(f"{run}/metrics.jsonl holds no steps")
    files = sorted(run.glob("events.out.tfevents.*"))
    if not files:
        fail(f"no events.out.tfevents.* in {run}")

    found = scalars(run)
    checked = 0
    for record in steps:
        for field, tag in TAGS.items():
            value = record.get(field)
            if value is None:
                continue
            if tag not in found or record["step"] not in found[tag]:
                fail(f"{tag} at step {record['step']}: missing (tags: {sorted(found)})")
            got = found[tag][record["step"]]
            want = float(np.float32(value))
            if not (got == want or (math.isnan(got) and math.isnan(want))):
                fail(f"{tag} at step {record['step']}: {got}, expected {want} ({field} {value})")
            checked += 1

    # A crash mid-write: the newest file's last record cut short. The reader must skip it.
    newest = files[-1]
    last_step = max(found["train/loss"])
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / newest.name
        shutil.copyfile(newest, copy)
        data = copy.read_bytes()
        copy.write_bytes(data[:-7])
        truncated = scalars(Path(folder))
    kept = truncated.get("train/loss", {})
    if last_step in kept:
        fail(f"the truncated record of step {last_step} was read back")
    expected = {step: value for step, value in found["train/loss"].items() if step < last_step}
    if len(files) == 1 and kept != expected:
        fail(f"after truncation: train/loss {kept}, expected {expected}")

    print(f"ok: {checked} values at {len(steps)} steps in {len(files)} event file(s), "
          f"{len(found)} tags; a truncated last record is skipped")


if __name__ == "__main__":
    main()
