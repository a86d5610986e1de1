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
  ~StepPrefetch() { wait(); }
  StepPrefetch(const StepPrefetch&) = delete;
  StepPrefetch& operator=(const StepPrefetch&) = delete;

  // Step `step`'s batches: the ones loaded ahead when that was this step, else loaded now. With
  // a `next` step (negative: none), its batches start loading on another thread. A failed load
  // ahead throws at the take() of its step; for another step it is dropped.
  Batches& take(int64_t step, int64_t next = -1) {
    if (pending_.valid()) {
      std::future<void> pending = std::move(pending_);
      try {
        pending.get();
      } catch (...) {
        const bool asked = ahead_step_ == step;
        ahead_step_ = -1;
        if (asked) throw;
      }
    }
    const bool loaded_ahead = ahead_step_ == step;
    ahead_step_ = -1;  // ahead_ is about to be taken, or overwritten by a load that may fail
    if (!loaded_ahead) load_(step, ahead_);
    std::swap(current_, ahead_);
    if (next >= 0) {
      pending_ = std::async(std::launch::async, [this, next] { load_(next, ahead_); });
      ahead_step_ = next;
    }
    return current_;
  }

  // Waits for the load in flight, if any, without its outcome (the take() of its step has it):
  // call before anything else uses what the loads use.
  void wait() const {
    if (pending_.valid()) pending_.wait();
  }

 private:
  Load load_;
  Batches current_{}, ahead_{};
  int64_t ahead_step_ = -1;  // the step whose batches ahead_ holds or is being loaded with
  std::future<void> pending_;
};

}  // namespace fp8t::train
