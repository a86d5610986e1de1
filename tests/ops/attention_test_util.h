// Helpers shared by the attention tests (ops/attention.h, ops/attention_fp8.h): a shape's
// description for failure messages and the sizes of its tensors.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <string>

#include "ops/attention.h"

namespace fp8t::test {

inline std::string describe(const ops::AttentionShape& s) {
  return fmt::format("B {} T {} H {} Hkv {} D {} window {}{}", s.batch, s.seq_len, s.heads,
                     s.kv_heads, s.head_dim, s.window, s.causal ? "" : " not causal");
}

inline size_t q_size(const ops::AttentionShape& s) {
  return static_cast<size_t>(s.batch * s.seq_len * s.heads * s.head_dim);
}
inline size_t kv_size(const ops::AttentionShape& s) {
  return static_cast<size_t>(s.batch * s.seq_len * s.kv_heads * s.head_dim);
}
inline size_t lse_size(const ops::AttentionShape& s) {
  return static_cast<size_t>(s.batch * s.heads * s.seq_len);
}

}  // namespace fp8t::test
