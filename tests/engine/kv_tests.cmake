# Tests of src/engine/kv (block pool, prefix cache, KV events).
