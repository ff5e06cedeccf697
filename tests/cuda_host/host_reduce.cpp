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

// One entry per kernel of reduce.cu (ddl_reduce and ddl_realign), from the file's own X-macro list.  The
// argument travels as a double (exact for a float scale and for any divisor p
// the tests use) and is cast to the kernel's argument type.
#define DDL_HOST_KERNEL(KIND, OPNAME, SUF, T, ARG)                                                      \
    {"ddl_" #KIND "_" #OPNAME "_" #SUF,                                                                \
     [](unsigned gx, unsigned bx, bool rev, void* d, const void* a, const void* b, unsigned long long n, \
        double arg) {                                                                                  \
         ddl_host_launch(ddl_##KIND##_##OPNAME##_##SUF, dim3(gx), dim3(bx), rev, (T*)d, (const T*)a,  \
                         (const T*)b, n, (ARG)arg);                                                    \
     }},
#define DDL_HOST_REDUCE(OPNAME, OPF, SUF, T, ARG) DDL_HOST_KERNEL(reduce, OPNAME, SUF, T, ARG)
#define DDL_HOST_REALIGN(OPNAME, OPF, SUF, T, ARG) DDL_HOST_KERNEL(realign, OPNAME, SUF, T, ARG)

static const HostReduceEntry kEntries[] = {DDL_REDUCE_KERNELS(DDL_HOST_REDUCE) DDL_REDUCE_KERNELS(DDL_HOST_REALIGN)};

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

// The fold kernels (DDL_FOLD_KERNELS, as ddl_fold and ddl_fold_realign): srcs holds 8 operand addresses, the
// first k used; extra holds 7 destination addresses, the first m used.
typedef void (*host_fold_fn)(unsigned, unsigned, bool, void*, const void* const*, int, void* const*, int,
                             unsigned long long, double);

struct HostFoldEntry {
    const char* name;
    host_fold_fn run;
};

#define DDL_HOST_FOLDING(KIND, OPNAME, OPF, SUF, T, ARG)                                                 \
    {"ddl_" #KIND "_" #OPNAME "_" #SUF,                                                                  \
     [](unsigned gx, unsigned bx, bool rev, void* d, const void* const* s, int k, void* const* e, int m,  \
        unsigned long long n, double arg) {                                                              \
         ddl_host_launch(ddl_##KIND##_##OPNAME##_##SUF, dim3(gx), dim3(bx), rev, (T*)d, n, (ARG)arg, k, m, \
                         (const T*)s[0], (const T*)s[1], (const T*)s[2], (const T*)s[3], (const T*)s[4],  \
                         (const T*)s[5], (const T*)s[6], (const T*)s[7], (T*)e[0], (T*)e[1], (T*)e[2],    \
                         (T*)e[3], (T*)e[4], (T*)e[5], (T*)e[6]);                                         \
     }},
#define DDL_HOST_FOLD(OPNAME, OPF, SUF, T, ARG) DDL_HOST_FOLDING(fold, OPNAME, OPF, SUF, T, ARG)
#define DDL_HOST_FOLD_REALIGN(OPNAME, OPF, SUF, T, ARG) DDL_HOST_FOLDING(fold_realign, OPNAME, OPF, SUF, T, ARG)

static const HostFoldEntry kFolds[] = {DDL_FOLD_KERNELS(DDL_HOST_FOLD) DDL_FOLD_KERNELS(DDL_HOST_FOLD_REALIGN)};

extern "C" int host_fold_count() { return (int)(sizeof(kFolds) / sizeof(kFolds[0])); }

extern "C" const char* host_fold_name(int i) { return kFolds[i].name; }

extern "C" int host_fold(const char* name, unsigned grid, unsigned block, int reverse, void* dst,
                         const void* const* srcs, int k, void* const* extra, int m, unsigned long long n,
                         double arg) {
    for (const HostFoldEntry& e : kFolds)
        if (std::strcmp(e.name, name) == 0) {
            e.run(grid, block, reverse != 0, dst, srcs, k, extra, m, n, arg);
            return 0;
        }
    return -1;
}

// The byte ranges the kernels' loads may read from now on (count 0: any), and how many loads reached outside
// them since the last call (cuda_host.h).
extern "C" void host_set_readable(const unsigned long long* lo, const unsigned long long* hi, int count) {
    ddl_host_reads = count < 8 ? count : 8;
    for (int i = 0; i < ddl_host_reads; ++i) {
        ddl_host_read_lo[i] = reinterpret_cast<const unsigned char*>(lo[i]);
        ddl_host_read_hi[i] = reinterpret_cast<const unsigned char*>(hi[i]);
    }
    ddl_host_stray = 0;
}

extern "C" unsigned long long host_stray_reads() { return ddl_host_stray; }
