// Host harness entry points for kernels/reduce.cu (see cuda_host.h).  Built by
// tests/test_cu_host.py; called through ctypes.
#include "cuda_host.h"
#include "../../kernels/reduce.cu"

#include <cstring>

typedef void (*host_reduce_fn)(unsigned, unsigned, bool, void*, const void*, const void*, unsigned long long,
                               double);

struct HostReduceEntry {
    const char* name;
    host_reduce_fn run;
};

// One entry per kernel of reduce.cu, from the file's own X-macro list.  The
// argument travels as a double (exact for a float scale and for any divisor p
// the tests use) and is cast to the kernel's argument type.
#define DDL_HOST_ENTRY(OPNAME, OPF, SUF, T, ARG)                                                       \
    {"ddl_reduce_" #OPNAME "_" #SUF,                                                                   \
     [](unsigned gx, unsigned bx, bool rev, void* d, const void* a, const void* b, unsigned long long n, \
        double arg) {                                                                                  \
         ddl_host_launch(ddl_reduce_##OPNAME##_##SUF, dim3(gx), dim3(bx), rev, (T*)d, (const T*)a,    \
                         (const T*)b, n, (ARG)arg);                                                    \
     }},

static const HostReduceEntry kEntries[] = {DDL_REDUCE_KERNELS(DDL_HOST_ENTRY)};

extern "C" int host_reduce_count() { return (int)(sizeof(kEntries) / sizeof(kEntries[0])); }

extern "C" const char* host_reduce_name(int i) { return kEntries[i].name; }

extern "C" int host_reduce(const char* name, unsigned grid, unsigned block, int reverse, void* dst, const void* a,
                           const void* b, unsigned long long n, double arg) {
    for (const HostReduceEntry& e : kEntries)
        if (std::strcmp(e.name, name) == 0) {
            e.run(grid, block, reverse != 0, dst, a, b, n, arg);
            return 0;
        }
    return -1;
}
