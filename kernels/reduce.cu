// reduce.cu -- elementwise chunk reduction for the ddlkernels ring allreduce.
//
// Purpose
//   One kernel per (op, dtype), all with the same signature
//
//       ddl_reduce_<op>_<t>(T* dst, const T* a, const T* __restrict__ b,
//                           unsigned long long n, ARG arg)
//
//   computing dst[i] = op(a[i], b[i]) for i in [0, n).  The 2-operand form
//   dst = op(dst, src) is the call with a == dst.  ddl_realign_<op>_<t>, of
//   the same signature, computes the same where a or b lies at another
//   offset modulo 16 than dst (a view one element in, say); each kernel is
//   correct for any of them, but fast only for its own case, and keeping
//   the two paths apart keeps the common one's registers low.
//     op : sum, prod, max, min, avg      (avg = sum with the fused 1/p scale)
//     t  : f16 (__half), bf16 (__nv_bfloat16), f32, f64, i32, i64
//     ARG: the accumulation type (float for f16/bf16/f32, double for f64,
//          int / long long for i32 / i64).  Only avg reads it: for floats it
//          is the scale 1/p (computed by the host in the accumulation type),
//          for integers the divisor p.  The other ops ignore it, so every
//          kernel can be launched by the same code.
//
// Semantics (identical bits to ddlkernels' numpy backend, see _dtypes.py)
//   * f16 and bf16 are widened to float, combined once in float and rounded
//     once (round-to-nearest-even) back to storage; float32 holds >= 2p+2 bits
//     of either, so this equals the correctly rounded half-precision result.
//     Their sum over 128-bit words computes that result directly, two lanes
//     an instruction (add.rn.f16x2 / .bf16x2: WordOp), the same bits.
//   * avg: floats (a + b) * scale, the product in the accumulation type,
//     one rounding to storage for f16/bf16; integers floor((a + b) / p).
//   * integer sum/prod/avg wrap modulo 2^bits like numpy (computed unsigned,
//     because signed overflow is undefined behaviour in C++).
//   * max/min propagate NaN like numpy's maximum/minimum: if a is NaN the
//     result is a, else if b is NaN it is b, and both bit patterns survive.
//     On a tie (+0 against -0) numpy returns b for float32/float64/bfloat16
//     and a for float16 (its scalar half loop uses >=); the kernels do the
//     same so that the sign of a zero matches too.
//
// Preconditions
//   * b does not overlap dst (it is read through the read-only cache).  a is
//     either exactly dst or does not overlap it.
//   * All three pointers are aligned to sizeof(T).  The bulk is moved with
//     128-bit loads/stores (a scalar head reaches dst's first 16-byte
//     boundary, a scalar tail ends it).  In ddl_reduce all three pointers
//     share one offset modulo 16 (else it goes one element at a time); in
//     ddl_realign an operand at another offset than dst is read as aligned
//     128-bit words too, each word it needs cut from the two it straddles
//     (realign_grid).
//   * 1-D grid of any size: the loops are grid-stride, so correctness does
//     not depend on the launch shape; no shared memory, no __syncthreads.
//
// The fold kernels (the CUDA IPC allreduce's reduce-scatter, which folds one
// shard of every rank's input in rank order):
//
//       ddl_fold_<op>_<t>(T* dst, unsigned long long n, ARG arg, int k, int m,
//                         const T* s0, ..., const T* s7, T* e0, ..., T* e6)
//
//   dst[i] = ((s0[i] op s1[i]) op s2[i]) ... op s(k-1)[i], 2 <= k <= 8: the
//   bits of k - 1 launches of ddl_reduce_<op>_<t> in a row (each step stored
//   to T; avg sums and scales in the last step only), in one pass that reads
//   every operand once and writes dst once, where the chain of launches reads
//   and writes the partial result k - 2 times more.  The same value also goes
//   to e0[i] .. e(m-1)[i], 0 <= m <= 7 (the IPC allreduce writes its shard
//   into every rank's output as it folds it, instead of copying it after).
//   Every operand is either exactly dst or exactly one e, or overlaps none of
//   them (a longer fold continues with dst as s0; the in-place IPC allreduce
//   folds into the very buffers it reads): each element is read, through
//   coherent loads, by the thread that writes it, before it writes it.  The
//   destinations do not overlap each other; operands past k and destinations
//   past m are ignored (pass any pointer).  128-bit accesses when every pointer
//   used has dst's offset modulo 16, else one element at a time.
//
//       ddl_fold_realign_<op>_<t>, of the same signature
//
//   computes the same where operands lie at other offsets modulo 16 than dst
//   (a view one element in, folded into fresh outputs): every destination at
//   dst's offset, each operand word cut from aligned loads as in ddl_realign.
//   A kernel of its own, as ddl_realign is: the aligned fold keeps its
//   registers.  Both take at most 256 threads a block: __launch_bounds__(256,
//   4) keeps the 16 operand and destination pointers within 64 registers a
//   thread (4 blocks an SM), reloading them from the parameters where needed.
//
// Use
//   Loaded by the CuPy backend (ddlkernels/backends/_cupy.py): one reduction
//   per received chunk of a ring step, the fused avg scale on the owner's last
//   step, ddl_reduce or ddl_realign by the pointers' offsets (_device.py);
//   the fold kernels by the CUDA IPC allreduce (reduce_many), ddl_fold or
//   ddl_fold_realign likewise.  DDL_KINDS, a bit mask (reduce 1, realign 2,
//   fold 4, fold_realign 8; default all), picks the kinds a compile defines:
//   the backend compiles each kind on its first need, a part of the whole
//   file's NVRTC time (ddlkernels.kernels.sources.unit_of).  The same file
//   compiles on its own with
//       nvcc -std=c++17 -arch=sm_90 -cubin kernels/reduce.cu
//   and, through tests/cuda_host/cuda_host.h, with g++ for the host test
//   harness, which runs every (block, thread) of the grid on the CPU.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace ddl {

typedef unsigned long long u64;

// ---- storage <-> accumulation ------------------------------------------------
// tie_a: which operand max/min return when the operands compare equal (see
// the header: numpy's choice per dtype).
template <class T> struct Traits;

template <> struct Traits<float> {
    typedef float acc; typedef unsigned int bits;
    static const bool tie_a = false;
    static __device__ __forceinline__ float load(float x) { return x; }
    static __device__ __forceinline__ float store(float x) { return x; }
};
template <> struct Traits<double> {
    typedef double acc; typedef u64 bits;
    static const bool tie_a = false;
    static __device__ __forceinline__ double load(double x) { return x; }
    static __device__ __forceinline__ double store(double x) { return x; }
};
template <> struct Traits<__half> {
    typedef float acc; typedef unsigned short bits;
    static const bool tie_a = true;
    static __device__ __forceinline__ float load(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half store(float x) { return __float2half_rn(x); }
};
template <> struct Traits<__nv_bfloat16> {
    typedef float acc; typedef unsigned short bits;
    static const bool tie_a = false;
    static __device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Traits<int> {
    typedef int acc; typedef unsigned int bits;
    static const bool tie_a = false;
};
template <> struct Traits<long long> {
    typedef long long acc; typedef u64 bits;
    static const bool tie_a = false;
};

template <class T> struct IsInt { static const bool value = false; };
template <> struct IsInt<int> { static const bool value = true; };
template <> struct IsInt<long long> { static const bool value = true; };

// ---- the operators ------------------------------------------------------------
// Floating types go through Traits::load/store; integer types wrap through
// their unsigned twin.  Each functor maps (a, b, arg) -> storage value.

template <class T, bool I = IsInt<T>::value> struct OpSum;
template <class T> struct OpSum<T, false> {
    static __device__ __forceinline__ T apply(T a, T b, typename Traits<T>::acc) {
        return Traits<T>::store(Traits<T>::load(a) + Traits<T>::load(b));
    }
};
template <class T> struct OpSum<T, true> {
    typedef typename Traits<T>::bits U;
    static __device__ __forceinline__ T apply(T a, T b, T) { return (T)((U)a + (U)b); }
};

template <class T, bool I = IsInt<T>::value> struct OpProd;
template <class T> struct OpProd<T, false> {
    static __device__ __forceinline__ T apply(T a, T b, typename Traits<T>::acc) {
        return Traits<T>::store(Traits<T>::load(a) * Traits<T>::load(b));
    }
};
template <class T> struct OpProd<T, true> {
    typedef typename Traits<T>::bits U;
    static __device__ __forceinline__ T apply(T a, T b, T) { return (T)((U)a * (U)b); }
};

template <class T, bool I = IsInt<T>::value> struct OpAvg;
template <class T> struct OpAvg<T, false> {
    // (a + b) * scale: the sum and the product each round in the accumulation
    // type, exactly as the numpy backend's add-then-multiply; the sum is not
    // an operand of a multiply, so no FMA contraction can change it.
    static __device__ __forceinline__ T apply(T a, T b, typename Traits<T>::acc scale) {
        typename Traits<T>::acc s = Traits<T>::load(a) + Traits<T>::load(b);
        return Traits<T>::store(s * scale);
    }
};
template <class T> struct OpAvg<T, true> {
    typedef typename Traits<T>::bits U;
    // floor((a + b) / p) for p > 0, as Python's //: C++ division truncates,
    // so a negative inexact quotient is stepped down by one.
    static __device__ __forceinline__ T apply(T a, T b, T p) {
        T s = (T)((U)a + (U)b);
        T q = s / p;
        T r = s - q * p;
        return (r != 0 && s < 0) ? (T)(q - 1) : q;
    }
};

template <class T, bool I = IsInt<T>::value> struct OpMax;
template <class T> struct OpMax<T, false> {
    static __device__ __forceinline__ T apply(T a, T b, typename Traits<T>::acc) {
        typename Traits<T>::acc x = Traits<T>::load(a), y = Traits<T>::load(b);
        // x != x is the NaN test (no header needed; we never build with fast-math).
        bool take_a = x > y || x != x || (Traits<T>::tie_a && x == y);
        return take_a ? a : b;
    }
};
template <class T> struct OpMax<T, true> {
    static __device__ __forceinline__ T apply(T a, T b, T) { return a > b ? a : b; }
};

template <class T, bool I = IsInt<T>::value> struct OpMin;
template <class T> struct OpMin<T, false> {
    static __device__ __forceinline__ T apply(T a, T b, typename Traits<T>::acc) {
        typename Traits<T>::acc x = Traits<T>::load(a), y = Traits<T>::load(b);
        bool take_a = x < y || x != x || (Traits<T>::tie_a && x == y);
        return take_a ? a : b;
    }
};
template <class T> struct OpMin<T, true> {
    static __device__ __forceinline__ T apply(T a, T b, T) { return a < b ? a : b; }
};

// ---- the grid-stride driver ----------------------------------------------------
template <class T> union Vec16 {
    uint4 u;
    T v[16 / sizeof(T)];
};

// Op over one 128-bit word of each operand: element by element through Op::apply.
template <class T, class Op> struct WordOp {
    static __device__ __forceinline__ uint4 apply(uint4 a, uint4 b, typename Traits<T>::acc arg) {
        Vec16<T> x, y, r;
        x.u = a;
        y.u = b;
#pragma unroll
        for (int k = 0; k < 16 / sizeof(T); ++k) r.v[k] = Op::apply(x.v[k], y.v[k], arg);
        return r.u;
    }
};

// The sum of f16 or bf16 two lanes an instruction (add.rn.f16x2 / .bf16x2; an fma by 1 before sm_90 for
// bf16), where widening costs 2 conversions an element and a pack per pair.  The same bits as OpSum's one
// rounding of the float sum (the header: both are the correctly rounded sum); a NaN stays a NaN.  _rn: no
// contraction with a neighbouring multiply.  Compiled with DDL_WIDEN_HALF_SUMS defined, the sums widen as the
// other ops do: bench/studies/half_sums.py times and checks both in one run.
#ifndef DDL_WIDEN_HALF_SUMS
template <class H2> __device__ __forceinline__ uint4 add_pairs(uint4 a, uint4 b) {
    union { uint4 u; H2 h[4]; } x, y, r;
    x.u = a;
    y.u = b;
#pragma unroll
    for (int k = 0; k < 4; ++k) r.h[k] = __hadd2_rn(x.h[k], y.h[k]);
    return r.u;
}
template <> struct WordOp<__half, OpSum<__half> > {
    static __device__ __forceinline__ uint4 apply(uint4 a, uint4 b, float) { return add_pairs<__half2>(a, b); }
};
template <> struct WordOp<__nv_bfloat16, OpSum<__nv_bfloat16> > {
    static __device__ __forceinline__ uint4 apply(uint4 a, uint4 b, float) {
        return add_pairs<__nv_bfloat162>(a, b);
    }
};
#endif

// ---- operands that do not share dst's offset modulo 16 -------------------------------
// The 16 bytes that start sh bytes into the aligned word lo and run on into the next
// one, hi (0 < sh < 16): each 32-bit lane is a funnel shift of two neighbours (little
// endian, as both the GPU and the host harness are).  sh is the same on every thread
// (it is a property of the pointers), so the switch does not diverge.
__device__ __forceinline__ uint4 realign(uint4 lo, uint4 hi, unsigned sh) {
    unsigned w0, w1, w2, w3, w4;
    switch (sh >> 2) {
        case 0: w0 = lo.x; w1 = lo.y; w2 = lo.z; w3 = lo.w; w4 = hi.x; break;
        case 1: w0 = lo.y; w1 = lo.z; w2 = lo.w; w3 = hi.x; w4 = hi.y; break;
        case 2: w0 = lo.z; w1 = lo.w; w2 = hi.x; w3 = hi.y; w4 = hi.z; break;
        default: w0 = lo.w; w1 = hi.x; w2 = hi.y; w3 = hi.z; w4 = hi.w; break;
    }
    const unsigned r = (sh & 3) * 8;
    uint4 v;
    v.x = __funnelshift_r(w0, w1, r);
    v.y = __funnelshift_r(w1, w2, r);
    v.z = __funnelshift_r(w2, w3, r);
    v.w = __funnelshift_r(w3, w4, r);
    return v;
}

// dst = op(a, b) where a or b lies at another offset modulo 16 than dst (a torch view one element
// in, say): 128-bit stores from dst's first boundary on, each operand word cut from the two aligned
// words it straddles (realign).  Every load is an aligned 128-bit one inside its operand: the body
// starts where each operand's first straddled word begins at or after the operand, and ends where
// each one's last ends inside it; the elements before and after go one at a time.  A second load of
// the neighbour's word mostly hits the cache its neighbour thread's load filled, so DRAM moves each
// byte once, as on the aligned path.
template <class T, class Op>
__device__ __forceinline__ void realign_grid(T* dst, const T* a, const T* __restrict__ b, u64 n,
                                             typename Traits<T>::acc arg) {
    const int V = 16 / sizeof(T);
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 body = ((16 - ((u64)dst & 15)) & 15) / sizeof(T);  // dst's first 16-byte boundary
    const unsigned sa = (unsigned)(((u64)a + body * sizeof(T)) & 15);
    const unsigned sb = (unsigned)(((u64)b + body * sizeof(T)) & 15);
    const u64 back = (sa > sb ? sa : sb) / sizeof(T);  // elements an operand's first word reaches back
    if (body < back) body += V;  // a word further on: the same offsets modulo 16
    u64 words = 0;
    if (body + V <= n) {
        words = (n - body) / V;
        const u64 wa = (n - body - V + sa / sizeof(T)) / V, wb = (n - body - V + sb / sizeof(T)) / V;
        if (sa && wa < words) words = wa;  // word i reads the operand's aligned words i and i + 1
        if (sb && wb < words) words = wb;
    }
    const u64 head = body < n ? body : n;
    for (u64 i = tid; i < head; i += stride) dst[i] = Op::apply(a[i], b[i], arg);
    const uint4* aw = reinterpret_cast<const uint4*>((u64)a + body * sizeof(T) - sa);
    const uint4* bw = reinterpret_cast<const uint4*>((u64)b + body * sizeof(T) - sb);
    uint4* dw = reinterpret_cast<uint4*>(dst + body);
    for (u64 i = tid; i < words; i += stride) {
        // a may be dst (then sa == 0): cache-all loads, as ordinary ones (naming the global state space).
        const uint4 x = sa ? realign(__ldca(aw + i), __ldca(aw + i + 1), sa) : __ldca(aw + i);
        const uint4 y = sb ? realign(__ldg(bw + i), __ldg(bw + i + 1), sb) : __ldg(bw + i);
        dw[i] = WordOp<T, Op>::apply(x, y, arg);
    }
    for (u64 i = head + words * V + tid; i < n; i += stride) dst[i] = Op::apply(a[i], b[i], arg);
}

template <class T, class Op>
__device__ __forceinline__ void reduce_grid(T* dst, const T* a, const T* __restrict__ b, u64 n,
                                            typename Traits<T>::acc arg) {
    const int V = 16 / sizeof(T);
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 off = (u64)dst & 15;
    if (((u64)a & 15) != off || ((u64)b & 15) != off) {  // correct, not fast: the host launches ddl_realign here
        for (u64 i = tid; i < n; i += stride) dst[i] = Op::apply(a[i], b[i], arg);
        return;
    }
    // Elements before the first 16-byte boundary.
    u64 head = ((16 - off) & 15) / sizeof(T);
    if (head > n) head = n;
    for (u64 i = tid; i < head; i += stride) dst[i] = Op::apply(a[i], b[i], arg);
    const u64 nvec = (n - head) / V;
    const uint4* av = reinterpret_cast<const uint4*>(a + head);
    const uint4* bv = reinterpret_cast<const uint4*>(b + head);
    uint4* dv = reinterpret_cast<uint4*>(dst + head);
    // One word at a time per thread: the CuPy backend launches a thread per word (rounds of several words in
    // flight, unused at that launch, cost registers and so blocks an SM).
    for (u64 i = tid; i < nvec; i += stride)  // a may be dst: an ordinary load; b is read-only: ld.global.nc
        dv[i] = WordOp<T, Op>::apply(av[i], __ldg(bv + i), arg);
    for (u64 i = head + nvec * V + tid; i < n; i += stride) dst[i] = Op::apply(a[i], b[i], arg);
}

// ---- the fold of k operands --------------------------------------------------------
// Step: the operator of every step but the last; Last: of the last (OpAvg for avg).
template <class T> struct FoldSum { typedef OpSum<T> Step; typedef OpSum<T> Last; };
template <class T> struct FoldProd { typedef OpProd<T> Step; typedef OpProd<T> Last; };
template <class T> struct FoldMax { typedef OpMax<T> Step; typedef OpMax<T> Last; };
template <class T> struct FoldMin { typedef OpMin<T> Step; typedef OpMin<T> Last; };
template <class T> struct FoldAvg { typedef OpSum<T> Step; typedef OpAvg<T> Last; };

template <class T, class Step, class Last, class ARG>
__device__ __forceinline__ T fold_step(T acc, T x, int j, int k, ARG arg) {
    return j == k - 1 ? Last::apply(acc, x, arg) : Step::apply(acc, x, arg);
}

// One element, by itself (the scalar head and tail, and every element when the pointers cannot be
// vectorized together): every operand read before dst and the extra destinations are written.
template <class T, class Step, class Last, class ARG>
__device__ __forceinline__ void fold_one(T* dst, const T* const* s, int k, T* const* e, int m, u64 i, ARG arg) {
    T acc = s[0][i];
#pragma unroll
    for (int j = 1; j < 8; ++j)
        if (j < k) acc = fold_step<T, Step, Last, ARG>(acc, s[j][i], j, k, arg);
    dst[i] = acc;
#pragma unroll
    for (int j = 0; j < 7; ++j)
        if (j < m) e[j][i] = acc;
}

// Word i of an operand's body, the elements from ``body`` on, whose store in dst is 16-byte aligned.  The
// operands' addresses come from an array, which loses their global state space: __ldcg / __ldg name it, so
// the accesses stay 128-bit global ones.
template <class T> struct CoherentWord {
    // The operand shares dst's offset.  Coherent loads (cached in L2, not L1): an operand may be a buffer
    // this kernel writes (the header), which the non-coherent cache does not allow.
    static __device__ __forceinline__ uint4 at(const T* p, u64 body, u64 i) {
        return __ldcg(reinterpret_cast<const uint4*>(p + body) + i);
    }
};

template <class T> struct RealignedWord {
    // The operand at any offset: one at dst's may be an output, read as CoherentWord; one at another offset
    // is none (ddl_fold_realign's destinations all lie at dst's), so its word is cut from the two aligned
    // ones it straddles (realign) through the non-coherent cache, where the neighbour thread's second load
    // of a word mostly hits L1.
    static __device__ __forceinline__ uint4 at(const T* p, u64 body, u64 i) {
        const u64 a = (u64)(p + body);
        const unsigned sh = (unsigned)(a & 15);
        const uint4* w = reinterpret_cast<const uint4*>(a - sh) + i;
        return sh ? realign(__ldg(w), __ldg(w + 1), sh) : __ldcg(w);
    }
};

// The fold's 128-bit body: words [0, words) from element ``body`` on, each operand's word read by Word.
template <class T, class Step, class Last, class ARG, class Word>
__device__ __forceinline__ void fold_words(T* dst, const T* const* s, int k, T* const* e, int m, u64 body,
                                           u64 words, ARG arg) {
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    uint4* dv = reinterpret_cast<uint4*>(dst + body);
    for (u64 i = tid; i < words; i += stride) {
        uint4 acc = Word::at(s[0], body, i);
#pragma unroll
        for (int j = 1; j < 8; ++j) {
            if (j < k) {
                const uint4 x = Word::at(s[j], body, i);
                acc = j == k - 1 ? WordOp<T, Last>::apply(acc, x, arg) : WordOp<T, Step>::apply(acc, x, arg);
            }
        }
        dv[i] = acc;
        // The extra destinations come from an array too: __stwb names the global state space.
#pragma unroll
        for (int j = 0; j < 7; ++j)
            if (j < m) __stwb(reinterpret_cast<uint4*>(e[j] + body) + i, acc);
    }
}

template <class T, class Step, class Last, class ARG>
__device__ __forceinline__ void fold_grid(T* dst, const T* const* s, int k, T* const* e, int m, u64 n, ARG arg) {
    const int V = 16 / sizeof(T);
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 off = (u64)dst & 15;
    // Every loop over the operands runs to 8 (over the extra destinations to 7) with a test of k (m), fully
    // unrolled: s and e are then indexed by constants and stay in registers (a variable index would put
    // them in a stack frame).
    bool vec = true;
#pragma unroll
    for (int j = 0; j < 8; ++j) vec = vec && (j >= k || ((u64)s[j] & 15) == off);
#pragma unroll
    for (int j = 0; j < 7; ++j) vec = vec && (j >= m || ((u64)e[j] & 15) == off);
    u64 head = n;
    if (vec) {
        head = ((16 - off) & 15) / sizeof(T);
        if (head > n) head = n;
    }
    for (u64 i = tid; i < head; i += stride) fold_one<T, Step, Last, ARG>(dst, s, k, e, m, i, arg);
    if (!vec) return;
    const u64 nvec = (n - head) / V;
    fold_words<T, Step, Last, ARG, CoherentWord<T> >(dst, s, k, e, m, head, nvec, arg);
    for (u64 i = head + nvec * V + tid; i < n; i += stride)
        fold_one<T, Step, Last, ARG>(dst, s, k, e, m, i, arg);
}

// The fold where operands lie at other offsets modulo 16 than dst (the IPC allreduce of a view one element
// in, out of place into fresh outputs): dst and every extra destination at one offset, each operand at its
// own.  128-bit stores from dst's first boundary on, each operand word a RealignedWord, with realign_grid's
// bounds over every operand.
template <class T, class Step, class Last, class ARG>
__device__ __forceinline__ void fold_realign_grid(T* dst, const T* const* s, int k, T* const* e, int m, u64 n,
                                                  ARG arg) {
    const int V = 16 / sizeof(T);
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 body = ((16 - ((u64)dst & 15)) & 15) / sizeof(T);  // dst's first 16-byte boundary
    unsigned back = 0;  // bytes the furthest-reaching operand's first word starts before its element
#pragma unroll
    for (int j = 0; j < 8; ++j)
        if (j < k) {
            const unsigned sh = (unsigned)(((u64)s[j] + body * sizeof(T)) & 15);
            back = sh > back ? sh : back;
        }
    if (body < back / sizeof(T)) body += V;  // a word further on: the same offsets modulo 16
    u64 words = 0;
    if (body + V <= n) {
        words = (n - body) / V;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (j < k) {
                const unsigned sh = (unsigned)(((u64)s[j] + body * sizeof(T)) & 15);
                const u64 w = (n - body - V + sh / sizeof(T)) / V;  // word i reads its aligned words i and i + 1
                if (sh && w < words) words = w;
            }
    }
    const u64 head = body < n ? body : n;
    for (u64 i = tid; i < head; i += stride) fold_one<T, Step, Last, ARG>(dst, s, k, e, m, i, arg);
    fold_words<T, Step, Last, ARG, RealignedWord<T> >(dst, s, k, e, m, body, words, arg);
    for (u64 i = head + words * V + tid; i < n; i += stride)
        fold_one<T, Step, Last, ARG>(dst, s, k, e, m, i, arg);
}

}  // namespace ddl

// ---- the exported kernels (unmangled names for Module.get_function) ----------
// X-macro: (op name, functor, dtype suffix, storage type, argument type).  The
// host test harness reuses the list to build its table of kernels.
#define DDL_REDUCE_DTYPES(X, OPNAME, OPF)              \
    X(OPNAME, OPF, f16, __half, float)                 \
    X(OPNAME, OPF, bf16, __nv_bfloat16, float)         \
    X(OPNAME, OPF, f32, float, float)                  \
    X(OPNAME, OPF, f64, double, double)                \
    X(OPNAME, OPF, i32, int, int)                      \
    X(OPNAME, OPF, i64, long long, long long)

// Every op x dtype with the functor family F (F##Sum ...): Op for the pairwise kernels, Fold for the folds.
#define DDL_OPS(X, F)                                  \
    DDL_REDUCE_DTYPES(X, sum, F##Sum)                  \
    DDL_REDUCE_DTYPES(X, prod, F##Prod)                \
    DDL_REDUCE_DTYPES(X, max, F##Max)                  \
    DDL_REDUCE_DTYPES(X, min, F##Min)                  \
    DDL_REDUCE_DTYPES(X, avg, F##Avg)

#define DDL_REDUCE_KERNELS(X) DDL_OPS(X, Op)

// KIND: reduce or realign, the kernel ddl_KIND_<op>_<t> running ddl::KIND_grid.
#define DDL_DEFINE_PAIRWISE(KIND, OPNAME, OPF, SUF, T, ARG)                                    \
    extern "C" __global__ void ddl_##KIND##_##OPNAME##_##SUF(T* dst, const T* a,                \
                                                              const T* __restrict__ b,          \
                                                              unsigned long long n, ARG arg) {  \
        ddl::KIND##_grid<T, ddl::OPF<T> >(dst, a, b, n, arg);                                   \
    }
#define DDL_DEFINE_REDUCE(OPNAME, OPF, SUF, T, ARG) DDL_DEFINE_PAIRWISE(reduce, OPNAME, OPF, SUF, T, ARG)
#define DDL_DEFINE_REALIGN(OPNAME, OPF, SUF, T, ARG) DDL_DEFINE_PAIRWISE(realign, OPNAME, OPF, SUF, T, ARG)

#ifndef DDL_KINDS
#define DDL_KINDS 15
#endif
#if DDL_KINDS & 1
DDL_REDUCE_KERNELS(DDL_DEFINE_REDUCE)
#endif
#if DDL_KINDS & 2
DDL_REDUCE_KERNELS(DDL_DEFINE_REALIGN)
#endif

#define DDL_FOLD_KERNELS(X) DDL_OPS(X, Fold)

// KIND: fold or fold_realign, the kernel ddl_KIND_<op>_<t> running ddl::KIND_grid.
#define DDL_DEFINE_FOLDING(KIND, OPNAME, OPF, SUF, T, ARG)                                              \
    extern "C" __global__ void __launch_bounds__(256, 4)                                                \
    ddl_##KIND##_##OPNAME##_##SUF(T* dst, unsigned long long n, ARG arg, int k, int m, const T* s0,     \
                                  const T* s1, const T* s2, const T* s3, const T* s4, const T* s5,      \
                                  const T* s6, const T* s7, T* e0, T* e1, T* e2, T* e3, T* e4, T* e5,   \
                                  T* e6) {                                                              \
        const T* s[8] = {s0, s1, s2, s3, s4, s5, s6, s7};                                              \
        T* e[7] = {e0, e1, e2, e3, e4, e5, e6};                                                        \
        ddl::KIND##_grid<T, typename ddl::OPF<T>::Step, typename ddl::OPF<T>::Last, ARG>(dst, s, k, e, m, n, \
                                                                                          arg);         \
    }
#define DDL_DEFINE_FOLD(OPNAME, OPF, SUF, T, ARG) DDL_DEFINE_FOLDING(fold, OPNAME, OPF, SUF, T, ARG)
#define DDL_DEFINE_FOLD_REALIGN(OPNAME, OPF, SUF, T, ARG) DDL_DEFINE_FOLDING(fold_realign, OPNAME, OPF, SUF, T, ARG)

#if DDL_KINDS & 4
DDL_FOLD_KERNELS(DDL_DEFINE_FOLD)
#endif
#if DDL_KINDS & 8
DDL_FOLD_KERNELS(DDL_DEFINE_FOLD_REALIGN)
#endif
