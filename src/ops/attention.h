// Self-attention with grouped-query heads, in nanochat's layout (heads not transposed):
// q [batch, seq_len, heads, head_dim], k and v [batch, seq_len, kv_heads, head_dim], out like q.
// Query head h reads kv head h / (heads / kv_heads). Causal (nanochat): query t attends to keys
// j with j <= t and t - j <= window (window >= seq_len - 1 is full causal; window 0 sees only
// itself). Not causal (Flux's joint attention): every query attends to every key. Scores are
// scale * q.k with a softmax in T.
//
// The forward saves only the log-sum-exp of each query's scores; the backward recomputes the
// probabilities from q, k and it (flash-attention style), so no [seq_len, seq_len] matrix is
// ever stored. Backward ADDS (+=) into dq, dk and dv, like every op in src/ops.
#pragma once

#include <cstdint>

#include "core/non_deduced.h"

namespace fp8t::ops {

struct AttentionShape {
  int64_t batch;
  int64_t seq_len;
  int64_t heads;
  int64_t kv_heads;  // divides heads
  int64_t head_dim;
  int64_t window;      // causal only, >= 0: how many keys to the left a query sees besides its own
  bool causal = true;  // false: no mask, and window is not used
};

// out = softmax(scale * q k^T + mask) v; lse: [batch, heads, seq_len], the natural log of
// the sum of exp(score) over the keys each query sees (scores already scaled).
template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v,
                       const AttentionShape& shape, NonDeduced<T> scale);

// dq, dk, dv += the gradients of sum(out * dout); lse is the forward's.
template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                        const T* lse, const AttentionShape& shape, NonDeduced<T> scale);

}  // namespace fp8t::ops
