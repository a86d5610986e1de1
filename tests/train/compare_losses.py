"""Each step's loss as a run last logged it (an interrupted run's restart repeats the steps after
its checkpoint) against a reference run's: every step present, every loss equal.
Usage: compare_losses.py REFERENCE_METRICS METRICS STEPS"""
import json
import sys


def losses(path):
    found = {}
    for line in open(path):
        record = json.loads(line)
        if "step" in record and "loss" in record:
            found[record["step"]] = record["loss"]
    return found


reference, run, steps = losses(sys.argv[1]), losses(sys.argv[2]), int(sys.argv[3])
missing = [s for s in range(1, steps + 1) if s not in run]
differ = [(s, reference[s], run[s]) for s in range(1, steps + 1)
          if s in run and run[s] != reference[s]]
if missing or differ:
    print(f"FAIL: {sys.argv[2]}: steps missing {missing[:5]}, losses differing (step, reference, "
          f"run) {differ[:5]}")
    sys.exit(1)
print(f"PASS: {sys.argv[2]}: {steps} steps, every loss equal to the reference run's")
