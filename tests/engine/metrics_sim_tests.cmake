# Tests of src/util/metrics and src/engine/executor/sim_latency.
