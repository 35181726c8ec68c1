// Exact top-k of fp32 rows with the row held in REGISTERS (sm90 / sm100): the fast path for rows up to 128K
// columns (`topk.cu` keeps the shared-memory kernel for wider rows). Compiled at first use (`jit.py`).
//
// Contract (the reference's `topk_indices`): per row r, the k largest values among columns [starts[r], ends[r]),
// ties to the lower column, int32 positions relative to starts[r] (or physical cache slots when a block table is
// given), -1 padding when the window holds <= k columns. A NaN ranks exactly as -inf and -0.0 equals +0.0. The
// order of the k positions is not part of the contract; it is fixed (deterministic): CTA, then warp, then lane,
// then the thread's own columns.
//
// Why this design (the shared-memory kernel paid ~9 us fixed plus ~1 us per 1K columns per CTA, four passes over
// shared memory and ~15 block barriers):
// - A CTA of 512 threads holds a chunk of KPT * 512 columns (KPT = 8, 16 or 32 keys per thread, 4K-16K columns)
//   as order-preserving uint32 keys in registers: the row is read from global memory once, coalesced (float4),
//   and every later pass is a loop over the thread's own registers, no shared-memory traffic except histogram
//   atomics. 512 threads x <= 64 registers lets 2 CTAs share an SM, so one CTA's loads overlap another's select.
// - A row longer than one chunk is split over a thread-block cluster of C <= 16 CTAs; the histograms are merged
//   through distributed shared memory (group sums first, then the one group of bins that holds the crossing),
//   so every CTA takes the same decisions without global scratch, global atomics or a second launch.
// - Radix select on the key with 11 / 11 / 10-bit digits (2048-bin histograms); a level stops the search as
//   soon as the threshold bin is taken whole (the usual case on real logits after two levels). Only keys in the
//   current threshold bin touch the histogram after level 1.
// - Ties at the exact k-th key (only when more keys equal it than are needed): a second radix select over the
//   tied keys' columns (key2 = ~column within 20 bits, larger = lower column) picks the lowest columns exactly.
// - The output positions: a block exclusive scan of per-thread selected counts (and the lower CTAs' totals), so
//   no atomic decides a position and the result is bitwise repeatable.
// - Rows are routed by their own window on the device, not by the launch's width (a padding bound: engines pad
//   decode logits to max_model_len): a row one CTA holds (its window within KPT * 512 columns of its start rounded
//   down to 4) is selected by one CTA of its cluster alone, the cluster's next such row by the next CTA; the
//   streaming kernel selects rows of up to 16K columns in registers the same way instead of streaming them.
// Launch shape and plan depend on tensor shapes only (no host synchronization: graph-capturable).

#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <cstddef>
#include <cstdio>

#include "cluster_launch.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kSoloMaxSpan = 32 * kThreads;  // rows one CTA holds in registers (32 keys per thread) are selected so
constexpr int kBinBits = 11;
constexpr int kBins = 1 << kBinBits;
constexpr int kBinsPerThread = kBins / kThreads;  // 4: one int4 per thread
static_assert(kBinsPerThread == 4, "find_bin reads one int4 of bins per thread");
constexpr int kPage = 64;
constexpr int kPeerBatch = 4;  // peers' DSMEM reads in flight together in find_bin (16 cost spills at 64 registers)
constexpr int kColBits = 20;  // the tie-break key ~column: windows are at most 16 x 16K columns (< 2^20)
constexpr unsigned kNegInfKey = 0x007fffffu;  // order_key(-inf); key 0 marks a column outside the window
// A probe build (benchmarks only, results wrong): the register select loads its keys, selects nothing, writes nothing.
#ifndef DSA_TOPK_PROBE_LOADS
#define DSA_TOPK_PROBE_LOADS 0
#endif
constexpr bool kProbeLoads = DSA_TOPK_PROBE_LOADS;
// A probe build of the streaming kernel (benchmarks only, results wrong): its sample and pass, no select, no write.
#ifndef DSA_TOPK_PROBE_STREAM_PASS
#define DSA_TOPK_PROBE_STREAM_PASS 0
#endif
constexpr bool kProbeStreamPass = DSA_TOPK_PROBE_STREAM_PASS;
// A probe build (benchmarks only, results right): thread 0 of the first CTA stamps the SM clock at each stage of its
// first row's register select (after a block barrier, so a stamp is the whole CTA's) and prints the cycles between.
#ifndef DSA_TOPK_STAGE_CLOCKS
#define DSA_TOPK_STAGE_CLOCKS 0
#endif
constexpr bool kStageClocks = DSA_TOPK_STAGE_CLOCKS;
// find_bin reads the peers' counts one peer per warp (all in one DSMEM round trip, through shared memory) where more
// than this many CTAs hold the row; below, warp 0 reads them kPeerBatch peers at a time. With one cluster barrier per
// level and warp 0 alone reading the lower peers' totals for the output offset, this cut the cluster rows by up to
// 1.1 us (H200, topk_variants_s15_h200.json: 1 x 32K 11.8 -> 10.8, 1 x 128K 14.6 -> 13.5, V4 1 x 32K 11.9 -> 10.8).
constexpr int kPeersByWarpFrom = 4;
constexpr int kMaxStages = 16;

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
  int aligned;  // 1: every row base is 16-byte aligned (float4 loads)
  // A routed launch (0: off, every row is this kernel's): the register-cluster kernel and the streaming kernel run
  // side by side on two streams, and each row is taken by exactly one of them, chosen on the device from the rows'
  // own windows (route_to_clusters). 1: this is the streaming kernel's share; 2: the cluster kernel's share.
  int route;
  int route_long_cols;  // rows longer than this are "long": they stream when route_long_rows or more rows are long
  int route_long_rows;
};

struct Shared {
  int hist[2][kBins];  // alternating per level, so a peer may still read the previous level's while we clear
  int group[2 * kBins / 32];  // a level's sums of 32 consecutive bins (read by the peers): the two halves alternate
                              // by level (find_bin)
  int warp_sum[kWarps];
  unsigned min_max[2][kWarps];  // per-warp min / max of a key set (block_min_max)
  int found[3];        // bin, k remaining within it, its count
  int cta_total;       // selected in this CTA (read by the higher-ranked peers)
  int cta_base;        // the lower-ranked peers' selected (summed by warp 0)
  // find_bin past kPeersByWarpFrom CTAs: the peers' group sums (read and written as int2: 8-byte aligned; after
  // cta_total and cta_base it fell on a 4-byte boundary, a misaligned address on the H100 at 9 CTAs per row)
  alignas(16) int peer_sums[16 * kBins / 32];
};
// The fields find_bin reads and writes as int2 / int4 (a misaligned one faults only on the GPU): checked where the
// layout is fixed, so any build catches a field added in front of them
static_assert(offsetof(Shared, hist) % 16 == 0 && offsetof(Shared, group) % 16 == 0 &&
                  offsetof(Shared, peer_sums) % 16 == 0,
              "Shared's vector-accessed fields must be 16-byte aligned");

__device__ __forceinline__ unsigned order_key(float value) {
  unsigned u = __float_as_uint(value);
  if (u == 0x80000000u) u = 0u;                            // -0.0 == +0.0
  if ((u & 0x7fffffffu) > 0x7f800000u) return kNegInfKey;  // every NaN bit pattern ranks as -inf
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);       // >= kNegInfKey > 0 for every value
}

__device__ __forceinline__ int out_value(int local, int req, const Params& p) {
  if (p.block_table == nullptr || local < 0) return local;
  const int page = p.block_table[(long long)req * p.bt_stride + local / kPage];
  return page * kPage + local % kPage;
}

// A routed launch's per-row choice, the same in every CTA of both kernels (each reads every row's window): a row
// that one CTA holds in registers (span <= kSoloSpan) or whose window holds <= k columns is the streaming kernel's
// (one CTA, no cluster); a longer one the cluster kernel's, unless it is long (> route_long_cols) and at least
// route_long_rows rows are long, where one CTA streaming each row beats the clusters' waves. Engines pad decode
// logits to max_model_len, so only the rows' own lengths can tell a short row from a long one; the launch's width
// is a bound.
// Whether the long rows of a routed launch stream (route_long_rows or more of them are long): every thread of the
// block gets the answer, from a block-wide count over every row's window.
__device__ __forceinline__ bool routed_long_rows_stream(const Params& p) {
  int total = 0;
  for (int r0 = 0; r0 < p.rows; r0 += blockDim.x) {  // uniform trip count: every thread reaches each barrier
    const int r = r0 + (int)threadIdx.x;
    bool is_long = false;
    if (r < p.rows) is_long = p.ends[r] - (p.starts != nullptr ? p.starts[r] : 0) > p.route_long_cols;
    total += __syncthreads_count(is_long);
  }
  return total >= p.route_long_rows;
}

// Whether a routed launch's cluster kernel takes this row (uniform over the block: one row's window).
// `long_rows_stream`: routed_long_rows_stream of the launch (kept in shared memory by the kernels: a register live
// across the row loop costs the 64-register kernels spills).
__device__ __forceinline__ bool route_to_clusters(const Params& p, int start, int end, bool long_rows_stream) {
  if (end - start <= p.k || end - (start & ~3) <= kSoloMaxSpan) return false;
  return end - start <= p.route_long_cols || !long_rows_stream;
}

// The inclusive prefix sum of `v` over the warp's lanes (every lane takes part).
__device__ __forceinline__ int warp_inclusive_sum(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v += y;
  }
  return v;
}

// The inclusive suffix sum of `v` over the warp's lanes: lanes >= lane (every lane takes part).
__device__ __forceinline__ int warp_suffix_sum(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_down_sync(0xffffffffu, v, off);
    if (lane + off < 32) v += y;
  }
  return v;
}

// The stage-clock probe (DSA_TOPK_STAGE_CLOCKS): thread 0 stamps the SM clock at each stage of its CTA's first
// selected row into shared memory (with the count, the row's facts and a done flag in the slots after the stamps),
// and the launch's first CTA prints them when the kernel ends: nothing is held in registers across the select, and
// printf (a call: live registers saved around it) runs after the row loop, so the 64-register kernels do not spill
// more for the probe.
__shared__ long long stage_stamps[kStageClocks ? kMaxStages + 5 : 1];
constexpr int kStampCount = kMaxStages, kStampDone = kMaxStages + 1, kStampFacts = kMaxStages + 2;
__device__ __forceinline__ void init_stage_clocks() {
  if (kStageClocks && threadIdx.x == 0) stage_stamps[kStampDone] = 0;
}
__device__ __forceinline__ void stage_clock() {
  if (!kStageClocks || threadIdx.x != 0 || stage_stamps[kStampDone] != 0) return;
  const int n = (int)stage_stamps[kStampCount];
  if (n < kMaxStages) stage_stamps[n] = clock64();
  stage_stamps[kStampCount] = n + 1;
}
__device__ __forceinline__ void first_stage_clock() {  // a row's start (a CTA's later rows leave the stamps be)
  if (kStageClocks && threadIdx.x == 0 && stage_stamps[kStampDone] == 0) stage_stamps[kStampCount] = 0;
  stage_clock();
}
__device__ __forceinline__ void last_stage_clock(int kpt, int csize, int level) {
  stage_clock();
  if (!kStageClocks || threadIdx.x != 0 || stage_stamps[kStampDone] != 0) return;
  stage_stamps[kStampFacts] = kpt;
  stage_stamps[kStampFacts + 1] = csize;
  stage_stamps[kStampFacts + 2] = level;
  stage_stamps[kStampDone] = 1;
}
__device__ __noinline__ void print_stage_clocks() {
  if (!kStageClocks || threadIdx.x != 0 || blockIdx.x != 0 || blockIdx.y != 0 || stage_stamps[kStampDone] == 0)
    return;
  const int n = min((int)stage_stamps[kStampCount], kMaxStages);
  printf("stage clocks KPT %d csize %d levels %d: total %lld |", (int)stage_stamps[kStampFacts],
         (int)stage_stamps[kStampFacts + 1], (int)stage_stamps[kStampFacts + 2], stage_stamps[n - 1] - stage_stamps[0]);
  for (int i = 1; i < n; ++i) printf(" %lld", stage_stamps[i] - stage_stamps[i - 1]);
  printf("\n");
}

__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::); }

// The first step of a find_bin, in warp 0: lane l holds the counts `lo` / `hi` of groups 2 l and 2 l + 1 (32 bins
// each). Every lane gets the group holding the k_rem-th largest and the count of the keys in the groups above it.
__device__ __forceinline__ void crossing_group(int lo, int hi, int k_rem, int& group, int& above) {
  const int lane = threadIdx.x & 31;
  const int both = lo + hi;
  const int incl = warp_suffix_sum(both);  // over lanes >= lane: groups above, larger keys first
  const int above_hi = incl - both, above_lo = above_hi + hi;
  group = -1;
  above = 0;
  if (above_hi < k_rem && above_hi + hi >= k_rem) {
    group = 2 * lane + 1;
    above = above_hi;
  } else if (above_lo < k_rem && above_lo + lo >= k_rem) {
    group = 2 * lane;
    above = above_lo;
  }
  const int src = __ffs(__ballot_sync(0xffffffffu, group >= 0)) - 1;  // exactly one lane holds the crossing
  group = __shfl_sync(0xffffffffu, group, src);
  above = __shfl_sync(0xffffffffu, above, src);
}

// The last step of a find_bin, in warp 0: lane l holds the count `c` of bin 32 * group + l (the group holding the
// k_rem-th largest), `above` counts the keys in the bins above the group. The lane of the crossing bin writes it, the
// k_rem left within it and its count to found[0..2].
__device__ __forceinline__ void publish_crossing_bin(int c, int group, int above, int k_rem, int* found) {
  const int lane = threadIdx.x & 31;
  const int incl = warp_suffix_sum(c);  // over lanes >= lane: bins above, larger keys first
  const int above_bin = above + incl - c;
  if (above_bin < k_rem && above_bin + c >= k_rem) {
    found[0] = group * 32 + lane;
    found[1] = k_rem - above_bin;
    found[2] = c;
  }
}

// The bin holding the k_rem-th largest element of this level's (cluster-merged) histogram `h`, how many of it
// are still needed, and its count; every thread of every CTA of the cluster gets the same answer. Two stages, so
// that a cluster moves 64 + 32 counts per CTA over distributed shared memory instead of every peer's 2048 bins
// (which cost ~1 us per MB moved: 64 KB per CTA per level at 8 CTAs): each CTA sums its bins in 64 groups of
// 32; warp 0 merges the peers' group sums, finds the group holding the crossing, then merges and scans only that
// group's 32 bins. `next` (the other buffer) is cleared on the way: every peer finished reading it one level ago,
// before this level's cluster barrier. Barriers: the cluster's (or the block's) once, the block's twice (three more
// where more than kPeersByWarpFrom CTAs hold the row: every warp reads a peer).
__device__ __forceinline__ void cluster_or_block_sync(cg::cluster_group& cluster, int csize) {
  if (csize > 1) cluster.sync(); else __syncthreads();
}

// `used`: the CTAs 0..used-1 of the cluster whose histograms can be non-zero (the ones holding columns of the row;
// a row shorter than the launch's cluster leaves the others empty, or they have left: see topk_registers_kernel).
// Up to kPeersByWarpFrom peers, warp 0 reads their counts kPeerBatch at a time, so their DSMEM round trips overlap
// (a loop that waits for each peer in turn pays one round trip per peer and stage: H200, 1 x 128K on 16 CTAs 15.5
// -> 14.2 us, 32 rows of 32K in a 10-CTA cluster sized for a 163840 width 35.3 -> 22.9 with the early exit).
__device__ __forceinline__ void find_bin(int* h, int* next, int k_rem, Shared& s, cg::cluster_group& cluster,
                                         int csize, int used, int& bin, int& need, int& count) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  // One cluster barrier per level: the group sums alternate between two halves of s.group by the histogram's
  // parity, so a peer may still read the previous level's while we write this one's; `next` is cleared after the
  // barrier, when every peer has read it (one level ago, before it arrived).
  int* group_sums = s.group + (h == s.hist[0] ? 0 : kBins / 32);
  __syncthreads();  // this CTA's atomics of this level are complete
  const int4 v = reinterpret_cast<const int4*>(h)[t];
  int m = v.x + v.y + v.z + v.w;  // bins 4t..4t+3; 8 consecutive threads hold one group of 32 bins
  m += __shfl_xor_sync(0xffffffffu, m, 1);
  m += __shfl_xor_sync(0xffffffffu, m, 2);
  m += __shfl_xor_sync(0xffffffffu, m, 4);
  if ((lane & 7) == 0) group_sums[t >> 3] = m;
  cluster_or_block_sync(cluster, csize);  // every CTA's group sums (and so its atomics) are complete
  reinterpret_cast<int4*>(next)[t] = make_int4(0, 0, 0, 0);
  const bool by_warp = used > kPeersByWarpFrom;  // uniform over the cluster
  if (by_warp) {  // warp w: peer w's 64 group sums
    if (warp < used)
      reinterpret_cast<int2*>(s.peer_sums)[warp * 32 + lane] =
          reinterpret_cast<const int2*>(cluster.map_shared_rank(group_sums, warp))[lane];
    __syncthreads();
  }
  if (warp == 0) {
    int lo = 0, hi = 0;  // merged sums of groups 2 * lane and 2 * lane + 1
    if (by_warp) {
      for (int q = 0; q < used; ++q) {
        const int2 pair = reinterpret_cast<const int2*>(s.peer_sums)[q * 32 + lane];
        lo += pair.x;
        hi += pair.y;
      }
    } else if (used <= 1) {
      const int2 pair = reinterpret_cast<const int2*>(group_sums)[lane];
      lo = pair.x;
      hi = pair.y;
    } else {
      for (int q0 = 0; q0 < used; q0 += kPeerBatch) {
        int2 pair[kPeerBatch];
#pragma unroll
        for (int q = 0; q < kPeerBatch; ++q)
          pair[q] = q0 + q < used ? reinterpret_cast<const int2*>(cluster.map_shared_rank(group_sums, q0 + q))[lane]
                                  : make_int2(0, 0);
#pragma unroll
        for (int q = 0; q < kPeerBatch; ++q) {
          lo += pair[q].x;
          hi += pair[q].y;
        }
      }
    }
    int group, above;
    crossing_group(lo, hi, k_rem, group, above);
    int c = 0;  // merged count of bin 32 * group + lane
    if (by_warp) {  // the bins are read by every warp below
      if (lane == 0) {
        s.found[0] = group;
        s.found[1] = above;
      }
    } else if (used <= 1) {
      c = h[group * 32 + lane];
    } else {
      for (int q0 = 0; q0 < used; q0 += kPeerBatch) {
        int part[kPeerBatch];
#pragma unroll
        for (int q = 0; q < kPeerBatch; ++q)
          part[q] = q0 + q < used ? cluster.map_shared_rank(h, q0 + q)[group * 32 + lane] : 0;
#pragma unroll
        for (int q = 0; q < kPeerBatch; ++q) c += part[q];
      }
    }
    if (!by_warp) publish_crossing_bin(c, group, above, k_rem, s.found);
  }
  if (by_warp) {  // warp w: peer w's count of each bin of the crossing group
    __syncthreads();  // the group is published; warp 0 has read the group sums
    const int group = s.found[0], above = s.found[1];
    if (warp < used) s.peer_sums[warp * 32 + lane] = cluster.map_shared_rank(h, warp)[group * 32 + lane];
    __syncthreads();  // (every warp read found[] before warp 0 publishes below)
    if (warp == 0) {
      int c = 0;
      for (int q = 0; q < used; ++q) c += s.peer_sums[q * 32 + lane];
      publish_crossing_bin(c, group, above, k_rem, s.found);
    }
  }
  __syncthreads();
  bin = s.found[0];
  need = s.found[1];
  count = s.found[2];
}

// The block's min and max of the threads' `lo` / `hi` (every thread gets them). Why: a radix select over keys that
// share their high bits (the candidates are all >= one threshold; a row's logits span few exponents) would put them
// all in a few bins of its first 11-bit level, serialising the shared-memory atomics; starting at the highest bit
// where min and max differ spreads them over the bins and saves the levels above.
template <int T, class S>
__device__ __forceinline__ void block_min_max(unsigned& lo, unsigned& hi, S& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  if (lane == 0) {
    s.min_max[0][warp] = lo;
    s.min_max[1][warp] = hi;
  }
  __syncthreads();
#pragma unroll
  for (int w = 0; w < T / 32; ++w) {
    lo = min(lo, s.min_max[0][w]);
    hi = max(hi, s.min_max[1][w]);
  }
}

// The radix start for keys in [lo, hi]: the bits above the highest one where they differ are common (the class
// prefix), so the first level reads the 11 bits below it.
__device__ __forceinline__ void radix_start(unsigned lo, unsigned hi, int& shift, unsigned& prefix) {
  const unsigned diff = lo ^ hi;
  shift = diff == 0u ? 0 : 32 - __clz(diff);
  prefix = shift >= 32 ? 0u : hi >> shift;
}

// The first radix level's digit: a window of exponents. Real logits crowd into few of the top 11 key bits (sign,
// exponent, 2 mantissa bits: on real V3.2 decode logits, 8K columns fill ~100 of those bins, the fullest with ~440
// keys), and the shared-memory atomics on a full bin serialise. This digit keeps the sign, the exponents 2^-15 ..
// 2^15 and 5 mantissa bits (32 bins an octave, like fp16's top bits: ~560 bins filled, the fullest ~70), with one
// clamp bin each for magnitudes below and above that window. It is monotone in the key, so the bins still order the
// keys, and each in-window bin is exactly the keys sharing a 14-bit prefix (shift kWindowShift): the levels below
// go on from there as before. A clamp bin is no such prefix: a row whose k-th key lies in one (logits all beyond
// 2^15 or below 2^-15 in magnitude) runs the plain levels from bit 31 after it, on the whole row.
constexpr int kWindowLowExp = 112;  // biased fp32 exponent of 2^-15

// The window with M mantissa bits: 2^(M + 6) bins (two sides of 31 exponents x 2^M steps and two clamp bins each).
// window_bin / window_prefix: M = 5, one histogram of 2048 bins, 14-bit prefixes at shift 18.
template <int M>
struct ExponentWindow {
  static constexpr int kShift = 23 - M;               // key >> kShift: sign, 8 exponent bits, M mantissa bits
  static constexpr int kBinCount = 1 << (M + 6);
  static constexpr int kPerSide = 31 << M;            // in-window bins per sign, between its two clamp bins
  static constexpr unsigned kSign = 1u << (8 + M);    // the sign bit of the prefix (set: >= +0)
  static constexpr int kLow = kWindowLowExp << M;     // the prefix's exponent and mantissa bits at 2^-15
  static_assert(2 * (kPerSide + 2) <= kBinCount, "the window's bins fit its histogram");

  static __host__ __device__ __forceinline__ int bin(unsigned key) {
    const unsigned prefix = key >> kShift;
    const int low = (int)(prefix & (kSign - 1u));  // exponent and mantissa bits (negatives: inverted, as the key)
    if (prefix & kSign) {  // >= +0: bins kBinCount / 2 (below the window) .. kBinCount / 2 + 1 + off .. top (above)
      const int off = low - kLow;
      return off < 0 ? kBinCount / 2 : off >= kPerSide ? kBinCount - 1 : kBinCount / 2 + 1 + off;
    }
    const int off = ((int)kSign - 1 - low) - kLow;  // of the magnitude
    return off < 0 ? kBinCount / 2 - 1 : off >= kPerSide ? 0 : kBinCount / 2 - 2 - off;
  }

  // The key prefix (at kShift) of in-window bin `b`; false for a clamp bin (no single prefix).
  static __host__ __device__ __forceinline__ bool prefix_of(int b, unsigned& prefix) {
    if (b > kBinCount / 2 && b <= kBinCount / 2 + kPerSide) {
      prefix = kSign | (unsigned)(kLow + b - (kBinCount / 2 + 1));
      return true;
    }
    if (b < kBinCount / 2 - 1 && b >= kBinCount / 2 - 1 - kPerSide) {
      prefix = (unsigned)((int)kSign - 1 - (kLow + (kBinCount / 2 - 2 - b)));
      return true;
    }
    return false;
  }
};
using Window = ExponentWindow<5>;
static_assert(Window::kBinCount == kBins, "one histogram");
constexpr int kWindowShift = Window::kShift;
__device__ __forceinline__ int window_bin(unsigned key) { return Window::bin(key); }
__device__ __forceinline__ bool window_prefix(int bin, unsigned& prefix) { return Window::prefix_of(bin, prefix); }

// `find_bin` for one CTA of T threads (no cluster): the bin holding the k_rem-th largest of `h`, how many of it are
// still needed, its count; `next` is cleared on the way (nobody reads it any more: it is two levels old). S: any
// shared struct with `group[kBins / 32]` and `found[3]`.
template <int T, class S>
__device__ __forceinline__ void block_find_bin(int* h, int* next, int k_rem, S& s, int& bin, int& need,
                                               int& count) {
  constexpr int kPer = kBins / T;        // bins per thread: 8 (T = 256), 4 (T = 512) or 2 (T = 1024)
  static_assert(kPer == 2 || kPer % 4 == 0, "bins are read as int2 or int4");
  constexpr int kThreadsPerGroup = 32 / kPer;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  __syncthreads();  // this level's atomics are complete
  int m = 0;
  if constexpr (kPer == 2) {
    const int2 v = reinterpret_cast<const int2*>(h)[t];
    m = v.x + v.y;
    reinterpret_cast<int2*>(next)[t] = make_int2(0, 0);
  } else {
#pragma unroll
    for (int j = 0; j < kPer / 4; ++j) {
      const int4 v = reinterpret_cast<const int4*>(h)[t * (kPer / 4) + j];
      m += v.x + v.y + v.z + v.w;
      reinterpret_cast<int4*>(next)[t * (kPer / 4) + j] = make_int4(0, 0, 0, 0);
    }
  }
#pragma unroll
  for (int off = 1; off < kThreadsPerGroup; off <<= 1) m += __shfl_xor_sync(0xffffffffu, m, off);
  if ((lane & (kThreadsPerGroup - 1)) == 0) s.group[t / kThreadsPerGroup] = m;
  __syncthreads();  // the group sums are complete
  if (warp == 0) {
    const int2 pair = reinterpret_cast<const int2*>(s.group)[lane];  // groups 2 * lane, 2 * lane + 1
    int group, above;
    crossing_group(pair.x, pair.y, k_rem, group, above);
    const int c = h[group * 32 + lane];
    publish_crossing_bin(c, group, above, k_rem, s.found);
  }
  __syncthreads();
  bin = s.found[0];
  need = s.found[1];
  count = s.found[2];
}

// Columns [c_lo, c_hi) of a row into L2 (a 128-byte line per thread and step), issued before the row's window is
// read: otherwise the kernel's first global read (ends) and its first loads of the row are two DRAM round trips
// in a row (~2 us each after the L2 is flushed). Prefetches fill no register and cannot change a result; they
// stay inside the logits' width (columns past a row's end may be fetched, they are never used).
template <int T = kThreads>  // the block's threads (the prefill kernel's CTAs are smaller)
__device__ __forceinline__ void prefetch_row_l2(const float* x_row, int c_lo, int c_hi) {
  for (int c = c_lo + (int)threadIdx.x * 32; c < c_hi; c += T * 32)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(x_row + c));
}

// The float4 at column c0 (c0 % 4 == 0): one vector load when it lies inside the window of an aligned row, else
// scalar loads of its columns inside the window (0 elsewhere). Loads only: callers convert after issuing several,
// so that the loads are in flight together (a conversion right after each load serialises them).
__device__ __forceinline__ float4 raw_load4(const float* x_row, int c0, int start, int end, int aligned) {
  if (aligned && c0 >= start && c0 + 4 <= end) return __ldg(reinterpret_cast<const float4*>(x_row + c0));
  float4 r;
  r.x = (c0 >= start && c0 < end) ? __ldg(x_row + c0) : 0.f;
  r.y = (c0 + 1 >= start && c0 + 1 < end) ? __ldg(x_row + c0 + 1) : 0.f;
  r.z = (c0 + 2 >= start && c0 + 2 < end) ? __ldg(x_row + c0 + 2) : 0.f;
  r.w = (c0 + 3 >= start && c0 + 3 < end) ? __ldg(x_row + c0 + 3) : 0.f;
  return r;
}

__device__ __forceinline__ void keys4(const float4 q, int c0, int start, int end, unsigned (&key)[4]) {
  const float f[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) key[i] = (c0 + i >= start && c0 + i < end) ? order_key(f[i]) : 0u;
}

__device__ __forceinline__ void load_vec4(const float* x_row, int c0, int start, int end, int aligned,
                                          unsigned (&key)[4]) {
  keys4(raw_load4(x_row, c0, start, end, aligned), c0, start, end, key);
}

// A variant (1; benchmarks compare it): the selected positions written warp by warp, key slot by key slot (for each
// of a thread's keys in turn, the warp's lanes that selected it write contiguous positions after a ballot), instead
// of thread by thread through a shared-memory stage. The order stays fixed (warp, key slot, lane), so the output is
// as repeatable; the stage's stores, its barrier and the copy go, and the warp's count is one reduction instead of
// a scan. The stage clocks put the scan and the ordered write at 4.6K of a 1 x 8K row's 15.8K cycles (H100,
// topk_stage_clocks_s18_h100.json); SGLang's small-row kernel, ~2 us shorter there, writes in atomic arrival order,
// which no two runs need share.
#ifndef DSA_TOPK_WARP_ORDERED_WRITE
#define DSA_TOPK_WARP_ORDERED_WRITE 0
#endif
constexpr bool kWarpOrderedWrite = DSA_TOPK_WARP_ORDERED_WRITE;
// A variant (1; benchmarks compare it): the first radix level's histogram from warp-aggregated atomics. Level 0
// bins a key by its top 11 bits (sign, exponent, two mantissa bits): on real V3.2 decode logits an 8K row fills ~100
// of those bins, the fullest with ~440 keys (see the exponent window below), so lanes of a warp share an address
// now and then and its shared-memory atomic replays for each. Here the lanes holding one bin find each other
// (__match_any_sync) and the lowest adds their count: one conflict-free atomic per bin per warp, at the cost of a
// match per key slot. Later levels keep the plain atomics. The stage clocks put level 0 at 4.1K of a 1 x 8K row's
// 15.8K cycles, level 1 (the same atomics, spread thinner) at 2.5K (H100, topk_stage_clocks_s18_h100.json): whether
// the difference is the replays is what timing this tells.
#ifndef DSA_TOPK_LEVEL0_MATCH
#define DSA_TOPK_LEVEL0_MATCH 0
#endif
constexpr bool kLevel0Match = DSA_TOPK_LEVEL0_MATCH;

// One row's select with the row held in registers by `csize` CTAs of `cluster` (this CTA is `rank`; csize 1: this
// CTA alone, block barriers only, its peers untouched). The caller has handled windows of <= k columns; every CTA
// taking part calls this with the same row. KPT keys per thread: the CTAs hold [start & ~3, + csize * KPT * 512).
// STAGED: the positions go through shared memory (coalesced writes); off where it costs spills (KPT 32 in 64
// registers: the register kernel's 16K-column chunks).
template <int KPT, bool STAGED = (KPT <= 16), bool WINDOW = false>
__device__ __forceinline__ void registers_select_row(const Params& p, const float* x_row, int start, int end, int req,
                                                     int* out_row, int rank, int csize, cg::cluster_group& cluster,
                                                     Shared& s) {
  static_assert(KPT % 4 == 0, "keys are loaded as float4");
  constexpr int kChunk = KPT * kThreads;
  constexpr int kVecs = KPT / 4;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  first_stage_clock();
  {
    // Column of key [j][i]: base + j * 4 * kThreads + 4 * t + i. base is 16-byte aligned when rows are.
    const int base = (start & ~3) + rank * kChunk;
    // Key groups j < live hold columns of the window (the same for every thread: a uniform branch per group).
    // A row shorter than the CTA's chunk (a solo row, or a cluster's last CTAs) then loops over its own keys
    // only, instead of every register of the chunk.
    const int live = max(0, min(kVecs, (end - base + 4 * kThreads - 1) / (4 * kThreads)));
    // The CTAs that hold columns of the window (the same for all: from the window alone); the others' histograms
    // stay empty (or they have left), so find_bin reads only these.
    const int used = min(csize, (end - (start & ~3) + kChunk - 1) / kChunk);
    reinterpret_cast<int4*>(s.hist[0])[t] = make_int4(0, 0, 0, 0);  // level 0's histogram (peers are past it)

    unsigned key[KPT];
    // A solo row issues every load of its keys before converting any: 0.3-1.0 us less (H200,
    // topk_variants_s15_h200.json: 1 / 32 / 128 x 8K 10.2 / 11.4 / 12.8 -> 9.9 / 10.9 / 12.2, 8K rows in a
    // 163840 width 12.4 / 12.0 -> 11.4 / 11.3). Cluster rows convert each group right after its load: loads first
    // cost them up to 1.4 us where two CTAs share each SM (128 x 32K 25.5 -> 26.9).
    if (csize == 1) {
      float4 q[kVecs];
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int c0 = base + j * 4 * kThreads + 4 * t;
        q[j] = j < live ? raw_load4(x_row, c0, start, end, p.aligned) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        unsigned k4[4];
        keys4(q[j], base + j * 4 * kThreads + 4 * t, start, end, k4);
#pragma unroll
        for (int i = 0; i < 4; ++i) key[j * 4 + i] = k4[i];
      }
    } else {  // each group converted right after its load
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int c0 = base + j * 4 * kThreads + 4 * t;
        float f[4] = {0.f, 0.f, 0.f, 0.f};
        if (p.aligned && c0 + 4 <= end) {  // (end <= cols: inside the row)
          if (c0 >= start) {
            const float4 q = __ldg(reinterpret_cast<const float4*>(x_row + c0));
            f[0] = q.x;
            f[1] = q.y;
            f[2] = q.z;
            f[3] = q.w;
          } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) f[i] = c0 + i >= start ? __ldg(x_row + c0 + i) : 0.f;
          }
        } else if (c0 < end) {
#pragma unroll
          for (int i = 0; i < 4; ++i) f[i] = (c0 + i >= start && c0 + i < end) ? __ldg(x_row + c0 + i) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int c = c0 + i;
          key[j * 4 + i] = (c >= start && c < end) ? order_key(f[i]) : 0u;
        }
      }
    }
    __syncthreads();  // the cleared histogram before any atomic
    stage_clock();

    // ---- radix select on the key: 11 + 11 + 10 bits, stopping when the threshold bin is taken whole. (Levels
    // from the row's highest varying bit, as the streaming kernel's, measured 1-2 us slower here: H200, 1 x 8K
    // 10.1 -> 11.7 us, the min / max costs a barrier, a cluster's an extra cluster barrier.)
    int level = 0;
    unsigned prefix = 0u;  // the resolved high bits of the k-th key: the class is key >> shift == prefix
    int shift = 32;
    int k_rem = p.k;
    bool tie = false;      // the class is one exact key with more members than needed: break by column
    bool done = kProbeLoads;  // (a probe build: no select, nothing written; times the loads and the scan)
    if (kProbeLoads) {  // a class above every key: nothing is selected
      prefix = 0xffffffffu;
      shift = 0;
    }
    if (WINDOW && !kProbeLoads) {  // level 0: the exponent window (window_bin)
      int* h = s.hist[0];
#pragma unroll
      for (int e = 0; e < KPT; ++e) {
        if ((e >> 2) >= live) break;
        if (key[e] != 0u) atomicAdd(&h[window_bin(key[e])], 1);
      }
      int bin, need, count;
      find_bin(h, s.hist[1], k_rem, s, cluster, csize, used, bin, need, count);
      stage_clock();
      ++level;
      if (window_prefix(bin, prefix)) {  // uniform: every CTA found the same bin
        shift = kWindowShift;
        k_rem = need;
        done = count == need;
      }  // else a clamp bin: the plain levels from bit 31 (prefix 0, shift 32, k_rem k)
    }
    while (!done) {
      const int nshift = shift > kBinBits ? shift - kBinBits : 0;
      const unsigned digit_mask = (1u << (shift - nshift)) - 1u;
      int* h = s.hist[level & 1];
#pragma unroll
      for (int e = 0; e < KPT; ++e) {
        if ((e >> 2) >= live) break;  // uniform over the block (kLevel0Match: every lane meets the match)
        const unsigned kk = key[e];
        if (kLevel0Match && shift >= 32) {  // (uniform) level 0: one atomic per bin per warp
          const unsigned b = (kk >> nshift) & digit_mask;
          const unsigned peers = __match_any_sync(0xffffffffu, kk != 0u ? b : 0xffffffffu);  // padding: apart
          if (kk != 0u && lane == __ffs(peers) - 1) atomicAdd(&h[b], __popc(peers));
        } else {
          const bool in_class = kk != 0u && (shift >= 32 || (kk >> shift) == prefix);
          if (in_class) atomicAdd(&h[(kk >> nshift) & digit_mask], 1);
        }
      }
      int bin, need, count;
      find_bin(h, s.hist[(level + 1) & 1], k_rem, s, cluster, csize, used, bin, need, count);
      stage_clock();
      ++level;
      prefix = (shift >= 32 ? 0u : (prefix << (shift - nshift))) | (unsigned)bin;
      shift = nshift;
      k_rem = need;
      if (count == need) break;  // the whole bin is taken
      if (shift == 0) {
        tie = true;
        break;
      }
    }

    // ---- ties: among keys equal to `prefix`, the k_rem lowest columns (key2 = ~column, larger = lower column)
    unsigned prefix2 = 0u;
    int shift2 = kColBits;
    if (tie) {
      while (true) {
        const int nshift = shift2 > kBinBits ? shift2 - kBinBits : 0;
        const unsigned digit_mask = (1u << (shift2 - nshift)) - 1u;
        int* h = s.hist[level & 1];
#pragma unroll
        for (int e = 0; e < KPT; ++e) {
          if ((e >> 2) >= live) break;
          if (key[e] == prefix) {
            const int c = base + (e >> 2) * 4 * kThreads + 4 * t + (e & 3);
            const unsigned k2 = ((1u << kColBits) - 1u) - (unsigned)(c - start);
            if (shift2 >= kColBits || (k2 >> shift2) == prefix2) atomicAdd(&h[(k2 >> nshift) & digit_mask], 1);
          }
        }
        int bin, need, count;
        find_bin(h, s.hist[(level + 1) & 1], k_rem, s, cluster, csize, used, bin, need, count);
        stage_clock();
        ++level;
        prefix2 = (shift2 >= kColBits ? 0u : (prefix2 << (shift2 - nshift))) | (unsigned)bin;
        shift2 = nshift;
        k_rem = need;
        if (count == need) break;  // columns are distinct: at the latest when shift2 reaches 0
      }
    }

    // ---- selection and ordered write: position = lower CTAs' + lower warps' + lower lanes' selected counts
    unsigned selected = 0u;  // bit e: key[e] is selected
#pragma unroll
    for (int e = 0; e < KPT; ++e) {
      if ((e >> 2) >= live) break;
      const unsigned kk = key[e];
      bool sel = false;
      if (kk != 0u) {
        const unsigned cls = kk >> shift;
        sel = cls > prefix;
        if (cls == prefix) {
          if (!tie) {
            sel = true;
          } else {
            const int c = base + (e >> 2) * 4 * kThreads + 4 * t + (e & 3);
            const unsigned k2 = ((1u << kColBits) - 1u) - (unsigned)(c - start);
            sel = (k2 >> shift2) >= prefix2;
          }
        }
      }
      selected |= sel ? (1u << e) : 0u;
    }
    const int mine = __popc(selected);
    int incl = mine;  // (kWarpOrderedWrite: the warp's count is all it needs, one reduction)
    if (kWarpOrderedWrite) {
      const int warp_total = (int)__reduce_add_sync(0xffffffffu, (unsigned)mine);
      if (lane == 0) s.warp_sum[warp] = warp_total;
    } else {
      incl = warp_inclusive_sum(mine);
      if (lane == 31) s.warp_sum[warp] = incl;
    }
    __syncthreads();
    stage_clock();
    int offset = incl - mine, cta_total = 0;  // offset: among this CTA's selected (kWarpOrderedWrite: the warp's)
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int n = s.warp_sum[w];
      offset += w < warp ? n : 0;
      cta_total += n;
    }
    int cta_base = 0;  // the lower CTAs' selected
    if (csize > 1) {
      if (t == 0) s.cta_total = cta_total;
      cluster.sync();
      if (warp == 0) {  // lane q reads peer q's total (csize <= 16): one DSMEM round trip, 32 reads in all
        int v = lane < rank ? *cluster.map_shared_rank(&s.cta_total, lane) : 0;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == 0) s.cta_base = v;
      }
      cluster_arrive();  // this CTA read its peers' shared memory for the last time in this row
      __syncthreads();   // cta_base
      cta_base = s.cta_base;
    }
    // The positions go through shared memory (both histograms: every reader of them, peers included, is past the
    // barriers above), so the row is written coalesced: scattered 4-byte stores cost ~1 us of a CTA's store
    // issue per 2048 positions (H200).
    const bool staged = !kWarpOrderedWrite && STAGED && p.k <= 2 * kBins;  // uniform
    int* stage = &s.hist[0][0];
    int* dst = staged ? stage : out_row + cta_base;
    const unsigned lanes_below = (1u << lane) - 1u;
#pragma unroll
    for (int e = 0; e < KPT; ++e) {
      if ((e >> 2) >= live) break;  // uniform over the block (kWarpOrderedWrite: every lane meets the ballot)
      const bool sel = (selected >> e) & 1u;
      const int c = base + (e >> 2) * 4 * kThreads + 4 * t + (e & 3);
      if (kWarpOrderedWrite) {  // this key slot's selected lanes: contiguous positions, one coalesced store
        const unsigned mask = __ballot_sync(0xffffffffu, sel);
        if (sel) dst[offset + __popc(mask & lanes_below)] = out_value(c - start, req, p);
        offset += __popc(mask);
      } else if (sel) {
        dst[offset++] = out_value(c - start, req, p);
      }
    }
    if (staged) {
      __syncthreads();
      for (int j = t; j < cta_total; j += kThreads) out_row[cta_base + j] = stage[j];
    }
    // No CTA may clear its histogram (next row) or exit while a peer may still read its shared memory; the
    // block barrier keeps warp_sum from being overwritten by the next row's scan before every warp read it.
    if (csize > 1) cluster_wait(); else __syncthreads();
    last_stage_clock(KPT, csize, level);
  }
}

// The select of a row whose window one CTA holds (span = end - (start & ~3) <= 32 * 512 columns), by this CTA
// alone, with the fewest keys per thread that hold it (KPT_MAX bounds them: the caller's register budget).
#ifndef DSA_TOPK_SOLO_WINDOW
#define DSA_TOPK_SOLO_WINDOW 0
#endif
// Off: timed in two processes on an H100 (topk_routed_window_s12_h100.json) it moved solo-row cells by 0-0.9 us, no
// more than cells it cannot touch moved between the same processes. A define, so a benchmark build can compare both.
constexpr bool kSoloWindow = DSA_TOPK_SOLO_WINDOW;
template <int KPT_MAX>
__device__ __forceinline__ void registers_select_row_solo(const Params& p, const float* x_row, int start, int end,
                                                          int req, int* out_row, cg::cluster_group& cluster,
                                                          Shared& s) {
  const int span = end - (start & ~3);
  if (KPT_MAX >= 8 && span <= 8 * kThreads) {
    registers_select_row<8, true, kSoloWindow>(p, x_row, start, end, req, out_row, 0, 1, cluster, s);
  } else if (KPT_MAX >= 16 && span <= 16 * kThreads) {
    registers_select_row<(KPT_MAX >= 16 ? 16 : 8), true, kSoloWindow>(p, x_row, start, end, req, out_row, 0, 1,
                                                                      cluster, s);
  } else {
    registers_select_row<KPT_MAX, true, kSoloWindow>(p, x_row, start, end, req, out_row, 0, 1, cluster, s);
  }
}

// In the 32-keys-per-thread kernel (launched for widths past 16 x 8K, i.e. logits padded to max_model_len), a row
// that 16 keys per thread hold (over the cluster, or on one CTA for a solo row) is selected at 16, as the launch for
// its own width would: a cluster row on twice as many CTAs, a solo row without the 32-key code's loop exits. Timed
// against 0 (H100, one process each, topk_engines_small_variants_s18_h100.json and topk_engines_variants_s18_h100
// .json, us): padded 1 x 8K in 163840, the one cell planned on this kernel at 32 keys, 11.0 -> 10.0 and 11.8 ->
// 10.2; the other cells within noise. 0 builds the old select for comparisons.
#ifndef DSA_TOPK_ROW_KPT
#define DSA_TOPK_ROW_KPT 1
#endif
constexpr bool kRowKpt = DSA_TOPK_ROW_KPT;

// Rows are routed by their own window, not by the launch's width (engines pass logits padded to max_model_len, so
// the width says nothing of the rows): a row whose window one CTA holds is a "solo" row, taken by one CTA of the
// cluster alone (the cluster's solo rows go to its ranks in turn, so a cluster runs up to csize of them side by
// side); a longer row is held by the whole cluster. Every CTA reads the same ends and starts, so all agree on
// each row's route without communicating. The launch may give a cluster several rows (grid_rows < rows).
template <int KPT>
__global__ void __launch_bounds__(kThreads, 2) topk_registers_kernel(Params p) {
  pdl_wait();
  constexpr int kChunk = KPT * kThreads;
  __shared__ __align__(16) Shared s;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();
  const int csize = (int)cluster.num_blocks();
  const int t = threadIdx.x;
  int solo_turn = 0;  // solo rows this cluster has met so far: the next one goes to rank solo_turn % csize
  init_stage_clocks();
  __shared__ int long_rows_stream;  // a routed launch's choice for its long rows (route_to_clusters)
  if (p.route != 0) {
    const bool v = routed_long_rows_stream(p);  // the same in every thread
    long_rows_stream = v;  // (every thread writes the same value and reads back its own write)
  }

  for (int row = blockIdx.y; row < p.rows; row += gridDim.y) {
    if (KPT <= 16 && p.starts == nullptr)  // this CTA's chunk of a full row (KPT 32: no registers to spare)
      prefetch_row_l2(p.x + (long long)row * p.x_stride, rank * kChunk, min(p.cols, (rank + 1) * kChunk));
    const int end = p.ends[row];
    const int start = p.starts != nullptr ? p.starts[row] : 0;
    if (p.route == 2 && !route_to_clusters(p, start, end, long_rows_stream != 0)) continue;  // the streaming kernel's
    const int req = p.row_request != nullptr ? p.row_request[row] : row;
    int* out_row = p.out + (long long)row * p.k;
    const int width = end - start;

    if (width <= p.k) {  // every visible column, then -1 (uniform over the cluster: no cluster barrier here)
      const int per = (p.k + csize - 1) / csize;
      const int lo = rank * per, hi = min(p.k, lo + per);
      for (int j = lo + t; j < hi; j += kThreads) out_row[j] = out_value(j < width ? j : -1, req, p);
      continue;
    }
    const float* x_row = p.x + (long long)row * p.x_stride;
    const int span = end - (start & ~3);
    const bool solo = csize > 1 && span <= kChunk;
    const bool half = kRowKpt && KPT == 32 && span <= (solo ? 1 : csize) * 16 * kThreads;  // uniform
    if (solo) {
      const bool mine = solo_turn % csize == rank;
      ++solo_turn;
      if (!mine) continue;
    } else if (rank * (half ? 16 * kThreads : kChunk) >= span && row + (int)gridDim.y >= p.rows) {
      // This CTA holds no column of its last row (a row shorter than the launch's cluster, which is sized from the
      // padded width): it leaves now and frees its SM slot. The peers' cluster barriers count an exited thread as
      // arrived (PTX `exit`), and no peer reads its shared memory (find_bin reads the `used` CTAs only).
      return;
    }
    // One call site for both routes (a second inlined copy of the select costs registers: spills at KPT 32).
    if (half)
      registers_select_row<(KPT == 32 ? 16 : KPT)>(p, x_row, start, end, req, out_row, solo ? 0 : rank,
                                                   solo ? 1 : csize, cluster, s);
    else
      registers_select_row<KPT>(p, x_row, start, end, req, out_row, solo ? 0 : rank, solo ? 1 : csize, cluster, s);
  }
  print_stage_clocks();
}

// ---- The streaming kernel: one CTA per row, the row read from global memory once on the fast path. For many
// long rows (B x 128K), where the register kernel needs several waves of CTAs and pays its barrier chain in each:
// 1. a threshold from a sample: 16 keys per thread (2048 float4s spread over the row); two radix levels find
//    the 22-bit key prefix T of the sample's m-th largest, m sized so that about 1.5 k keys of the whole row
//    are >= T (the sample only guesses: nothing below depends on it being right);
// 2. one streaming pass: keys >= T (with their columns) are appended to shared memory (warp ballots, one
//    shared atomic per warp and float4 group that has any);
// 3. if the count is between k and the capacity, every one of the k largest is a candidate (each key >= the
//    k-th is >= T), so the exact radix select (and the column tie-break) runs over the candidates only;
//    otherwise (an unlucky or adversarial row) the same select runs over the whole row, re-read per level;
// 4. the selected columns set bits of a shared bitmap (atomicOr: order-free), and a block scan over the bitmap
//    writes them in ascending column order, so the output is bitwise repeatable whatever the atomics' order.
// Launched with a cluster of C CTAs per row (the split pass, `topk_stream_kernel<true>`), a long row's pass is
// shared: every CTA computes the same threshold from the same sample, streams its own 1/C of the row's float4
// batches, and appends its candidates to CTA 0's shared memory (distributed shared memory atomics and stores);
// CTA 0 alone selects. One SM reads a row at ~40 GB/s (a 128K row: ~12 us), so C CTAs cut the pass C-fold where
// the launch has SMs to spare (a few long rows among short ones: the longest row sets the time). Rows one CTA
// holds (and rows of <= k columns) go to the cluster's CTAs in turn, as in the register kernel.
constexpr int kStreamCandCap = 6144;
constexpr int kStreamMaxCols = 1 << 18;  // bitmap of 8K words; below 2^kColBits for the column tie-break
constexpr int kStreamSampleVecs = 4;     // float4s per thread in the sample
constexpr int kStreamUnroll = 8;         // float4 loads in flight per thread

// Float4 i of a sample of n float4s of a window of nvec (i = j * threads + thread): runs of kSampleRun consecutive
// float4s (128 B, read by 8 lanes of a warp) spread evenly over the window. The first sample took single float4s
// spread evenly: one every 256 B of a 128K row, one every 64 B of a 32K row, each its own DRAM access, so the sample
// read a quarter of a long row's lines and every line of a 32K row, scattered (stage clocks, H100: the sample 17 us
// of 128 x 128K's 52, 9.8 of 128 x 32K's 18 at k = 512, 30 of 1024 x 32K prefill rows' 65; topk_stage_clocks_*_s18).
// Runs read n x 16 B in whole lines. Windows shorter than n float4s keep the single-float4 spread.
// DSA_TOPK_SAMPLE_RUN=1 builds the single-float4 spread for comparisons. Runs of >= 8 keep the products in 32 bits:
// i x nvec < n x n where nvec < n, and (i / kSampleRun) x nvec < 2^30 for n <= 2048 and windows below 2^24 columns
// (the prefill kernel's bound; the streaming kernel's is 2^18).
#ifndef DSA_TOPK_SAMPLE_RUN
#define DSA_TOPK_SAMPLE_RUN 8
#endif
constexpr int kSampleRun = DSA_TOPK_SAMPLE_RUN;
// A variant (DSA_TOPK_SAMPLE_LEVELS=1; benchmarks compare it): the threshold from the sample's first 11-bit level
// alone where that level's bin overshoots the m-th sampled key by at most m / 4 keys (every sampled key of the bin
// is then above the threshold: at most a quarter more candidates than aimed at, within the buffers), without the
// second level's atomics and barriers. The stage clocks put the sample (loads, min / max, two levels) at 10.6K
// cycles of 32 x 32K's 30.4K in a 163840 width, where its loads and levels alone should take ~6K; the probe now
// stamps the loads apart from the levels to tell.
#ifndef DSA_TOPK_SAMPLE_LEVELS
#define DSA_TOPK_SAMPLE_LEVELS 2
#endif
constexpr int kSampleLevels = DSA_TOPK_SAMPLE_LEVELS;
// A variant (D > 0; benchmarks compare it): the streaming pass keeps D batches beyond the one in flight on their way
// into L2 (one prefetch per thread per batch of kStreamUnroll float4s, 64 KB a batch), and the first D + 1 batches
// of this CTA's share are prefetched while the sample's levels run. The shipped pass has one batch of loads in flight
// while it examines the last, and none during the sample's levels: at 128 x 128K (one CTA per SM) the pass reads
// ~2.3 TB/s, at V4 128 x 32K the sample's levels and the pass take 21.8K cycles where the row's bytes need ~9.4K
// at 3 TB/s (H100, topk_stage_clocks_sample_runs_s18_h100.json).
#ifndef DSA_TOPK_PASS_PREFETCH
#define DSA_TOPK_PASS_PREFETCH 0
#endif
constexpr int kPassPrefetch = DSA_TOPK_PASS_PREFETCH;
template <int N>
__device__ __forceinline__ int sample_vec(int i, int nvec) {
  static_assert(N <= 2048 && N % kSampleRun == 0, "sample positions: runs dividing the sample");
  if constexpr (kSampleRun < 8) {
    return (int)(((long long)(i / kSampleRun) * nvec) / (N / kSampleRun)) + i % kSampleRun;
  } else {
    const unsigned ui = (unsigned)i, un = (unsigned)nvec;  // unsigned: the divisions by powers of two are shifts
    return (int)(un < N ? ui * un / N : (ui / kSampleRun) * un / (N / kSampleRun) + ui % kSampleRun);
  }
}

struct StreamShared {
  Shared base;
  int n_cand;
  unsigned cand_key[kStreamCandCap];
  int cand_col[kStreamCandCap];
  unsigned bitmap[kStreamMaxCols / 32];
  unsigned cand_range[2];  // the split pass (CTA 0's): min / max of every CTA's candidates
};

// Calls f(key, column) for every column of the window (key 0 for the padding of the first / last float4):
// from the candidates (fast) or from the row in global memory.
template <class F>
__device__ __forceinline__ void for_each_key(bool fast, const StreamShared& s, int n_cand, const float* x_row,
                                             int base, int nvec, int start, int end, int aligned, F&& f) {
  const int t = threadIdx.x;
  if (fast) {
    for (int i = t; i < n_cand; i += kThreads) f(s.cand_key[i], s.cand_col[i]);
  } else {
    for (int v = t; v < nvec; v += kThreads) {
      unsigned key[4];
      const int c0 = base + 4 * v;
      load_vec4(x_row, c0, start, end, aligned, key);
#pragma unroll
      for (int i = 0; i < 4; ++i) f(key[i], c0 + i);
    }
  }
}

template <bool SPLIT>
__global__ void __launch_bounds__(kThreads, 1) topk_stream_kernel(Params p) {
  pdl_wait();
  extern __shared__ __align__(16) unsigned char stream_smem[];
  StreamShared& s = *reinterpret_cast<StreamShared*>(stream_smem);
  // find_bin is always called with csize 1 here (block barriers only); SPLIT's cluster barriers are explicit
  cg::cluster_group cluster = cg::this_cluster();
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int csize = SPLIT ? (int)cluster.num_blocks() : 1;
  const int rank = SPLIT ? (int)cluster.block_rank() : 0;
  int solo_turn = 0;        // SPLIT: rows one CTA selects so far (the next goes to rank solo_turn % csize)
  bool wait_pending = false;  // SPLIT, ranks > 0: arrived at a row's second cluster barrier, not yet waited
  // CTA 0's candidate buffers (its own shared memory for CTA 0 and without SPLIT)
  int* cand_count = &s.n_cand;
  unsigned* cand_key = s.cand_key;
  int* cand_col = s.cand_col;
  unsigned* cand_range = s.cand_range;
  if (SPLIT && rank != 0) {
    cand_count = cluster.map_shared_rank(cand_count, 0);
    cand_key = cluster.map_shared_rank(cand_key, 0);
    cand_col = cluster.map_shared_rank(cand_col, 0);
    cand_range = cluster.map_shared_rank(cand_range, 0);
  }
  init_stage_clocks();

  __shared__ int long_rows_stream;  // a routed launch's choice for its long rows (route_to_clusters)
  if (p.route != 0) {
    if (p.starts == nullptr && blockIdx.x < p.rows)  // the first row's columns first (the count reads every end)
      prefetch_row_l2(p.x + (long long)blockIdx.x * p.x_stride, 0, min(p.cols, kSoloMaxSpan));
    const bool v = routed_long_rows_stream(p);
    long_rows_stream = v;
  }

  for (int row = blockIdx.x / csize; row < p.rows; row += gridDim.x / csize) {
    if (p.starts == nullptr && rank == 0)  // the columns a short row's select reads, the first of a long row's pass
      prefetch_row_l2(p.x + (long long)row * p.x_stride, 0, min(p.cols, kSoloMaxSpan));
    const int end = p.ends[row];
    const int start = p.starts != nullptr ? p.starts[row] : 0;
    if (p.route == 1 && route_to_clusters(p, start, end, long_rows_stream != 0)) continue;  // the cluster kernel's
    const int req = p.row_request != nullptr ? p.row_request[row] : row;
    int* out_row = p.out + (long long)row * p.k;
    const int width = end - start;

    const float* x_row = p.x + (long long)row * p.x_stride;
    const bool one_cta = width <= p.k || end - (start & ~3) <= kSoloMaxSpan;  // uniform over the cluster
    if (SPLIT && one_cta && solo_turn++ % csize != rank) continue;  // another CTA of the cluster's turn
    if (width <= p.k) {  // every visible column, then -1 (uniform over the block)
      for (int j = t; j < p.k; j += kThreads) out_row[j] = out_value(j < width ? j : -1, req, p);
      continue;
    }
    if (one_cta) {  // a short row (a padded launch's width is no guide): in registers
      registers_select_row_solo<32>(p, x_row, start, end, req, out_row, cluster, s.base);
      continue;
    }
    const int base = start & ~3;  // float4 v covers columns base + 4v .. base + 4v + 3
    const int nvec = (end - base + 3) >> 2;
    const int nwords = (width + 31) >> 5;
    const int iters = (nvec + kThreads - 1) / kThreads;  // uniform over the block: shuffles see every lane
    // SPLIT: this CTA's share of the pass, whole batches of kStreamUnroll iterations; `used` CTAs have one
    int it_lo = 0, it_hi = iters, used = 1;
    if (SPLIT) {
      const int batches = (iters + kStreamUnroll - 1) / kStreamUnroll;
      used = min(csize, batches);
      it_lo = rank < used ? (rank * batches / used) * kStreamUnroll : iters;
      it_hi = rank < used ? min(iters, ((rank + 1) * batches / used) * kStreamUnroll) : iters;
      if (rank > 0 && rank < used)  // this CTA's first batch into L2 while it computes the sample (CTA 0's: above)
        prefetch_row_l2(x_row, base + 4 * it_lo * kThreads, min(end, base + 4 * (it_lo + kStreamUnroll) * kThreads));
      if (wait_pending) cluster_wait();  // the previous long row's second barrier (CTA 0 has appended it all)
      wait_pending = false;
    }
    first_stage_clock();

    reinterpret_cast<int4*>(s.base.hist[0])[t] = make_int4(0, 0, 0, 0);
    if (rank == 0) {
      for (int w = t; w < nwords; w += kThreads) s.bitmap[w] = 0u;
      if (t == 0) s.n_cand = 0;
      if (SPLIT && t == 0) {
        s.cand_range[0] = 0xffffffffu;
        s.cand_range[1] = 0u;
      }
    }
    // SPLIT: the first cluster barrier, arrived here and waited on just before the first append: CTA 0's buffers
    // are cleared (and its previous row's select, which read them, is done) before any CTA appends to them
    if (SPLIT) cluster_arrive();
    if (SPLIT && rank >= used) {  // no batch of this row: its barriers only
      cluster_wait();
      cluster_arrive();
      wait_pending = true;
      continue;
    }

    // ---- 1. the sample and its threshold
    unsigned skey[4 * kStreamSampleVecs];
    {
      float4 q[kStreamSampleVecs];
      int c0[kStreamSampleVecs];
#pragma unroll
      for (int j = 0; j < kStreamSampleVecs; ++j) {
        c0[j] = base + 4 * sample_vec<kStreamSampleVecs * kThreads>(j * kThreads + t, nvec);
        q[j] = raw_load4(x_row, c0[j], start, end, p.aligned);
      }
      if (kPassPrefetch > 0)  // this CTA's first batches into L2 behind the sample's loads, during its levels
        prefetch_row_l2(x_row, base + 4 * it_lo * kThreads,
                        min(end, base + 4 * min(it_hi, it_lo + (kPassPrefetch + 1) * kStreamUnroll) * kThreads));
#pragma unroll
      for (int j = 0; j < kStreamSampleVecs; ++j) {
        unsigned key[4];
        keys4(q[j], c0[j], start, end, key);
#pragma unroll
        for (int i = 0; i < 4; ++i) skey[4 * j + i] = key[i];
      }
    }
    // Every sampled float4 holds >= 1 column of the window, so the sample has >= 2048 keys and m <= 2048 exists.
    long long want = (3LL * p.k * kStreamSampleVecs * kThreads) / (2LL * nvec) + 16;
    const int m = (int)(want < 2048 ? want : 2048);
    // Two 11-bit levels from the sample's highest varying bit (a row's logits span few exponents: levels from
    // bit 31 would put the sample in a few bins and serialise the shared-memory atomics on them); the threshold
    // is the m-th largest sampled key's prefix of those bits.
    unsigned lo = 0xffffffffu, hi = 0u;
#pragma unroll
    for (int e = 0; e < 4 * kStreamSampleVecs; ++e)
      if (skey[e] != 0u) {
        lo = min(lo, skey[e]);
        hi = max(hi, skey[e]);
      }
    block_min_max<kThreads>(lo, hi, s.base);  // its barrier also orders the cleared histogram before the atomics
    stage_clock();  // (the probe: the sample's loads and their range)
    int sshift, level = 0, bin, need, count, m_rem = m;
    unsigned sprefix;
    radix_start(lo, hi, sshift, sprefix);
    for (int pass = 0; pass < 2; ++pass) {
      const int nshift = sshift > kBinBits ? sshift - kBinBits : 0;
      const unsigned digit_mask = (1u << (sshift - nshift)) - 1u;
      int* h = s.base.hist[level & 1];
#pragma unroll
      for (int e = 0; e < 4 * kStreamSampleVecs; ++e) {
        const unsigned kk = skey[e];
        if (kk != 0u && (sshift >= 32 || (kk >> sshift) == sprefix)) atomicAdd(&h[(kk >> nshift) & digit_mask], 1);
      }
      find_bin(h, s.base.hist[(level + 1) & 1], m_rem, s.base, cluster, 1, 1, bin, need, count);
      ++level;
      sprefix = (sshift >= 32 ? 0u : (sprefix << (sshift - nshift))) | (unsigned)bin;
      sshift = nshift;
      m_rem = need;
      if (count == need || sshift == 0 || (kSampleLevels < 2 && count - need <= m / 4)) break;
    }
    stage_clock();  // the sample's threshold (after its levels' barriers)
    unsigned threshold = sprefix << sshift;
    if (threshold == 0u) threshold = 1u;  // key 0 marks padding, never a candidate

    // ---- 2. one pass over the row: keys >= threshold to shared memory. Most keys are below the threshold, so
    // the per-key work is one float compare and a count (the order of keys equals the order of floats above a
    // threshold above -inf; a NaN compares false, as the -inf it ranks as); a warp reserves its slots with one
    // shared atomic per batch (a warp scan of the lanes' counts), and only threads holding a candidate convert and
    // store. (The first version took a warp ballot and an atomic per key: instruction-bound at 58 us for one
    // 128K row, where one CTA reads the row in 12 us; benchmarks/results/topk_stream_pass_h200.json.)
    const int v_lo = start > base ? 1 : 0;  // the float4s wholly inside the window: [v_lo, v_hi)
    const int v_hi = (end - base) >> 2;
    const bool float_compare = threshold > kNegInfKey;  // uniform; else the row's top reaches -inf / NaN
    const float threshold_value = __uint_as_float((threshold & 0x80000000u) ? (threshold & 0x7fffffffu) : ~threshold);
    unsigned cand_lo = 0xffffffffu, cand_hi = 0u;  // of the candidates (the select starts where they differ)
    // Two batches in flight: the next batch's loads are issued before this one is examined (one CTA's loads are
    // latency-bound: ~1.9 us per batch of 8 float4s per thread when each waited for the last).
    auto batch_inside = [&](int it0) {  // uniform
      return p.aligned && it0 * kThreads >= v_lo && (it0 + kStreamUnroll) * kThreads <= v_hi;
    };
    auto load_batch = [&](int it0, float4 (&q)[kStreamUnroll]) {
      if (batch_inside(it0)) {
#pragma unroll
        for (int u = 0; u < kStreamUnroll; ++u)
          q[u] = __ldg(reinterpret_cast<const float4*>(x_row + base + 4 * ((it0 + u) * kThreads + t)));
      } else {
#pragma unroll
        for (int u = 0; u < kStreamUnroll; ++u) {
          const int v = (it0 + u) * kThreads + t;
          q[u] = v < nvec ? raw_load4(x_row, base + 4 * v, start, end, p.aligned) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
    };
    float4 q_next[kStreamUnroll];
    load_batch(it_lo, q_next);
    if (SPLIT) cluster_wait();
    for (int it0 = it_lo; it0 < it_hi; it0 += kStreamUnroll) {
      float4 q[kStreamUnroll];
#pragma unroll
      for (int u = 0; u < kStreamUnroll; ++u) q[u] = q_next[u];
      if (it0 + kStreamUnroll < it_hi) load_batch(it0 + kStreamUnroll, q_next);
      if (kPassPrefetch > 0 && it0 + (kPassPrefetch + 1) * kStreamUnroll < it_hi) {  // D batches beyond the next
        const int ahead = it0 + (kPassPrefetch + 1) * kStreamUnroll;
        prefetch_row_l2(x_row, base + 4 * ahead * kThreads,
                        min(end, base + 4 * min(it_hi, ahead + kStreamUnroll) * kThreads));
      }
      const bool inside = batch_inside(it0);
      // take[u] bit i: column base + 4 * ((it0 + u) * kThreads + t) + i is a candidate
      unsigned take = 0u;
      if (inside && float_compare) {
#pragma unroll
        for (int u = 0; u < kStreamUnroll; ++u) {
          take |= (q[u].x >= threshold_value ? 1u : 0u) << (4 * u);
          take |= (q[u].y >= threshold_value ? 2u : 0u) << (4 * u);
          take |= (q[u].z >= threshold_value ? 4u : 0u) << (4 * u);
          take |= (q[u].w >= threshold_value ? 8u : 0u) << (4 * u);
        }
      } else {  // the window's edges (columns outside it have key 0) or a threshold at -inf: compare keys
#pragma unroll
        for (int u = 0; u < kStreamUnroll; ++u) {
          unsigned key[4];  // columns past the window (v >= nvec) get key 0 here too
          keys4(q[u], base + 4 * ((it0 + u) * kThreads + t), start, end, key);
#pragma unroll
          for (int i = 0; i < 4; ++i) take |= (key[i] >= threshold ? 1u : 0u) << (4 * u + i);
        }
      }
      const int mine = __popc(take);
      int incl = warp_inclusive_sum(mine);
      const int warp_total = __shfl_sync(0xffffffffu, incl, 31);
      if (warp_total != 0) {  // uniform over the warp
        int first = 0;
        if (lane == 31) first = atomicAdd(cand_count, warp_total);
        first = __shfl_sync(0xffffffffu, first, 31);
        int pos = first + incl - mine;
        const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
        while (take != 0u) {  // this thread's candidates, lowest column first
          const int bit = __ffs(take) - 1;
          take &= take - 1u;
          const int u = bit >> 2, i = bit & 3;
          float4 v4 = zero;
#pragma unroll
          for (int uu = 0; uu < kStreamUnroll; ++uu) v4 = uu == u ? q[uu] : v4;  // registers: no local array
          const float value = i == 0 ? v4.x : i == 1 ? v4.y : i == 2 ? v4.z : v4.w;
          const unsigned kk = order_key(value);
          cand_lo = min(cand_lo, kk);
          cand_hi = max(cand_hi, kk);
          if (pos < kStreamCandCap) {
            cand_key[pos] = kk;
            cand_col[pos] = base + 4 * ((it0 + u) * kThreads + t) + i;
          }
          ++pos;
        }
      }
    }
    block_min_max<kThreads>(cand_lo, cand_hi, s.base);  // its barrier: the candidates are complete
    if (SPLIT) {  // the second cluster barrier: every CTA's candidates and range are in CTA 0's shared memory
      if (t == 0) {
        atomicMin(&cand_range[0], cand_lo);
        atomicMax(&cand_range[1], cand_hi);
      }
      cluster_arrive();
      if (rank != 0) {  // CTA 0 selects; this CTA goes on (it waits before its next cluster barrier)
        wait_pending = true;
        continue;
      }
      cluster_wait();
      cand_lo = s.cand_range[0];
      cand_hi = s.cand_range[1];
    }
    stage_clock();
    const int n_cand = s.n_cand;
    if (kProbeStreamPass) {  // a probe build: the sample and the pass only, nothing selected or written
      __syncthreads();
      continue;
    }
    const bool fast = n_cand >= p.k && n_cand <= kStreamCandCap;  // uniform

    // ---- 3. exact radix select over the candidates (fast: 11-bit levels from their highest varying bit) or the
    // row (from bit 31): as in the register kernel
    unsigned prefix = 0u;
    int shift = 32;
    if (fast) radix_start(cand_lo, cand_hi, shift, prefix);
    int k_rem = p.k;
    bool tie = false;
    while (true) {
      const int nshift = shift > kBinBits ? shift - kBinBits : 0;
      const unsigned digit_mask = (1u << (shift - nshift)) - 1u;
      int* h = s.base.hist[level & 1];
      for_each_key(fast, s, n_cand, x_row, base, nvec, start, end, p.aligned, [&](unsigned kk, int) {
        if (kk != 0u && (shift >= 32 || (kk >> shift) == prefix)) atomicAdd(&h[(kk >> nshift) & digit_mask], 1);
      });
      find_bin(h, s.base.hist[(level + 1) & 1], k_rem, s.base, cluster, 1, 1, bin, need, count);
      stage_clock();
      ++level;
      prefix = (shift >= 32 ? 0u : (prefix << (shift - nshift))) | (unsigned)bin;
      shift = nshift;
      k_rem = need;
      if (count == need) break;
      if (shift == 0) {
        tie = true;
        break;
      }
    }
    unsigned prefix2 = 0u;
    int shift2 = kColBits;
    if (tie) {
      while (true) {
        const int nshift = shift2 > kBinBits ? shift2 - kBinBits : 0;
        const unsigned digit_mask = (1u << (shift2 - nshift)) - 1u;
        int* h = s.base.hist[level & 1];
        for_each_key(fast, s, n_cand, x_row, base, nvec, start, end, p.aligned, [&](unsigned kk, int c) {
          if (kk == prefix) {
            const unsigned k2 = ((1u << kColBits) - 1u) - (unsigned)(c - start);
            if (shift2 >= kColBits || (k2 >> shift2) == prefix2) atomicAdd(&h[(k2 >> nshift) & digit_mask], 1);
          }
        });
        find_bin(h, s.base.hist[(level + 1) & 1], k_rem, s.base, cluster, 1, 1, bin, need, count);
        ++level;
        prefix2 = (shift2 >= kColBits ? 0u : (prefix2 << (shift2 - nshift))) | (unsigned)bin;
        shift2 = nshift;
        k_rem = need;
        if (count == need) break;
      }
    }

    // ---- 4. the selection as a bitmap, written in column order
    for_each_key(fast, s, n_cand, x_row, base, nvec, start, end, p.aligned, [&](unsigned kk, int c) {
      if (kk == 0u) return;
      const unsigned cls = kk >> shift;
      bool sel = cls > prefix;
      if (cls == prefix) {
        if (!tie) {
          sel = true;
        } else {
          const unsigned k2 = ((1u << kColBits) - 1u) - (unsigned)(c - start);
          sel = (k2 >> shift2) >= prefix2;
        }
      }
      if (sel) atomicOr(&s.bitmap[(c - start) >> 5], 1u << ((c - start) & 31));
    });
    __syncthreads();
    const int per = (nwords + kThreads - 1) / kThreads;  // consecutive words per thread (<= 16)
    const int w0 = t * per, w1 = min(nwords, w0 + per);
    int mine = 0;
    for (int w = w0; w < w1; ++w) mine += __popc(s.bitmap[w]);
    int incl = warp_inclusive_sum(mine);
    if (lane == 31) s.base.warp_sum[warp] = incl;
    __syncthreads();
    int offset = incl - mine;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) offset += w < warp ? s.base.warp_sum[w] : 0;
    const bool staged = p.k <= kStreamCandCap;  // uniform; the candidates are read (bitmap barrier): reuse them
    int* dst = staged ? s.cand_col : out_row;
    for (int w = w0; w < w1; ++w) {
      unsigned bits = s.bitmap[w];
      while (bits != 0u) {
        const int b = __ffs(bits) - 1;
        bits &= bits - 1u;
        dst[offset++] = out_value(w * 32 + b, req, p);
      }
    }
    if (staged) {  // written coalesced (see registers_select_row)
      __syncthreads();
      for (int j = t; j < p.k; j += kThreads) out_row[j] = s.cand_col[j];
    }
    __syncthreads();  // the bitmap, histograms and warp sums are reused by the next row
    last_stage_clock(-1, csize, level);
  }
  // A CTA leaves with no barrier phase half done (CTA 0's shared memory outlives every peer's appends: it waited
  // for them at each row's second barrier)
  if (SPLIT && wait_pending) cluster_wait();
  print_stage_clocks();
}

template <bool SPLIT>
cudaError_t configure_stream() {
  static bool configured = false;  // host work once per kernel: the >48 KB dynamic shared memory opt-in
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(topk_stream_kernel<SPLIT>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 (int)sizeof(StreamShared));
    if (err != cudaSuccess) return err;
    configured = true;
  }
  return cudaSuccess;
}

// `grid` rows at a time (CTAs loop over the rows), each on `cluster` CTAs (1: no cluster; 2, 4 or 8: the split pass).
cudaError_t launch_stream(const Params& p, int grid, int cluster, cudaStream_t stream) {
  if (cluster <= 1) {
    const cudaError_t err = configure_stream<false>();
    if (err != cudaSuccess) return err;
    return launch_plain(topk_stream_kernel<false>, dim3((unsigned)grid, 1, 1), kThreads, sizeof(StreamShared), stream,
                        p);
  }
  const cudaError_t err = configure_stream<true>();
  if (err != cudaSuccess) return err;
  return launch_in_clusters(topk_stream_kernel<true>, dim3((unsigned)(grid * cluster), 1, 1), kThreads,
                            (unsigned)cluster, sizeof(StreamShared), stream, p);
}

// ---- The prefill kernel: a prefill chunk's rows (thousands of rows of 8K-1M columns; issue 27). The streaming
// kernel's plan (sample -> threshold -> one pass keeping the keys above it -> exact select over those), shaped for
// many rows instead of a few long ones:
// - small CTAs (256 threads, <= 80 registers, ~66 KB of shared memory) so that three share an SM: while one runs
//   its select (a chain of block barriers), the others stream their rows, and the SM's loads never stop;
// - rows no wider than the candidate buffer skip the sample and keep every column (the exact select over them);
// - no bitmap (its 1 bit per column would cost 128 KB at 1M columns): the candidates are appended in a fixed order
//   (a block scan per pass step assigns the slots: step, then thread, then the thread's own columns), so the
//   output, written in that order, is bitwise repeatable; the rare exact fallback over the whole row writes the
//   same way;
// - columns up to 2^24 in the tie-break key (a 1M-token prefill's rows).
constexpr int kPrefillCap = 6144;           // candidate slots (key + column: 48 KB)
constexpr int kPrefillColBits = 24;         // tie-break key ~column: windows of < 2^24 columns
// float4 loads in flight per thread per pass step: the most that fit the register budget without spills
// (nvcc 13.0, sm90: 6 at 256 threads x 80 registers, 4 at 512 x 64)
template <int T>
constexpr int prefill_unroll() { return T >= 512 ? 4 : 6; }
constexpr int kPrefillSampleKeys = 8192;    // 2048 float4s spread over the row

template <int T>
struct PrefillShared {
  int hist[2][kBins];
  int group[kBins / 32];
  int found[3];
  int warp_sum[2][T / 32];
  unsigned min_max[2][T / 32];  // per-warp min / max of a key set (block_min_max)
  union {
    struct {
      unsigned cand_key[kPrefillCap];
      int cand_col[kPrefillCap];
    };
    unsigned sample[kPrefillSampleKeys];  // the sampled keys, before any candidate is written
  };
};

// Exclusive block scan of `mine` (the step's warp sums in warp_sum[parity]): the thread's offset among the
// block's, and the block's total. One barrier: the other parity's buffer is written by the next step, and every
// thread has read this one before it passes that step's barrier.
static_assert(offsetof(PrefillShared<256>, group) % 16 == 0 && offsetof(PrefillShared<512>, group) % 16 == 0,
              "block_find_bin reads the group sums as int2");

template <int T>
__device__ __forceinline__ int prefill_scan(int mine, PrefillShared<T>& s, int parity, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = warp_inclusive_sum(mine);
  if (lane == 31) s.warp_sum[parity][warp] = incl;
  __syncthreads();
  int offset = incl - mine;
  total = 0;
#pragma unroll
  for (int w = 0; w < T / 32; ++w) {
    const int n = s.warp_sum[parity][w];
    offset += w < warp ? n : 0;
    total += n;
  }
  return offset;
}

// One pass over the row's window, prefill_unroll<T>() float4s per thread per step: sink(slot, key, column) for every
// key with take(key, column), at slots 0, 1, ... in the fixed order (step, thread, the thread's own columns);
// returns how many were taken (sink is called for every one: it checks its own capacity).
template <int T, class Take, class Sink>
__device__ __forceinline__ int prefill_pass(const float* x_row, int base, int nvec, int start, int end, int aligned,
                                            PrefillShared<T>& s, Take&& take, Sink&& sink, unsigned& lo,
                                            unsigned& hi) {
  constexpr int U = prefill_unroll<T>();
  const int t = threadIdx.x;
  const int steps = (nvec + T * U - 1) / (T * U);  // uniform over the block
  const int v_lo = start > base ? 1 : 0;  // the float4s wholly inside the window: [v_lo, v_hi)
  const int v_hi = (end - base) >> 2;
  int taken = 0;
  if (kPassPrefetch > 0)  // (DSA_TOPK_PASS_PREFETCH) the first steps into L2 ahead of their loads
    prefetch_row_l2<T>(x_row, base, min(end, base + 4 * min(nvec, (kPassPrefetch + 1) * T * U)));
  for (int step = 0; step < steps; ++step) {
    const int v0 = step * T * U;
    if (kPassPrefetch > 0 && step + kPassPrefetch + 1 < steps) {  // D steps beyond the next on their way to L2
      const int ahead = v0 + (kPassPrefetch + 1) * T * U;
      prefetch_row_l2<T>(x_row, base + 4 * ahead, min(end, base + 4 * min(nvec, ahead + T * U)));
    }
    float4 q[U];
    if (aligned && v0 >= v_lo && v0 + T * U <= v_hi) {  // uniform
#pragma unroll
      for (int u = 0; u < U; ++u)
        q[u] = __ldg(reinterpret_cast<const float4*>(x_row + base + 4 * (v0 + u * T + t)));
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = v0 + u * T + t;
        q[u] = v < nvec ? raw_load4(x_row, base + 4 * v, start, end, aligned) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    unsigned key[U][4];  // columns past the window get key 0
    unsigned taken_bits = 0u;
    int mine = 0;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c0 = base + 4 * (v0 + u * T + t);
      keys4(q[u], c0, start, end, key[u]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool yes = key[u][i] != 0u && take(key[u][i], c0 + i);
        taken_bits |= yes ? (1u << (4 * u + i)) : 0u;
        mine += yes ? 1 : 0;
      }
    }
    int total;
    int slot = taken + prefill_scan<T>(mine, s, step & 1, total);
    taken += total;
    if (taken_bits != 0u) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c0 = base + 4 * (v0 + u * T + t);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (taken_bits & (1u << (4 * u + i))) {
            sink(slot++, key[u][i], c0 + i);
            lo = min(lo, key[u][i]);  // of the taken keys (the caller's select starts where they differ)
            hi = max(hi, key[u][i]);
          }
      }
    }
  }
  return taken;
}

template <int T, int MIN_BLOCKS>
__global__ void __launch_bounds__(T, MIN_BLOCKS) topk_prefill_kernel(Params p) {
  pdl_wait();
  extern __shared__ __align__(16) unsigned char prefill_smem[];
  PrefillShared<T>& s = *reinterpret_cast<PrefillShared<T>*>(prefill_smem);
  const int t = threadIdx.x;
  constexpr unsigned kColMask = (1u << kPrefillColBits) - 1u;
  init_stage_clocks();

  for (int row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int end = p.ends[row];
    const int start = p.starts != nullptr ? p.starts[row] : 0;
    const int req = p.row_request != nullptr ? p.row_request[row] : row;
    int* out_row = p.out + (long long)row * p.k;
    const int width = end - start;

    if (width <= p.k) {  // every visible column, then -1 (uniform over the block)
      for (int j = t; j < p.k; j += T) out_row[j] = out_value(j < width ? j : -1, req, p);
      continue;
    }
    const float* x_row = p.x + (long long)row * p.x_stride;
    const int base = start & ~3;  // float4 v covers columns base + 4v .. base + 4v + 3
    const int nvec = (end - base + 3) >> 2;
    first_stage_clock();  // (the probe: the stages of this CTA's first row that reaches the select)
    for (int j = t; j < kBins / 4; j += T) reinterpret_cast<int4*>(s.hist[0])[j] = make_int4(0, 0, 0, 0);

    // ---- 1. the threshold: every column when the window fits the candidates, else from a sample
    int level = 0, bin, need, count;
    unsigned threshold = 1u;  // key 0 marks padding, never a candidate
    if (width > kPrefillCap) {
      constexpr int kVecs = kPrefillSampleKeys / 4 / T;  // sampled float4s per thread
      // The threshold aims at `target` candidates, 2 k for k <= 2048 (4096: as far, relative to its own spread,
      // from the k it must reach as from the capacity it must not pass), the midpoint of k and the capacity above.
      // It is the m-th largest sampled key, m = the target's share of the sample (each sampled key stands for
      // width / 8192 columns); the sample holds more than 6144 keys (every sampled float4 has >= 1 window column,
      // the window is wider than 6144 so the float4s sampled are mostly distinct and whole).
      const long long target = min(2LL * p.k, (p.k + (long long)kPrefillCap) / 2);
      const long long want = (target * kPrefillSampleKeys) / width;
      int m = (int)(want < 1 ? 1 : (want > kPrefillCap ? kPrefillCap : want));
      unsigned lo = 0xffffffffu, hi = 0u;  // over the sampled window keys
      {
        float4 q[kVecs];  // (the columns are computed again below: cheaper than registers held over the loads)
#pragma unroll
        for (int j = 0; j < kVecs; ++j)
          q[j] = raw_load4(x_row, base + 4 * sample_vec<kVecs * T>(j * T + t, nvec), start, end, p.aligned);
        if (kPassPrefetch > 0) {  // the pass's first steps into L2 behind the sample's loads, during its levels
          constexpr int kStep = T * prefill_unroll<T>();  // float4s of a pass step
          prefetch_row_l2<T>(x_row, base, min(end, base + 4 * min(nvec, (kPassPrefetch + 1) * kStep)));
        }
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          unsigned key[4];
          keys4(q[j], base + 4 * sample_vec<kVecs * T>(j * T + t, nvec), start, end, key);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            s.sample[(4 * j + i) * T + t] = key[i];  // kept in shared memory for the levels, not in registers
            if (key[i] != 0u) {
              lo = min(lo, key[i]);
              hi = max(hi, key[i]);
            }
          }
        }
      }
      block_min_max<T>(lo, hi, s);  // its barrier also orders the cleared histogram before the atomics
      stage_clock();  // (the probe: the sample's loads and their range)
      const int m_target = m;
      // Two levels of 11 bits from the highest varying bit: the threshold is the m-th largest sampled key's
      // prefix of those bits (every key at or above it is a candidate).
      int sshift;
      unsigned sprefix;
      radix_start(lo, hi, sshift, sprefix);
      for (int pass = 0; pass < 2; ++pass) {
        const int nshift = sshift > kBinBits ? sshift - kBinBits : 0;
        const unsigned digit_mask = (1u << (sshift - nshift)) - 1u;
        int* h = s.hist[level & 1];
#pragma unroll 4
        for (int e = 0; e < 4 * kVecs; ++e) {
          const unsigned kk = s.sample[e * T + t];
          if (kk != 0u && (sshift >= 32 || (kk >> sshift) == sprefix)) atomicAdd(&h[(kk >> nshift) & digit_mask], 1);
        }
        block_find_bin<T>(h, s.hist[(level + 1) & 1], m, s, bin, need, count);
        ++level;
        sprefix = (sshift >= 32 ? 0u : (sprefix << (sshift - nshift))) | (unsigned)bin;
        sshift = nshift;
        m = need;
        if (count == need || sshift == 0 || (kSampleLevels < 2 && count - need <= m_target / 4)) break;
      }
      threshold = sprefix << sshift;
      __syncthreads();  // every thread read its sample before the pass overwrites it with candidates
      if (threshold == 0u) threshold = 1u;
    } else {
      __syncthreads();  // the cleared histogram
    }
    stage_clock();

    // ---- 2. one pass: keys >= threshold, in the fixed order, to the candidates
    unsigned cand_lo = 0xffffffffu, cand_hi = 0u;
    const int n_cand = prefill_pass<T>(
        x_row, base, nvec, start, end, p.aligned, s, [&](unsigned kk, int) { return kk >= threshold; },
        [&](int slot, unsigned kk, int c) {
          if (slot < kPrefillCap) {
            s.cand_key[slot] = kk;
            s.cand_col[slot] = c;
          }
        },
        cand_lo, cand_hi);
    block_min_max<T>(cand_lo, cand_hi, s);  // its barrier: the candidates are complete
    stage_clock();
    const bool fast = n_cand >= p.k && n_cand <= kPrefillCap;  // uniform; else the exact select over the row

    auto for_each_key = [&](auto&& f) {
      if (fast) {
        for (int i = t; i < n_cand; i += T) f(s.cand_key[i], s.cand_col[i]);
      } else {
        for (int v = t; v < nvec; v += T) {
          unsigned key[4];
          const int c0 = base + 4 * v;
          load_vec4(x_row, c0, start, end, p.aligned, key);
#pragma unroll
          for (int i = 0; i < 4; ++i) f(key[i], c0 + i);
        }
      }
    };

    // ---- 3. exact radix select on the key (11-bit levels from the candidates' highest varying bit; the row's
    // from bit 31), then on ~column among ties at the k-th key
    unsigned prefix = 0u;
    int shift = 32;
    if (fast) radix_start(cand_lo, cand_hi, shift, prefix);
    int k_rem = p.k;
    bool tie = false;
    while (true) {
      const int nshift = shift > kBinBits ? shift - kBinBits : 0;
      const unsigned digit_mask = (1u << (shift - nshift)) - 1u;
      int* h = s.hist[level & 1];
      for_each_key([&](unsigned kk, int) {
        if (kk != 0u && (shift >= 32 || (kk >> shift) == prefix)) atomicAdd(&h[(kk >> nshift) & digit_mask], 1);
      });
      block_find_bin<T>(h, s.hist[(level + 1) & 1], k_rem, s, bin, need, count);
      stage_clock();
      ++level;
      prefix = (shift >= 32 ? 0u : (prefix << (shift - nshift))) | (unsigned)bin;
      shift = nshift;
      k_rem = need;
      if (count == need) break;
      if (shift == 0) {
        tie = true;
        break;
      }
    }
    unsigned prefix2 = 0u;
    int shift2 = kPrefillColBits;
    if (tie) {
      while (true) {
        const int nshift = shift2 > kBinBits ? shift2 - kBinBits : 0;
        const unsigned digit_mask = (1u << (shift2 - nshift)) - 1u;
        int* h = s.hist[level & 1];
        for_each_key([&](unsigned kk, int c) {
          if (kk == prefix) {
            const unsigned k2 = kColMask - (unsigned)(c - start);
            if (shift2 >= kPrefillColBits || (k2 >> shift2) == prefix2) atomicAdd(&h[(k2 >> nshift) & digit_mask], 1);
          }
        });
        block_find_bin<T>(h, s.hist[(level + 1) & 1], k_rem, s, bin, need, count);
        stage_clock();
        ++level;
        prefix2 = (shift2 >= kPrefillColBits ? 0u : (prefix2 << (shift2 - nshift))) | (unsigned)bin;
        shift2 = nshift;
        k_rem = need;
        if (count == need) break;
      }
    }
    auto selected = [&](unsigned kk, int c) {
      if (kk == 0u) return false;
      const unsigned cls = kk >> shift;
      if (cls != prefix) return cls > prefix;
      return !tie || ((kColMask - (unsigned)(c - start)) >> shift2) >= prefix2;
    };

    // ---- 4. the k selected, written in the candidates' fixed order (fast) or the row's (fallback)
    if (fast) {
      // Warp w owns candidate slots [w * per, (w + 1) * per), read 32 consecutive slots at a time (no bank
      // conflicts); its selected keys go out in slot order after the lower warps' (one block scan of the counts).
      const int lane = t & 31, warp = t >> 5;
      const int per = ((n_cand + T - 1) / T) * 32;
      const int i0 = warp * per, i1 = min(n_cand, i0 + per);
      int mine = 0;
      for (int i = i0 + lane; i - lane < i1; i += 32) {
        const bool sel = i < i1 && selected(s.cand_key[i], s.cand_col[i]);
        mine += __popc(__ballot_sync(0xffffffffu, sel));
      }
      int total;
      int slot = prefill_scan<T>(lane == 0 ? mine : 0, s, 0, total);  // lane 0 carries the warp's count
      slot = __shfl_sync(0xffffffffu, slot, 0);
      const unsigned lanes_below = (1u << lane) - 1u;
      for (int i = i0 + lane; i - lane < i1; i += 32) {
        const bool sel = i < i1 && selected(s.cand_key[i], s.cand_col[i]);
        const unsigned mask = __ballot_sync(0xffffffffu, sel);
        if (sel) out_row[slot + __popc(mask & lanes_below)] = out_value(s.cand_col[i] - start, req, p);
        slot += __popc(mask);
      }
    } else {
      unsigned unused_lo = 0xffffffffu, unused_hi = 0u;
      prefill_pass<T>(
          x_row, base, nvec, start, end, p.aligned, s, selected,
          [&](int slot, unsigned, int c) {
            if (slot < p.k) out_row[slot] = out_value(c - start, req, p);
          },
          unused_lo, unused_hi);
    }
    __syncthreads();  // histograms, candidates and warp sums are reused by the next row
    last_stage_clock(-2, 1, level);
  }
  print_stage_clocks();
}

template <int T, int MIN_BLOCKS>
cudaError_t prefill_configure() {
  static bool configured = false;  // host work once: the >48 KB dynamic shared memory opt-in
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(topk_prefill_kernel<T, MIN_BLOCKS>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 (int)sizeof(PrefillShared<T>));
    if (err != cudaSuccess) return err;
    configured = true;
  }
  return cudaSuccess;
}

template <int T, int MIN_BLOCKS>
cudaError_t launch_prefill(const Params& p, int grid, cudaStream_t stream) {
  const cudaError_t err = prefill_configure<T, MIN_BLOCKS>();
  if (err != cudaSuccess) return err;
  return launch_plain(topk_prefill_kernel<T, MIN_BLOCKS>, dim3((unsigned)grid, 1, 1), T, sizeof(PrefillShared<T>),
                      stream, p);
}

template <int T, int MIN_BLOCKS>
int prefill_blocks_per_sm() {
  if (prefill_configure<T, MIN_BLOCKS>() != cudaSuccess) return 0;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, topk_prefill_kernel<T, MIN_BLOCKS>, T,
                                                    sizeof(PrefillShared<T>)) != cudaSuccess)
    return 0;
  return blocks;
}

template <int KPT>
cudaError_t launch(const Params& p, int cluster, int grid_rows, cudaStream_t stream) {
  if (cluster > 8) {  // 16 CTAs per cluster is beyond the portable 8: allowed per kernel, once (host work)
    static bool allowed = false;
    if (!allowed) {
      const cudaError_t err =
          cudaFuncSetAttribute(topk_registers_kernel<KPT>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      if (err != cudaSuccess) return err;
      allowed = true;
    }
  }
  return launch_in_clusters(topk_registers_kernel<KPT>, dim3((unsigned)cluster, (unsigned)grid_rows, 1), kThreads,
                            (unsigned)cluster, 0, stream, p);
}

// A routed launch's second stream and its fork / join events, one set per host thread and device (created at first
// use, never destroyed: a captured graph may refer to them). The cluster kernel runs on the second stream, side by
// side with the streaming kernel on the caller's: inside a CUDA graph the two are parallel branches.
struct RouteStreams {
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};

cudaError_t route_streams(RouteStreams*& out) {
  constexpr int kMaxDevices = 64;
  thread_local RouteStreams per_device[kMaxDevices];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  RouteStreams& r = per_device[device];
  if (r.side == nullptr) {
    if ((err = cudaStreamCreateWithFlags(&r.side, cudaStreamNonBlocking)) != cudaSuccess) return err;
    if ((err = cudaEventCreateWithFlags(&r.fork, cudaEventDisableTiming)) != cudaSuccess) return err;
    if ((err = cudaEventCreateWithFlags(&r.join, cudaEventDisableTiming)) != cudaSuccess) return err;
  }
  out = &r;
  return cudaSuccess;
}

template <int KPT>
cudaError_t launch_routed(Params p, int cluster, int stream_grid, cudaStream_t stream) {
  RouteStreams* r = nullptr;
  cudaError_t err = route_streams(r);
  if (err != cudaSuccess) return err;
  if ((err = cudaEventRecord(r->fork, stream)) != cudaSuccess) return err;
  if ((err = cudaStreamWaitEvent(r->side, r->fork, 0)) != cudaSuccess) return err;
  p.route = 2;
  if ((err = launch<KPT>(p, cluster, p.rows, r->side)) != cudaSuccess) return err;
  p.route = 1;
  if ((err = launch_stream(p, stream_grid, 1, stream)) != cudaSuccess) return err;
  if ((err = cudaEventRecord(r->join, r->side)) != cudaSuccess) return err;
  return cudaStreamWaitEvent(stream, r->join, 0);
}

}  // namespace

extern "C" {

const char* dsa_topk_registers_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

// Columns one CTA holds for `keys_per_thread` (8, 16 or 32); 0 for any other value.
int dsa_topk_registers_chunk(int keys_per_thread) {
  return (keys_per_thread == 8 || keys_per_thread == 16 || keys_per_thread == 32) ? keys_per_thread * kThreads : 0;
}

// Launch on `stream`; returns a cudaError_t (0 = success). `cluster` in 1..16 CTAs per row, each holding
// keys_per_thread * 512 columns; cluster * chunk must be >= cols (a window's first chunk starts at its start rounded
// down to a multiple of 4, so the chunks cover [that, that + cluster * chunk), which holds [start, end) as end <=
// cols). `aligned`: every row base is 16-byte aligned.
int dsa_topk_registers_launch(const float* x, long long x_stride, int rows, int cols, int k, const int* starts,
                              const int* ends, const int* block_table, long long bt_stride, const int* row_request,
                              int* out, int cluster, int keys_per_thread, int aligned, int max_grid_rows,
                              void* stream) {
  Params p{x, x_stride, rows, cols, k, starts, ends, block_table, bt_stride, row_request, out, aligned};
  const int grid_rows = rows < max_grid_rows ? rows : max_grid_rows;
  cudaError_t err;
  switch (keys_per_thread) {
    case 8: err = launch<8>(p, cluster, grid_rows, (cudaStream_t)stream); break;
    case 16: err = launch<16>(p, cluster, grid_rows, (cudaStream_t)stream); break;
    case 32: err = launch<32>(p, cluster, grid_rows, (cudaStream_t)stream); break;
    default: return (int)cudaErrorInvalidValue;
  }
  if (err != cudaSuccess) return (int)err;
  return (int)cudaGetLastError();
}

// The routed launch (see Params::route): the register kernel (`cluster` CTAs of `keys_per_thread` keys per thread
// per row, rows <= 65535) on a second stream takes the rows longer than one CTA holds (> 16K columns) and, while
// fewer than `long_rows` rows are longer than `long_cols`, the long ones too; the streaming kernel on `stream` takes
// the rest. Returns after both are enqueued and `stream` waits for the second one (a graph captures the fork and the
// join). Rows of at most dsa_topk_stream_max_cols() columns.
int dsa_topk_routed_launch(const float* x, long long x_stride, int rows, int cols, int k, const int* starts,
                           const int* ends, const int* block_table, long long bt_stride, const int* row_request,
                           int* out, int cluster, int keys_per_thread, int aligned, int long_cols, int long_rows,
                           void* stream) {
  if (cols > kStreamMaxCols || rows > 65535) return (int)cudaErrorInvalidValue;
  Params p{x, x_stride, rows, cols, k, starts, ends, block_table, bt_stride, row_request, out, aligned, 0, long_cols,
           long_rows};
  cudaError_t err;
  switch (keys_per_thread) {
    case 8: err = launch_routed<8>(p, cluster, rows, (cudaStream_t)stream); break;
    case 16: err = launch_routed<16>(p, cluster, rows, (cudaStream_t)stream); break;
    case 32: err = launch_routed<32>(p, cluster, rows, (cudaStream_t)stream); break;
    default: return (int)cudaErrorInvalidValue;
  }
  if (err != cudaSuccess) return (int)err;
  return (int)cudaGetLastError();
}

// The streaming kernel (`cluster` CTAs per row: 1, or 2 / 4 / 8 for the split pass; `grid` rows at a time, looping
// over the rows): rows of at most dsa_topk_stream_max_cols() columns; needs dsa_topk_stream_smem_bytes() of opt-in
// shared memory per CTA.
int dsa_topk_stream_max_cols() { return kStreamMaxCols; }

// How many clusters of `cluster` CTAs (2, 4 or 8) of the split pass this GPU runs at once (one CTA per SM with its
// shared memory; a GPC holds a cluster, so GPCs whose SM count is not a multiple of `cluster` leave SMs idle: on an
// H100 SXM 30 clusters of 4 on 132 SMs), 0 where none fits. Rows beyond it would run in a second wave, so the split
// plan narrows its clusters until its rows fit (topk.py).
int dsa_topk_stream_active_clusters(int cluster) {
  if (cluster < 2 || cluster > 8 || configure_stream<true>() != cudaSuccess) return 0;
  cudaLaunchAttribute attr[kLaunchAttrs];
  cudaLaunchConfig_t config = cluster_launch_config(dim3((unsigned)cluster, 1, 1), kThreads, (unsigned)cluster,
                                                    sizeof(StreamShared), nullptr, attr);
  config.numAttrs = 1;  // the cluster dimension alone: occupancy does not depend on how the launch is serialized
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, (const void*)topk_stream_kernel<true>, &config) != cudaSuccess) {
    (void)cudaGetLastError();  // a refused query leaves no error for the next launch to report
    return 0;
  }
  return clusters;
}
long long dsa_topk_stream_smem_bytes() { return (long long)sizeof(StreamShared); }

int dsa_topk_stream_launch(const float* x, long long x_stride, int rows, int cols, int k, const int* starts,
                           const int* ends, const int* block_table, long long bt_stride, const int* row_request,
                           int* out, int grid, int cluster, int aligned, void* stream) {
  if (cols > kStreamMaxCols || grid < 1 || (cluster != 1 && cluster != 2 && cluster != 4 && cluster != 8))
    return (int)cudaErrorInvalidValue;
  Params p{x, x_stride, rows, cols, k, starts, ends, block_table, bt_stride, row_request, out, aligned};
  const cudaError_t err = launch_stream(p, grid, cluster, (cudaStream_t)stream);
  if (err != cudaSuccess) return (int)err;
  return (int)cudaGetLastError();
}

// The prefill kernel (one CTA per row at a time, `grid` CTAs looping over the rows), `threads` 256 or 512: rows of
// fewer than dsa_topk_prefill_max_cols() columns.
int dsa_topk_prefill_max_cols() { return 1 << kPrefillColBits; }

// CTAs of the prefill kernel that fit one SM (0: not launchable), for the grid size.
int dsa_topk_prefill_blocks_per_sm(int threads) {
  if (threads == 256) return prefill_blocks_per_sm<256, 3>();
  if (threads == 512) return prefill_blocks_per_sm<512, 2>();
  return 0;
}

int dsa_topk_prefill_launch(const float* x, long long x_stride, int rows, int cols, int k, const int* starts,
                            const int* ends, const int* block_table, long long bt_stride, const int* row_request,
                            int* out, int threads, int grid, int aligned, void* stream) {
  if (cols >= (1 << kPrefillColBits) || grid < 1) return (int)cudaErrorInvalidValue;
  Params p{x, x_stride, rows, cols, k, starts, ends, block_table, bt_stride, row_request, out, aligned};
  cudaError_t err;
  if (threads == 256) err = launch_prefill<256, 3>(p, grid, (cudaStream_t)stream);
  else if (threads == 512) err = launch_prefill<512, 2>(p, grid, (cudaStream_t)stream);
  else return (int)cudaErrorInvalidValue;
  if (err != cudaSuccess) return (int)err;
  return (int)cudaGetLastError();
}

}  // extern "C"
