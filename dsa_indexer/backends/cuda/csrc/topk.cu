// Exact top-k of fp32 rows for the DeepSeek lightning indexer (sm90 / sm100), compiled at first use.
//
// Contract (the reference's `topk_indices`): per row r, the k largest values among columns [starts[r], ends[r]),
// ties to the lower column, int32 positions relative to starts[r] (or physical cache slots when a block table is
// given), -1 padding when the window holds <= k columns. A NaN ranks exactly as -inf (the library's NaN rule: the
// result equals the reference's on the row with every NaN replaced by -inf) and -0.0 equals +0.0.
//
// Design: a row is loaded ONCE from global memory into shared memory (as order-preserving uint32 keys), split
// over a thread-block cluster of C CTAs when it is long (C <= 8, distributed shared memory joins the
// histograms), and every later pass reads shared memory only:
//   P0  load + the row's min and max key;
//   P1  a histogram of 4096 equal-width VALUE bins over the row's finite range (real indexer logits straddle
//       zero, where bins on the order key's bits are 1/8 octave wide and hold a few percent of the row); when
//       the k-th value's bin is taken whole or holds <= 64 keys, that bin is resolved directly (ranked by key,
//       then column);
//   P2+ otherwise a radix select over u = key - min with 12-bit digits from the top set bit of (max - min)
//       down, stopping early the same way; at most 3 levels;
//   P4  per-warp counts of keys above the threshold and equal to it; P5 the ordered write.
// Each warp owns a contiguous run of columns and CTAs own contiguous chunks, so ranks in column order come
// from warp scans plus one exclusive scan over warps and CTAs: the output holds the keys above the threshold
// in column order, then the lowest-column keys equal to it. Deterministic: no atomics decide any position.
// No host synchronization; launch shape depends on tensor shapes only, so the launch can be graph-captured.

#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cluster_launch.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kRadixBits = 12;
constexpr int kBins = 1 << kRadixBits;
constexpr int kBinsPerThread = kBins / kThreads;
constexpr int kPage = 64;
// A threshold bin holding at most this many keys is resolved by ranking its keys against each other (exact,
// ties to the lower column) instead of by further histogram levels over the whole row.
constexpr int kCandCap = 64;

struct Params {
  const float* x;
  long long x_stride;
  int rows;
  int cols;
  int k;
  const int* starts;  // may be null: every window starts at 0
  const int* ends;
  const int* block_table;  // may be null: request-local positions
  long long bt_stride;
  const int* row_request;  // may be null: row r reads block_table row r
  int* out;
  int chunk_cols;  // shared-memory key capacity per CTA (a multiple of 32 * VEC)
};

// Shared memory beyond the key array; peers of the cluster read `hist`, `exports` through DSMEM.
struct Smem {
  int hist[2][kBins];  // local histograms, alternating per level so a peer can still read the previous one
  int total[kBins];    // the cluster-wide histogram of the current level
  int warp_a[kWarps];
  int warp_b[kWarps];
  unsigned exports[6];  // min key, max key, count above, count equal, min / max finite key (read by peers)
  int found[3];         // bin, k remaining within it, its count
  unsigned bcast[4];
  int cand_count;       // candidates gathered into rank 0's list (peers append through DSMEM)
  unsigned cand_key[kCandCap];
  int cand_col[kCandCap];
  int cand_sel[kCandCap];
};

constexpr unsigned kNegInfKey = 0x007fffffu;  // order_key(-inf)

__device__ __forceinline__ unsigned order_key(float value) {
  unsigned u = __float_as_uint(value);
  if (u == 0x80000000u) u = 0u;                             // -0.0 == +0.0
  if ((u & 0x7fffffffu) > 0x7f800000u) return kNegInfKey;   // every NaN bit pattern ranks as -inf
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(unsigned key) {  // order_key's inverse (NaN and -0.0 folded)
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

__device__ __forceinline__ bool finite_key(unsigned key) {
  return key != 0xff800000u && key != kNegInfKey;  // not +inf, not -inf (NaN has -inf's key)
}

// Level 0 in value space: 4096 equal-width bins over the row's finite [lo, hi], +inf in the top bin, -inf (and
// NaN, which has its key) in the bottom one. Non-decreasing in the value (float rounding is monotone), so it selects exactly.
// Equal value-width bins put few keys in the k-th value's bin whatever the row's scale and sign; bins on
// the order key's bits are 1/8 octave wide across zero and hold a few percent of a normal-looking row.
__device__ __forceinline__ unsigned value_digit(unsigned key, float lo, float inv_width) {
  if (key >= 0xff800000u) return kBins - 1;
  const float q = (key_value(key) - lo) * inv_width;
  return q <= 0.f ? 0u : (q >= (float)(kBins - 1) ? (unsigned)(kBins - 1) : (unsigned)q);
}

__device__ __forceinline__ int out_value(int local, int req, const Params& p) {
  if (p.block_table == nullptr || local < 0) return local;
  const int page = p.block_table[(long long)req * p.bt_stride + local / kPage];
  return page * kPage + local % kPage;
}

// The bin of `h` holding the k_rem-th largest element (bins ordered by digit, larger = larger key), how many
// elements of it are still needed, and its count; every thread gets them. Two block barriers.
__device__ __forceinline__ void find_bin(const int* h, int k_rem, Smem& s, int& bin, int& need, int& count) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  int v[kBinsPerThread];
  int mine = 0;
#pragma unroll
  for (int i = 0; i < kBinsPerThread; ++i) {
    v[i] = h[t * kBinsPerThread + i];
    mine += v[i];
  }
  int incl = mine;  // sum over lanes >= lane of this warp
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_down_sync(0xffffffffu, incl, off);
    if (lane + off < 32) incl += y;
  }
  if (lane == 0) s.warp_a[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int w = s.warp_a[lane];
    int wi = w;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_down_sync(0xffffffffu, wi, off);
      if (lane + off < 32) wi += y;
    }
    s.warp_b[lane] = wi - w;  // sum over warps above this one
  }
  __syncthreads();
  int above = s.warp_b[warp] + (incl - mine);
#pragma unroll
  for (int i = kBinsPerThread - 1; i >= 0; --i) {
    if (above < k_rem && above + v[i] >= k_rem) {
      s.found[0] = t * kBinsPerThread + i;
      s.found[1] = k_rem - above;
      s.found[2] = v[i];
    }
    above += v[i];
  }
  __syncthreads();
  bin = s.found[0];
  need = s.found[1];
  count = s.found[2];
}

// The cluster-wide histogram of this level (this CTA's own when alone); every thread returns after a barrier.
__device__ __forceinline__ const int* merged_hist(int* h, Smem& s, cg::cluster_group& cluster, int csize) {
  const int t = threadIdx.x;
  const int* src_hist = h;
  if (csize > 1) {
    cluster.sync();  // every CTA's histogram of this level is complete
    int sum[kBinsPerThread] = {};
    for (int q = 0; q < csize; ++q) {  // all of a peer's loads issued before their adds
      const int* peer = cluster.map_shared_rank(h, q);
      int v[kBinsPerThread];
#pragma unroll
      for (int i = 0; i < kBinsPerThread; ++i) v[i] = peer[t + i * kThreads];
#pragma unroll
      for (int i = 0; i < kBinsPerThread; ++i) sum[i] += v[i];
    }
#pragma unroll
    for (int i = 0; i < kBinsPerThread; ++i) s.total[t + i * kThreads] = sum[i];
    src_hist = s.total;
  }
  __syncthreads();
  return src_hist;
}

template <int VEC>
struct Row {
  int start, end;  // the window
  int a0;          // first column of step 0 (start rounded down to VEC)
  int first_step, num_steps;  // this CTA's steps
  int warp_first, warp_steps; // this warp's steps within the CTA's (relative)
};

// The key array: index (step - first_step) * 32 * VEC + lane * VEC + i holds column a0 + step * 32 * VEC +
// lane * VEC + i; columns outside the window are never read back as valid (checked against start/end).
template <int VEC>
__device__ __forceinline__ bool valid_col(int col, const Row<VEC>& r) {
  return col >= r.start && col < r.end;
}

template <int VEC>
__global__ void __launch_bounds__(kThreads, 1) topk_rows_kernel(Params p) {
  pdl_wait();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned* keys = reinterpret_cast<unsigned*>(smem_raw);
  Smem& s = *reinterpret_cast<Smem*>(smem_raw + (size_t)p.chunk_cols * sizeof(unsigned));
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();
  const int csize = (int)cluster.num_blocks();
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  constexpr int kStepCols = 32 * VEC;

  for (int row = blockIdx.y; row < p.rows; row += gridDim.y) {
    Row<VEC> r;
    r.end = p.ends[row];
    r.start = p.starts != nullptr ? p.starts[row] : 0;
    const int req = p.row_request != nullptr ? p.row_request[row] : row;
    int* out_row = p.out + (long long)row * p.k;
    const int width = r.end - r.start;

    if (width <= p.k) {  // every visible column, then -1: no selection (uniform over the cluster)
      const int per = (p.k + csize - 1) / csize;
      const int lo = rank * per, hi = min(p.k, lo + per);
      for (int j = lo + t; j < hi; j += kThreads) out_row[j] = out_value(j < width ? j : -1, req, p);
      continue;  // no cluster barrier taken on this branch by any CTA of the cluster
    }

    r.a0 = r.start & ~(VEC - 1);
    const int total_steps = (r.end - r.a0 + kStepCols - 1) / kStepCols;
    const int chunk_steps = (total_steps + csize - 1) / csize;
    r.first_step = min(total_steps, rank * chunk_steps);
    r.num_steps = min(total_steps, r.first_step + chunk_steps) - r.first_step;
    r.warp_steps = (r.num_steps + kWarps - 1) / kWarps;
    r.warp_first = min(r.num_steps, warp * r.warp_steps);
    const int warp_last = min(r.num_steps, r.warp_first + r.warp_steps);
    const float* x_row = p.x + (long long)row * p.x_stride;

    // ---- P0: global -> shared keys, local min / max over the window
    unsigned kmin = 0xffffffffu, kmax = 0u, fmin = 0xffffffffu, fmax = 0u;
    for (int s0 = r.warp_first; s0 < warp_last; s0 += 4) {
      float vals[4][VEC];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col0 = r.a0 + (r.first_step + s0 + j) * kStepCols + lane * VEC;
        if (s0 + j < warp_last) {
          if (VEC == 4 && col0 + 4 <= r.end) {
            const float4 f = __ldg(reinterpret_cast<const float4*>(x_row + col0));
            vals[j][0] = f.x;
            vals[j][VEC > 1 ? 1 : 0] = f.y;
            vals[j][VEC > 2 ? 2 : 0] = f.z;
            vals[j][VEC > 3 ? 3 : 0] = f.w;
          } else {
#pragma unroll
            for (int i = 0; i < VEC; ++i) vals[j][i] = (col0 + i < r.end) ? __ldg(x_row + col0 + i) : 0.f;
          }
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (s0 + j < warp_last) {
          const int col0 = r.a0 + (r.first_step + s0 + j) * kStepCols + lane * VEC;
          unsigned kk[VEC];
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            kk[i] = order_key(vals[j][i]);
            if (valid_col(col0 + i, r)) {
              kmin = min(kmin, kk[i]);
              kmax = max(kmax, kk[i]);
              if (finite_key(kk[i])) {
                fmin = min(fmin, kk[i]);
                fmax = max(fmax, kk[i]);
              }
            }
          }
          unsigned* dst = keys + (s0 + j) * kStepCols + lane * VEC;
          if (VEC == 4) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(kk[0], kk[VEC > 1 ? 1 : 0], kk[VEC > 2 ? 2 : 0],
                                                        kk[VEC > 3 ? 3 : 0]);
          } else {
#pragma unroll
            for (int i = 0; i < VEC; ++i) dst[i] = kk[i];
          }
        }
      }
    }
    kmin = __reduce_min_sync(0xffffffffu, kmin);
    kmax = __reduce_max_sync(0xffffffffu, kmax);
    fmin = __reduce_min_sync(0xffffffffu, fmin);
    fmax = __reduce_max_sync(0xffffffffu, fmax);
    if (lane == 0) {
      s.warp_a[warp] = (int)kmin;
      s.warp_b[warp] = (int)kmax;
      s.cand_key[warp] = fmin;  // the candidate list is free until the levels: borrowed as scratch
      s.cand_key[kWarps + warp] = fmax;
    }
    __syncthreads();
    if (warp == 0) {
      unsigned a = (unsigned)s.warp_a[lane], b = (unsigned)s.warp_b[lane];
      unsigned fa = s.cand_key[lane], fb = s.cand_key[kWarps + lane];
      a = __reduce_min_sync(0xffffffffu, a);
      b = __reduce_max_sync(0xffffffffu, b);
      fa = __reduce_min_sync(0xffffffffu, fa);
      fb = __reduce_max_sync(0xffffffffu, fb);
      if (lane == 0) {
        s.exports[0] = a;
        s.exports[1] = b;
        s.exports[4] = fa;
        s.exports[5] = fb;
      }
    }
    cluster.sync();  // exports visible cluster-wide; the key array complete within each CTA
    if (t == 0) {
      unsigned a = 0xffffffffu, b = 0u, fa = 0xffffffffu, fb = 0u;
      for (int q = 0; q < csize; ++q) {
        const unsigned* e = cluster.map_shared_rank(s.exports, q);
        a = min(a, e[0]);
        b = max(b, e[1]);
        fa = min(fa, e[4]);
        fb = max(fb, e[5]);
      }
      s.bcast[0] = a;
      s.bcast[1] = b;
      s.bcast[2] = fa;
      s.bcast[3] = fb;
      s.cand_count = 0;  // ordered before any peer's append by the level barriers below
    }
    __syncthreads();
    const unsigned lo = s.bcast[0], hi = s.bcast[1];
    const unsigned span = hi - lo;
    // Value-space level 0 when the finite values span a positive, representable range.
    const float vlo = key_value(s.bcast[2]), vhi = key_value(s.bcast[3]);
    const float vrange = vhi - vlo;
    const bool value_level = s.bcast[2] <= s.bcast[3] && vrange > 0.f && vrange < 3.0e38f;
    const float inv_width = value_level ? (float)kBins / vrange : 0.f;

    // ---- P1..P3: radix select on u = key - lo, digits from the top set bit of span down
    int shift = span == 0u ? 0 : 32 - __clz(span);
    unsigned prefix = 0u;
    int k_rem = p.k;
    bool rank_bin = false;
    bool by_value = false;  // the threshold class is a value bin (value_digit == prefix), not a key prefix
    int level = 0;
    if (value_level && shift > 0) {
      int* h = s.hist[0];
      for (int b = t; b < kBins; b += kThreads) h[b] = 0;
      __syncthreads();
      for (int s0 = r.warp_first; s0 < warp_last; ++s0) {
        const int col0 = r.a0 + (r.first_step + s0) * kStepCols + lane * VEC;
        const unsigned* src = keys + s0 * kStepCols + lane * VEC;
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          if (valid_col(col0 + i, r)) atomicAdd(&h[value_digit(src[i], vlo, inv_width)], 1);
      }
      const int* src_hist = merged_hist(h, s, cluster, csize);
      int bin, need, count;
      find_bin(src_hist, k_rem, s, bin, need, count);
      level = 1;
      if (count == need || count <= kCandCap) {  // resolved in value space; else key levels from scratch
        by_value = true;
        prefix = (unsigned)bin;
        k_rem = need;
        rank_bin = count != need;
        shift = 0;
      }
    }
    for (; shift > 0; ++level) {
      const int nshift = max(shift - kRadixBits, 0);
      const int digit_bits = shift - nshift;
      const unsigned digit_mask = (1u << digit_bits) - 1u;
      int* h = s.hist[level & 1];
      for (int b = t; b < kBins; b += kThreads) h[b] = 0;
      __syncthreads();
      for (int s0 = r.warp_first; s0 < warp_last; ++s0) {
        const int col0 = r.a0 + (r.first_step + s0) * kStepCols + lane * VEC;
        const unsigned* src = keys + s0 * kStepCols + lane * VEC;
        unsigned kk[VEC];  // (the key levels)
        if (VEC == 4) {
          const uint4 q4 = *reinterpret_cast<const uint4*>(src);
          kk[0] = q4.x;
          kk[VEC > 1 ? 1 : 0] = q4.y;
          kk[VEC > 2 ? 2 : 0] = q4.z;
          kk[VEC > 3 ? 3 : 0] = q4.w;
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i) kk[i] = src[i];
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const unsigned u = kk[i] - lo;
          const bool match = valid_col(col0 + i, r) && (shift >= 32 || (u >> shift) == prefix);
          if (match) atomicAdd(&h[(u >> nshift) & digit_mask], 1);
        }
      }
      const int* src_hist = merged_hist(h, s, cluster, csize);
      int bin, need, count;
      find_bin(src_hist, k_rem, s, bin, need, count);
      prefix = (shift >= 32 ? 0u : (prefix << digit_bits)) | (unsigned)bin;
      shift = nshift;
      k_rem = need;
      if (count == need) break;  // the whole bin is taken: no finer digit needed
      if (count <= kCandCap && shift > 0) {  // few keys left in the bin: rank them directly
        rank_bin = true;
        break;
      }
    }
    // The threshold class: u >> shift == prefix. Keys above it are all taken. Of the class, either the first
    // k_rem in column order (exact key equality, or the whole class), or (rank_bin) the k_rem best by rank.
    const int need_eq = k_rem;
    const int count_gt = p.k - need_eq;

    // ---- P4: counts above / equal per warp, then offsets over warps and CTAs (column order)
    int my_gt = 0, my_eq = 0;
    for (int s0 = r.warp_first; s0 < warp_last; ++s0) {
      const int col0 = r.a0 + (r.first_step + s0) * kStepCols + lane * VEC;
      const unsigned* src = keys + s0 * kStepCols + lane * VEC;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        if (valid_col(col0 + i, r)) {
          const unsigned c = by_value ? value_digit(src[i], vlo, inv_width) : (src[i] - lo) >> shift;
          my_gt += c > prefix;
          if (c == prefix) {
            if (rank_bin) {  // append to rank 0's candidate list (its count is <= kCandCap by construction)
              int* count_at = csize > 1 ? cluster.map_shared_rank(&s.cand_count, 0) : &s.cand_count;
              const int slot = atomicAdd(count_at, 1);
              unsigned* keys_at = csize > 1 ? cluster.map_shared_rank(s.cand_key, 0) : s.cand_key;
              int* cols_at = csize > 1 ? cluster.map_shared_rank(s.cand_col, 0) : s.cand_col;
              keys_at[slot] = src[i];
              cols_at[slot] = col0 + i;
            } else {
              ++my_eq;
            }
          }
        }
      }
    }
    my_gt = __reduce_add_sync(0xffffffffu, my_gt);
    my_eq = __reduce_add_sync(0xffffffffu, my_eq);
    if (lane == 0) {
      s.warp_a[warp] = my_gt;
      s.warp_b[warp] = my_eq;
    }
    __syncthreads();
    if (warp == 0) {  // exclusive scan over warps (in place), CTA totals exported
      const int g = s.warp_a[lane], e = s.warp_b[lane];
      int gi = g, ei = e;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int yg = __shfl_up_sync(0xffffffffu, gi, off);
        const int ye = __shfl_up_sync(0xffffffffu, ei, off);
        if (lane >= off) {
          gi += yg;
          ei += ye;
        }
      }
      s.warp_a[lane] = gi - g;
      s.warp_b[lane] = ei - e;
      if (lane == 31) {
        s.exports[2] = (unsigned)gi;
        s.exports[3] = (unsigned)ei;
      }
    }
    int cta_gt = 0, cta_eq = 0;
    if (csize > 1) {
      cluster.sync();
      for (int q = 0; q < rank; ++q) {
        const unsigned* e = cluster.map_shared_rank(s.exports, q);
        cta_gt += (int)e[2];
        cta_eq += (int)e[3];
      }
    } else {
      __syncthreads();
    }

    // ---- P5: ordered write
    int run_gt = cta_gt + s.warp_a[warp];
    int run_eq = cta_eq + s.warp_b[warp];
    for (int s0 = r.warp_first; s0 < warp_last; ++s0) {
      const int col0 = r.a0 + (r.first_step + s0) * kStepCols + lane * VEC;
      const unsigned* src = keys + s0 * kStepCols + lane * VEC;
      int cls[VEC];  // 2 above, 1 equal, 0 neither
      int packed = 0;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        cls[i] = 0;
        if (valid_col(col0 + i, r)) {
          const unsigned c = by_value ? value_digit(src[i], vlo, inv_width) : (src[i] - lo) >> shift;
          cls[i] = c > prefix ? 2 : (c == prefix && !rank_bin ? 1 : 0);
        }
        packed += cls[i] == 2 ? 1 : (cls[i] == 1 ? (1 << 16) : 0);
      }
      int incl = packed;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += y;
      }
      const int step_total = __shfl_sync(0xffffffffu, incl, 31);
      int g = run_gt + ((incl - packed) & 0xffff);
      int e = run_eq + ((incl - packed) >> 16);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        if (cls[i] == 2) {
          out_row[g] = out_value(col0 + i - r.start, req, p);
          ++g;
        } else if (cls[i] == 1) {
          if (e < need_eq) out_row[count_gt + e] = out_value(col0 + i - r.start, req, p);
          ++e;
        }  // (rank_bin: class keys were counted in neither total, so cls is never 1 here)
      }
      run_gt += step_total & 0xffff;
      run_eq += step_total >> 16;
    }
    if (rank_bin && rank == 0) {
      // Every CTA appended its candidates before the counts barrier above. Exact order: a key beats another
      // when larger, or equal at a lower column; the best need_eq are taken, written in column order.
      const int n = s.cand_count;
      for (int i = t; i < n; i += kThreads) {
        const unsigned ki = s.cand_key[i];
        const int ci = s.cand_col[i];
        int better = 0;
        for (int j = 0; j < n; ++j) {
          const unsigned kj = s.cand_key[j];
          better += kj > ki || (kj == ki && s.cand_col[j] < ci);
        }
        s.cand_sel[i] = better < need_eq;
      }
      __syncthreads();
      for (int i = t; i < n; i += kThreads) {
        if (s.cand_sel[i]) {
          const int ci = s.cand_col[i];
          int before = 0;
          for (int j = 0; j < n; ++j) before += s.cand_sel[j] && s.cand_col[j] < ci;
          out_row[count_gt + before] = out_value(ci - r.start, req, p);
        }
      }
    }
    // No CTA may reuse its shared memory (next row) or exit while a peer still reads or writes it.
    if (csize > 1) cluster.sync(); else __syncthreads();
  }
}

}  // namespace

extern "C" {

// Shared memory bytes a launch needs for `chunk_cols` keys per CTA.
long long dsa_topk_smem_bytes(int chunk_cols) {
  return (long long)chunk_cols * (long long)sizeof(unsigned) + (long long)sizeof(Smem);
}

const char* dsa_topk_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

// Launch on `stream`; returns a cudaError_t (0 = success). `vec` is 4 when the rows are 16-byte aligned
// (row base and stride), else 1. `cluster` in 1..8 CTAs per row.
int dsa_topk_launch(const float* x, long long x_stride, int rows, int cols, int k, const int* starts,
                    const int* ends, const int* block_table, long long bt_stride, const int* row_request, int* out,
                    int cluster, int vec, int chunk_cols, int max_grid_rows, void* stream) {
  Params p{x, x_stride, rows, cols, k, starts, ends, block_table, bt_stride, row_request, out, chunk_cols};
  const size_t smem = (size_t)dsa_topk_smem_bytes(chunk_cols);
  void (*kernel)(Params) = vec == 4 ? topk_rows_kernel<4> : topk_rows_kernel<1>;
  // Raise the kernel's shared-memory limit once per (device, variant) to the largest size asked so far: the
  // attribute call is host work that a per-launch hot path (and a graph capture) need not repeat.
  static size_t raised[64][2];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return (int)err;
  size_t& done = raised[device & 63][vec == 4 ? 1 : 0];
  if (smem > done) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return (int)err;
    done = smem;
  }
  err = launch_in_clusters(kernel, dim3((unsigned)cluster, (unsigned)min(rows, max_grid_rows), 1), kThreads,
                           (unsigned)cluster, (size_t)smem, (cudaStream_t)stream, p);
  if (err != cudaSuccess) return (int)err;
  return (int)cudaGetLastError();
}

}  // extern "C"
