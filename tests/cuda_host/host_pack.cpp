// Host harness entry points for kernels/pack.cu (see cuda_host.h).  Built by
// tests/test_cu_host.py; called through ctypes.
#include "cuda_host.h"
#include "../../kernels/pack.cu"

extern "C" void host_pack(unsigned gx, unsigned gy, unsigned block, int reverse, const unsigned long long* table,
                          int count, unsigned char* buf) {
    ddl_host_launch(ddl_pack, dim3(gx, gy), dim3(block), reverse != 0, table, count, buf);
}

extern "C" void host_unpack(unsigned gx, unsigned gy, unsigned block, int reverse, const unsigned long long* table,
                            int count, const unsigned char* buf) {
    ddl_host_launch(ddl_unpack, dim3(gx, gy), dim3(block), reverse != 0, table, count, buf);
}
