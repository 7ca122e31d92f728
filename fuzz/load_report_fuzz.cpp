// Fuzzes the /load body parser (api/load_report.h) that the gateway's poll runs on every engine's
// answer, then what the gateway does with a parsed report (describes_an_engine) and the engine's
// own serialiser on the result. tandem::Error is the parser's documented error; anything else
// escaping is a finding.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "api/load_report.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  try {
    const tandem::api::LoadReport report = tandem::api::parse_load_report(body);
    (void)tandem::api::describes_an_engine(report);
    (void)tandem::api::to_json(report, 0);
  } catch (const tandem::Error&) {
  }
  // The poll's target parameter comes from the same untrusted side of the wire in the engine.
  (void)tandem::api::load_since_step(body);
  return 0;
}
