#include "core/error.h"

namespace fp8t {

void throw_check_failure(const char* file, int line, const char* statement,
                         const std::string& message) {
  throw Error(fmt::format("{}:{}: check '{}' failed: {}", file, line, statement, message));
}

}  // namespace fp8t
