// `tandem`: the single binary of the project; each part is a subcommand.
#include <sys/prctl.h>
#include <sys/resource.h>

#include <csignal>
#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <string_view>

#include <CLI/CLI.hpp>

#include "build_info.h"  // generated: TANDEM_GIT_COMMIT
#include "cli/bench_command.h"
#include "cli/cli11_errors.h"
#include "cli/engine_command.h"
#include "cli/gateway_command.h"
#include "cli/generate_command.h"
#include "cli/model_commands.h"
#include "cli/number_checks.h"
#include "cli/place_command.h"
#include "cli/serve_command.h"
#include "cli/simulate_command.h"
#include "cli/text_commands.h"
#include "util/error.h"

namespace {

// A server holds one descriptor per connection: lift the soft limit to the hard one (what the
// operator allows), as servers commonly do, so that the default soft limit of 1024 does not cap
// the gateway at a few hundred clients.
void raise_file_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }
}

// CLI11 takes a mistyped subcommand ("servee") for an extra argument and answers "A subcommand
// is required": the word the user typed is named instead, with the subcommands there are.
// Empty when the first argument is a flag or a subcommand.
std::string unknown_subcommand(const CLI::App& app, int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return std::string();
  const std::string word = argv[1];
  std::string known;
  for (const CLI::App* command : app.get_subcommands([](const CLI::App*) { return true; })) {
    if (command->check_name(word)) return std::string();
    if (!command->get_group().empty())  // the internal ones are not offered
      known += (known.empty() ? "" : ", ") + command->get_name();
  }
  return "unknown subcommand '" + word + "'; the subcommands are " + known +
         " (tandem --help says what each does)";
}

// CLI11's error as one line, as tandem's own errors are said: "tandem: error: --port: ...", not
// with "Run with --help for more information." below.
std::string cli11_failure(const CLI::App*, const CLI::Error& e) {
  return "tandem: error: " + tandem::cli::cli11_error_text(e) + " (--help lists the flags)\n";
}

}  // namespace

int main(int argc, char** argv) {
  // serve starts its engines, and an engine its expert-parallel ranks, through /proc/self/exe,
  // which the kernel names "exe": named here (before any thread, which inherits it), they show as
  // tandem in ps and pgrep, as serve does.
  ::prctl(PR_SET_NAME, "tandem");
  raise_file_limit();
  // Sockets are written with MSG_NOSIGNAL; stdout is not. Whoever reads a server's first lines
  // (a script, `| head`) may close the pipe, and the next status or access-log line must then be
  // a failed write, not a SIGPIPE that ends the gateway, or `serve` and with it every engine.
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"Tandem: disaggregated prefill/decode serving for mixture-of-experts LLMs",
               "tandem"};
  app.require_subcommand(1);
  app.failure_message(cli11_failure);  // before the subcommands, which take it from app
  // For bug reports: which source the binary was built from (build_info.cmake).
  app.set_version_flag("--version", std::string("tandem, built from commit ") + TANDEM_GIT_COMMIT,
                       "print the commit this binary was built from and exit");
  tandem::cli::add_text_commands(app);
  tandem::cli::add_model_commands(app);
  tandem::cli::add_generate_command(app);
  tandem::cli::add_engine_command(app);
  tandem::cli::add_gateway_command(app);
  tandem::cli::add_serve_command(app);
  tandem::cli::add_bench_command(app);
  tandem::cli::add_simulate_command(app);
  tandem::cli::add_place_command(app);
  tandem::cli::refuse_malformed_numbers(app);  // every command's, once all are added
  if (const std::string unknown = unknown_subcommand(app, argc, argv); !unknown.empty()) {
    std::fprintf(stderr, "tandem: error: %s\n", unknown.c_str());
    return 1;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const tandem::Error& e) {
    std::fprintf(stderr, "tandem: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    // Uncaught, these would end the process with "terminate called" and SIGABRT.
    std::fprintf(stderr, "tandem: out of memory (std::bad_alloc)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem: internal error (unexpected exception, please report it): %s\n",
                 e.what());
    return 1;
  }
  return 0;
}
