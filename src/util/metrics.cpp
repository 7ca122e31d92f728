#include "util/metrics.h"
