// rmacomm CUDA kernels: reductions for every op x dtype of rmacomm-kernels
// (the CPU kernels' semantics: integers wrap, float min/max are IEEE
// 754-2019 minimum/maximum, f16/bf16 computed in f32 and rounded once),
// the PremulSum / Avg maps, and the signal / wait kernels. Compiled at run
// time by NVRTC; no header is included (NVRTC needs none for this).

// Element types by rmacomm's dtype names (f16 and bf16 are structs below).
typedef float f32;
typedef double f64;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef int i32;
typedef unsigned short u16;
typedef signed char i8;
typedef unsigned char u8;

struct f16 { u16 bits; };
struct bf16 { u16 bits; };

#define GRID_LOOP(n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// Element <-> compute type. Floats compute in themselves (f16 and bf16 in
// f32); integers in themselves, with wrapping done through unsigned types.
template <class T> struct Tr;
#define NATIVE(T)                                                   \
    template <> struct Tr<T> {                                      \
        typedef T C;                                                \
        static __device__ __forceinline__ C load(T x) { return x; } \
        static __device__ __forceinline__ T store(C x) { return x; }\
    };
NATIVE(float)
NATIVE(double)
NATIVE(i8)
NATIVE(u8)
NATIVE(i32)
NATIVE(i64)
template <> struct Tr<f16> {
    typedef float C;
    static __device__ __forceinline__ float load(f16 x) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
        return f;
    }
    static __device__ __forceinline__ f16 store(float f) {
        f16 r;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
        return r;
    }
};
template <> struct Tr<bf16> {
    typedef float C;
    static __device__ __forceinline__ float load(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }
    static __device__ __forceinline__ bf16 store(float f) {
        bf16 r;
#if __CUDA_ARCH__ >= 800
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
#else
        // Before sm_80 there is no bf16 conversion: round to nearest even
        // by hand (NaN stays a quiet NaN).
        u32 u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            r.bits = (u16)((u >> 16) | 0x40u);
        } else {
            r.bits = (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
#endif
        return r;
    }
};

// Wrapping integer arithmetic (signed overflow is undefined in C++).
#define WRAP(T, U)                                                                              \
    static __device__ __forceinline__ T add_(T a, T b) { return (T)((U)a + (U)b); }             \
    static __device__ __forceinline__ T mul_(T a, T b) { return (T)((U)a * (U)b); }             \
    static __device__ __forceinline__ T min_(T a, T b) { return a < b ? a : b; }                \
    static __device__ __forceinline__ T max_(T a, T b) { return a > b ? a : b; }                \
    static __device__ __forceinline__ T and_(T a, T b) { return (T)(a & b); }                   \
    static __device__ __forceinline__ T or_(T a, T b) { return (T)(a | b); }                    \
    static __device__ __forceinline__ T xor_(T a, T b) { return (T)(a ^ b); }                   \
    static __device__ __forceinline__ T scale_(T x, double f) { return (T)((u64)(i64)x * (u64)(i64)f); }
WRAP(i8, u32)
WRAP(u8, u32)
WRAP(i32, u32)
WRAP(i64, u64)

// IEEE 754-2019 minimum / maximum: NaN if either is NaN (a + b is a quiet
// NaN), -0.0 < +0.0 (equal values: OR / AND of the bits picks the zero).
#define FLOAT(T, BITS, TO, FROM)                                                                \
    static __device__ __forceinline__ T add_(T a, T b) { return a + b; }                        \
    static __device__ __forceinline__ T mul_(T a, T b) { return a * b; }                        \
    static __device__ __forceinline__ T min_(T a, T b) {                                        \
        if (a != a || b != b) return a + b;                                                     \
        if (a == b) return FROM((BITS)(TO(a) | TO(b)));                                         \
        return a < b ? a : b;                                                                   \
    }                                                                                           \
    static __device__ __forceinline__ T max_(T a, T b) {                                        \
        if (a != a || b != b) return a + b;                                                     \
        if (a == b) return FROM((BITS)(TO(a) & TO(b)));                                         \
        return a > b ? a : b;                                                                   \
    }                                                                                           \
    static __device__ __forceinline__ T scale_(T x, double f) { return x * (T)f; }
FLOAT(float, u32, __float_as_uint, __uint_as_float)
FLOAT(double, u64, (u64)__double_as_longlong, __longlong_as_double)

struct op_sum { template <class C> static __device__ __forceinline__ C ap(C a, C b) { return add_(a, b); } };
struct op_product { template <class C> static __device__ __forceinline__ C ap(C a, C b) { return mul_(a, b); } };
struct op_min { template <class C> static __device__ __forceinline__ C ap(C a, C b) { return min_(a, b); } };
struct op_max { template <class C> static __device__ __forceinline__ C ap(C a, C b) { return max_(a, b); } };
struct op_band { template <class C> static __device__ __forceinline__ C ap(C a, C b) { return and_(a, b); } };
struct op_bor { template <class C> static __device__ __forceinline__ C ap(C a, C b) { return or_(a, b); } };
struct op_bxor { template <class C> static __device__ __forceinline__ C ap(C a, C b) { return xor_(a, b); } };

// out = op(a, b), element-wise; out may be a (in place) or a third buffer
// (the fused copy + reduce of a ring step).
template <class T, class O>
static __device__ __forceinline__ void binary(T* out, const T* a, const T* b, u64 n) {
    GRID_LOOP(n) out[i] = Tr<T>::store(O::ap(Tr<T>::load(a[i]), Tr<T>::load(b[i])));
}

// out = op over k inputs (k >= 1), in one pass; out may be one of them.
template <class T, class O>
static __device__ __forceinline__ void nary(T* out, const T* const* in, u32 k, u64 n) {
    GRID_LOOP(n) {
        typename Tr<T>::C acc = Tr<T>::load(in[0][i]);
        for (u32 j = 1; j < k; ++j) acc = O::ap(acc, Tr<T>::load(in[j][i]));
        out[i] = Tr<T>::store(acc);
    }
}

// PremulSum's prepare: each input times the factor (integers: wrapping by
// the factor as an integer; f16 / bf16: in f32, rounded once).
template <class T>
static __device__ __forceinline__ void scale(T* buf, double f, u64 n) {
    GRID_LOOP(n) buf[i] = Tr<T>::store(scale_(Tr<T>::load(buf[i]), f));
}

// Avg's finish: divide by the count (integers truncate toward zero; i8,
// u8, i32 through f64 as the CPU kernels, i64 by integer division).
static __device__ __forceinline__ float div_(float x, u64 c) { return x / (float)c; }
static __device__ __forceinline__ double div_(double x, u64 c) { return x / (double)c; }
static __device__ __forceinline__ i8 div_(i8 x, u64 c) { return (i8)((double)x / (double)c); }
static __device__ __forceinline__ u8 div_(u8 x, u64 c) { return (u8)((double)x / (double)c); }
static __device__ __forceinline__ i32 div_(i32 x, u64 c) { return (i32)((double)x / (double)c); }
static __device__ __forceinline__ i64 div_(i64 x, u64 c) { return x / (i64)c; }
template <class T>
static __device__ __forceinline__ void divide(T* buf, u64 count, u64 n) {
    GRID_LOOP(n) buf[i] = Tr<T>::store(div_(Tr<T>::load(buf[i]), count));
}

// The whole reduction of raw contributions, as the CPU's reduce_full: each
// input times `factor` (PremulSum; 1 otherwise), summed in the compute type,
// divided by `count` (Avg; 1 otherwise), rounded once.
template <class T>
static __device__ __forceinline__ void full(T* out, const T* const* in, u32 k, u64 n, double factor, u64 count) {
    GRID_LOOP(n) {
        typename Tr<T>::C acc = scale_(Tr<T>::load(in[0][i]), factor);
        for (u32 j = 1; j < k; ++j) acc = add_(acc, scale_(Tr<T>::load(in[j][i]), factor));
        out[i] = Tr<T>::store(div_(acc, count));
    }
}

// A signal: adds to a word another process or the host watches (system
// scope: visible to the CPU and to peers mapping the memory).
extern "C" __global__ void rmacomm_signal_add(u64* word, u64 add) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        __threadfence_system();
        atomicAdd_system(word, add);
    }
}

// The fallback for stream-ordered waits where the driver has no stream
// memory operations: spins until *word >= value.
extern "C" __global__ void rmacomm_wait_geq(const volatile u64* word, u64 value) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        while (*word < value) __nanosleep(200);
        __threadfence_system();
    }
}
