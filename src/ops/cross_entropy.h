// Cross-entropy of soft-capped logits, as nanochat computes its loss: the raw lm_head output
// [rows, padded_vocab] is cropped to the real vocab, capped = softcap * tanh(raw / softcap),
// and the loss is the mean cross-entropy over the rows whose target is not kIgnoreTarget.
//
// Memory-frugal: the gradient overwrites the logits in place, so the [rows, padded_vocab]
// logits are never copied. Sums over rows accumulate in double.
#pragma once

#include <cstdint>

#include "core/non_deduced.h"

namespace fp8t::ops {

inline constexpr int32_t kIgnoreTarget = -1;
inline constexpr double kLogitSoftcap = 15.0;

struct CrossEntropyShape {
  int64_t rows;          // tokens
  int64_t vocab;         // real vocab: the columns that count
  int64_t padded_vocab;  // row length of the logits, >= vocab
};

// The mean loss; logits are left untouched. token_losses [rows], when not null, receives each
// row's loss (0 for ignored rows). With every target ignored the loss is 0, not torch's NaN
// (0 / 0), so that an all-padding micro-batch adds nothing to an accumulated loss.
// targets: [rows], each kIgnoreTarget or in [0, vocab); throws fp8t::Error otherwise (before
// anything is written).
template <typename T>
double softcap_cross_entropy(const T* logits, const int32_t* targets,
                             const CrossEntropyShape& shape, NonDeduced<T>* token_losses = nullptr,
                             NonDeduced<T> softcap = kLogitSoftcap);

// As softcap_cross_entropy, and overwrites logits with dloss * d(loss)/d(raw logits):
// (softmax - onehot(target)) / valid_rows * (1 - tanh^2) * dloss on the real vocab columns,
// 0 on the padding columns and on ignored rows. Unlike the other backwards this writes, not
// adds: the gradient takes the place of the logits it came from.
template <typename T>
double softcap_cross_entropy_with_gradient(T* logits, const int32_t* targets,
                                           const CrossEntropyShape& shape, NonDeduced<T> dloss,
                                           NonDeduced<T>* token_losses = nullptr,
                                           NonDeduced<T> softcap = kLogitSoftcap);

}  // namespace fp8t::ops
