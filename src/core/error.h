// One error family for the whole project: the library throws, only main() exits.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace fp8t {

// Raised for anything a caller or a user can act on: bad input, a failed device call,
// a broken invariant. what() is a complete message.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A configuration value is missing, malformed or out of range; the message names the
// source (file and line when known), the key and what is allowed.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A GPU allocation failed for want of memory: the device is left usable, so a caller may go
// on with less (the benchmarks report such a run and measure the next).
class DeviceOutOfMemory : public Error {
 public:
  using Error::Error;
};

[[noreturn]] void throw_check_failure(const char* file, int line, const char* statement,
                                      const std::string& message);

}  // namespace fp8t

// Checks a precondition; on failure throws fp8t::Error naming the source location, the
// statement and a formatted message ("expected X, found Y").
#define FP8T_CHECK(cond, ...)                                                             \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      ::fp8t::throw_check_failure(__FILE__, __LINE__, #cond, ::fmt::format(__VA_ARGS__)); \
    }                                                                                     \
  } while (false)
