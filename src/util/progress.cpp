#include "util/progress.h"

#include <unistd.h>

#include <cstdio>

namespace tandem {

ProgressBar::ProgressBar(std::string label) : label_(std::move(label)), tty_(isatty(2) == 1) {}

ProgressBar::~ProgressBar() {
  if (shown_ < 0) return;
  if (tty_) {
    std::fprintf(stderr, "\n");
  } else {
    std::fprintf(stderr, "%s: done (%zu)\n", label_.c_str(), total_);
  }
}

void ProgressBar::update(size_t done, size_t total) {
  total_ = total;
  const int pct = total ? static_cast<int>(done * 100 / total) : 100;
  if (pct == shown_) return;
  shown_ = pct;
  if (!tty_) return;
  constexpr int kWidth = 30;
  const int filled = pct * kWidth / 100;
  std::fprintf(stderr, "\r%s [%.*s%*s] %3d%%", label_.c_str(), filled,
               "==============================", kWidth - filled, "", pct);
  std::fflush(stderr);
}

}  // namespace tandem
