#include "numerics/formats.h"

#include "core/error.h"

namespace fp8t {

Fp8Format e4m3_format(Fp8Family family) {
  return family == Fp8Family::Ocp ? Fp8Format::E4M3 : Fp8Format::E4M3FNUZ;
}

Fp8Format e5m2_format(Fp8Family family) {
  return family == Fp8Family::Ocp ? Fp8Format::E5M2 : Fp8Format::E5M2FNUZ;
}

Fp8Family family_for_architecture(std::string_view architecture) {
  if (architecture == "cpu") return Fp8Family::Ocp;
  if (architecture.starts_with("sm_")) return Fp8Family::Ocp;
  if (architecture == "gfx950") return Fp8Family::Ocp;
  if (architecture == "gfx942") return Fp8Family::Fnuz;
  throw ConfigError(fmt::format(
      "device architecture '{}' has no FP8 format this build knows; expected cpu, sm_NN, gfx942 "
      "or gfx950 (set fp8_dtype_family: ocp|fnuz to choose explicitly)",
      architecture));
}

Fp8Family resolve_family(FamilySetting setting, std::string_view architecture) {
  switch (setting) {
    case FamilySetting::Ocp:
      return Fp8Family::Ocp;
    case FamilySetting::Fnuz:
      return Fp8Family::Fnuz;
    case FamilySetting::Auto:
      return family_for_architecture(architecture);
  }
  return Fp8Family::Ocp;
}

std::string_view format_name(Fp8Format format) {
  switch (format) {
    case Fp8Format::E4M3:
      return "e4m3";
    case Fp8Format::E5M2:
      return "e5m2";
    case Fp8Format::E4M3FNUZ:
      return "e4m3fnuz";
    case Fp8Format::E5M2FNUZ:
      return "e5m2fnuz";
    case Fp8Format::E8M0:
      return "e8m0";
  }
  return "?";
}

std::optional<Fp8Format> parse_format(std::string_view name) {
  for (Fp8Format format : kAllFormats) {
    if (format_name(format) == name) return format;
  }
  return std::nullopt;
}

std::string_view family_name(Fp8Family family) {
  return family == Fp8Family::Ocp ? "ocp" : "fnuz";
}

}  // namespace fp8t
