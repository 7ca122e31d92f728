# Writes OUTPUT (build_info.h) with the commit of SOURCE_DIR: run at every build, not once at
# configure time, which a later commit would leave stale; the file is rewritten only when the
# commit changed, so nothing recompiles otherwise. Not `git describe --dirty`: it refreshes the
# index, taking index.lock while someone may be committing in the same checkout.
execute_process(COMMAND git -C "${SOURCE_DIR}" rev-parse --short=12 HEAD
                OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT commit)
  set(commit "unknown (not built from a git checkout)")
endif()
file(CONFIGURE OUTPUT "${OUTPUT}" CONTENT "#pragma once\n#define TANDEM_GIT_COMMIT \"${commit}\"\n")
