#include "train/stop_signal.h"

#include <csignal>

namespace fp8t::train {

namespace {

volatile std::sig_atomic_t g_received = 0;
struct sigaction g_previous_int {};
struct sigaction g_previous_term {};
struct sigaction g_previous_usr1 {};

void record(int signal) {
  g_received = signal;
}

}  // namespace

StopSignal::StopSignal() {
  g_received = 0;
  struct sigaction action {};
  action.sa_handler = record;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, &g_previous_int);
  sigaction(SIGTERM, &action, &g_previous_term);
  sigaction(SIGUSR1, &action, &g_previous_usr1);
}

StopSignal::~StopSignal() {
  sigaction(SIGINT, &g_previous_int, nullptr);
  sigaction(SIGTERM, &g_previous_term, nullptr);
  sigaction(SIGUSR1, &g_previous_usr1, nullptr);
}

int StopSignal::received() {
  return g_received;
}

}  // namespace fp8t::train
