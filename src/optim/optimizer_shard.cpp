#include "optim/optimizer_shard.h"

#include <algorithm>

#include "core/error.h"
#include "optim/gpt_optimizer.h"

namespace fp8t::optim {

OptimizerShard::OptimizerShard(const std::vector<OptimizerGroup>& groups,
                               const std::function<int64_t(const std::string&)>& numel, int rank,
                               int ranks)
    : rank_(rank), ranks_(ranks) {
  FP8T_CHECK(ranks >= 1 && rank >= 0 && rank < ranks,
             "expected a rank in [0, {}) of at least one rank, found {}", ranks, rank);
  struct Tensor {
    const std::string* name;
    int64_t numel;
    size_t order;  // place in the groups' order
  };
  std::vector<Tensor> adamw;
  for (size_t index = 0; index < groups.size(); ++index) {
    const OptimizerGroup& group = groups[index];
    if (group.rule == UpdateRule::AdamW) {
      for (const std::string& name : group.parameters)
        adamw.push_back({&name, numel(name), adamw.size()});
      continue;
    }
    const auto count = std::ssize(group.parameters);
    for (int r = 0; r < ranks; ++r) {
      const int64_t first = count * r / ranks, end = count * (r + 1) / ranks;
      for (int64_t matrix = first; matrix < end; ++matrix)
        owners_[group.parameters[static_cast<size_t>(matrix)]] = r;
      if (r == rank) muon_ranges_[index] = {first, end - first};
    }
  }
  // Largest first; equal sizes keep the groups' order, so every rank sorts alike.
  std::ranges::sort(adamw, [](const Tensor& a, const Tensor& b) {
    return a.numel != b.numel ? a.numel > b.numel : a.order < b.order;
  });
  std::vector<int64_t> load(static_cast<size_t>(ranks), 0);
  for (const Tensor& tensor : adamw) {
    const auto lightest = std::ranges::min_element(load) - load.begin();
    load[static_cast<size_t>(lightest)] += tensor.numel;
    owners_[*tensor.name] = static_cast<int>(lightest);
  }
}

int OptimizerShard::owner(const std::string& parameter) const {
  const auto found = owners_.find(parameter);
  FP8T_CHECK(found != owners_.end(), "optimizer shards: no group holds a parameter named '{}'",
             parameter);
  return found->second;
}

std::pair<int64_t, int64_t> OptimizerShard::muon_range(size_t group) const {
  const auto found = muon_ranges_.find(group);
  FP8T_CHECK(found != muon_ranges_.end(), "optimizer shards: group {} is not a Muon group", group);
  return found->second;
}

std::string parameter_of_state(const std::string& buffer) {
  const size_t dot = buffer.rfind('.');
  FP8T_CHECK(dot != std::string::npos && dot > 0,
             "optimizer state: expected a buffer named '<parameter>.<kind>', found '{}'", buffer);
  return buffer.substr(0, dot);
}

}  // namespace fp8t::optim
