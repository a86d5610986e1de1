#!/usr/bin/env python3
"""fp8train's MLflow tracker against a real MLflow tracking server, read back by MLflow's client.

Usage: check_mlflow.py FP8TRAIN REPO_ROOT

Starts `mlflow server` on 127.0.0.1 (a free port, a temporary SQLite store), then:
1. trains configs/tiny.yaml for 6 steps with --tracker=jsonl,mlflow and checks with
   MlflowClient: the experiment, the run's name and status FINISHED, the resolved configuration
   as params (section.key), the fp8train.* tags, a summary/ metric, and train/loss at each step
   equal to metrics.jsonl's loss;
2. resumes it to step 9 (--resume=auto): the same MLflow run, its loss history now to step 9;
3. points MLFLOW_TRACKING_URI at a closed port: the run stops before its first step with an
   error naming the URI;
4. a run that fails (a NaN injected with nan_restore_after 1 and no checkpoint to restore)
   ends FAILED, and one stopped by SIGINT ends KILLED;
5. stops the server while a 40-step run trains: the run still finishes (exit status 0) and its
   output says that MLflow could not be reached and what was not delivered.
Prints "ok: ..." and exits 0, exits 1 with the first problem, or 77 (skipped) when the mlflow
package is not installed.
"""
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

try:
    from mlflow.tracking import MlflowClient
except ImportError:
    print("skipped: the Python package mlflow is not installed (pip install mlflow)")
    sys.exit(77)

import yaml

EXPERIMENT = "fp8train-ci"
TAGS = ("fp8train.git_commit", "fp8train.device", "fp8train.precision", "fp8train.fp8_recipe")
RUN_TIMEOUT = 600  # seconds for one training run


def fail(message: str) -> None:
    print(f"FAIL: {message}")
    sys.exit(1)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """`mlflow server` in its own process group, so that stopping it ends its workers too."""

    def __init__(self, folder: Path):
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = folder / "mlflow-server.log"
        # One worker and no job runner: the server starts sooner on a small CI machine.
        environment = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
                 "--port", str(self.port), "--workers", "1",
                 "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
                 "--default-artifact-root", str(folder / "artifacts")],
                stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                fail(f"mlflow server exited with {self.process.returncode}:\n"
                     f"{self.log.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        fail(f"mlflow server did not answer within 120 s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def train_command(fp8train: str, root: Path, runs: Path, run: str, *extra: str) -> list:
    return [fp8train, "train", "--config", str(root / "configs" / "tiny.yaml"),
            f"--output-dir={runs}", f"--run={run}", "--tracker=jsonl,mlflow",
            f"--experiment={EXPERIMENT}", *extra]


def train(command: list, uri: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=dict(os.environ, MLFLOW_TRACKING_URI=uri),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=RUN_TIMEOUT)


def check_ran(result: subprocess.CompletedProcess, what: str) -> None:
    if result.returncode != 0:
        fail(f"{what}: exit status {result.returncode}:\n{result.stdout}")


def jsonl_losses(run_folder: Path) -> dict:
    """step -> loss of metrics.jsonl (a resumed run appends; the latest record of a step wins)."""
    losses = {}
    for line in (run_folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step" in record:
            losses[record["step"]] = record["loss"]
    return losses


def mlflow_history(client: MlflowClient, run_id: str, key: str) -> dict:
    """step -> value of a metric's history (the latest value of a step wins)."""
    history = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return {metric.step: metric.value for metric in history}


def check_losses(client: MlflowClient, run_id: str, run_folder: Path, last_step: int) -> None:
    expected = jsonl_losses(run_folder)
    found = mlflow_history(client, run_id, "train/loss")
    if sorted(found) != list(range(1, last_step + 1)):
        fail(f"train/loss logged at steps {sorted(found)}, expected 1 to {last_step}")
    if sorted(expected) != sorted(found):
        fail(f"train/loss steps {sorted(found)}, metrics.jsonl has {sorted(expected)}")
    for step, value in expected.items():
        if not math.isclose(found[step], value, rel_tol=1e-6):
            fail(f"train/loss at step {step}: {found[step]} in MLflow, {value} in metrics.jsonl")


def the_run(client: MlflowClient, name: str):
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        fail(f"no experiment '{EXPERIMENT}'")
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"attributes.run_name = '{name}'")
    if len(runs) != 1:
        fail(f"{len(runs)} runs named '{name}' in '{EXPERIMENT}', expected 1")
    return runs[0]


def check_first_run(client: MlflowClient, fp8train: str, root: Path, runs: Path,
                    uri: str) -> str:
    result = train(train_command(fp8train, root, runs, "tiny-mlflow", "--train-iters=6",
                                 "--save-every=3"), uri)
    check_ran(result, "6 steps")
    run = the_run(client, "tiny-mlflow")
    if run.info.status != "FINISHED":
        fail(f"run status {run.info.status}, expected FINISHED")
    if run.info.run_name != "tiny-mlflow":
        fail(f"run name {run.info.run_name}, expected tiny-mlflow")
    # Every key of the resolved configuration, as section.key.
    resolved = yaml.safe_load((runs / "tiny-mlflow" / "config.yaml").read_text())
    params = run.data.params
    missing = [f"{section}.{key}" for section, keys in resolved.items() for key in keys
               if f"{section}.{key}" not in params]
    if missing:
        fail(f"params missing: {missing} (params: {sorted(params)})")
    for key, value in (("model.depth", "4"), ("training.train_iters", "6")):
        if params[key] != value:
            fail(f"param {key} = {params[key]!r}, expected {value!r}")
    for tag in TAGS:
        if not run.data.tags.get(tag):
            fail(f"tag {tag} missing or empty (tags: {run.data.tags})")
    if not any(key.startswith("summary/") for key in run.data.metrics):
        fail(f"no summary/ metric (metrics: {sorted(run.data.metrics)})")
    check_losses(client, run.info.run_id, runs / "tiny-mlflow", 6)
    return run.info.run_id


def check_resume(client: MlflowClient, fp8train: str, root: Path, runs: Path, uri: str,
                 run_id: str) -> None:
    result = train(train_command(fp8train, root, runs, "tiny-mlflow", "--train-iters=9",
                                 "--save-every=3", "--resume=auto"), uri)
    check_ran(result, "the resume to step 9")
    run = the_run(client, "tiny-mlflow")
    if run.info.run_id != run_id:
        fail(f"the resume logged to run {run.info.run_id}, expected {run_id}")
    if run.info.status != "FINISHED":
        fail(f"resumed run status {run.info.status}, expected FINISHED")
    check_losses(client, run_id, runs / "tiny-mlflow", 9)


def check_wrong_uri(fp8train: str, root: Path, runs: Path) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    result = train(train_command(fp8train, root, runs, "tiny-wrong-uri", "--train-iters=2"), uri)
    if result.returncode == 0:
        fail(f"a closed port at {uri}: exit status 0:\n{result.stdout}")
    if uri not in result.stdout:
        fail(f"a closed port: the error does not name {uri}:\n{result.stdout}")
    if "step 1/" in result.stdout:
        fail(f"a closed port: the run trained before stopping:\n{result.stdout}")


def run_named(client: MlflowClient, name: str):
    experiment = client.get_experiment_by_name(EXPERIMENT)
    found = client.search_runs([experiment.experiment_id],
                               filter_string=f"attributes.run_name = '{name}'")
    return found[0] if found else None


def check_failed_and_killed(client: MlflowClient, fp8train: str, root: Path, runs: Path,
                            uri: str) -> None:
    result = train(train_command(fp8train, root, runs, "tiny-failed", "--train-iters=6",
                                 "--nan-inject-steps=2",
                                 "--nan-inject-parameter=transformer.h.1.mlp.c_fc.weight",
                                 "--nan-restore-after=1"), uri)
    if result.returncode == 0:
        fail(f"the run with a NaN and nothing to restore: exit status 0:\n{result.stdout}")
    run = run_named(client, "tiny-failed")
    if run is None or run.info.status != "FAILED":
        fail(f"the run that failed: MLflow status {run and run.info.status}, expected FAILED")

    command = train_command(fp8train, root, runs, "tiny-killed", "--train-iters=200",
                            "--eval-every=0", "--sample-tokens=0")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=dict(os.environ, MLFLOW_TRACKING_URI=uri))
    deadline = time.monotonic() + RUN_TIMEOUT
    while True:  # SIGINT once a loss has arrived: the run has trained a step
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            fail(f"the 200-step run: no loss arrived in MLflow:\n{process.communicate()[0]}")
        time.sleep(0.5)
        run = run_named(client, "tiny-killed")
        if run is not None and mlflow_history(client, run.info.run_id, "train/loss"):
            break
    process.send_signal(signal.SIGINT)
    output = process.communicate(timeout=RUN_TIMEOUT)[0]
    status = client.get_run(run.info.run_id).info.status
    if "stopped by signal" not in output or status != "KILLED":
        fail(f"the run stopped by SIGINT: MLflow status {status}, expected KILLED:\n{output}")


def check_outage(client: MlflowClient, server: Server, fp8train: str, root: Path,
                 runs: Path) -> str:
    command = train_command(fp8train, root, runs, "tiny-outage", "--train-iters=40",
                            "--eval-every=0", "--sample-tokens=0")
    log = runs / "tiny-outage.log"
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True,
                                   env=dict(os.environ, MLFLOW_TRACKING_URI=server.uri))
    # Stop the server once the first losses arrived, while the run still trains.
    deadline = time.monotonic() + RUN_TIMEOUT
    arrived = {}
    while not arrived:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            fail(f"the 40-step run: no loss arrived in MLflow:\n{log.read_text()}")
        time.sleep(0.5)
        experiment = client.get_experiment_by_name(EXPERIMENT)
        found = client.search_runs([experiment.experiment_id],
                                   filter_string="attributes.run_name = 'tiny-outage'")
        if found:
            arrived = mlflow_history(client, found[0].info.run_id, "train/loss")
    server.stop()
    if max(arrived) >= 40:
        fail("the 40-step run ended before the server was stopped")
    try:
        status = process.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        fail(f"the 40-step run did not end after the server stopped:\n{log.read_text()}")
    output = log.read_text()
    if status != 0:
        fail(f"the run whose server stopped: exit status {status}:\n{output}")
    if "step 40/40" not in output:
        fail(f"the run whose server stopped did not train to step 40:\n{output}")
    for said in (f"MLflow: cannot deliver to {server.uri}", "MLflow: not delivered to"):
        if said not in output:
            fail(f"the run whose server stopped does not say '{said}':\n{output}")
    return f"server stopped after step {max(arrived)}"


def main() -> None:
    fp8train, root = sys.argv[1], Path(sys.argv[2])
    with tempfile.TemporaryDirectory(prefix="fp8train-mlflow-") as folder:
        folder = Path(folder)
        runs = folder / "runs"
        server = Server(folder)
        try:
            client = MlflowClient(tracking_uri=server.uri)
            run_id = check_first_run(client, fp8train, root, runs, server.uri)
            check_resume(client, fp8train, root, runs, server.uri, run_id)
            check_wrong_uri(fp8train, root, runs)
            check_failed_and_killed(client, fp8train, root, runs, server.uri)
            outage = check_outage(client, server, fp8train, root, runs)
        finally:
            server.stop()
    print(f"ok: run {run_id}: params, tags, status and loss history of 6 steps, resumed to 9 in "
          f"the same run; a closed port stops the start; failed and interrupted runs end FAILED "
          f"and KILLED; {outage}, the run finished and said "
          f"what was not delivered")


if __name__ == "__main__":
    main()
