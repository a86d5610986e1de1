// ZeRO-1 for the GPT's optimizer: which data-parallel rank updates each parameter. Every rank
// still sums every gradient; each then runs the update of the parameters it owns (with their
// optimizer state, which the GPU path keeps for those only) and the owners send the new values
// to the other ranks.
//   - Muon groups: matrix i of a group of n same-shape matrices belongs to the rank r with
//     r·n/R <= i < (r+1)·n/R (integer division), so each rank orthogonalizes one contiguous
//     stack of about n/R matrices: the work splits evenly and the batched GEMMs stay batched.
//   - AdamW tensors: the largest first, each to the rank with the fewest AdamW elements so far
//     (the lowest such rank on a tie), which balances the memory-bound AdamW passes.
// The assignment depends only on the groups and the rank count, so every rank computes the
// same one, and a checkpoint (which holds the whole state) resumes on any number of ranks.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fp8t::optim {

struct OptimizerGroup;

class OptimizerShard {
 public:
  // numel(name): the element count of each parameter of the groups. One rank owns every
  // parameter.
  OptimizerShard(const std::vector<OptimizerGroup>& groups,
                 const std::function<int64_t(const std::string&)>& numel, int rank, int ranks);

  int rank() const { return rank_; }
  int ranks() const { return ranks_; }
  bool whole() const { return ranks_ == 1; }
  // The rank that updates `parameter`. Throws fp8t::Error for a parameter the groups lack.
  int owner(const std::string& parameter) const;
  bool owns(const std::string& parameter) const { return owner(parameter) == rank_; }
  // The matrices [first, first + count) of Muon group `group` (an index into the groups) that
  // this rank updates; {0, n} when whole().
  std::pair<int64_t, int64_t> muon_range(size_t group) const;

 private:
  int rank_;
  int ranks_;
  std::map<std::string, int> owners_;
  std::map<size_t, std::pair<int64_t, int64_t>> muon_ranges_;
};

// The parameter a state buffer "<parameter>.<kind>" belongs to (kind: exp_avg, exp_avg_sq,
// momentum or second_moment).
std::string parameter_of_state(const std::string& buffer);

}  // namespace fp8t::optim
