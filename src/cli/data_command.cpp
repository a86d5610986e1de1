// `fp8train data check`: validates precomputed Flux shards (docs/data.md, "Flux shards").
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "data/flux_shards.h"
#include "models/flux_config.h"

namespace fp8t::cli {

int run_data_check(const DataCheckOptions& options) {
  std::optional<FluxConfig> model;
  if (options.model != "none") model = FluxConfig::preset(options.model);
  const std::vector<std::filesystem::path> paths(options.paths.begin(), options.paths.end());
  const std::vector<data::FluxShardCheck> checks =
      data::check_flux_shards(paths, model ? &*model : nullptr);

  int64_t samples = 0;
  int64_t passed = 0;
  for (const data::FluxShardCheck& check : checks) {
    if (!check.error.empty()) {
      fmt::print("FAIL {}\n", check.error);
      continue;
    }
    const data::FluxShardLayout& layout = *check.layout;
    fmt::print("ok   {}: {} samples, {} [{}, {}, {}] {}, t5 [{}, {}] {}{}, clip [{}] {}\n",
               check.path.string(), layout.samples, data::flux_latent_mode_name(layout.mode),
               layout.latent.channels, layout.latent.height, layout.latent.width,
               io::dtype_name(layout.latent_dtype), layout.text_tokens, layout.context_dim,
               io::dtype_name(layout.t5_dtype), layout.has_t5_mask ? " with mask" : "",
               layout.pooled_dim, io::dtype_name(layout.clip_dtype));
    samples += layout.samples;
    ++passed;
  }
  fmt::print("{} of {} shards passed, {} samples; checked against {}\n", passed, checks.size(),
             samples, model ? options.model : "no model");
  return passed == static_cast<int64_t>(checks.size()) ? kExitOk : kExitProblemFound;
}

}  // namespace fp8t::cli
