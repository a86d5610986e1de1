#!/usr/bin/env python3
"""Reads an fp8train checkpoint with the reference `safetensors` package, as nanochat would.

Usage: check_checkpoint.py CHECKPOINT_FOLDER DEPTH VOCAB_SIZE

Checks that model.safetensors opens, holds exactly the tensors of nanochat's GPT state_dict for
that depth (names and shapes computed here, independently of the C++ code) and that every value
is finite; that optimizer.safetensors opens; and that trainer_state.json names its step.
Exits 1 with a message on the first problem.
"""
import json
import math
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def nanochat_state_dict_shapes(depth: int, vocab_size: int) -> dict:
    dim = math.ceil(depth * 64 / 128) * 128
    kv_heads = dim // 128
    padded_vocab = (vocab_size + 63) // 64 * 64
    shapes = {
        "transformer.wte.weight": (padded_vocab, dim),
        "lm_head.weight": (padded_vocab, dim),
        "resid_lambdas": (depth,),
        "x0_lambdas": (depth,),
        "smear_gate.weight": (1, 24),
        "smear_lambda": (1,),
        "backout_lambda": (1,),
    }
    for i in range(depth):
        block = f"transformer.h.{i}."
        for name in ("c_q", "c_k", "c_v", "c_proj"):
            shapes[block + f"attn.{name}.weight"] = (dim, dim)
        shapes[block + "mlp.c_fc.weight"] = (4 * dim, dim)
        shapes[block + "mlp.c_proj.weight"] = (dim, 4 * dim)
        if i % 2 == (depth - 1) % 2:  # layers with a value embedding
            shapes[block + "attn.ve_gate.weight"] = (kv_heads, 12)
            shapes[f"value_embeds.{i}.weight"] = (padded_vocab, kv_heads * 128)
    return shapes


def main() -> int:
    folder, depth, vocab_size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    tensors = load_file(str(folder / "model.safetensors"))
    expected = nanochat_state_dict_shapes(depth, vocab_size)
    if set(tensors) != set(expected):
        print(f"names differ: missing {sorted(set(expected) - set(tensors))}, "
              f"unexpected {sorted(set(tensors) - set(expected))}")
        return 1
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            print(f"{name}: shape {tensors[name].shape}, expected {shape}")
            return 1
        if not np.all(np.isfinite(tensors[name])):
            print(f"{name}: non-finite values")
            return 1
    optimizer = load_file(str(folder / "optimizer.safetensors"))
    state = json.loads((folder / "trainer_state.json").read_text())
    print(f"ok: {len(tensors)} model tensors with nanochat's names and shapes, "
          f"{len(optimizer)} optimizer tensors, step {state['step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
