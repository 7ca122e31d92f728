# Tests of src/util/metrics and src/engine/executor/sim_latency.
# Registered like tandem_test() but linked only against the libraries they test, so they build
# quickly and do not depend on the rest of the engine.
function(tandem_lean_test name source)
  add_executable(${name} ${source})
  target_link_libraries(${name} PRIVATE ${ARGN} GTest::gtest GTest::gtest_main)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  target_compile_definitions(${name} PRIVATE TANDEM_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 900)
endfunction()

tandem_lean_test(metrics_test util/metrics_test.cpp tandem_util nlohmann_json::nlohmann_json)
tandem_lean_test(sim_latency_test engine/sim_latency_test.cpp tandem_executor)
