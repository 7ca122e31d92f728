#include "engine/kv/kv_events.h"
