// mk_common.cuh - types and small helpers shared by every mkernel kernel.
// Compiled by NVRTC (no host code, no standard library beyond what cuda headers give).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned long long mk_u64;
typedef long long mk_i64;
typedef unsigned int mk_u32;

#define MK_DEVICE __device__ __forceinline__

// dtype codes shared with mkernel/core/dtypes.py (DType.code)
#define MK_DTYPE_BF16 0
#define MK_DTYPE_F16 1
#define MK_DTYPE_F32 2
#define MK_DTYPE_I32 3
#define MK_DTYPE_I64 4

// A field's byte offset as a word of such a list.
#define MK_OFFSET_WORD(S, f) ((unsigned long long)__builtin_offsetof(S, f))

// Compile time: two word lists are equal (a struct's sizes and offsets as the device compiler sees them
// against the host's ctypes mirror, passed as -D lists: static_assert(mk_same_words(expected, device))).
template <unsigned N, unsigned M>
__host__ __device__ constexpr bool mk_same_words(const unsigned long long (&a)[N], const unsigned long long (&b)[M]) {
  if (N != M) return false;
  for (unsigned i = 0; i < N; ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// Element type from a compile-time code, and fp32 conversions.
template <int CODE> struct mk_type;
template <> struct mk_type<MK_DTYPE_BF16> { typedef __nv_bfloat16 T; };
template <> struct mk_type<MK_DTYPE_F16> { typedef __half T; };
template <> struct mk_type<MK_DTYPE_F32> { typedef float T; };

MK_DEVICE float mk_to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
MK_DEVICE float mk_to_f32(__half x) { return __half2float(x); }
MK_DEVICE float mk_to_f32(float x) { return x; }
template <typename T> MK_DEVICE T mk_from_f32(float x);
template <> MK_DEVICE __nv_bfloat16 mk_from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> MK_DEVICE __half mk_from_f32<__half>(float x) { return __float2half_rn(x); }
template <> MK_DEVICE float mk_from_f32<float>(float x) { return x; }

// Programmatic dependent launch (a kernel launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_
// SERIALIZATION may start before the previous kernel in its stream has finished): wait until that
// kernel has completed and its memory is visible (a no-op without the attribute), and let the next
// such kernel start launching (its blocks take SMs as this grid's blocks exit).
MK_DEVICE void mk_grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
MK_DEVICE void mk_grid_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Global nanosecond timer (same clock on every SM of a GPU).
MK_DEVICE mk_u64 mk_globaltimer() {
  mk_u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

MK_DEVICE mk_u64 mk_div_up(mk_u64 a, mk_u64 b) { return (a + b - 1) / b; }
MK_DEVICE mk_u64 mk_min(mk_u64 a, mk_u64 b) { return a < b ? a : b; }
