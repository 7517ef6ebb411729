#include "client/fwctl/interrupts.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <thread>
#include <utility>

#include "client/fwctl/cli.h"

namespace fwctl {

void Interrupts::Start() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  if (pipe(wake_pipe_) == 0) {
    fcntl(wake_pipe_[0], F_SETFL, fcntl(wake_pipe_[0], F_GETFL) | O_NONBLOCK);
    fcntl(wake_pipe_[1], F_SETFL, fcntl(wake_pipe_[1], F_GETFL) | O_NONBLOCK);
  }
  std::thread([set] {
    for (;;) {
      int signal_number = 0;
      if (sigwait(&set, &signal_number) != 0) continue;
      count_.fetch_add(1);
      [[maybe_unused]] ssize_t written = write(wake_pipe_[1], "i", 1);
      std::lock_guard<std::mutex> lock(mutex_);
      if (handler_) {
        handler_();
      } else {
        std::fflush(stdout);
        std::fputs("\nfwctl: interrupted\n", stderr);
        std::_Exit(kExitInterrupted);
      }
    }
  }).detach();
}

void Interrupts::DrainWakeups() {
  char buffer[64];
  while (read(wake_pipe_[0], buffer, sizeof(buffer)) > 0) {
  }
}

Interrupts::Handler::Handler(std::function<void()> handler) {
  std::lock_guard<std::mutex> lock(mutex_);
  previous_ = std::move(handler_);
  handler_ = std::move(handler);
}

Interrupts::Handler::~Handler() {
  std::lock_guard<std::mutex> lock(mutex_);
  handler_ = std::move(previous_);
}

}  // namespace fwctl
