// mk_copy.cuh - vectorized copies (local or to/from a peer GPU over NVLink) and typed reductions.
#pragma once
#include "core/mk_common.cuh"

// Copy `nbytes` with the threads [tid, tid+nthreads) of a group: 16-byte vectors with 4 loads in
// flight when src, dst and nbytes allow it, else 4- or 2-byte words, else bytes.
// Source loads bypass L1 (ld.global.cg): a source may be a receive slot a peer rewrote over NVLink
// since this SM last read it, and L1 is not coherent with such writes.
MK_DEVICE void mk_copy(void* __restrict__ dst, const void* __restrict__ src, mk_u64 nbytes, unsigned tid,
                       unsigned nthreads) {
  const mk_u64 a = (mk_u64)dst | (mk_u64)src | nbytes;
  if ((a & 15) == 0) {
    const int4* s = (const int4*)src;
    int4* d = (int4*)dst;
    const mk_u64 n = nbytes >> 4;
    mk_u64 i = tid;
    for (; i + 3 * (mk_u64)nthreads < n; i += 4 * (mk_u64)nthreads) {
      int4 v0 = __ldcg(s + i), v1 = __ldcg(s + i + nthreads), v2 = __ldcg(s + i + 2 * (mk_u64)nthreads),
           v3 = __ldcg(s + i + 3 * (mk_u64)nthreads);
      d[i] = v0;
      d[i + nthreads] = v1;
      d[i + 2 * (mk_u64)nthreads] = v2;
      d[i + 3 * (mk_u64)nthreads] = v3;
    }
    for (; i < n; i += nthreads) d[i] = __ldcg(s + i);
  } else if ((a & 3) == 0) {
    const unsigned* s = (const unsigned*)src;
    unsigned* d = (unsigned*)dst;
    for (mk_u64 i = tid; i < (nbytes >> 2); i += nthreads) d[i] = __ldcg(s + i);
  } else if ((a & 1) == 0) {
    const unsigned short* s = (const unsigned short*)src;
    unsigned short* d = (unsigned short*)dst;
    for (mk_u64 i = tid; i < (nbytes >> 1); i += nthreads) d[i] = __ldcg(s + i);
  } else {
    const unsigned char* s = (const unsigned char*)src;
    unsigned char* d = (unsigned char*)dst;
    for (mk_u64 i = tid; i < nbytes; i += nthreads) d[i] = __ldcg((const char*)s + i);
  }
}

MK_DEVICE void mk_block_copy(void* dst, const void* src, mk_u64 nbytes) {
  mk_copy(dst, src, nbytes, threadIdx.x, blockDim.x);
}

// 16 bytes of elements of T, converted to/from fp32.
template <typename T> struct mk_vec {
  static constexpr int N = 16 / sizeof(T);
};

template <typename T> MK_DEVICE void mk_unpack(const int4& v, float* f) {
  const T* e = (const T*)&v;
#pragma unroll
  for (int j = 0; j < mk_vec<T>::N; ++j) f[j] = mk_to_f32(e[j]);
}
template <typename T> MK_DEVICE int4 mk_pack(const float* f) {
  int4 v;
  T* e = (T*)&v;
#pragma unroll
  for (int j = 0; j < mk_vec<T>::N; ++j) e[j] = mk_from_f32<T>(f[j]);
  return v;
}

// dst[i] = sum over k < count of src(k)[i] for i < n, fp32 accumulation, in k order (a fixed order:
// whoever sums the same sources gets the same bits).  `src(k)` returns a const T*; `aligned`: dst and
// every src(k) are 16-byte aligned (then 16-byte vectors, scalar tail).  Source loads bypass L1 (peers
// rewrite receive slots over NVLink between calls).  The threads of the block share the work.
template <typename T, typename F>
MK_DEVICE void mk_sum_sources(T* dst, int count, F src, mk_u64 n, bool aligned) {
  constexpr int V = mk_vec<T>::N;
  const mk_u64 nvec = aligned ? n / V : 0;
  for (mk_u64 i = threadIdx.x; i < nvec; i += blockDim.x) {
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.f;
    for (int k = 0; k < count; ++k) {
      float f[V];
      mk_unpack<T>(__ldcg((const int4*)src(k) + i), f);
#pragma unroll
      for (int q = 0; q < V; ++q) acc[q] += f[q];
    }
    ((int4*)dst)[i] = mk_pack<T>(acc);
  }
  for (mk_u64 i = nvec * V + threadIdx.x; i < n; i += blockDim.x) {
    float acc = 0.f;
    for (int k = 0; k < count; ++k) acc += mk_to_f32(__ldcg(src(k) + i));
    dst[i] = mk_from_f32<T>(acc);
  }
}
