// Every test binary names its checkout to the tandem binaries it runs (TANDEM_CHECKOUT, read by
// cli::default_tokenizer): a build folder outside the clone has no checkout above its tandem, so a
// sim: engine or bench given no --tokenizer would find no default tokenizer. Set before main, so
// a test run from ctest or by hand, and each child it starts, inherit it; a value already set
// wins.
#include <cstdlib>

namespace {

[[maybe_unused]] const bool checkout_named = ::setenv("TANDEM_CHECKOUT", TANDEM_SOURCE_DIR, 0) == 0;

}  // namespace
