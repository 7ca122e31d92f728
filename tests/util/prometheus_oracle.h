#pragma once
// Runs tests/oracle/parse_prometheus.py on a Prometheus text exposition: a strict grammar check
// written from the format's specification plus the Prometheus Python client's parser (Debian
// python3-prometheus-client, run under /usr/bin/python3). A missing package is a failure, not a
// skip. For the tests of the registry (util/metrics_test) and of what engines and the gateway
// export.
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "text/oracle_support.h"
#include "util/file.h"

namespace tandem::test {

// The oracle's JSON for `text` ({"families": [{"name", "type", "help", "samples": [{"name",
// "labels", "value"}]}]}, in input order; a counter's family name without "_total"), or null
// after failing the test with the oracle's stderr.
inline nlohmann::json parse_prometheus(const std::string& text) {
  const auto in = temp_path("metrics-in");
  const auto out = temp_path("metrics-out");
  const auto err = temp_path("metrics-err");
  {
    std::ofstream f(in, std::ios::binary);
    f << text;
  }
  const std::string cmd = "/usr/bin/python3 " + quote(oracle_dir() / "parse_prometheus.py") +
                          " < " + quote(in) + " > " + quote(out) + " 2> " + quote(err);
  const int status = run_command(cmd);
  const std::string err_text = std::filesystem::exists(err) ? read_file(err) : "";
  nlohmann::json result;
  if (status == 0) result = nlohmann::json::parse(read_file(out));
  std::filesystem::remove(in);
  std::filesystem::remove(out);
  std::filesystem::remove(err);
  EXPECT_EQ(status, 0) << "parse_prometheus.py failed (is python3-prometheus-client installed? "
                          "scripts/install-deps.sh installs it):\n"
                       << err_text << "\ninput:\n"
                       << text;
  return result;
}

}  // namespace tandem::test
