#pragma once
#include <chrono>
#include <span>
#include <string>

#include <CLI/CLI.hpp>

namespace tandem::cli {

// `tandem engine`: a serving worker (OpenAI and tokens-in HTTP API) on the CPU model or a
// simulated executor.
void add_engine_command(CLI::App& app);

// Checks a `tandem engine` command line (`args`: the program's name, "engine", then its flags) as
// the engine checks it before it loads anything: every flag known and given once, every value of
// its type and range, and the settings that need no model (not its folder, which may not be
// written yet). Throws tandem::Error with the engine's message. `tandem serve` checks its engines'
// command lines with it before it writes a preset or starts anything. Returns the drain the
// engine will give its requests at its stop (its --shutdown-timeout).
std::chrono::milliseconds check_engine_command_line(std::span<const std::string> args);

}  // namespace tandem::cli
