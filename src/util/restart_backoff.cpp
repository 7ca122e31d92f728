#include "util/restart_backoff.h"

#include <algorithm>

namespace tandem {

std::chrono::milliseconds RestartBackoff::next_delay(std::chrono::milliseconds ran,
                                                     int& quick_deaths) const {
  if (ran >= healthy_run) quick_deaths = 0;
  std::chrono::milliseconds delay = first;
  for (int i = 0; i < quick_deaths && delay < max; ++i) delay *= 2;
  ++quick_deaths;
  return std::min(delay, max);
}

}  // namespace tandem
