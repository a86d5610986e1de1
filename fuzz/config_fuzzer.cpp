// The YAML training configuration: the input is a --config file that load_train_config reads
// and validates, and that fp8_config_from_yaml (check-numerics --config) reads for its fp8 keys.
// A configuration that loads must also load back from its to_yaml() to the same YAML.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "config/train_config.h"
#include "core/error.h"
#include "fuzz_input.h"
#include "numerics/scaling.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(fp8t::fuzz::as_text(data, size));
  const std::string path = fp8t::fuzz::scratch().write("config.yaml", text).string();
  std::optional<fp8t::TrainConfig> config;
  try {
    config = fp8t::load_train_config({"--config", path});
  } catch (const fp8t::Error&) {  // bad input, refused with a message
  }
  if (config) {
    // Outside the try: an error here is a bug, reported as an uncaught exception.
    const std::string yaml = fp8t::to_yaml(*config);
    const std::string resolved = fp8t::fuzz::scratch().write("resolved.yaml", yaml).string();
    const std::string again = fp8t::to_yaml(fp8t::load_train_config({"--config", resolved}));
    std::filesystem::remove(resolved);  // so that no later input can name it as its base
    if (again != yaml) {
      fmt::print(stderr, "to_yaml does not round-trip:\n{}\nread back as:\n{}\n", yaml, again);
      std::abort();
    }
  }

  try {
    fp8t::fp8_config_from_yaml(YAML::Load(text), "input");
  } catch (const fp8t::Error&) {      // bad input, refused with a message
  } catch (const YAML::Exception&) {  // its callers report yaml-cpp's errors as ConfigError
  }
  return 0;
}
