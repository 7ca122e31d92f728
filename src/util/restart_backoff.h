#pragma once
// When to restart a child process that died: at once is wrong for a child that dies at start
// (a bad flag, a port taken), never is wrong for one that crashed after serving for hours. The
// delay doubles with each quick death and starts over once a child ran long enough.
#include <chrono>

namespace tandem {

struct RestartBackoff {
  std::chrono::milliseconds first = std::chrono::seconds(1);
  std::chrono::milliseconds max = std::chrono::seconds(30);
  // A child that ran at least this long before it died counts as healthy: its restart waits
  // `first` again.
  std::chrono::milliseconds healthy_run = std::chrono::seconds(60);

  // The wait before the next start of a child that ran `ran` before it died, after
  // `quick_deaths` earlier deaths that each came sooner than healthy_run (updated: reset or
  // incremented).
  std::chrono::milliseconds next_delay(std::chrono::milliseconds ran, int& quick_deaths) const;
};

}  // namespace tandem
