# Tests of src/engine/kv (block pool, prefix cache, KV events) and the block hash.
tandem_test(block_hash_test engine/block_hash_test.cpp)
target_link_libraries(block_hash_test PRIVATE tandem_util xxhash)

tandem_test(kv_cache_manager_test engine/kv_cache_manager_test.cpp)
target_link_libraries(kv_cache_manager_test PRIVATE tandem_kv)

tandem_test(kv_events_test engine/kv_events_test.cpp)
target_link_libraries(kv_events_test PRIVATE tandem_kv nlohmann_json::nlohmann_json)
