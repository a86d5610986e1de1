// Token embedding lookup (nn.Embedding), used for wte and the value embeddings.
//
// Like every op in src/ops: plain functions over contiguous row-major buffers, instantiated
// for float and double; the backward ADDS (+=) into its gradient buffers, so zero them first
// to get a plain gradient, or leave them to let shared inputs sum.
#pragma once

#include <cstdint>

namespace fp8t::ops {

// out[n, :] = table[ids[n], :] for n < num_tokens.
// table: [vocab, dim]; ids: [num_tokens]; out: [num_tokens, dim].
// Throws fp8t::Error when an id lies outside [0, vocab).
template <typename T>
void embedding_forward(T* out, const int32_t* ids, const T* table, int64_t num_tokens,
                       int64_t vocab, int64_t dim);

// dtable[ids[n], :] += dout[n, :]: a sparse accumulation where repeated ids sum.
// dtable: [vocab, dim]; dout: [num_tokens, dim]. Throws like the forward on a bad id.
template <typename T>
void embedding_backward(T* dtable, const T* dout, const int32_t* ids, int64_t num_tokens,
                        int64_t vocab, int64_t dim);

}  // namespace fp8t::ops
