/* dspark-harden native DP2 exchange: public C API (cdef'd by cffi and #included by the C source). */
#ifndef DSPARK_DP2_EXCHANGE_H
#define DSPARK_DP2_EXCHANGE_H

#define DSPARK_DP2_ABI_VERSION 1

int dspark_dp2_abi_version(void);

#endif
