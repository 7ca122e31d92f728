#include "util/block_hash.h"
