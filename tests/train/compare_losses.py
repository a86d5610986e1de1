"""Each step's loss as an interrupted run last logged it (a restart repeats the steps after its
checkpoint) against an uninterrupted run's: every step present, every loss equal.
Usage: compare_losses.py STRAIGHT_METRICS INTERRUPTED_METRICS STEPS"""
import json
import sys


def losses(path):
    found = {}
    for line in open(path):
        record = json.loads(line)
        if "step" in record and "loss" in record:
            found[record["step"]] = record["loss"]
    return found


straight, interrupted, steps = losses(sys.argv[1]), losses(sys.argv[2]), int(sys.argv[3])
missing = [s for s in range(1, steps + 1) if s not in interrupted]
differ = [(s, straight[s], interrupted[s]) for s in range(1, steps + 1)
          if s in interrupted and interrupted[s] != straight[s]]
if missing or differ:
    print(f"FAIL: steps missing {missing[:5]}, losses differing (step, straight, interrupted) "
          f"{differ[:5]}")
    sys.exit(1)
print(f"PASS: {steps} steps through the kills, every loss equal to the uninterrupted run's")
