// Fuzzes the gateway's topology file parser (gateway/topology.h: YAML, then validation), which
// `tandem gateway --config` and the admin API's reload run on an operator's file. tandem::Error is
// its documented error (YAML syntax errors included); anything else escaping is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "gateway/topology.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    (void)tandem::gateway::parse_topology_yaml(text, "topology.yaml");
  } catch (const tandem::Error&) {
  }
  return 0;
}
