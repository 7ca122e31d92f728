#include "net/http_server.h"
