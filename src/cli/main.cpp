// fp8train: the command-line entry point. The only place that turns errors into exit codes.
#include <cstdint>
#include <exception>
#include <iostream>

#include <CLI/CLI.hpp>

#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"fp8train: FP8 training engine", "fp8train"};
  app.set_version_flag("--version", "fp8train " FP8TRAIN_VERSION);
  app.require_subcommand(1);

  fp8t::cli::DoctorOptions doctor_options;
  CLI::App* doctor = app.add_subcommand(
      "doctor", "Report the GPUs, CUDA, cuBLASLt, cuDNN and NCCL versions and the FP8 formats");
  doctor->add_flag("--json", doctor_options.json, "Print the report as one JSON object");

  fp8t::cli::CheckNumericsOptions numerics_options;
  CLI::App* check_numerics = app.add_subcommand(
      "check-numerics", "Quantize random data with every FP8 recipe and check the errors");
  check_numerics->add_option("--config", numerics_options.config_path,
                             "YAML file whose fp8 keys configure the check (default: defaults)");
  check_numerics->add_option("--rows", numerics_options.rows, "Rows of the test tensor")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  check_numerics->add_option("--cols", numerics_options.cols, "Columns of the test tensor")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));

  try {
    app.parse(argc, argv);
    if (*doctor) return fp8t::cli::run_doctor(doctor_options);
    return fp8t::cli::run_check_numerics(numerics_options);
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      return app.exit(error);  // --help, --version
    }
    std::cerr << "fp8train: error: " << error.what() << "\nRun with --help for more information.\n";
    return fp8t::cli::kExitError;
  } catch (const std::exception& error) {
    // fp8t::Error and ConfigError carry complete messages (file, key, allowed values); anything
    // else (bad_alloc, ...) is reported the same way rather than aborting.
    std::cerr << "fp8train: error: " << error.what() << '\n';
    return fp8t::cli::kExitError;
  }
}
