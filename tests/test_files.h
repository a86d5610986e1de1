// Helpers shared by the tests that write files and check error messages: a temporary folder
// per test, a substring check that prints both strings, and the message of the error a call
// raises.
#pragma once

#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/error.h"

namespace fp8t::test {

// An empty folder for the running test, named after its suite, its name and the process id, so
// that tests run in parallel (ctest starts one process per test) never share one. Created on
// construction, removed with everything in it on destruction; a fixture member lives exactly as
// long as the test.
class TempFolder {
 public:
  TempFolder() : path_(std::filesystem::temp_directory_path() / unique_name()) {
    std::filesystem::remove_all(path_);  // left over by a crashed run of a reused pid
    std::filesystem::create_directories(path_);
  }
  ~TempFolder() {
    std::error_code ignored;  // a destructor must not throw; a leftover folder is harmless
    std::filesystem::remove_all(path_, ignored);
  }
  TempFolder(const TempFolder&) = delete;
  TempFolder& operator=(const TempFolder&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::filesystem::path& name) const { return path_ / name; }

 private:
  // Parameterized tests have '/' in their names; any character but [A-Za-z0-9_.] becomes '_'.
  static std::string unique_name() {
    const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = test == nullptr ? fmt::format("fp8t_{}", ::getpid())
                                       : fmt::format("fp8t_{}.{}_{}", test->test_suite_name(),
                                                     test->name(), ::getpid());
    for (char& c : name) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.') c = '_';
    }
    return name;
  }

  std::filesystem::path path_;
};

// EXPECT_TRUE(Contains(message, "expected X")) prints the whole text when the part is missing.
inline ::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

// What error_message returns when the call raised nothing.
inline constexpr char kNoError[] = "(no error was raised)";

// Runs f and returns the message of the E (fp8t::Error by default) it raises, or kNoError; any
// other exception propagates and fails the test. Checks of the message then fail too when
// nothing was raised.
template <typename E = Error, typename F>
std::string error_message(F&& f) {
  try {
    static_cast<void>(std::forward<F>(f)());
  } catch (const E& error) {
    return error.what();
  }
  return kNoError;
}

}  // namespace fp8t::test
