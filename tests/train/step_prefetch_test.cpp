// StepPrefetch gives each step its own batches whether they were loaded ahead or not, loads the
// next step on another thread, drops a load ahead that the next take does not ask for, and
// passes a failed load's exception to the take of its step, never handing out what it left.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "train/step_prefetch.h"

namespace fp8t::train {
namespace {

using Batches = std::vector<int64_t>;

// A loader that fills a step's batches with the step's number and counts where it ran.
struct CountingLoader {
  std::mutex mutex;
  std::map<int64_t, int> loads;                // per step
  std::map<int64_t, std::thread::id> threads;  // the last load's
  int64_t failing_step = -1;

  StepPrefetch<Batches>::Load load() {
    return [this](int64_t step, Batches& out) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        ++loads[step];
        threads[step] = std::this_thread::get_id();
      }
      out.assign(3, step);  // a failing load leaves its batches half made
      if (step == failing_step) throw std::runtime_error("no such step");
    };
  }
};

TEST(StepPrefetch, EachStepGetsItsOwnBatchesTheNextLoadedOnAnotherThread) {
  CountingLoader loader;
  StepPrefetch<Batches> prefetch(loader.load());
  for (int64_t step = 0; step < 4; ++step) {
    const Batches& batches = prefetch.take(step, step + 1);
    prefetch.wait();  // the next step's load done: it must not have written these
    EXPECT_EQ(batches, Batches(3, step));
  }
  const auto caller = std::this_thread::get_id();
  EXPECT_EQ(loader.threads.at(0), caller);  // nothing was ahead of step 0
  for (int64_t step = 1; step <= 4; ++step) {
    EXPECT_EQ(loader.loads.at(step), 1) << step;
    EXPECT_NE(loader.threads.at(step), caller) << step;
  }
}

TEST(StepPrefetch, AStepOtherThanTheOneLoadedAheadIsLoadedThen) {
  CountingLoader loader;
  StepPrefetch<Batches> prefetch(loader.load());
  prefetch.take(0, 1);
  EXPECT_EQ(prefetch.take(5), Batches(3, 5));  // step 1's load is dropped
  EXPECT_EQ(loader.threads.at(5), std::this_thread::get_id());
  EXPECT_EQ(prefetch.take(1), Batches(3, 1));  // and loaded again when asked for
  EXPECT_EQ(loader.loads.at(1), 2);
  // No next step: nothing is loaded ahead.
  EXPECT_EQ(loader.loads.count(2), 0u);
}

TEST(StepPrefetch, AFailedLoadAheadThrowsAtTheTakeOfItsStep) {
  CountingLoader loader;
  loader.failing_step = 3;
  StepPrefetch<Batches> prefetch(loader.load());
  EXPECT_EQ(prefetch.take(2, 3), Batches(3, 2));
  EXPECT_THROW(prefetch.take(3), std::runtime_error);
  loader.failing_step = -1;
  EXPECT_EQ(prefetch.take(3), Batches(3, 3));  // loaded anew, not taken as loaded
  EXPECT_EQ(loader.loads.at(3), 2);

  // Failed ahead of a step that is not asked for: dropped.
  loader.failing_step = 4;
  prefetch.take(3, 4);
  EXPECT_EQ(prefetch.take(7), Batches(3, 7));
}

TEST(StepPrefetch, AFailedLoadNowLeavesNothingTakenAsLoaded) {
  CountingLoader loader;
  StepPrefetch<Batches> prefetch(loader.load());
  prefetch.take(0, 1);
  prefetch.wait();  // step 1's batches are ahead
  loader.failing_step = 9;
  EXPECT_THROW(prefetch.take(9), std::runtime_error);  // and half overwritten by step 9's
  EXPECT_EQ(prefetch.take(1), Batches(3, 1));
  EXPECT_EQ(loader.loads.at(1), 2);
}

}  // namespace
}  // namespace fp8t::train
