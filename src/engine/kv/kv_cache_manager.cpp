#include "engine/kv/kv_cache_manager.h"
