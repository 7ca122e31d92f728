#pragma once
// A progress bar on stderr for long loads and writes. It redraws only when the shown percentage
// changes and stays silent when stderr is not a terminal, so logs and tests see one final line.
#include <cstddef>
#include <string>

namespace tandem {

class ProgressBar {
 public:
  // `unit` names what update() counts ("tensors", "bytes"): the final line says "done (135
  // tensors)".
  explicit ProgressBar(std::string label, std::string unit = {});
  ~ProgressBar();  // finishes the line if update() was called
  void update(size_t done, size_t total);

 private:
  std::string label_, unit_;
  bool tty_;
  int shown_ = -1;
  size_t total_ = 0;
};

}  // namespace tandem
