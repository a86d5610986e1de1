#!/usr/bin/env python3
"""Reads an FP8 run's health statistics and step timers back, from the JSON lines and with
TensorBoard's own reader.

Usage: check_fp8_health.py RUN_FOLDER EVERY STEPS

RUN/fp8_health.jsonl must hold a record for every FP8 linear and operand (input, weight,
grad_output) at each statistics step (EVERY, 2·EVERY, ... up to STEPS), with fractions that
are its counts over its values; TensorBoard's EventAccumulator must read each record's
fp8/<layer>/<operand>/... scalars at its step with its values (as 32-bit floats), and each step's
timers (metrics.jsonl's timers_ms) as timers/<name>_ms. Prints "ok: ..." and exits 0, or exits 1
with the first problem.
"""
import json
import sys
from pathlib import Path

import numpy as np

# The event-file reading of the TensorBoard check, beside this script.
from check_tensorboard import fail, scalars

OPERANDS = {"input", "weight", "grad_output"}


def same_float(logged, read) -> bool:
    return np.float32(logged) == np.float32(read)


def main() -> None:
    run, every, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    records = [json.loads(line) for line in (run / "fp8_health.jsonl").read_text().splitlines()]
    expected_steps = list(range(every, steps + 1, every))
    if sorted({r["step"] for r in records}) != expected_steps:
        fail(f"statistics steps {sorted({r['step'] for r in records})}, expected {expected_steps}")
    tensors = {(r["layer"], r["operand"]) for r in records}
    layers = {layer for layer, _ in tensors}
    if len(tensors) != 3 * len(layers) or {o for _, o in tensors} != OPERANDS:
        fail(f"expected input, weight and grad_output of each of {len(layers)} linears")
    if len(records) != len(tensors) * len(expected_steps):
        fail(f"{len(records)} records, expected {len(tensors)} per statistics step")

    found = scalars(run)
    for r in records:
        name = f"{r['layer']} {r['operand']} at step {r['step']}"
        if r["elements"] <= 0:
            fail(f"{name}: no values counted")
        for kind in ("saturated", "underflow"):
            if not 0 <= r[kind] <= r["elements"]:
                fail(f"{name}: {r[kind]} {kind} of {r['elements']}")
            if abs(r[f"{kind}_fraction"] - r[kind] / r["elements"]) > 1e-12:
                fail(f"{name}: {kind}_fraction is not {kind} / elements")
        if not (r["amax"] > 0 and r["scale"] > 0):
            fail(f"{name}: amax {r['amax']}, scale {r['scale']} under a per-tensor recipe")
        for field in ("saturated_fraction", "underflow_fraction", "amax", "scale"):
            tag = f"fp8/{r['layer']}/{r['operand']}/{field}"
            value = found.get(tag, {}).get(r["step"])
            if value is None or not same_float(r[field], value):
                fail(f"{tag} at step {r['step']}: TensorBoard has {value}, the JSON line {r[field]}")

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in metrics if "step" in m]
    timers = 0
    for m in metrics:
        if "step" not in m.get("timers_ms", {}):
            fail(f"step {m['step']}: no timers_ms.step in metrics.jsonl")
        for name, milliseconds in m["timers_ms"].items():
            value = found.get(f"timers/{name}_ms", {}).get(m["step"])
            if value is None or not same_float(milliseconds, value) or milliseconds < 0:
                fail(f"timers/{name}_ms at step {m['step']}: {value}, the JSON line {milliseconds}")
            timers += 1
    print(f"ok: {len(records)} health records of {len(layers)} linears at steps {expected_steps} "
          f"and {timers} timers read back")


if __name__ == "__main__":
    main()
