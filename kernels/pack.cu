// pack.cu -- gather many tensors into one fusion buffer, and scatter it back,
// in a single launch each.
//
// Purpose
//   Reducing many small gradients one by one pays a ring's latency per tensor;
//   ddlkernels copies them into one contiguous fusion buffer, reduces that,
//   and copies the result back.  These two kernels do the copies for a whole
//   list of tensors at once, so the cost is one launch instead of one per
//   tensor:
//
//     ddl_pack  (const unsigned long long* table, int count, unsigned char* buf)
//         for each entry t: buf[off_t : off_t + nbytes_t] = *ptr_t
//     ddl_unpack(const unsigned long long* table, int count, const unsigned char* buf)
//         for each entry t: *ptr_t = buf[off_t : off_t + nbytes_t]
//
//   table holds count entries of three 64-bit words, in device memory:
//   { tensor address, length in bytes, byte offset in buf }.
//
// Preconditions
//   * No destination range overlaps any source range or another destination
//     (sources are read through the read-only cache).
//   * Any alignment and any lengths: a copy whose source and destination
//     share the same offset modulo 16 bytes moves its bulk as 128-bit words
//     (scalar bytes before the first boundary and after the last); same
//     offset modulo 4, as 32-bit words; otherwise byte by byte.  Packing at
//     16-byte aligned offsets keeps every tensor on the fast path.
//   * Launch: blockIdx.y walks the table (grid-stride over entries, so any
//     gridDim.y works), blockIdx.x/threadIdx.x walk the bytes of one entry
//     (grid-stride).  No shared memory, no __syncthreads.
//
// Use
//   Loaded by the CuPy backend (ddlkernels/backends/_cupy.py, Backend.pack /
//   Backend.unpack) for fused allreduce of a list of tensors.  It cuts every
//   tensor into entries of at most 64 KiB (_device.pack_pieces) and launches
//   one block per entry, gridDim = (1, entries): blocks get equal work however
//   the sizes differ, where one row per tensor left a long tensor to the few
//   blocks of gridDim.x.  Compiles on
//   its own with  nvcc -std=c++17 -arch=sm_90 -cubin kernels/pack.cu  and
//   with g++ through tests/cuda_host/cuda_host.h (host test harness).

namespace ddl {

typedef unsigned long long u64;

// Copy n bytes as words of type W: a byte head up to the first sizeof(W)
// boundary of dst (src has the same offset, checked by the caller), the
// words, then a byte tail.  Loads go through the read-only cache (__ldg) and
// stores through __stwb (an ordinary write-back st.global): both name the
// global state space, which a pointer read from the table would otherwise
// lose (it is generic), so the 128-bit accesses stay global accesses.
template <class W>
__device__ __forceinline__ void copy_words(unsigned char* dst, const unsigned char* __restrict__ src, u64 n,
                                           u64 tid, u64 stride) {
    u64 head = (sizeof(W) - ((u64)dst % sizeof(W))) % sizeof(W);
    if (head > n) head = n;
    for (u64 i = tid; i < head; i += stride) __stwb(dst + i, __ldg(src + i));
    const u64 nw = (n - head) / sizeof(W);
    const W* sw = reinterpret_cast<const W*>(src + head);
    W* dw = reinterpret_cast<W*>(dst + head);
    for (u64 i = tid; i < nw; i += stride) __stwb(dw + i, __ldg(sw + i));
    for (u64 i = head + nw * sizeof(W) + tid; i < n; i += stride) __stwb(dst + i, __ldg(src + i));
}

__device__ __forceinline__ void copy_bytes(unsigned char* dst, const unsigned char* __restrict__ src, u64 n) {
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 d = (u64)dst, s = (u64)src;
    if ((d & 15) == (s & 15))
        copy_words<uint4>(dst, src, n, tid, stride);
    else if ((d & 3) == (s & 3))
        copy_words<unsigned int>(dst, src, n, tid, stride);
    else
        copy_words<unsigned char>(dst, src, n, tid, stride);
}

}  // namespace ddl

extern "C" __global__ void ddl_pack(const unsigned long long* __restrict__ table, int count, unsigned char* buf) {
    for (int t = blockIdx.y; t < count; t += gridDim.y) {
        const unsigned long long* e = table + 3 * (unsigned long long)t;
        ddl::copy_bytes(buf + e[2], reinterpret_cast<const unsigned char*>(e[0]), e[1]);
    }
}

extern "C" __global__ void ddl_unpack(const unsigned long long* __restrict__ table, int count,
                                      const unsigned char* buf) {
    for (int t = blockIdx.y; t < count; t += gridDim.y) {
        const unsigned long long* e = table + 3 * (unsigned long long)t;
        ddl::copy_bytes(reinterpret_cast<unsigned char*>(e[0]), buf + e[2], e[1]);
    }
}
