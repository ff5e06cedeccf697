// cuda_host.h -- run CUDA grid-stride kernels on the CPU, unmodified.
//
// Purpose
//   No machine of this project has a GPU.  To execute the very .cu files
//   that CuPy loads, the test harness compiles them with g++ after this
//   header, which supplies what nvcc would: the qualifiers (__global__,
//   __device__, __forceinline__), the built-in index variables (threadIdx,
//   blockIdx, blockDim, gridDim), __ldg/__ldcg/__ldca/__stwb (the loads
//   checked against the byte ranges a test allows) and __funnelshift_r.
//   uint4/dim3 and the half types come from the CUDA toolkit's own
//   vector_types.h, cuda_fp16.h and cuda_bf16.h, which compile for the host
//   (their host paths do the same round-to-nearest-even conversions as the
//   device instructions).
//
//   ddl_host_launch(kernel, grid, block, args...) calls the kernel once for
//   every (block, thread) of the grid, setting the index variables before
//   each call.
//
// Preconditions (what makes sequential execution faithful)
//   The kernel must not communicate between threads: no shared memory, no
//   __syncthreads, no atomics, no warp intrinsics.  ddlkernels' kernels are
//   elementwise grid-stride loops in which every element is owned by one
//   thread, so the result does not depend on the order threads run in; the
//   harness can also run the grid backwards (reverse = true) so a test can
//   show that the order does not matter.
//
// Use
//   tests/cuda_host/host_reduce.cpp and host_pack.cpp include this header and
//   then ../../kernels/<file>.cu; tests/test_cu_host.py builds them with g++
//   into shared libraries and compares them with numpy through ctypes.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <vector_types.h>

// The toolkit headers map these to host annotations for non-CUDA compilers;
// here a kernel is an ordinary function.
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

static uint3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

// A GPU faults on an access not aligned to its size (a 128-bit one needs 16 bytes); the host would not:
// the intrinsics below stop the process instead, so a kernel that picks its vector path wrongly fails here.
template <class T>
static inline void ddl_host_aligned(const T* p) {
    if ((unsigned long long)p % sizeof(T) != 0) {
        std::fprintf(stderr, "cuda_host: misaligned %zu-byte access at %p\n", sizeof(T), (const void*)p);
        std::abort();
    }
}

// Byte ranges a test allows the loads below to read (none set: any).  A load that reaches outside every one is
// counted, not made: on a GPU it would read a neighbour's bytes, or fault past the end of an allocation.
static const unsigned char* ddl_host_read_lo[8];
static const unsigned char* ddl_host_read_hi[8];
static int ddl_host_reads = 0;
static unsigned long long ddl_host_stray = 0;

template <class T>
static inline bool ddl_host_readable(const T* p) {
    const unsigned char* b = reinterpret_cast<const unsigned char*>(p);
    for (int i = 0; i < ddl_host_reads; ++i)
        if (b >= ddl_host_read_lo[i] && b + sizeof(T) <= ddl_host_read_hi[i]) return true;
    if (ddl_host_reads > 0) ++ddl_host_stray;
    return ddl_host_reads == 0;
}

// Read-only-cache load: on the host, a load.
template <class T>
static inline T __ldg(const T* p) {
    ddl_host_aligned(p);
    return ddl_host_readable(p) ? *p : T();
}

// Cache-global load (coherent at L2): on the host, a load.
template <class T>
static inline T __ldcg(const T* p) {
    ddl_host_aligned(p);
    return ddl_host_readable(p) ? *p : T();
}

// Cache-all load (the default policy, as an ordinary load): on the host, a load.
template <class T>
static inline T __ldca(const T* p) {
    ddl_host_aligned(p);
    return ddl_host_readable(p) ? *p : T();
}

// Cache-hinted store (write-back, the default policy): on the host, a store.
template <class T>
static inline void __stwb(T* p, T v) {
    ddl_host_aligned(p);
    *p = v;
}

// The low 32 bits of hi:lo shifted right by shift & 31 (the SHF instruction; both machines are little endian).
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> (shift & 31));
}

template <class... P, class... A>
static void ddl_host_launch(void (*kernel)(P...), dim3 grid, dim3 block, bool reverse, A... args) {
    gridDim = grid;
    blockDim = block;
    const unsigned long long nb = (unsigned long long)grid.x * grid.y * grid.z;
    const unsigned long long nt = (unsigned long long)block.x * block.y * block.z;
    for (unsigned long long bi = 0; bi < nb; ++bi) {
        unsigned long long b = reverse ? nb - 1 - bi : bi;
        blockIdx.x = (unsigned)(b % grid.x);
        blockIdx.y = (unsigned)((b / grid.x) % grid.y);
        blockIdx.z = (unsigned)(b / ((unsigned long long)grid.x * grid.y));
        for (unsigned long long ti = 0; ti < nt; ++ti) {
            unsigned long long t = reverse ? nt - 1 - ti : ti;
            threadIdx.x = (unsigned)(t % block.x);
            threadIdx.y = (unsigned)((t / block.x) % block.y);
            threadIdx.z = (unsigned)(t / ((unsigned long long)block.x * block.y));
            kernel(args...);
        }
    }
}
