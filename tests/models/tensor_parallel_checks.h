// What the models' tensor-parallel tests share: ranks that meet in memory instead of over MPI or
// TCP, so that a model's ranks run side by side as threads of one test, and the comparison of
// their results with one model's.
#pragma once

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "models/tensor_parallel.h"

namespace fp8t::testing {

// Collectives among `size` threads: each contributes, the last to arrive combines the
// contributions in rank order (a sum or maximum, or their concatenation), and every thread
// leaves with the result.
class ThreadGroup {
 public:
  explicit ThreadGroup(int size) : size_(size), contributions_(static_cast<size_t>(size)) {}

  int size() const { return size_; }

  void reduce(int rank, float* values, size_t count, const std::function<float(float, float)>& op) {
    meet(rank, values, count, values, [&] {
      result_ = contributions_[0];
      for (size_t r = 1; r < contributions_.size(); ++r)
        for (size_t i = 0; i < count; ++i)
          result_[i] = op(result_[i], contributions_[r][i]);
    });
  }

  void all_gather(int rank, const float* own, float* all, size_t count) {
    meet(rank, own, count, all, [&] {
      result_.clear();
      for (const std::vector<float>& contribution : contributions_)
        result_.insert(result_.end(), contribution.begin(), contribution.end());
    });
  }

  TensorParallel member(int rank) {
    TensorParallel group;
    group.size = size_;
    group.rank = rank;
    group.sum = [this, rank](float* values, size_t count) {
      reduce(rank, values, count, [](float a, float b) { return a + b; });
    };
    group.max = [this, rank](float value) {
      reduce(rank, &value, 1, [](float a, float b) { return std::max(a, b); });
      return value;
    };
    group.all_gather = [this, rank](const float* own, float* all, size_t count) {
      all_gather(rank, own, all, count);
    };
    return group;
  }

 private:
  int size_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int arrived_ = 0;
  int round_ = 0;
  std::vector<std::vector<float>> contributions_;
  std::vector<float> result_;

  // This rank's `count` values in; once every rank is in, the last one's combine() sets result_,
  // which every rank copies to `out`.
  template <typename Combine>
  void meet(int rank, const float* values, size_t count, float* out, Combine&& combine) {
    std::unique_lock lock(mutex_);
    contributions_[static_cast<size_t>(rank)].assign(values, values + count);
    const int round = round_;
    if (++arrived_ == size_) {
      combine();
      arrived_ = 0;
      ++round_;
      changed_.notify_all();
    } else {
      changed_.wait(lock, [&] { return round_ != round; });
    }
    // Copied under the lock: the next round cannot finish before this thread has joined it.
    std::copy(result_.begin(), result_.end(), out);
  }
};

// The group's ranks of a model, each made by make(its TensorParallel) and given the parameters
// of `whole` (every tensor named by an entry of `params`).
template <typename Model, typename Params, typename Make>
std::vector<std::unique_ptr<Model>> ranks_like(ThreadGroup& group, Model& whole,
                                               const Params& params, Make&& make) {
  std::vector<std::unique_ptr<Model>> ranks;
  for (int rank = 0; rank < group.size(); ++rank) {
    ranks.push_back(make(group.member(rank)));
    for (const auto& param : params) {
      std::memcpy(ranks.back()->parameters()[param.name].raw(),
                  whole.parameters()[param.name].raw(), whole.parameters()[param.name].bytes());
    }
    ranks.back()->weights_changed();
  }
  return ranks;
}

// step(model, rank) on every rank at once, one thread each, as the ranks of a job would run.
template <typename Model>
void run_ranks(const std::vector<std::unique_ptr<Model>>& ranks,
               const std::function<void(Model&, size_t)>& step) {
  std::vector<std::thread> threads;
  for (size_t rank = 0; rank < ranks.size(); ++rank)
    threads.emplace_back([&, rank] { step(*ranks[rank], rank); });
  for (std::thread& thread : threads)
    thread.join();
}

// Every rank holds the same gradient, byte for byte, of each tensor named in `params`.
template <typename Model, typename Params>
void expect_same_gradients(const std::vector<std::unique_ptr<Model>>& ranks, const Params& params) {
  for (const auto& param : params) {
    const auto& first = ranks[0]->gradients()[param.name];
    for (size_t rank = 1; rank < ranks.size(); ++rank) {
      EXPECT_EQ(std::memcmp(first.raw(), ranks[rank]->gradients()[param.name].raw(), first.bytes()),
                0)
          << param.name << ": rank " << rank << " holds another gradient than rank 0";
    }
  }
}

// ‖got − want‖ / ‖want‖ over `count` values.
inline double relative_difference(const float* got, const float* want, int64_t count) {
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

}  // namespace fp8t::testing
