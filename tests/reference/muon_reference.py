#!/usr/bin/env python3
"""Runs nanochat's own MuonAdamW optimizer for a few steps and writes a golden file for the C++
Muon and AdamW (src/optim/muon.h, src/optim/adamw.h; checked by MuonGolden.* in
tests/optim/muon_test.cpp).

Usage, on any machine with torch (the CPU build is enough) and safetensors:

    git clone https://github.com/karpathy/nanochat ~/nanochat   # commit 92d63d4
    python3 tests/reference/muon_reference.py --nanochat ~/nanochat
    python3 tests/reference/muon_reference.py --nanochat ~/nanochat --dtype bfloat16

--nanochat is the directory that contains nanochat/optim.py. The first command writes
tests/data/muon_golden.safetensors (nanochat's COMPUTE_DTYPE float32, as on a CPU), the second
tests/data/muon_golden_bf16.safetensors (COMPUTE_DTYPE bfloat16, as on an sm80+ GPU: Muon
orthogonalizes in bf16). Both run on the CPU in eager mode: torch.compile is switched off
before torch is imported and the compiled step functions are unwrapped, so no C++ compiler or
GPU is needed. nanochat's other dependencies are not needed either: when nanochat.common does
not import (filelock missing, say), a stub that only defines COMPUTE_DTYPE stands in for it,
which is all optim.py takes from it.

What runs: three Muon groups (three stacked [12, 40] matrices, a tall [48, 16] one, a square
[24, 24] one) and two AdamW groups (an embedding [32, 16], a vector of 4 scalars), with fixed
seeded parameters and gradients, for 4 steps whose lr multiplier, Muon momentum and Muon weight
decay change every step as base_train.py changes them. The file holds the initial parameters,
the gradients of every step, the parameters after every step, the schedule, the final optimizer
state, and the groups' hyperparameters (metadata "groups", JSON); README.md lists the names.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

GOLDEN_FORMAT = "fp8train-muon-golden"
GOLDEN_VERSION = "1"
NANOCHAT_COMMIT = "92d63d4"
SEED = 1234

# lr multiplier, Muon momentum and Muon weight-decay multiplier of each step.
LR_MULTIPLIER = [1.0, 0.8, 0.5, 0.25]
MUON_MOMENTUM = [0.85, 0.9, 0.95, 0.97]
WEIGHT_DECAY_MULTIPLIER = [1.0, 0.9, 0.6, 0.3]
STEPS = len(LR_MULTIPLIER)

# The groups as nanochat's setup_optimizer writes them, with how their parameters start:
# "uniform" as nanochat's block matrices, "normal" as its embeddings, "near_one" as its
# lambdas. The Muon weight decay is large so that the cautious decay moves the parameters about
# as much as the update does.
MUON_GROUPS = [
    {"params": {"wide.0": (12, 40), "wide.1": (12, 40), "wide.2": (12, 40)}, "init": "uniform"},
    {"params": {"tall": (48, 16)}, "init": "uniform"},
    {"params": {"square": (24, 24)}, "init": "uniform"},
]
MUON_HYPERPARAMETERS = {"lr": 0.02, "ns_steps": 5, "beta2": 0.9, "weight_decay": 1.0}
ADAMW_GROUPS = [
    {"params": {"embedding": (32, 16)}, "init": "normal", "lr": 0.3, "betas": (0.8, 0.995),
     "eps": 1e-10, "weight_decay": 0.001},
    {"params": {"scalars": (4,)}, "init": "near_one", "lr": 0.005, "betas": (0.8, 0.95),
     "eps": 1e-10, "weight_decay": 0.05},
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanochat", required=True, type=Path,
                        help="directory containing nanochat/optim.py (a nanochat checkout)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="nanochat's COMPUTE_DTYPE: where Muon orthogonalizes")
    parser.add_argument("--out", type=Path, default=None,
                        help="output file (default: tests/data/muon_golden[_bf16].safetensors)")
    args = parser.parse_args()
    if not (args.nanochat / "nanochat" / "optim.py").is_file():
        parser.error(f"{args.nanochat / 'nanochat' / 'optim.py'} does not exist; --nanochat is "
                     "the directory that contains the nanochat package")
    if args.out is None:
        suffix = "" if args.dtype == "float32" else "_bf16"
        args.out = Path(__file__).resolve().parents[1] / "data" / f"muon_golden{suffix}.safetensors"
    return args


def nanochat_revision(nanochat_dir):
    try:
        return subprocess.run(["git", "-C", str(nanochat_dir), "rev-parse", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def import_nanochat_optim(nanochat_dir, compute_dtype):
    sys.path.insert(0, str(nanochat_dir.resolve()))
    try:
        import nanochat.common  # noqa: F401  (sets COMPUTE_DTYPE from NANOCHAT_DTYPE)
    except ImportError as error:
        print(f"note: nanochat.common does not import ({error}); a stub with COMPUTE_DTYPE "
              "stands in for it")
        stub = types.ModuleType("nanochat.common")
        stub.COMPUTE_DTYPE = compute_dtype
        sys.modules["nanochat.common"] = stub
    import nanochat.optim as optim

    optim.COMPUTE_DTYPE = compute_dtype  # what NANOCHAT_DTYPE asked for, made certain
    # torch.compile wraps the step functions; the methods look them up in the module at call
    # time, so the unwrapped originals run eagerly.
    eager = []
    for name in ("muon_step_fused", "adamw_step_fused"):
        compiled = getattr(optim, name)
        original = getattr(compiled, "_torchdynamo_orig_callable", None) or getattr(
            compiled, "__wrapped__", None)
        if original is not None:
            setattr(optim, name, original)
            eager.append(name)
    if len(eager) < 2:
        print("note: could not unwrap every compiled function; relying on torch._dynamo being "
              "disabled for the others")
    return optim, eager


def main():
    args = parse_args()
    # Before torch is imported: eager mode, and nanochat's compute dtype.
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    os.environ["NANOCHAT_DTYPE"] = args.dtype
    try:
        import torch
        from safetensors import safe_open
        from safetensors.torch import save_file
    except ImportError as error:
        sys.exit(f"error: {error}; this script needs torch and safetensors "
                 "(pip install torch safetensors)")
    try:
        torch._dynamo.config.disable = True
    except AttributeError:
        pass
    compute_dtype = getattr(torch, args.dtype)
    optim, unwrapped = import_nanochat_optim(args.nanochat, compute_dtype)
    optim_source = (args.nanochat / "nanochat" / "optim.py").read_bytes()
    revision = nanochat_revision(args.nanochat)
    if not revision.startswith(NANOCHAT_COMMIT):
        print(f"warning: nanochat is at {revision}, the C++ side follows {NANOCHAT_COMMIT}")

    generator = torch.Generator().manual_seed(SEED)

    def initial_value(init, shape):
        if init == "near_one":
            return 1.0 + 0.1 * torch.randn(shape, generator=generator)
        if init == "normal":
            return torch.randn(shape, generator=generator)
        bound = 3 ** 0.5 * shape[1] ** -0.5
        return (torch.rand(shape, generator=generator) * 2 - 1) * bound

    params = {}
    param_groups = []
    metadata_groups = []
    for group in MUON_GROUPS:
        names = list(group["params"])
        for name, shape in group["params"].items():
            params[name] = torch.nn.Parameter(initial_value(group["init"], shape).float())
        param_groups.append(dict(kind="muon", params=[params[n] for n in names],
                                 momentum=MUON_MOMENTUM[0], **MUON_HYPERPARAMETERS))
        metadata_groups.append(dict(kind="muon", params=names, **MUON_HYPERPARAMETERS))
    for group in ADAMW_GROUPS:
        names = list(group["params"])
        for name, shape in group["params"].items():
            params[name] = torch.nn.Parameter(initial_value(group["init"], shape).float())
        hyper = {key: group[key] for key in ("lr", "betas", "eps", "weight_decay")}
        param_groups.append(dict(kind="adamw", params=[params[n] for n in names], **hyper))
        metadata_groups.append(dict(kind="adamw", params=names, **hyper))

    optimizer = optim.MuonAdamW(param_groups)
    initial_lrs = [group["lr"] for group in optimizer.param_groups]
    initial_weight_decays = [group["weight_decay"] for group in optimizer.param_groups]

    tensors = {f"initial.{name}": p.detach().clone() for name, p in params.items()}
    for step in range(STEPS):
        # What base_train.py does before each optimizer.step().
        for group, lr, weight_decay in zip(optimizer.param_groups, initial_lrs,
                                           initial_weight_decays):
            group["lr"] = lr * LR_MULTIPLIER[step]
            if group["kind"] == "muon":
                group["momentum"] = MUON_MOMENTUM[step]
                group["weight_decay"] = weight_decay * WEIGHT_DECAY_MULTIPLIER[step]
        for name, p in params.items():
            grad = torch.randn(p.shape, generator=generator)
            tensors[f"grad.{step}.{name}"] = grad.clone()
            p.grad = grad
        optimizer.step()
        for name, p in params.items():
            tensors[f"param.{step}.{name}"] = p.detach().clone()

    for group, torch_group in zip(metadata_groups, optimizer.param_groups):
        if group["kind"] == "muon":
            state = optimizer.state[torch_group["params"][0]]
            for index, name in enumerate(group["params"]):
                tensors[f"state.{name}.momentum"] = state["momentum_buffer"][index].clone()
                tensors[f"state.{name}.second_moment"] = (
                    state["second_momentum_buffer"][index].clone())
        else:
            for name, p in zip(group["params"], torch_group["params"]):
                tensors[f"state.{name}.exp_avg"] = optimizer.state[p]["exp_avg"].clone()
                tensors[f"state.{name}.exp_avg_sq"] = optimizer.state[p]["exp_avg_sq"].clone()
    for key, values in (("lr_multiplier", LR_MULTIPLIER), ("muon_momentum", MUON_MOMENTUM),
                        ("weight_decay_multiplier", WEIGHT_DECAY_MULTIPLIER)):
        tensors[f"schedule.{key}"] = torch.tensor(values, dtype=torch.float64)
    tensors = {name: t.contiguous() for name, t in tensors.items()}

    metadata = {
        "format": GOLDEN_FORMAT,
        "version": GOLDEN_VERSION,
        "compute_dtype": args.dtype,
        "steps": str(STEPS),
        "groups": json.dumps(metadata_groups),
        "seed": str(SEED),
        "torch": torch.__version__,
        "nanochat_revision": revision,
        "nanochat_optim_sha256": hashlib.sha256(optim_source).hexdigest(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out), metadata=metadata)

    # Read it back: every tensor bit for bit.
    with safe_open(str(args.out), framework="pt") as handle:
        assert set(handle.keys()) == set(tensors), "the file lost or gained tensors"
        for name, expected in tensors.items():
            assert torch.equal(handle.get_tensor(name), expected), f"{name} reads back different"

    print(f"wrote {args.out}: {len(tensors)} tensors, nanochat {revision}, torch "
          f"{torch.__version__}, COMPUTE_DTYPE {args.dtype}, unwrapped {', '.join(unwrapped)}")
    for name in params:
        start = tensors[f"initial.{name}"]
        moved = tensors[f"param.{STEPS - 1}.{name}"] - start
        print(f"  {name:10s} {str(tuple(start.shape)):9s} moved |p - p0| = {moved.norm():.6f} "
              f"(|p0| = {start.norm():.4f})")


if __name__ == "__main__":
    main()
