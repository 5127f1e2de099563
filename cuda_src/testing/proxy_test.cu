// proxy_test.cu - test kernels for the GPU -> CPU proxy ring (mk_proxy.cuh).
//
// mk_proxy_test_push: block b fills its chunks of `data` (window 0 of this rank, device memory) with
//   a pattern, then thread 0 pushes one WRITE per chunk to rank `dst_rank`: chunk i of block b
//   (global chunk g = b * n_per_block + i, `chunk_bytes` each, at byte offset g * chunk_bytes on both
//   ends) raises the flag at flag_base + 8 * g of the destination's window `flag_win` to `epoch`.
//   With `wait_done`, the block waits for local completion of its last command before returning.
//   Parameter list mirrored by tests/cpu/test_proxy_scenarios.py gpu_kernel_args (PTX-checked on the CPU).
//   Pattern: byte k of chunk g is (g * 131 + k * 7 + epoch) & 0xff.
// mk_proxy_layout: writes sizeof/offsetof of MkProxyCmd and MkProxy into out[0..15], so a GPU test
//   can check mkernel/proxy/engine.py's mirror against the compiler's layout.
#include "core/mk_proxy.cuh"

extern "C" __global__ void mk_proxy_test_push(MkComm c, MkProxy p, unsigned char* data, int n_per_block,
                                              int dst_rank, mk_u64 chunk_bytes, int flag_win,
                                              mk_u64 flag_base, mk_u64 epoch, int wait_done) {
  mk_u64 last = MK_PROXY_NO_FLAG;
  for (int i = 0; i < n_per_block; ++i) {
    const mk_u64 g = (mk_u64)blockIdx.x * n_per_block + i;
    unsigned char* dst = data + g * chunk_bytes;
    for (mk_u64 k = threadIdx.x; k < chunk_bytes; k += blockDim.x) dst[k] = (unsigned char)((g * 131 + k * 7 + epoch) & 0xff);
    __syncthreads();
    int ok = 1;
    if (threadIdx.x == 0) {
      last = mk_proxy_push(c, p, MK_PROXY_OP_WRITE, dst_rank, 0, g * chunk_bytes, g * chunk_bytes, chunk_bytes,
                           flag_win, flag_base + 8 * g, epoch, mk_globaltimer());
      ok = last != MK_PROXY_NO_FLAG;
    }
    if (!__syncthreads_and(ok)) return;
  }
  if (wait_done && threadIdx.x == 0 && last != MK_PROXY_NO_FLAG) mk_proxy_wait_done(c, p, last);
}

// Offsets from a local object's member addresses: older NVRTC releases reject __builtin_offsetof here.
#define MK_OFF(obj, f) ((mk_u64)((const char*)&(obj).f - (const char*)&(obj)))
extern "C" __global__ void mk_proxy_layout(mk_u64* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  MkProxyCmd cmd;
  MkProxy p;
  out[0] = sizeof(MkProxyCmd);
  out[1] = MK_OFF(cmd, op);
  out[2] = MK_OFF(cmd, win);
  out[3] = MK_OFF(cmd, flag_win);
  out[4] = MK_OFF(cmd, dst_rank);
  out[5] = MK_OFF(cmd, src_offset);
  out[6] = MK_OFF(cmd, dst_offset);
  out[7] = MK_OFF(cmd, bytes);
  out[8] = MK_OFF(cmd, flag_offset);
  out[9] = MK_OFF(cmd, flag_value);
  out[10] = MK_OFF(cmd, user);
  out[11] = MK_OFF(cmd, seq);
  out[12] = sizeof(MkProxy);
  out[13] = MK_OFF(p, capacity);
  out[14] = MK_OFF(p, rank);
  out[15] = sizeof(MkComm);
}
