// The small Flux the model tests build: flux_tiny with two heads.
#pragma once

#include "models/flux_config.h"

namespace fp8t::testing {

// flux_tiny with `hidden` features in two heads (rotary axes of 1/4, 3/8 and 3/8 of a head) and
// the given numbers of double and single blocks.
inline FluxConfig two_head_flux_config(int hidden, int double_blocks, int single_blocks) {
  FluxConfig config = FluxConfig::preset("flux_tiny");
  config.hidden_size = hidden;
  config.num_heads = 2;
  const int quarter = hidden / 2 / 4;  // head_dim / 4
  config.axes_dim = {quarter, 3 * quarter / 2, 3 * quarter / 2};
  config.double_blocks = double_blocks;
  config.single_blocks = single_blocks;
  return config;
}

}  // namespace fp8t::testing
