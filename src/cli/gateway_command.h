#pragma once
#include <CLI/CLI.hpp>

namespace tandem::cli {

// `tandem gateway`: one OpenAI endpoint in front of prefill and decode engines.
void add_gateway_command(CLI::App& app);

}  // namespace tandem::cli
