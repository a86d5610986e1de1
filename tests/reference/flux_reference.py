#!/usr/bin/env python3
"""PyTorch reference of the Flux MMDiT (MODELS.md section 2) that writes golden files.

The model runs in fp32 (or fp64) on the CPU, written plainly from the description of Black
Forest Labs' flux1 model (Flux.forward and the layers it uses), so the C++ engine can be
checked against it: parameters, inputs, the velocity prediction, the rectified-flow loss and
every gradient go into one safetensors file.

    python3 tests/reference/flux_reference.py --out tests/data/flux_tiny_golden.safetensors
    python3 tests/reference/flux_reference.py --guidance \
        --out tests/data/flux_tiny_guidance_golden.safetensors
    python3 tests/reference/flux_reference.py --selftest

The configuration and the parameter table need no torch; the model, the golden files and the
self-test do (torch and safetensors).
"""

import argparse
import dataclasses
import math
import os
import sys
import tempfile
from dataclasses import dataclass

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the configuration and the parameter table work without torch
    torch = None

GOLDEN_FORMAT = "fp8train-golden"
GOLDEN_VERSION = "1"

NORM_EPS = 1e-6  # BFL's LayerNorms (no affine) and the QK RMSNorm
TIME_FACTOR = 1000.0  # timestep_embedding scales sigma (and guidance) by this
MAX_PERIOD = 10000.0


@dataclass
class FluxConfig:
    """Mirrors fp8t::FluxConfig (src/models/flux_config.h); the defaults are flux_tiny."""

    hidden_size: int = 64
    num_heads: int = 2
    mlp_ratio: int = 4
    in_channels: int = 16  # 4 latent channels packed 2x2
    context_in_dim: int = 32  # T5 width
    vec_in_dim: int = 16  # CLIP pooled width
    double_blocks: int = 1
    single_blocks: int = 1
    guidance_embed: bool = False
    axes_dim: tuple = (8, 12, 12)  # RoPE channels per id axis (0, row, col); sums to head_dim
    rope_theta: float = 10000.0
    # Width of the timestep (and guidance) sinusoid: 256 in BFL and in fp8t::FluxConfig. Only
    # the self-test narrows it, to keep its finite differences cheap.
    timestep_dim: int = 256

    @property
    def head_dim(self):
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self):
        return self.hidden_size * self.mlp_ratio

    def validate(self):
        assert self.hidden_size % self.num_heads == 0, "num_heads must divide hidden_size"
        assert sum(self.axes_dim) == self.head_dim, "axes_dim must sum to head_dim"
        assert all(d >= 2 and d % 2 == 0 for d in self.axes_dim), "axes must be even"
        assert self.double_blocks + self.single_blocks >= 1, "need at least one block"
        assert self.timestep_dim % 2 == 0


@dataclass
class GoldenShape:
    """One micro-batch: batch samples of a rows x cols grid of image tokens, txt_tokens text."""

    batch: int = 2
    rows: int = 4
    cols: int = 4
    txt_tokens: int = 5

    @property
    def img_tokens(self):
        return self.rows * self.cols


# The golden configuration is the flux_tiny preset (with and without the guidance embedder), a
# 4x4 grid of latent tokens, 5 text tokens, 2 samples.
GOLDEN_PRESET = "flux_tiny"
GOLDEN_CONFIG = FluxConfig()
GOLDEN_SHAPE = GoldenShape()
GOLDEN_SEED = 1234


def parameter_shapes(config):
    """[(name, shape)] in BFL's state_dict order, as fp8t::flux_parameters()."""
    C, M = config.hidden_size, config.mlp_hidden
    params = []

    def linear(name, fan_in, fan_out):
        params.append((name + ".weight", (fan_out, fan_in)))
        params.append((name + ".bias", (fan_out,)))

    def embedder(name, fan_in):  # MLPEmbedder: in_layer, SiLU, out_layer
        linear(name + ".in_layer", fan_in, C)
        linear(name + ".out_layer", C, C)

    def qk_norm(prefix):
        params.append((prefix + ".query_norm.scale", (config.head_dim,)))
        params.append((prefix + ".key_norm.scale", (config.head_dim,)))

    linear("img_in", config.in_channels, C)
    embedder("time_in", config.timestep_dim)
    embedder("vector_in", config.vec_in_dim)
    if config.guidance_embed:
        embedder("guidance_in", config.timestep_dim)
    linear("txt_in", config.context_in_dim, C)
    for block in range(config.double_blocks):
        for stream in ("img", "txt"):
            prefix = f"double_blocks.{block}.{stream}"
            linear(prefix + "_mod.lin", C, 6 * C)
            linear(prefix + "_attn.qkv", C, 3 * C)
            qk_norm(prefix + "_attn.norm")
            linear(prefix + "_attn.proj", C, C)
            linear(prefix + "_mlp.0", C, M)
            linear(prefix + "_mlp.2", M, C)
    for block in range(config.single_blocks):
        prefix = f"single_blocks.{block}"
        linear(prefix + ".linear1", C, 3 * C + M)
        linear(prefix + ".linear2", C + M, C)
        qk_norm(prefix + ".norm")
        linear(prefix + ".modulation.lin", C, 3 * C)
    linear("final_layer.linear", C, config.in_channels)
    linear("final_layer.adaLN_modulation.1", C, 2 * C)
    return params


def golden_metadata(config, shape, seed):
    """The string map stored in the golden file's __metadata__."""
    metadata = {"format": GOLDEN_FORMAT, "version": GOLDEN_VERSION, "model": "flux"}
    metadata["preset"] = GOLDEN_PRESET
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, bool):
            metadata[field.name] = "true" if value else "false"
        elif isinstance(value, tuple):
            metadata[field.name] = ",".join(str(v) for v in value)
        else:
            metadata[field.name] = str(value)
    metadata["batch"] = str(shape.batch)
    metadata["img_rows"] = str(shape.rows)
    metadata["img_cols"] = str(shape.cols)
    metadata["img_tokens"] = str(shape.img_tokens)
    metadata["txt_tokens"] = str(shape.txt_tokens)
    metadata["seed"] = str(seed)
    metadata["torch"] = torch.__version__ if torch is not None else "none"
    return metadata


# ---------------------------------------------------------------------------------------------
# The model, as a function of a {name: tensor} parameter map.


def zero_initialized(name):
    """The modulation linears (*_mod.lin, modulation.lin, final_layer.adaLN_modulation.1) and
    final_layer.linear, which the model zero-initializes (MODELS.md)."""
    return "_mod." in name or ".modulation." in name or name.startswith("final_layer.")


def uniform_linear(shapes, name, generator):
    """nn.Linear's default for a weight or bias: uniform in +-1/sqrt(fan_in)."""
    fan_in = shapes[name.rsplit(".", 1)[0] + ".weight"][1]
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(shapes[name], generator=generator, dtype=torch.float64) * 2 - 1) * bound


def init_parameters(config, generator, dtype):
    """The model's initialization (fp8t::init_flux_weights, MODELS.md): nn.Linear's default
    for every linear, QK-norm scales 1, and zero for the modulation linears and
    final_layer.linear, so that the model first predicts exactly 0."""
    shapes = dict(parameter_shapes(config))
    params = {}
    for name, shape in shapes.items():
        if name.endswith(".scale"):
            value = torch.ones(shape, dtype=torch.float64)
        elif zero_initialized(name):
            value = torch.zeros(shape, dtype=torch.float64)
        else:
            value = uniform_linear(shapes, name, generator)
        params[name] = value.to(dtype)
    return params


def randomize_for_golden(params, generator):
    """Redraws what the initialization zeroes or sets to one, so that every parameter is random
    and every gradient is non-trivial: with zero modulation linears every gate is 0, the blocks
    are the identity and no block gets a gradient, and with a zero final_layer.linear nothing
    but that layer does. The zero-initialized linears get nn.Linear's default, the QK-norm
    scales 1 + U(-0.5, 0.5)."""
    shapes = {name: tuple(value.shape) for name, value in params.items()}
    for name, value in params.items():
        if name.endswith(".scale"):
            new = 0.5 + torch.rand(value.shape, generator=generator, dtype=torch.float64)
        elif zero_initialized(name):
            new = uniform_linear(shapes, name, generator)
        else:
            continue
        params[name] = new.to(value.dtype)


def linear(params, name, x):
    return x @ params[name + ".weight"].T + params[name + ".bias"]


def layer_norm(x):
    """nn.LayerNorm(elementwise_affine=False, eps=1e-6): biased variance over the last axis."""
    mean = x.mean(dim=-1, keepdim=True)
    var = (x - mean).pow(2).mean(dim=-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + NORM_EPS)


def rms_norm(x, scale):
    """BFL's QKNorm halves: RMSNorm with eps 1e-6 and a learnable scale, per head. BFL computes
    it in fp32 (x.float()); the model here is already fp32 (or fp64)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + NORM_EPS) * scale


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


def timestep_embedding(t, dim):
    """BFL's timestep_embedding: t scaled by 1000, half = dim / 2 frequencies
    exp(-ln(10000) * i / half) in fp32, the products in fp32, then [cos, sin], cast back to t's
    dtype. t: [B] -> [B, dim]."""
    t = TIME_FACTOR * t
    half = dim // 2
    freqs = torch.exp(-math.log(MAX_PERIOD) * torch.arange(0, half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(t.dtype)


def rope_tables(ids, axes_dim, theta, dtype):
    """BFL's EmbedND / rope: ids [L, 3] -> cos, sin [L, head_dim / 2]. Pair j of an axis of
    width d turns by id * theta^(-2j/d); the angles and their cos and sin in float64, then
    rounded (BFL: .float(), fp32; the fp64 self-test keeps fp64)."""
    angles = []
    for axis, dim in enumerate(axes_dim):
        omega = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles.append(ids[:, axis].to(torch.float64)[:, None] * omega[None, :])
    angles = torch.cat(angles, dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x: [B, H, L, D]; adjacent channels (2i, 2i+1) form a pair, turned by its angle:
    (x0 cos - x1 sin, x0 sin + x1 cos)."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out0 = cos * x0 - sin * x1
    out1 = sin * x0 + cos * x1
    return torch.stack([out0, out1], dim=-1).flatten(-2)


def attention(q, k, v, cos, sin):
    """Joint attention without a mask: q, k, v [B, H, L, D] -> [B, L, H * D]."""
    B, H, L, D = q.shape
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(B, L, H * D)


def split_heads(qkv, heads):
    """Splits as "B L (K H D) -> K B H L D": q, k and v are consecutive thirds of a token."""
    B, L, width = qkv.shape
    parts = qkv.view(B, L, 3, heads, width // (3 * heads)).permute(2, 0, 3, 1, 4)
    return parts[0], parts[1], parts[2]


def modulation(params, name, vec_act, chunks):
    """Modulation.lin(SiLU(vec)), chunked; each chunk [B, 1, C] broadcasts over the tokens."""
    return linear(params, name, vec_act)[:, None, :].chunk(chunks, dim=-1)


def mlp_embedder(params, name, x):
    return linear(params, name + ".out_layer", F.silu(linear(params, name + ".in_layer", x)))


def double_block(params, config, block, img, txt, vec_act, cos, sin):
    """DoubleStreamBlock: img and txt keep their own weights, attend jointly over [txt; img]."""
    prefix = f"double_blocks.{block}."
    streams = {"img": img, "txt": txt}
    mods, qkv = {}, {}
    for name, x in streams.items():
        # shift1, scale1, gate1 (attention), shift2, scale2, gate2 (MLP)
        mods[name] = modulation(params, prefix + name + "_mod.lin", vec_act, 6)
        shift, scale = mods[name][0], mods[name][1]
        h = modulate(layer_norm(x), shift, scale)
        q, k, v = split_heads(linear(params, prefix + name + "_attn.qkv", h), config.num_heads)
        norm = prefix + name + "_attn.norm"
        q = rms_norm(q, params[norm + ".query_norm.scale"])
        k = rms_norm(k, params[norm + ".key_norm.scale"])
        qkv[name] = (q, k, v)
    # The text's tokens first, then the image's (dim 2 is L).
    q, k, v = (torch.cat([qkv["txt"][i], qkv["img"][i]], dim=2) for i in range(3))
    attn = attention(q, k, v, cos, sin)
    L_txt = txt.shape[1]
    attn_parts = {"txt": attn[:, :L_txt], "img": attn[:, L_txt:]}
    out = {}
    for name, x in streams.items():
        shift1, scale1, gate1, shift2, scale2, gate2 = mods[name]
        x = x + gate1 * linear(params, prefix + name + "_attn.proj", attn_parts[name])
        h = modulate(layer_norm(x), shift2, scale2)
        mlp = linear(params, prefix + name + "_mlp.0", h)
        mlp = linear(params, prefix + name + "_mlp.2", F.gelu(mlp, approximate="tanh"))
        out[name] = x + gate2 * mlp
    return out["img"], out["txt"]


def single_block(params, config, block, x, vec_act, cos, sin):
    """SingleStreamBlock on [txt; img]: linear1 gives qkv and the MLP input side by side,
    linear2 reads the attention output and GELU(MLP input) side by side."""
    prefix = f"single_blocks.{block}."
    C = config.hidden_size
    shift, scale, gate = modulation(params, prefix + "modulation.lin", vec_act, 3)
    h = modulate(layer_norm(x), shift, scale)
    qkv, mlp = torch.split(linear(params, prefix + "linear1", h), [3 * C, config.mlp_hidden], -1)
    q, k, v = split_heads(qkv, config.num_heads)
    q = rms_norm(q, params[prefix + "norm.query_norm.scale"])
    k = rms_norm(k, params[prefix + "norm.key_norm.scale"])
    attn = attention(q, k, v, cos, sin)
    out = linear(params, prefix + "linear2", torch.cat([attn, F.gelu(mlp, approximate="tanh")], -1))
    return x + gate * out


def forward(params, config, inputs):
    """Flux.forward: inputs holds img [B, L_img, in_channels], img_ids [L_img, 3] (the same
    for every sample), txt [B, L_txt, context_in_dim], y [B, vec_in_dim], timesteps [B] and,
    with the guidance embedder, guidance [B]. Returns the prediction [B, L_img, in_channels]."""
    dtype = params["img_in.weight"].dtype
    img = linear(params, "img_in", inputs["img"])
    timesteps = timestep_embedding(inputs["timesteps"], config.timestep_dim)
    vec = mlp_embedder(params, "time_in", timesteps)
    if config.guidance_embed:
        guidance = timestep_embedding(inputs["guidance"], config.timestep_dim)
        vec = vec + mlp_embedder(params, "guidance_in", guidance)
    vec = vec + mlp_embedder(params, "vector_in", inputs["y"])
    txt = linear(params, "txt_in", inputs["txt"])
    # Every modulation (and the final layer's adaLN) reads SiLU(vec).
    vec_act = F.silu(vec)

    L_txt = txt.shape[1]
    txt_ids = torch.zeros(L_txt, 3, dtype=inputs["img_ids"].dtype)  # BFL's txt_ids: all zero
    ids = torch.cat([txt_ids, inputs["img_ids"]], dim=0)
    cos, sin = rope_tables(ids, config.axes_dim, config.rope_theta, dtype)

    for block in range(config.double_blocks):
        img, txt = double_block(params, config, block, img, txt, vec_act, cos, sin)
    x = torch.cat([txt, img], dim=1)
    for block in range(config.single_blocks):
        x = single_block(params, config, block, x, vec_act, cos, sin)
    img = x[:, L_txt:]

    # LastLayer: adaLN_modulation = (SiLU, Linear) gives shift, then scale.
    final_mod = linear(params, "final_layer.adaLN_modulation.1", vec_act)
    shift, scale = final_mod[:, None, :].chunk(2, dim=-1)
    return linear(params, "final_layer.linear", modulate(layer_norm(img), shift, scale))


def flow_loss(prediction, target):
    """The rectified-flow MSE: mean((pred - target)^2) over every element."""
    return (prediction - target).pow(2).mean()


def image_ids(rows, cols, dtype):
    """[rows * cols, 3]: (0, row, col) of each image token, row-major, as BFL's img_ids."""
    row = torch.arange(rows, dtype=dtype)[:, None].expand(rows, cols)
    col = torch.arange(cols, dtype=dtype)[None, :].expand(rows, cols)
    return torch.stack([torch.zeros(rows, cols, dtype=dtype), row, col], dim=-1).reshape(-1, 3)


def draw_inputs(config, shape, generator, dtype):
    """A micro-batch as training builds one: clean latents x0 and noise, sigma in (0.05, 0.95),
    img = x_t = (1 - sigma) x0 + sigma noise, target = noise - x0; text, pooled vectors and
    (with the guidance embedder) guidance in [1, 5), all random."""

    def normal(*size):
        return torch.randn(size, generator=generator, dtype=torch.float64)

    def uniform(low, high, count):
        return low + (high - low) * torch.rand(count, generator=generator, dtype=torch.float64)

    B, L = shape.batch, shape.img_tokens
    x0 = normal(B, L, config.in_channels)
    noise = normal(B, L, config.in_channels)
    sigma = uniform(0.05, 0.95, B)
    inputs = {
        "img": (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise,
        "img_ids": image_ids(shape.rows, shape.cols, torch.float64),
        "txt": normal(B, shape.txt_tokens, config.context_in_dim),
        "y": normal(B, config.vec_in_dim),
        "timesteps": sigma,
        "target": noise - x0,
    }
    if config.guidance_embed:
        inputs["guidance"] = uniform(1.0, 5.0, B)
    return {name: value.to(dtype) for name, value in inputs.items()}


def run_golden(config, shape, seed):
    """Builds the model and a batch from `seed`, runs forward and backward in fp32.
    The parameters are rounded to bf16 (exactly representable, so the file stores them in half
    the bytes) and then used in fp32. Returns (params, inputs, prediction, loss, grads)."""
    config.validate()
    generator = torch.Generator().manual_seed(seed)
    params = init_parameters(config, generator, torch.float64)
    randomize_for_golden(params, generator)
    params = {name: value.to(torch.bfloat16).float() for name, value in params.items()}
    inputs = draw_inputs(config, shape, generator, torch.float32)
    for value in params.values():
        value.requires_grad_(True)
    prediction = forward(params, config, inputs)
    loss = flow_loss(prediction, inputs["target"])
    loss.backward()
    grads = {name: value.grad.detach().clone() for name, value in params.items()}
    params = {name: value.detach() for name, value in params.items()}
    return params, inputs, prediction.detach(), loss.detach(), grads


INPUT_NAMES = ("img", "img_ids", "txt", "y", "timesteps", "guidance", "target")


def make_golden(path, config=GOLDEN_CONFIG, shape=GOLDEN_SHAPE, seed=GOLDEN_SEED):
    """Writes the golden safetensors file (layout: tests/reference/README.md)."""
    from safetensors.torch import save_file

    params, inputs, prediction, loss, grads = run_golden(config, shape, seed)
    tensors = {}
    for name, _ in parameter_shapes(config):
        tensors[name] = params[name].to(torch.bfloat16).contiguous()  # exact: see run_golden
    for name in INPUT_NAMES:
        if name in inputs:
            tensors["input." + name] = inputs[name].float().contiguous()
    tensors["output.prediction"] = prediction.float().contiguous()
    tensors["output.loss"] = loss.float().reshape(1).contiguous()
    for name, _ in parameter_shapes(config):
        tensors["grad." + name] = grads[name].float().contiguous()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, path, metadata=golden_metadata(config, shape, seed))
    return tensors


def load_golden(path, config):
    """(params, inputs) of a golden file, as fp32 tensors, for the self-test's round trip."""
    from safetensors.torch import load_file

    loaded = load_file(path)
    params = {name: loaded[name].float() for name, _ in parameter_shapes(config)}
    inputs = {name: loaded["input." + name] for name in INPUT_NAMES if "input." + name in loaded}
    return loaded, params, inputs


# ---------------------------------------------------------------------------------------------
# Self-test: run on any machine with torch and safetensors.


def check_building_blocks():
    """The pieces against independent formulations of the same definitions."""
    generator = torch.Generator().manual_seed(3)
    dtype = torch.float64

    # RoPE as a complex multiplication: pair (x0, x1) is x0 + i x1, turned by e^{i angle}.
    axes, theta = (2, 4, 6), 10000.0
    ids = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 2.0], [0.0, 3.0, 1.0]], dtype=dtype)
    cos, sin = rope_tables(ids, axes, theta, dtype)
    x = torch.randn(2, 3, 3, sum(axes), generator=generator, dtype=dtype)  # [B, H, L, D]
    angles = []
    for axis, dim in enumerate(axes):
        for j in range(dim // 2):
            angles.append(ids[:, axis] * theta ** (-2.0 * j / dim))
    angles = torch.stack(angles, dim=-1)  # [L, D / 2]
    turned = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous()) * torch.polar(
        torch.ones_like(angles), angles
    )
    expected = torch.view_as_real(turned).flatten(-2)
    assert torch.allclose(apply_rope(x, cos, sin), expected, atol=1e-12)
    # Text ids (all zero) are not turned; scores depend only on id differences.
    assert torch.equal(apply_rope(x, cos, sin)[:, :, 0], x[:, :, 0])
    shifted = ids + torch.tensor([0.0, 5.0, -2.0], dtype=dtype)
    cos2, sin2 = rope_tables(shifted, axes, theta, dtype)
    scores = apply_rope(x, cos, sin) @ apply_rope(x, cos, sin).transpose(-1, -2)
    scores2 = apply_rope(x, cos2, sin2) @ apply_rope(x, cos2, sin2).transpose(-1, -2)
    assert torch.allclose(scores, scores2, atol=1e-10)
    print("rope (complex rotation, zero ids, relative positions): ok")

    # Timestep embedding: [cos(1000 t f_i), sin(1000 t f_i)], f_i = 10000^(-i / half).
    t = torch.tensor([0.0, 0.25, 0.9], dtype=dtype)
    embedding = timestep_embedding(t, 256)
    for n in range(3):
        for i in range(128):
            angle = 1000.0 * t[n].item() * 10000.0 ** (-i / 128)
            # fp32 products of angles up to 1000: within ~1e-4 of the exact value
            assert abs(embedding[n, i].item() - math.cos(angle)) < 2e-4, (n, i)
            assert abs(embedding[n, 128 + i].item() - math.sin(angle)) < 2e-4, (n, i)
    print("timestep embedding: ok")

    # Norms and attention against torch's own.
    x = torch.randn(2, 5, 12, generator=generator, dtype=dtype)
    scale = torch.rand(12, generator=generator, dtype=dtype) + 0.5
    assert torch.allclose(layer_norm(x), F.layer_norm(x, (12,), eps=NORM_EPS), atol=1e-12)
    assert torch.allclose(rms_norm(x, scale), F.rms_norm(x, (12,), scale, eps=NORM_EPS), atol=1e-12)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=generator, dtype=dtype) for _ in range(3))
    ones, zeros = torch.ones(5, 4, dtype=dtype), torch.zeros(5, 4, dtype=dtype)
    reference = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 24)
    assert torch.allclose(attention(q, k, v, ones, zeros), reference, atol=1e-12)
    print("layer norm, QK RMSNorm, attention: ok")


def selftest():
    check_building_blocks()

    # A small configuration with every part: the guidance embedder, a double block, two single
    # blocks (one feeding the next), RoPE on all three axes, a 2x3 grid (rows != cols).
    config = FluxConfig(
        hidden_size=16,
        num_heads=2,
        in_channels=4,
        context_in_dim=6,
        vec_in_dim=5,
        double_blocks=1,
        single_blocks=2,
        guidance_embed=True,
        axes_dim=(2, 2, 4),
        timestep_dim=16,
    )
    config.validate()
    shape = GoldenShape(batch=2, rows=2, cols=3, txt_tokens=3)
    generator = torch.Generator().manual_seed(7)
    params = init_parameters(config, generator, torch.float64)

    # The model's initialization predicts exactly zero (zero final_layer.linear).
    inputs = draw_inputs(config, shape, generator, torch.float64)
    assert torch.equal(forward(params, config, inputs), torch.zeros(2, 6, 4, dtype=torch.float64))
    print("initialization predicts zero: ok")

    randomize_for_golden(params, generator)
    names = list(params)
    values = tuple(params[name].requires_grad_(True) for name in names)

    def loss_and_prediction(*values):
        prediction = forward(dict(zip(names, values)), config, inputs)
        return flow_loss(prediction, inputs["target"]), prediction

    # gradcheck in fast mode: per parameter tensor, a random projection of the Jacobian by
    # finite differences against autograd's (the full Jacobian takes minutes on a CPU).
    ok = torch.autograd.gradcheck(
        loss_and_prediction, values, eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True
    )
    count = sum(value.numel() for value in values)
    print(f"gradcheck (fp64, loss and prediction, {count} parameters): {'ok' if ok else 'FAILED'}")

    # And entry by entry: central differences of the loss on 3 entries of every tensor.
    loss = loss_and_prediction(*values)[0]
    grads = torch.autograd.grad(loss, values)
    worst = 0.0
    with torch.no_grad():
        for value, grad in zip(values, grads):
            for i in torch.randint(0, value.numel(), (3,), generator=generator).tolist():
                flat = value.view(-1)
                saved = flat[i].item()
                flat[i] = saved + 1e-6
                up = loss_and_prediction(*values)[0].item()
                flat[i] = saved - 1e-6
                down = loss_and_prediction(*values)[0].item()
                flat[i] = saved
                numeric = (up - down) / 2e-6
                error = abs(grad.view(-1)[i].item() - numeric)
                worst = max(worst, error / (1e-6 + abs(numeric)))
    entries_ok = worst < 1e-4
    ok = ok and entries_ok
    print(f"central differences ({3 * len(values)} entries): worst relative error {worst:.1e}: "
          f"{'ok' if entries_ok else 'FAILED'}")

    # The golden configurations: flux_tiny's parameter count (docs/flux.md), every gradient
    # non-zero, the loss finite.
    for guidance in (False, True):
        golden = dataclasses.replace(GOLDEN_CONFIG, guidance_embed=guidance)
        count = sum(math.prod(shape) for _, shape in parameter_shapes(golden))
        expected = 250128 + ((256 + 1) * 64 + (64 + 1) * 64 if guidance else 0)  # guidance_in
        assert count == expected, (count, expected)
        _, _, _, loss, grads = run_golden(golden, GOLDEN_SHAPE, GOLDEN_SEED)
        assert torch.isfinite(loss), loss
        for name, grad in grads.items():
            assert grad.abs().max() > 0, f"gradient of {name} is zero"
        print(f"golden config (guidance {guidance}): {count} parameters, loss {loss.item():.6f}, "
              "every gradient non-zero: ok")

    # The golden file round-trips, and what it holds reproduces the run bit for bit.
    from safetensors import safe_open

    for guidance in (False, True):
        golden = dataclasses.replace(GOLDEN_CONFIG, guidance_embed=guidance)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "golden.safetensors")
            written = make_golden(path, golden)
            loaded, params, inputs = load_golden(path, golden)
            with safe_open(path, framework="pt") as handle:
                metadata = handle.metadata()
            size = os.path.getsize(path)
        assert set(loaded) == set(written)
        for name, value in written.items():
            assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
        assert metadata == golden_metadata(golden, GOLDEN_SHAPE, GOLDEN_SEED), metadata
        for name, shape in parameter_shapes(golden):
            assert tuple(loaded[name].shape) == shape, (name, loaded[name].shape, shape)
            assert loaded["grad." + name].shape == loaded[name].shape, name
        assert ("input.guidance" in loaded) == guidance
        for value in params.values():
            value.requires_grad_(True)
        prediction = forward(params, golden, inputs)
        loss = flow_loss(prediction, inputs["target"])
        loss.backward()
        assert torch.equal(prediction.detach(), loaded["output.prediction"])
        assert torch.equal(loss.detach().reshape(1), loaded["output.loss"])
        for name, value in params.items():
            assert torch.equal(value.grad, loaded["grad." + name]), name
        print(f"golden file round trip (guidance {guidance}, {size} bytes): ok")
    return 0 if ok else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="where to write the golden safetensors file")
    parser.add_argument("--guidance", action="store_true", help="with the guidance embedder")
    parser.add_argument("--selftest", action="store_true", help="fp64 gradcheck and round trip")
    args = parser.parse_args(argv)
    if torch is None:
        print("flux_reference.py needs torch (and safetensors)", file=sys.stderr)
        return 2
    if args.selftest:
        return selftest()
    if not args.out:
        parser.error("give --out PATH or --selftest")
    config = dataclasses.replace(GOLDEN_CONFIG, guidance_embed=args.guidance)
    tensors = make_golden(args.out, config)
    print(
        f"wrote {args.out}: {len(tensors)} tensors, {os.path.getsize(args.out)} bytes, "
        f"loss {tensors['output.loss'].item():.6f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
