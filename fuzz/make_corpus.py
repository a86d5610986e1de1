#!/usr/bin/env python3
"""Writes the binary seeds of corpus/ (safetensors, token shards, tokenizer files): a few small
valid files and a few broken ones. The YAML seeds of corpus/config are written by hand."""
import base64
import json
import pathlib
import re
import struct

FUZZ = pathlib.Path(__file__).resolve().parent
CORPUS = FUZZ / "corpus"

DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def safetensors(tensors, metadata=None, zeros=False):
    """tensors: (name, dtype, shape) in data order; the data is a byte ramp, or zeros (finite
    values and t5_mask 0, as a Flux shard's must be)."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        size = DTYPE_SIZES[dtype]
        for extent in shape:
            size *= extent
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data = bytes(offset) if zeros else bytes(i % 251 for i in range(offset))
    return struct.pack("<Q", len(text)) + text + data


def token_shard(tokens, vocab_size, bos_id, document_count=None):
    width = 2 if vocab_size <= 65536 else 4
    documents = tokens.count(bos_id) if document_count is None else document_count
    header = b"FP8TOKS\0" + struct.pack("<IIIIQQ", 1, width, vocab_size, bos_id, len(tokens),
                                        documents)
    header += bytes(64 - len(header))
    return header + struct.pack(f"<{len(tokens)}{'H' if width == 2 else 'I'}", *tokens)


def split_pattern():
    header = (FUZZ.parent / "src/tokenizer/bpe_tokenizer.h").read_text()
    return re.search(r'kSplitPattern =\s*R"\((.*)\)";', header).group(1)


def tokenizer(merges, special_tokens, newline="\n", skip_byte=None, sidecar_changes=()):
    tokens = [bytes([b]) for b in range(256) if b != skip_byte] + merges
    vocab = "".join(f"{base64.b64encode(t).decode()} {rank}{newline}"
                    for rank, t in enumerate(tokens))
    sidecar = {"format": "fp8train-bpe-special-tokens", "version": 1, "pattern": split_pattern(),
               "special_tokens": [{"name": name, "id": len(tokens) + i}
                                  for i, name in enumerate(special_tokens)]}
    sidecar.update(sidecar_changes)
    return (vocab + "---\n" + json.dumps(sidecar)).encode()


def write(target, name, data):
    folder = CORPUS / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)


def main():
    write("safetensors", "checkpoint.safetensors",
          safetensors([("wte", "F32", [2, 3]), ("lambdas", "BF16", [4]), ("step", "I64", [])],
                      {"step": "3", "format": "pt"}))
    write("safetensors", "every_dtype.safetensors",
          safetensors([(f"t_{d.lower()}", d, [2]) for d in DTYPE_SIZES]
                      + [("empty", "F32", [0, 5])]))
    write("safetensors", "flux_shard.safetensors",
          safetensors([("latent", "F32", [1, 1, 2, 2]), ("t5", "F32", [1, 2, 3]),
                       ("t5_mask", "U8", [1, 2]), ("clip", "F32", [1, 2])],
                      {"format": "fp8train-flux-shard", "version": "1", "latent_scale": "0.5",
                       "latent_shift": "0.1", "image_size": "16"}, zeros=True))
    write("safetensors", "flux_shard_posterior.safetensors",
          safetensors([("latent_mean", "BF16", [2, 1, 2, 2]),
                       ("latent_logvar", "BF16", [2, 1, 2, 2]), ("t5", "BF16", [2, 1, 2]),
                       ("t5_mask", "I64", [2, 1]), ("clip", "BF16", [2, 2])],
                      {"format": "fp8train-flux-shard", "version": "1"}, zeros=True))
    valid = safetensors([("a", "F32", [2]), ("b", "U8", [3])])
    write("safetensors", "truncated.safetensors", valid[:-2])
    write("safetensors", "overlap.safetensors",
          valid.replace(b'"data_offsets":[8,11]', b'"data_offsets":[6,9] '))
    write("safetensors", "long_header.safetensors", struct.pack("<Q", 1 << 40) + b"{}")
    nested = b'{"a":' + b"[" * 20 + b"]" * 20 + b"}"
    write("safetensors", "nested.safetensors", struct.pack("<Q", len(nested)) + nested)

    write("token_shard", "two_documents.tokens", token_shard([0, 5, 7, 0, 9, 511], 512, 0))
    write("token_shard", "wide.tokens", token_shard([69999, 3, 65536, 69999, 1], 70000, 69999))
    write("token_shard", "empty.tokens", token_shard([], 256, 1))
    write("token_shard", "wrong_documents.tokens", token_shard([0, 1, 0], 16, 0, document_count=3))
    write("token_shard", "trailing.tokens", token_shard([2, 3], 16, 2) + b"\1")

    write("tokenizer", "nanochat.tiktoken",
          tokenizer([b"th", b"he", b"the", b" t", b" the", b"\xc3\xa9"],
                    ["<|bos|>", "<|user_start|>", "<|user_end|>"]))
    write("tokenizer", "crlf.tiktoken", tokenizer([b"ab", b"abab"], [], newline="\r\n"))
    write("tokenizer", "missing_byte.tiktoken", tokenizer([], ["<|bos|>"], skip_byte=0x41))
    write("tokenizer", "wrong_types.tiktoken",
          tokenizer([], [], sidecar_changes={"version": "1", "format": 1}))
    nested = []
    for _ in range(20):
        nested = [nested]
    write("tokenizer", "nested.tiktoken",
          tokenizer([], [], sidecar_changes={"special_tokens": nested}))


if __name__ == "__main__":
    main()
