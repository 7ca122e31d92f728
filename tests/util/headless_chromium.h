#pragma once
// Headless Chromium for the tests of our HTML pages (the bench report, the gateway dashboard):
// Debian's `chromium`, run with a DOM dump and its console messages collected. Tests skip their
// render checks only when the binary is absent (scripts/install-deps.sh installs it).
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace tandem::testing {

// The path of `chromium` (or `chromium-browser`) on PATH; empty when there is none.
inline std::string find_chromium() {
  for (const char* name : {"chromium", "chromium-browser"}) {
    const std::string cmd = std::string("command -v ") + name + " 2>/dev/null";
    FILE* p = ::popen(cmd.c_str(), "r");
    if (!p) continue;
    char buf[4096];
    std::string out;
    while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
    ::pclose(p);
    while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
    if (!out.empty()) return out;
  }
  return {};
}

struct ChromiumRender {
  int status = -1;
  std::string dom;
  std::vector<std::string> console;  // every console message Chromium logged
  std::string stderr_text;
};

// Opens `url` in headless Chromium and dumps the DOM after load (and after `flags` such as
// --virtual-time-budget=MS, which lets the page's timers run first), collecting the console
// messages, which Chromium logs to stderr as "...:CONSOLE:<line>] "message", source: ...". `work`
// holds the profile and the outputs.
inline ChromiumRender render_in_chromium(const std::string& chromium, const std::string& url,
                                         const std::filesystem::path& work,
                                         const std::string& flags = {}) {
  const auto dom = work / "dom.html", err = work / "stderr.txt";
  const std::string cmd = "timeout 120 '" + chromium +
                          "' --headless=new --disable-gpu --no-sandbox --no-first-run "
                          "--user-data-dir='" +
                          (work / "profile").string() + "' --enable-logging=stderr --v=0 " + flags +
                          " --dump-dom '" + url + "' >'" + dom.string() + "' 2>'" + err.string() +
                          "'";
  ChromiumRender r;
  const int rc = std::system(cmd.c_str());
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  const auto read = [](const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
  };
  r.dom = read(dom);
  r.stderr_text = read(err);
  std::istringstream lines(r.stderr_text);
  for (std::string line; std::getline(lines, line);)
    if (line.find(":CONSOLE") != std::string::npos || line.find("Uncaught") != std::string::npos)
      r.console.push_back(line);
  return r;
}

}  // namespace tandem::testing
