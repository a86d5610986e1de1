#!/usr/bin/env python3
"""PyTorch reference of the nanochat GPT (MODELS.md section 1) that writes a golden file.

The model runs in fp32 (or fp64) on the CPU, written plainly from the description of
nanochat's gpt.py at commit 92d63d4, so the C++ engine can be checked against it: parameters,
inputs, logits, loss and every gradient go into one safetensors file.

    python3 tests/reference/gpt_reference.py --out tests/data/gpt_tiny_golden.safetensors
    python3 tests/reference/gpt_reference.py --selftest

The configuration and the parameter table need no torch; the model, the golden file and the
self-test do (torch and safetensors).
"""

import argparse
import dataclasses
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the configuration and the parameter table work without torch
    torch = None

GOLDEN_FORMAT = "fp8train-golden"
GOLDEN_VERSION = "1"

SMEAR_GATE_CHANNELS = 24
VALUE_GATE_CHANNELS = 12
ROTARY_BASE = 100000
SOFTCAP = 15.0
QK_SCALE = 1.2  # q and k are multiplied by this after their RMSNorm
VALUE_GATE_RANGE = 3.0  # the value-embedding gate is 3 * sigmoid(...)


@dataclass
class GptConfig:
    """Mirrors fp8t::GptConfig (src/models/gpt_config.h), plus short_window."""

    n_layer: int = 3
    n_embd: int = 64
    n_head: int = 2
    n_kv_head: int = 1
    vocab_size: int = 100  # before padding
    sequence_len: int = 16
    window_pattern: str = "SL"  # tiled over layers; the last layer is always L
    pad_vocab_to: int = 64
    # Window of the S layers. None: nanochat's ceil(sequence_len / 4 / 128) * 128, which is
    # >= sequence_len for short sequences, so a test sets it to make the window bite.
    short_window: Optional[int] = None

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def kv_dim(self):
        return self.n_kv_head * self.head_dim

    @property
    def padded_vocab(self):
        return -(-self.vocab_size // self.pad_vocab_to) * self.pad_vocab_to

    def has_value_embedding(self, layer):
        return layer % 2 == (self.n_layer - 1) % 2

    @property
    def backout_layer(self):
        return self.n_layer // 2

    def window(self, layer):
        """Left window: query t sees keys j with j <= t and t - j <= window."""
        long_window = self.sequence_len
        if self.short_window is not None:
            short = self.short_window
        else:
            short = math.ceil(self.sequence_len / 4 / 128) * 128
        if layer == self.n_layer - 1:
            return long_window
        kind = self.window_pattern[layer % len(self.window_pattern)]
        return short if kind == "S" else long_window

    def validate(self):
        assert self.n_layer >= 1, "n_layer must be at least 1"
        assert self.n_embd % self.n_head == 0, "n_head must divide n_embd"
        assert self.head_dim % 2 == 0, "head_dim must be even for rotary"
        assert self.n_head % self.n_kv_head == 0, "n_kv_head must divide n_head"
        assert self.n_embd >= SMEAR_GATE_CHANNELS, "n_embd must be at least 24"
        assert set(self.window_pattern) <= {"S", "L"} and self.window_pattern
        assert self.short_window is None or self.short_window >= 0


# The default golden configuration: 3 layers give a layer without a value embedding (1), two
# with (0, 2), the backout layer (1) and a short window (layer 0) that bites at T = 16.
GOLDEN_CONFIG = GptConfig(short_window=5)
GOLDEN_BATCH = 2
GOLDEN_SEED = 1234


def parameter_shapes(config):
    """[(name, shape)] in nanochat's state_dict order, as fp8t::gpt_parameters()."""
    dim, vocab = config.n_embd, config.padded_vocab
    params = [("transformer.wte.weight", (vocab, dim))]
    for layer in range(config.n_layer):
        prefix = f"transformer.h.{layer}."
        params.append((prefix + "attn.c_q.weight", (config.n_head * config.head_dim, dim)))
        params.append((prefix + "attn.c_k.weight", (config.kv_dim, dim)))
        params.append((prefix + "attn.c_v.weight", (config.kv_dim, dim)))
        params.append((prefix + "attn.c_proj.weight", (dim, dim)))
        if config.has_value_embedding(layer):
            params.append((prefix + "attn.ve_gate.weight", (config.n_kv_head, VALUE_GATE_CHANNELS)))
        params.append((prefix + "mlp.c_fc.weight", (4 * dim, dim)))
        params.append((prefix + "mlp.c_proj.weight", (dim, 4 * dim)))
    params.append(("lm_head.weight", (vocab, dim)))
    params.append(("resid_lambdas", (config.n_layer,)))
    params.append(("x0_lambdas", (config.n_layer,)))
    params.append(("smear_gate.weight", (1, SMEAR_GATE_CHANNELS)))
    params.append(("smear_lambda", (1,)))
    params.append(("backout_lambda", (1,)))
    for layer in range(config.n_layer):
        if config.has_value_embedding(layer):
            params.append((f"value_embeds.{layer}.weight", (vocab, config.kv_dim)))
    return params


def golden_metadata(config, batch, seed):
    """The string map stored in the golden file's __metadata__."""
    metadata = {"format": GOLDEN_FORMAT, "version": GOLDEN_VERSION}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        metadata[field.name] = "none" if value is None else str(value)
    metadata["batch"] = str(batch)
    metadata["seed"] = str(seed)
    metadata["torch"] = torch.__version__ if torch is not None else "none"
    return metadata


# ---------------------------------------------------------------------------------------------
# The model, as a function of a {name: tensor} parameter map.


def init_parameters(config, generator, dtype):
    """nanochat's initialization (MODELS.md), drawn from `generator`."""

    def uniform(shape, bound):
        return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1) * bound

    def normal(shape, std):
        return torch.randn(shape, generator=generator, dtype=torch.float64) * std

    dim = config.n_embd
    linear_bound = math.sqrt(3) / math.sqrt(dim)
    last = max(config.n_layer - 1, 1)
    params = {}
    for name, shape in parameter_shapes(config):
        if name == "transformer.wte.weight":
            value = normal(shape, 0.8)
        elif name == "lm_head.weight":
            value = normal(shape, 0.001)
        elif name.endswith(("c_q.weight", "c_k.weight", "c_v.weight")) or name.startswith(
            "value_embeds."
        ):
            value = uniform(shape, linear_bound)
        elif name.endswith("c_fc.weight"):
            value = uniform(shape, 0.4 * linear_bound)
        elif name.endswith("c_proj.weight"):
            value = torch.zeros(shape, dtype=torch.float64)
        elif name.endswith("gate.weight"):
            value = torch.rand(shape, generator=generator, dtype=torch.float64) * 0.02
        elif name == "resid_lambdas":
            value = torch.tensor([1.15 - 0.10 * i / last for i in range(shape[0])])
        elif name == "x0_lambdas":
            value = torch.tensor([0.20 - 0.15 * i / last for i in range(shape[0])])
        elif name == "smear_lambda":
            value = torch.zeros(shape, dtype=torch.float64)
        elif name == "backout_lambda":
            value = torch.full(shape, 0.2, dtype=torch.float64)
        else:
            raise KeyError(f"no initialization for {name}")
        params[name] = value.to(torch.float64).to(dtype)
    return params


def perturb_for_golden(params, config, generator):
    """Overwrites what nanochat zero-initializes (the output projections, smear_lambda), the
    gates, and lm_head, so that every path carries signal and every gradient is non-trivial:
    with zero projections the q/k/v/c_fc gradients vanish, and with lm_head at std 0.001 the
    soft cap 15 tanh(z / 15) is the identity to 1e-8, so a missing cap would go unnoticed."""

    def uniform(shape, bound):
        return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1) * bound

    dim = config.n_embd
    for name, value in params.items():
        if name.endswith("attn.c_proj.weight"):
            new = uniform(value.shape, 0.5 * math.sqrt(3) / math.sqrt(dim))
        elif name.endswith("mlp.c_proj.weight"):
            new = uniform(value.shape, 0.5 * math.sqrt(3) / math.sqrt(4 * dim))
        elif name.endswith("gate.weight"):
            new = uniform(value.shape, 0.5)
        elif name == "smear_lambda":
            new = 0.2 + 0.3 * torch.rand(value.shape, generator=generator, dtype=torch.float64)
        elif name == "lm_head.weight":
            # Logits of std ~4 (final rmsnorm gives unit-RMS rows): the cap is well inside tanh.
            new = torch.randn(value.shape, generator=generator, dtype=torch.float64) * (
                4.0 / math.sqrt(dim)
            )
        else:
            continue
        params[name] = new.to(value.dtype)


def rms_norm(x):
    # F.rms_norm(x, (x.size(-1),)) without weight; its default eps is finfo(dtype).eps, and the
    # engine uses fp32's, so this fixes that value for the fp64 self-test too.
    eps = torch.finfo(torch.float32).eps
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def rotary_tables(seq_len, head_dim, dtype):
    """cos and sin, [T, head_dim / 2], computed in fp32."""
    channels = torch.arange(0, head_dim, 2, dtype=torch.float32)
    inv_freq = 1.0 / (ROTARY_BASE ** (channels / head_dim))
    positions = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rotary(x, cos, sin):
    """x: [B, T, H, D]; pairs are (first half, second half) of D."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    y1 = x1 * cos + x2 * sin
    y2 = -x1 * sin + x2 * cos
    return torch.cat([y1, y2], dim=-1)


def window_mask(seq_len, window):
    """[T, T] bool, True where query t may see key j: j <= t and t - j <= window."""
    t = torch.arange(seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    return (j <= t) & (t - j <= window)


def attention(params, config, layer, x, idx, cos, sin):
    """x: the block input after rmsnorm, [B, T, C]."""
    B, T, _ = x.shape
    H, Hkv, D = config.n_head, config.n_kv_head, config.head_dim
    prefix = f"transformer.h.{layer}.attn."
    q = (x @ params[prefix + "c_q.weight"].T).view(B, T, H, D)
    k = (x @ params[prefix + "c_k.weight"].T).view(B, T, Hkv, D)
    v = (x @ params[prefix + "c_v.weight"].T).view(B, T, Hkv, D)
    if config.has_value_embedding(layer):
        ve = params[f"value_embeds.{layer}.weight"][idx].view(B, T, Hkv, D)
        gate_logits = x[..., :VALUE_GATE_CHANNELS] @ params[prefix + "ve_gate.weight"].T
        gate = VALUE_GATE_RANGE * torch.sigmoid(gate_logits)  # [B, T, Hkv]
        v = v + gate.unsqueeze(-1) * ve
    q = rms_norm(apply_rotary(q, cos, sin)) * QK_SCALE
    k = rms_norm(apply_rotary(k, cos, sin)) * QK_SCALE

    # Grouped kv heads: query head h reads kv head h // (H / Hkv).
    group = H // Hkv
    q = q.transpose(1, 2)  # [B, H, T, D]
    k = k.transpose(1, 2).repeat_interleave(group, dim=1)
    v = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D))  # [B, H, T, T]
    visible = window_mask(T, config.window(layer))
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    y = (probs @ v).transpose(1, 2).reshape(B, T, H * D)
    return y @ params[prefix + "c_proj.weight"].T


def mlp(params, layer, x):
    prefix = f"transformer.h.{layer}.mlp."
    hidden = torch.relu(x @ params[prefix + "c_fc.weight"].T).square()
    return hidden @ params[prefix + "c_proj.weight"].T


def forward(params, config, idx, targets):
    """idx, targets: int [B, T] (targets -1 are ignored). Returns (loss, capped logits)."""
    B, T = idx.shape
    idx = idx.long()
    dtype = params["transformer.wte.weight"].dtype
    cos, sin = rotary_tables(T, config.head_dim, dtype)

    x = rms_norm(params["transformer.wte.weight"][idx])
    # Smear: mix each token with the previous one, gated by the token's own first channels.
    gate = torch.sigmoid(x[:, 1:, :SMEAR_GATE_CHANNELS] @ params["smear_gate.weight"].T)
    smeared = x[:, 1:] + params["smear_lambda"] * gate * x[:, :-1]
    x = torch.cat([x[:, :1], smeared], dim=1)

    x0 = x
    x_backout = None
    for layer in range(config.n_layer):
        x = params["resid_lambdas"][layer] * x + params["x0_lambdas"][layer] * x0
        x = x + attention(params, config, layer, rms_norm(x), idx, cos, sin)
        x = x + mlp(params, layer, rms_norm(x))
        if layer == config.backout_layer:
            x_backout = x
    x = x - params["backout_lambda"] * x_backout
    x = rms_norm(x)

    # nanochat casts the logits to fp32 here; this model already runs in fp32 (or fp64).
    logits = (x @ params["lm_head.weight"].T)[..., : config.vocab_size]
    logits = SOFTCAP * torch.tanh(logits / SOFTCAP)
    loss = F.cross_entropy(
        logits.reshape(B * T, -1), targets.reshape(-1).long(), ignore_index=-1, reduction="mean"
    )
    return loss, logits


def draw_batch(config, batch, generator):
    """Token inputs and targets, int32 [B, T]; three targets are -1 (ignored)."""
    shape = (batch, config.sequence_len)
    idx = torch.randint(0, config.vocab_size, shape, generator=generator, dtype=torch.int64)
    targets = torch.randint(0, config.vocab_size, shape, generator=generator, dtype=torch.int64)
    flat = targets.view(-1)
    ignored = torch.randperm(flat.numel(), generator=generator)[:3]
    flat[ignored] = -1
    return idx.to(torch.int32), targets.to(torch.int32)


def run_golden(config, batch, seed):
    """Builds the model (fp32) and a batch from `seed`, runs forward and backward.
    Returns (params, idx, targets, loss, logits, grads), all detached."""
    config.validate()
    generator = torch.Generator().manual_seed(seed)
    params = init_parameters(config, generator, torch.float32)
    perturb_for_golden(params, config, generator)
    idx, targets = draw_batch(config, batch, generator)
    for value in params.values():
        value.requires_grad_(True)
    loss, logits = forward(params, config, idx, targets)
    loss.backward()
    grads = {name: value.grad.detach().clone() for name, value in params.items()}
    params = {name: value.detach() for name, value in params.items()}
    return params, idx, targets, loss.detach(), logits.detach(), grads


def make_golden(path, config=GOLDEN_CONFIG, batch=GOLDEN_BATCH, seed=GOLDEN_SEED):
    """Writes the golden safetensors file (layout: tests/reference/README.md)."""
    from safetensors.torch import save_file

    params, idx, targets, loss, logits, grads = run_golden(config, batch, seed)
    tensors = {}
    for name, _ in parameter_shapes(config):
        tensors[name] = params[name].float().contiguous()
    tensors["input.idx"] = idx.contiguous()
    tensors["input.targets"] = targets.contiguous()
    tensors["output.logits"] = logits.float().contiguous()
    tensors["output.loss"] = loss.float().reshape(1).contiguous()
    for name, _ in parameter_shapes(config):
        tensors["grad." + name] = grads[name].float().contiguous()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, path, metadata=golden_metadata(config, batch, seed))
    return tensors


# ---------------------------------------------------------------------------------------------
# Self-test: run on any machine with torch and safetensors.


def selftest():
    # Smallest config that still has: a layer with and one without value embedding, the
    # backout layer, grouped kv heads (2 query heads on 1 kv head), a biting short window,
    # padded vocabulary rows and ignored targets.
    config = GptConfig(
        n_layer=2,
        n_embd=24,
        n_head=2,
        n_kv_head=1,
        vocab_size=11,
        sequence_len=6,
        window_pattern="SL",
        pad_vocab_to=8,
        short_window=2,
    )
    config.validate()
    generator = torch.Generator().manual_seed(7)
    params = init_parameters(config, generator, torch.float64)
    perturb_for_golden(params, config, generator)
    idx, targets = draw_batch(config, 2, generator)
    names = list(params)
    inputs = tuple(params[name].requires_grad_(True) for name in names)

    def loss_and_logits(*values):
        return forward(dict(zip(names, values)), config, idx, targets)

    ok = torch.autograd.gradcheck(loss_and_logits, inputs, eps=1e-6, atol=1e-5, rtol=1e-3)
    count = sum(value.numel() for value in inputs)
    print(f"gradcheck (fp64, loss and logits, {count} parameters): {'ok' if ok else 'FAILED'}")

    # Every gradient of the golden configuration is non-zero somewhere.
    _, _, _, loss, _, grads = run_golden(GOLDEN_CONFIG, GOLDEN_BATCH, GOLDEN_SEED)
    assert torch.isfinite(loss), loss
    for name, grad in grads.items():
        assert grad.abs().max() > 0, f"gradient of {name} is zero"
    print(f"golden config: loss {loss.item():.6f}, every gradient non-zero: ok")

    # Layer 0 of the golden config sees 5 keys back, so at most 6 in all.
    mask = window_mask(16, GOLDEN_CONFIG.window(0))
    assert mask.sum(dim=1).tolist() == [min(t + 1, 6) for t in range(16)]
    print("window mask: ok")

    # The golden file round-trips, and what it holds reproduces the run bit for bit.
    from safetensors import safe_open
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "golden.safetensors")
        written = make_golden(path)
        loaded = load_file(path)
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata()
        size = os.path.getsize(path)
    assert set(loaded) == set(written)
    for name, value in written.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
    assert metadata == golden_metadata(GOLDEN_CONFIG, GOLDEN_BATCH, GOLDEN_SEED), metadata
    shapes = parameter_shapes(GOLDEN_CONFIG)
    for name, shape in shapes:
        assert tuple(loaded[name].shape) == shape, (name, loaded[name].shape, shape)
        assert loaded["grad." + name].shape == loaded[name].shape, name
    reloaded = {name: loaded[name].clone().requires_grad_(True) for name, _ in shapes}
    loss, logits = forward(reloaded, GOLDEN_CONFIG, loaded["input.idx"], loaded["input.targets"])
    loss.backward()
    assert torch.equal(logits.detach(), loaded["output.logits"])
    assert torch.equal(loss.detach().reshape(1), loaded["output.loss"])
    for name, value in reloaded.items():
        assert torch.equal(value.grad, loaded["grad." + name]), name
    print(f"golden file round trip ({size} bytes): ok")
    return 0 if ok else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="where to write the golden safetensors file")
    parser.add_argument("--selftest", action="store_true", help="fp64 gradcheck and round trip")
    parser.add_argument(
        "--window-pattern",
        default=GOLDEN_CONFIG.window_pattern,
        help="S/L pattern of the golden config (L alone: no sliding window)",
    )
    args = parser.parse_args(argv)
    if torch is None:
        print("gpt_reference.py needs torch (and safetensors)", file=sys.stderr)
        return 2
    if args.selftest:
        return selftest()
    if not args.out:
        parser.error("give --out PATH or --selftest")
    config = dataclasses.replace(GOLDEN_CONFIG, window_pattern=args.window_pattern)
    tensors = make_golden(args.out, config)
    print(
        f"wrote {args.out}: {len(tensors)} tensors, {os.path.getsize(args.out)} bytes, "
        f"loss {tensors['output.loss'].item():.6f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
