#include "util/progress.h"

#include <unistd.h>

#include <cstdio>
#include <string>

namespace tandem {

namespace {

// 66523744 -> "66,523,744".
std::string grouped(size_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

ProgressBar::ProgressBar(std::string label, std::string unit)
    : label_(std::move(label)), unit_(std::move(unit)), tty_(isatty(2) == 1) {}

ProgressBar::~ProgressBar() {
  if (shown_ < 0) return;
  if (tty_) {
    std::fprintf(stderr, "\n");
  } else {
    std::fprintf(stderr, "%s: done (%s%s%s)\n", label_.c_str(), grouped(total_).c_str(),
                 unit_.empty() ? "" : " ", unit_.c_str());
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
