#include "dp2_exchange.h"

int dspark_dp2_abi_version(void) { return DSPARK_DP2_ABI_VERSION; }
