// `fp8train config`: the resolved training configuration, or the reference of its keys.
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "config/train_config.h"

namespace fp8t::cli {

int run_config(const ConfigOptions& options) {
  if (options.markdown) {
    fmt::print("{}", configuration_markdown());
    return kExitOk;
  }
  std::vector<std::string> args = options.overrides;
  if (!options.config_path.empty()) args.insert(args.begin(), {"--config", options.config_path});
  fmt::print("{}", to_yaml(load_train_config(args)));
  return kExitOk;
}

}  // namespace fp8t::cli
