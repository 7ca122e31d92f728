#include "engine/executor/sim_latency.h"
