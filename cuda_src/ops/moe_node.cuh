// moe_node.cuh - MoE dispatch and combine across nodes with node-level de-duplication (docs/moe.md,
// "Node-level de-duplication").  Included by moe_internode.cu (XWs, the x_* helpers, T / TO).
//
// World rank me = n * L + i.  Its rail peer on node m is m * L + i (same local rank: NIC traffic stays
// rail-aligned).  Dispatch: a token row crosses the network once per destination node m != n, to the rail
// peer there, which fans it out over NVLink to the ranks of its node holding the token's kept pairs;
// combine: that peer sums the weighted rows of the token's pairs on its node (fp32, j order) and sends the
// one partial back; the owner adds the per-node partials in node order.  No data atomics: bit-reproducible.
// The receive layout (x_recv, recv_map) is the per-rank path's.
//
// A rank writes only into its neighbours' workspaces (this node's ranks by NVLink, its rail peers through
// the proxy), so the call words, consumed handshakes and ready flags cover the neighbours only; the data of
// a remote rank r off our rail is vouched for by its forwarder n * L + r % L, which checked r's call word
// before forwarding it (docs/internode.md, "Call signatures").
//
// Meta entry (int32, W = 1 + 3k words): t, ids[t][0..k), slots[t][0..k), bits of weights[t][0..k).
// A batch is [count, entry 0, entry 1, ...]: M = 1 + T * W words per node (moe/layout.py node_meta_words).

struct XNodeNear {  // this node's ranks and our rail peers (whom we write into, who write into us)
  int L, n, i;
  MK_DEVICE bool operator()(int r) const { return r / L == n || r % L == i; }
};
struct XNodeRail {  // our rail peers on other nodes
  int L, n, i;
  MK_DEVICE bool operator()(int r) const { return r % L == i && r / L != n; }
};
struct XNodeLocal {
  int L, n;
  MK_DEVICE bool operator()(int r) const { return r / L == n; }
};
struct XNodeWriter {  // who raised ready[r] here: r itself (neighbour), else its forwarder on this node
  int L, n, i;
  MK_DEVICE int operator()(int r) const { return (r / L == n || r % L == i) ? r : n * L + r % L; }
};
struct XNodeOn {  // pair kept when its owner is on node n
  int L, n;
  MK_DEVICE bool operator()(int, int d) const { return d / L == n; }
};

// The dispatch workspace's region e (moe/layout.py x_node_dispatch_layout): u32 cnt[N] (rows batched for
// node m, zeroed by the host before each launch), int32 meta_in[N][M] (batch from our rail peer on node m),
// meta_out[N][M] (our batch for node m: the proxy's source).
struct XNodeMeta {
  mk_u64 cnt_off, in_off, out_off, M;
  int W;
};
MK_DEVICE XNodeMeta x_node_meta(const MoeXLayout& X, const MoeShape& s) {
  XNodeMeta m;
  m.W = 1 + 3 * s.k;
  m.M = 1 + (mk_u64)s.T * m.W;
  m.cnt_off = X.e_off;
  m.in_off = X.e_off + (((mk_u64)X.N * 4 + 15) & ~15ull);
  m.out_off = m.in_off + (mk_u64)X.N * m.M * 4;
  return m;
}

// Dispatch phase 1, a warp per token: this node's destination ranks get the row once each ([me][t] of region
// b) and recv_src at the slot (region a); each other node m holding a kept pair gets it once: row q of our
// batch for m (q from cnt[m]: any order, the receiver places rows by slot), its meta entry, node_pos[t][m] = q.
MK_DEVICE void n_send_tokens(const XWs& w, const XNodeMeta& nm, const char* __restrict__ x, const int* __restrict__ ids,
                             const float* __restrict__ weights, const int* __restrict__ slots,
                             int* __restrict__ node_pos, const MoeShape& s) {
  const MoeWarps pool;
  const int lane = pool.lane, k = s.k, me = w.me, El = s.El, L = w.X.L, N = w.X.N;
  const mk_u64 RB = w.X.row_bytes, Tk = (mk_u64)s.T * k;
  unsigned* cnt = (unsigned*)(w.base + nm.cnt_off);
  for (int t = pool.gw; t < s.T; t += pool.warps) {  // (warp-uniform)
    const mk_u64 o = (mk_u64)t * k + lane;
    int d = -1, slot = -1;
    if (lane < k) {
      slot = slots[o];
      if (slot >= 0) d = ids[o] / El;
    }
    const bool here = slot >= 0 && w.local(d);
    if (here) ((int*)w.at(d, w.X.a_off))[slot] = (int)((mk_u64)me * Tk + o);
    unsigned todo = __ballot_sync(0xffffffffu, here && d != me);
    while (todo) {
      const int dst = __shfl_sync(0xffffffffu, d, __ffs(todo) - 1);
      todo &= ~__ballot_sync(0xffffffffu, here && d == dst);
      mk_copy(w.at(dst, w.X.b_off + ((mk_u64)me * s.T + t) * RB), x + (mk_u64)t * RB, RB, lane, 32);
    }
    for (int m = lane; m < N; m += 32) node_pos[(mk_u64)t * N + m] = -1;
    __syncwarp();
    const int node = slot >= 0 && !here ? d / L : -1;
    unsigned far = __ballot_sync(0xffffffffu, node >= 0);
    while (far) {
      const int m = __shfl_sync(0xffffffffu, node, __ffs(far) - 1);
      far &= ~__ballot_sync(0xffffffffu, node == m);
      int q = 0;
      if (lane == 0) {
        q = (int)atomicAdd(cnt + m, 1u);
        node_pos[(mk_u64)t * N + m] = q;
      }
      q = __shfl_sync(0xffffffffu, q, 0);
      mk_copy(w.base + w.X.d_off + ((mk_u64)m * s.T + q) * RB, x + (mk_u64)t * RB, RB, lane, 32);
      int* ent = (int*)(w.base + nm.out_off) + (mk_u64)m * nm.M + 1 + (mk_u64)q * nm.W;
      if (lane == 0) ent[0] = t;
      if (lane < k) {
        ent[1 + lane] = ids[o];
        ent[1 + k + lane] = slots[o];
        ent[1 + 2 * k + lane] = __float_as_int(weights[o]);
      }
    }
  }
}

// Whole block, block-uniform verdict; block 0's thread 0: ready[me] = e at this node's ranks (NVLink); to the
// rail peer on each other node m, WRITE our batch's rows and its meta (count first), the FLAG ready[me] on
// the last WRITE ("flag visible => data complete", docs/internode.md).
MK_DEVICE bool n_publish_batches(const MkComm& c, const XWs& w, const MkProxy& p, const XNodeMeta& nm, mk_u64 e,
                                 int T) {
  int ok = 1;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const int L = w.X.L, n = w.n, i = w.me % L;
    const mk_u64 RB = w.X.row_bytes;
    for (int r = n * L; r < (n + 1) * L; ++r)
      if (r != w.me) mk_signal_set((mk_u64*)w.at(r, w.ready_off(w.me)), e);
    for (int m = 0; m < w.X.N && ok; ++m) {
      if (m == n) continue;
      const mk_u64 cnt = min(*(volatile unsigned*)(w.base + nm.cnt_off + 4ull * m), (unsigned)T);
      int* batch = (int*)(w.base + nm.out_off) + (mk_u64)m * nm.M;
      batch[0] = (int)cnt;
      const int g = m * L + i;
      if (cnt > 0)
        ok = mk_proxy_push(c, p, MK_PROXY_OP_WRITE, g, 0, w.X.d_off + (mk_u64)m * T * RB, w.X.c_off + (mk_u64)n * T * RB,
                           cnt * RB, 0, MK_PROXY_NO_FLAG, 0) != MK_PROXY_NO_FLAG;
      ok = ok && mk_proxy_push(c, p, MK_PROXY_OP_WRITE, g, 0, nm.out_off + (mk_u64)m * nm.M * 4,
                               nm.in_off + (mk_u64)n * nm.M * 4, (1 + cnt * nm.W) * 4, 0, w.ready_off(w.me), e) !=
                     MK_PROXY_NO_FLAG;
    }
  }
  return __syncthreads_and(ok) != 0;
}

// Dispatch phase 2, a warp per received entry: the batch of our rail peer s on node m is fanned out to this
// node's ranks holding its kept pairs: recv_src at the slot, the row once per rank into [s][t] of region b.
// The entry is kept in node_meta[m] for combine, its slots -1 where the pair is not this node's (or out of
// range: never, with a consistent routing; no wild store).
MK_DEVICE void n_forward(const XWs& w, const XNodeMeta& nm, int* __restrict__ node_meta, const MoeShape& s) {
  const MoeWarps pool;
  const int lane = pool.lane, k = s.k, El = s.El, L = w.X.L, n = w.n;
  const mk_u64 RB = w.X.row_bytes, Tk = (mk_u64)s.T * k;
  for (int m = 0; m < w.X.N; ++m) {
    if (m == n) continue;
    const int* in = (const int*)(w.base + nm.in_off) + (mk_u64)m * nm.M;
    int* keep = node_meta + (mk_u64)m * nm.M;
    const int cnt = min(max(__ldcg(in), 0), s.T), src = m * L + w.me % L;
    if (pool.gw == 0 && lane == 0) keep[0] = cnt;
    for (int q = pool.gw; q < cnt; q += pool.warps) {  // (warp-uniform)
      const int* ent = in + 1 + (mk_u64)q * nm.W;
      int* kent = keep + 1 + (mk_u64)q * nm.W;
      const int t = __ldcg(ent);
      int d = -1, slot = -1;
      if (lane < k) {
        const int id = __ldcg(ent + 1 + lane);
        slot = __ldcg(ent + 1 + k + lane);
        const bool ok = t >= 0 && t < s.T && slot >= 0 && slot < s.r_cap && id >= 0 && id < s.E && id / El / L == n;
        d = ok ? id / El : -1;
        slot = ok ? slot : -1;
        kent[1 + lane] = id;
        kent[1 + k + lane] = slot;
        kent[1 + 2 * k + lane] = __ldcg(ent + 1 + 2 * k + lane);
      }
      if (lane == 0) kent[0] = t;
      if (slot >= 0) ((int*)w.at(d, w.X.a_off))[slot] = (int)((mk_u64)src * Tk + (mk_u64)t * k + lane);
      unsigned todo = __ballot_sync(0xffffffffu, slot >= 0);
      while (todo) {
        const int dst = __shfl_sync(0xffffffffu, d, __ffs(todo) - 1);
        todo &= ~__ballot_sync(0xffffffffu, slot >= 0 && d == dst);
        mk_copy(w.at(dst, w.X.b_off + ((mk_u64)src * s.T + t) * RB),
                w.base + w.X.c_off + ((mk_u64)m * s.T + q) * RB, RB, lane, 32);
      }
    }
  }
}

// Block 0's thread 0: at this node's other ranks, ready[s] = e for each rail peer s we forwarded (NVLink).
MK_DEVICE void n_raise_forwarded(const XWs& w, mk_u64 e) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const int L = w.X.L, n = w.n, i = w.me % L;
  for (int r = n * L; r < (n + 1) * L; ++r)
    for (int m = 0; m < w.X.N && r != w.me; ++m)
      if (m != n) mk_signal_set((mk_u64*)w.at(r, w.ready_off(m * L + i)), e);
}

// Dispatch with node-level de-duplication (cooperative, fixed grid, blocks of 256 threads).  Regions
// (moe/layout.py x_node_dispatch_layout): a = int32 in_src[r_cap], b = rows [P][T] (world rank s's token t:
// from this node's ranks, or forwarded), c = rows [N][T] (batch from our rail peer on node m), d = rows
// [N][T] (our batch for node m: the proxy's source), e = XNodeMeta.
//   1. n_send_tokens; grid barrier; n_publish_batches;
//   2. wait for the rail peers' batches (their calls checked); n_forward; grid barrier; n_raise_forwarded;
//   3. wait for every rank's rows (checked against their writers' calls); expand x_recv[r] by in_src[r].
extern "C" __global__ void __launch_bounds__(256, 1)
mk_moe_n_dispatch(MkComm c, MkProxy p, const char* __restrict__ x, const int* __restrict__ ids,
                  const float* __restrict__ weights, const int* __restrict__ slots,
                  const int* __restrict__ expert_offsets, char* __restrict__ x_recv, int* __restrict__ recv_map,
                  int* __restrict__ node_pos, int* __restrict__ node_meta, char* ws, const mk_u64* __restrict__ peers,
                  MoeXLayout X, MoeShape s) {
  const XWs w = make_xws(c, ws, peers, X);
  const mk_u64 ep = mk_epoch_begin(w.st());
  const int i = w.me % X.L;
  const XNodeNear near{X.L, w.n, i};
  const XNodeMeta nm = x_node_meta(X, s);
  if (!x_open(c, w, p, ep, near)) return;
  if (!x_wait_consumed(c, w, ep, near)) return;
  n_send_tokens(w, nm, x, ids, weights, slots, node_pos, s);
  if (!x_grid_wait(c, w, ep, 2, 0)) return;
  if (!n_publish_batches(c, w, p, nm, ep, s.T)) return;
  if (!x_wait_ready(c, w, ep, XNodeRail{X.L, w.n, i})) return;
  n_forward(w, nm, node_meta, s);
  if (!x_grid_wait(c, w, ep, 2, 1)) return;
  n_raise_forwarded(w, ep);
  if (!x_wait_ready(c, w, ep, XEvery(), XNodeWriter{X.L, w.n, i})) return;
  const MoeWarps pool;
  const mk_u64 RB = X.row_bytes, Tk = (mk_u64)s.T * s.k;
  const int R = min(__ldcg(expert_offsets + s.El), s.r_cap);
  const int* in_src = (const int*)(w.base + X.a_off);
  for (int r = pool.gw; r < R; r += pool.warps) {
    const int v = __ldcg(in_src + r);
    if (pool.lane == 0) recv_map[r] = v;
    if (v < 0 || (mk_u64)v >= (mk_u64)w.P * Tk) continue;  // (never, with a consistent routing: no wild read)
    const int src = (int)(v / Tk), t = (int)((v % Tk) / s.k);
    const char* from = src == w.me ? x + (mk_u64)t * RB : w.base + X.b_off + ((mk_u64)src * s.T + t) * RB;
    mk_copy(x_recv + (mk_u64)r * RB, from, RB, pool.lane, 32);
  }
  x_finish(c, w, p, ep, near);
}

// Combine phase 1, a warp per received row r (recv_map[r] = owner s, pair (t, j)): an owner on this node gets
// it at [t * k + j] of its region b; a remote owner's forwarder here (n * L + s % L) at [node of s][t * k + j]
// of its region c (the forwarder reads its own rows from y).
MK_DEVICE void n_return_rows(const XWs& w, const T* __restrict__ y, const int* __restrict__ expert_offsets,
                             const int* __restrict__ recv_map, const MoeShape& s) {
  const MoeWarps pool;
  const int L = w.X.L;
  const mk_u64 RB = w.X.row_bytes, Tk = (mk_u64)s.T * s.k;
  const int R = min(__ldcg(expert_offsets + s.El), s.r_cap);
  for (int r = pool.gw; r < R; r += pool.warps) {
    const int v = __ldcg(recv_map + r);
    if (v < 0 || (mk_u64)v >= (mk_u64)w.P * Tk) continue;  // (never, with a consistent routing: no wild store)
    const int src = (int)(v / Tk), fwd = w.n * L + src % L;
    if (src == w.me || (!w.local(src) && fwd == w.me)) continue;
    char* to = w.local(src) ? w.at(src, w.X.b_off + (mk_u64)(v % Tk) * RB)
                            : w.at(fwd, w.X.c_off + ((mk_u64)(src / L) * Tk + v % Tk) * RB);
    mk_copy(to, (const char*)y + (mk_u64)r * RB, RB, pool.lane, 32);
  }
}

// Block 0's thread 0: ready[me] = e at this node's other ranks (NVLink).
MK_DEVICE void n_raise_local(const XWs& w, mk_u64 e) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  for (int r = w.n * w.X.L; r < (w.n + 1) * w.X.L; ++r)
    if (r != w.me) mk_signal_set((mk_u64*)w.at(r, w.ready_off(w.me)), e);
}

// Combine phase 2, a warp per entry of node_meta[m] (the tokens of our rail peer on node m with pairs on this
// node, as dispatch forwarded them): partial[m][q] = sum over the entry's pairs here, in j order, of w_j * y
// (fp32), from our own y or region c.
MK_DEVICE void n_partials(const XWs& w, const T* __restrict__ y, const int* __restrict__ node_meta, const MoeShape& s) {
  const MoeWarps pool;
  const int k = s.k, W = 1 + 3 * k;
  const mk_u64 M = 1 + (mk_u64)s.T * W, RB = w.X.row_bytes, PB = (mk_u64)s.H * 4, Tk = (mk_u64)s.T * k;
  for (int m = 0; m < w.X.N; ++m) {
    if (m == w.n) continue;
    const int* batch = node_meta + (mk_u64)m * M;
    const int cnt = min(max(batch[0], 0), s.T);
    for (int q = pool.gw; q < cnt; q += pool.warps) {  // (warp-uniform)
      const int* ent = batch + 1 + (mk_u64)q * W;
      const int t = ent[0];
      if (t < 0 || t >= s.T) continue;  // (never: the owner reads no partial for it)
      float* part = (float*)(w.base + w.X.d_off + ((mk_u64)m * s.T + q) * PB);
      moe_combine_token<T, float>(0, k, s.H, s.El, pool.lane, ent + 1 + k, ent + 1, (const float*)(ent + 1 + 2 * k),
                                  part, [&](int j, int dj, int sj) {
                                    return dj == w.me ? y + (mk_u64)sj * s.H
                                                      : (const T*)(w.base + w.X.c_off +
                                                                   ((mk_u64)m * Tk + (mk_u64)t * k + j) * RB);
                                  });
    }
  }
}

// Whole block, block-uniform verdict; block 0's thread 0: to the rail peer on each other node m (the owner
// of batch m), WRITE our partials [m][0, count) into its [n][0, count) of region e, FLAG ready[me] with it.
MK_DEVICE bool n_publish_partials(const MkComm& c, const XWs& w, const MkProxy& p, const int* __restrict__ node_meta,
                                  mk_u64 e, const MoeShape& s) {
  int ok = 1;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const int L = w.X.L, n = w.n;
    const mk_u64 M = 1 + (mk_u64)s.T * (1 + 3 * s.k), PB = (mk_u64)s.H * 4;
    for (int m = 0; m < w.X.N && ok; ++m) {
      if (m == n) continue;
      const mk_u64 cnt = (mk_u64)min(max(node_meta[(mk_u64)m * M], 0), s.T);
      ok = mk_proxy_push(c, p, MK_PROXY_OP_WRITE, m * L + w.me % L, 0, w.X.d_off + (mk_u64)m * s.T * PB,
                         w.X.e_off + (mk_u64)n * s.T * PB, cnt * PB, 0, w.ready_off(w.me), e) != MK_PROXY_NO_FLAG;
    }
  }
  return __syncthreads_and(ok) != 0;
}

// Combine phase 3, a warp per token t of ours: out[t] = sum over nodes m in order of node m's partial -- this
// node's computed here (pairs on it, j order, fp32; y from our own rows or region b), another's read from
// region e at node_pos[t][m] (none: the token has no pair there).
MK_DEVICE void n_sum_nodes(const XWs& w, const T* __restrict__ y, const int* __restrict__ ids,
                           const float* __restrict__ weights, const int* __restrict__ slots,
                           const int* __restrict__ node_pos, TO* __restrict__ out, const MoeShape& s) {
  constexpr int V = mk_vec<T>::N;
  const MoeWarps pool;
  const int k = s.k, N = w.X.N;
  const mk_u64 RB = w.X.row_bytes, PB = (mk_u64)s.H * 4;
  const XNodeOn here{w.X.L, w.n};
  for (int t = pool.gw; t < s.T; t += pool.warps)  // (warp-uniform)
    moe_token_out<T, TO>(t, k, s.H, s.El, pool.lane, slots, ids, weights, out,
                         [&](float* tot, const MoeChoice& ch, int i, bool act) {
      for (int m = 0; m < N; ++m) {  // (warp-uniform)
        float acc[V];
#pragma unroll
        for (int q = 0; q < V; ++q) acc[q] = 0.f;
        if (m == w.n) {
          moe_acc_pairs<T, V>(acc, ch, k, i, act, [&](int j, int dj, int sj) {
            return dj == w.me ? y + (mk_u64)sj * s.H : (const T*)(w.base + w.X.b_off + ((mk_u64)t * k + j) * RB);
          }, here);
        } else {
          const int pos = node_pos[(mk_u64)t * N + m];
          if (pos < 0 || pos >= s.T || !act) continue;
          const float4* src = (const float4*)(w.base + w.X.e_off + ((mk_u64)m * s.T + pos) * PB) + (mk_u64)i * (V / 4);
#pragma unroll
          for (int q = 0; q < V; q += 4) {
            const float4 f = __ldcg(src + q / 4);
            acc[q] = f.x, acc[q + 1] = f.y, acc[q + 2] = f.z, acc[q + 3] = f.w;
          }
        }
#pragma unroll
        for (int q = 0; q < V; ++q) tot[q] += acc[q];
      }
    });
}

// Combine with node-level de-duplication (cooperative, fixed grid, blocks of 256 threads).  Regions
// (moe/layout.py x_node_combine_layout): b = rows [T * k] (y(t, j) of our tokens from this node's ranks),
// c = rows [N][T * k] (y of our rail peer on node m's pairs, from this node's ranks), d = fp32 rows [N][T]
// (our partials for node m: the proxy's source), e = fp32 rows [N][T] (node m's partials for our tokens).
//   1. n_return_rows; grid barrier; n_raise_local;
//   2. wait for this node's ranks; n_partials; grid barrier; n_publish_partials;
//   3. wait for the rail peers' partials; n_sum_nodes.
extern "C" __global__ void __launch_bounds__(256, 1)
mk_moe_n_combine(MkComm c, MkProxy p, const T* __restrict__ y, const int* __restrict__ ids,
                 const float* __restrict__ weights, const int* __restrict__ slots,
                 const int* __restrict__ expert_offsets, const int* __restrict__ recv_map,
                 const int* __restrict__ node_pos, const int* __restrict__ node_meta, TO* __restrict__ out, char* ws,
                 const mk_u64* __restrict__ peers, MoeXLayout X, MoeShape s) {
  const XWs w = make_xws(c, ws, peers, X);
  const mk_u64 ep = mk_epoch_begin(w.st());
  const int i = w.me % X.L;
  const XNodeNear near{X.L, w.n, i};
  if (!x_open(c, w, p, ep, near)) return;
  if (!x_wait_consumed(c, w, ep, near)) return;
  n_return_rows(w, y, expert_offsets, recv_map, s);
  if (!x_grid_wait(c, w, ep, 2, 0)) return;
  n_raise_local(w, ep);
  if (!x_wait_ready(c, w, ep, XNodeLocal{X.L, w.n})) return;
  n_partials(w, y, node_meta, s);
  if (!x_grid_wait(c, w, ep, 2, 1)) return;
  if (!n_publish_partials(c, w, p, node_meta, ep, s)) return;
  if (!x_wait_ready(c, w, ep, XNodeRail{X.L, w.n, i})) return;
  n_sum_nodes(w, y, ids, weights, slots, node_pos, out, s);
  x_finish(c, w, p, ep, near);
}
