// mk_gemm_dtypes.cuh - the dtype specialization every GEMM-family kernel (gemm.cu, ag_gemm.cu, gemv.cu)
// is compiled for (defines set by mkernel/ops/gemm/configs.py, mkernel/ops/gemm/gemv.py):
//   MK_GEMM_IN   input dtype code (MK_DTYPE_BF16 | MK_DTYPE_F16) of A and B
//   MK_GEMM_OUT  output dtype code (MK_DTYPE_BF16 | MK_DTYPE_F16 | MK_DTYPE_F32); MkOut is its type
#pragma once
#include "core/mk_common.cuh"

#ifndef MK_GEMM_IN
#define MK_GEMM_IN MK_DTYPE_BF16
#endif
#ifndef MK_GEMM_OUT
#define MK_GEMM_OUT MK_DTYPE_BF16
#endif

typedef typename mk_type<MK_GEMM_OUT>::T MkOut;
