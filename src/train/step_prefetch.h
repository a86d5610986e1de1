// The next optimizer step's batches loaded on a thread of their own while the current step runs:
// a Flux micro-batch (its samples read, its noise drawn) costs the host milliseconds that the
// GPU would otherwise wait through between steps. Each step's batches are a function of the step
// alone (train/flux_batches.h), so loading ahead changes no value.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <utility>

namespace fp8t::train {

template <typename Batches>
class StepPrefetch {
 public:
  using Load = std::function<void(int64_t step, Batches& out)>;
  explicit StepPrefetch(Load load) : load_(std::move(load)) {}
  ~StepPrefetch() {
    if (pending_.valid()) pending_.wait();
  }
  StepPrefetch(const StepPrefetch&) = delete;
  StepPrefetch& operator=(const StepPrefetch&) = delete;

  // Step `step`'s batches: the ones loaded ahead when that was this step, else loaded now. With
  // `next` (0: none), step `next`'s start loading on another thread. A load's exception is
  // thrown by the take() or finish() that waits for it.
  Batches& take(int64_t step, int64_t next = -1) {
    finish();
    if (ahead_step_ != step) load_(step, ahead_);
    ahead_step_ = -1;
    std::swap(current_, ahead_);
    if (next >= 0) {
      ahead_step_ = next;
      pending_ = std::async(std::launch::async, [this, next] { load_(next, ahead_); });
    }
    return current_;
  }

  // Waits for the load in flight, if any: call before anything else uses what the loads use.
  // If it failed, nothing counts as loaded ahead.
  void finish() {
    if (!pending_.valid()) return;
    std::future<void> pending = std::move(pending_);
    try {
      pending.get();
    } catch (...) {
      ahead_step_ = -1;
      throw;
    }
  }

 private:
  Load load_;
  Batches current_{}, ahead_{};
  int64_t ahead_step_ = -1;  // the step whose batches ahead_ holds or is being loaded with
  std::future<void> pending_;
};

}  // namespace fp8t::train
