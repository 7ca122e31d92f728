// Fuzzes the KV events decoder (gateway/kv_events_consumer.h): one msgpack payload of an engine's
// ZMQ stream, decoded and, when valid, applied to a prefix index, as the gateway's consumer does.
// The index lives across inputs (the consumer's does too), capped small so eviction runs.
// tandem::Error is the decoder's documented error; anything else escaping is a finding.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gateway/kv_events_consumer.h"
#include "gateway/prefix_index.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static tandem::gateway::PrefixIndex index(4096);
  const std::string_view payload(reinterpret_cast<const char*>(data), size);
  try {
    const tandem::gateway::KvEventBatchRecord batch =
        tandem::gateway::decode_kv_event_payload(payload);
    (void)tandem::gateway::apply_kv_event_batch(index, static_cast<int>(size % 3), batch);
  } catch (const tandem::Error&) {
  }
  return 0;
}
