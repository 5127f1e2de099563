// mk_copy.cuh - vectorized copies (local or to/from a peer GPU over NVLink) and typed reductions.
#pragma once
#include "mk_common.cuh"

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

// dst[i] = sum_k srcs[k][i] for i < n elements, fp32 accumulation, in the order srcs are given
// (a fixed order: every rank gets bit-identical sums).  Vectorized when every pointer is 16B
// aligned and n is a multiple of the vector width; the tail is scalar.
template <typename T, int MAXSRC>
MK_DEVICE void mk_reduce(T* __restrict__ dst, const T* const* srcs, int nsrc, mk_u64 n, unsigned tid, unsigned nthreads) {
  constexpr int V = mk_vec<T>::N;
  mk_u64 align = (mk_u64)dst;
  for (int k = 0; k < nsrc; ++k) align |= (mk_u64)srcs[k];
  mk_u64 nvec = ((align & 15) == 0) ? n / V : 0;
  for (mk_u64 i = tid; i < nvec; i += nthreads) {
    float acc[V];
    mk_unpack<T>(((const int4*)srcs[0])[i], acc);
    for (int k = 1; k < nsrc; ++k) {
      float f[V];
      mk_unpack<T>(((const int4*)srcs[k])[i], f);
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += f[j];
    }
    ((int4*)dst)[i] = mk_pack<T>(acc);
  }
  for (mk_u64 i = nvec * V + tid; i < n; i += nthreads) {
    float acc = mk_to_f32(srcs[0][i]);
    for (int k = 1; k < nsrc; ++k) acc += mk_to_f32(srcs[k][i]);
    dst[i] = mk_from_f32<T>(acc);
  }
}
