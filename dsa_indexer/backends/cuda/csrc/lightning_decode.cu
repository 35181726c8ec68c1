// Decode lightning indexer in ONE kernel (sm90 / sm100): paged fp8 logits and the exact top-k, with the logits
// kept in shared memory (never written to global memory). Compiled at first use (`jit.py`).
//
// Contract (the reference's `lightning_indexer`): row r = b * next_n + j scores the first len = context_lens[r]
// keys of request b (pages block_table[b, :]) with L[c] = k_scale[c] * sum_h w[r, h] * relu(q[r, h] . k[c]),
// and returns the k largest columns, ties to the lower column, a NaN ranked as -inf, -1 padding when len <= k
// (then every column 0..len-1 in order); with a block table for slots, physical cache slots instead of columns.
//
// Design:
// - A row is split over a thread-block cluster of C CTAs (C <= 8), each owning a contiguous chunk of columns
//   (a multiple of the 64-token page). The CTA computes its chunk's logits with fp8 mma.sync (m16n8k32, fp32
//   accumulate): a warp takes 16 keys (the MMA's M side) against the 64 heads (8 N tiles of 8), the head
//   dimension in 4 K steps of 32. q of the row and the head weights stay in registers for the whole chunk.
//   The dot product does not depend on the order of its terms, so a thread loads each key's bytes as two
//   16-byte vectors and q's with the SAME permutation of the 128 dims (loads stay vectorised and coalesced).
// - Each logit becomes an order-preserving uint32 key in shared memory (0 marks a column past the row).
// - Radix select over the cluster: 11 / 11 / 10-bit digits, one 2048-bin shared histogram per level and CTA,
//   merged through distributed shared memory, so every CTA takes the same decisions without global scratch.
//   The result is the exact k-th key T and how many keys equal to T are taken.
// - Output: the keys above T, then the lowest columns equal to T; positions from warp ballots, a scan over
//   warps and the lower CTAs' totals: no atomic decides a position (bitwise repeatable).
// Launch shape depends on tensor shapes and max_context_len only (no host synchronization: graph-capturable).

#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cluster_launch.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kHeads = 64;
constexpr int kDim = 128;
constexpr int kPage = 64;
constexpr int kPageBytes = kPage * (kDim + 4);  // 64 fp8 keys of 128 bytes, then 64 fp32 scales
constexpr int kBins = 2048;
constexpr int kBinsPerThread = kBins / kThreads;  // 8
constexpr int kMaxCluster = 8;

struct Params {
  const uint8_t* q;        // [rows, 64, 128] fp8 e4m3
  const uint8_t* kv;       // [pages, 64, 1, 132] bytes
  const float* weights;    // [rows, 64]
  const int* lens;         // [rows]
  const int* block_table;  // [B, bt_stride]
  long long bt_stride;
  int rows;
  int next_n;
  int max_len;
  int k;
  int chunk;               // columns per CTA, a multiple of 64
  int slots;               // 1: write physical cache slots
  int* out;                // [rows, k]
  float* logits_out;       // may be null: [rows, logits_stride] fp32 logits of the visible columns (tests)
  long long logits_stride;
};

struct alignas(16) Smem {  // 16-byte size: the key array and the stages after it stay 16-byte aligned
  int hist[3][kBins];
  int warp_a[kWarps];
  int warp_b[kWarps];
  int found[3];
  alignas(8) int totals[2];  // this CTA's keys above T and equal to T (read by higher-ranked peers)
};

__device__ __forceinline__ unsigned order_key(float value) {
  unsigned u = __float_as_uint(value);
  if (u == 0x80000000u) u = 0u;                                   // -0.0 == +0.0
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x007fffffu;        // NaN ranks as -inf
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);              // >= 0x007fffff: never 0
}

__device__ __forceinline__ void mma_e4m3(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float relu_keep_nan(float x) { return x < 0.f ? 0.f : x; }

__device__ __forceinline__ int out_value(int col, int req, const Params& p) {
  if (!p.slots || col < 0) return col;
  const int page = p.block_table[(long long)req * p.bt_stride + col / kPage];
  return page * kPage + col % kPage;
}

// Pages stream into a ring of shared-memory stages with cp.async (several stages in flight per CTA: the load
// parallelism one CTA per SM needs to reach HBM bandwidth). A stage holds 2 pages: 128 keys of 128 bytes, then their
// 128 fp32 scales. Key rows are stored with their 16-byte chunks XOR-swizzled by (row & 1) * 4, so the MMA
// fragment loads of two adjacent rows fall on different banks.
constexpr int kPagesPerStage = 2;
constexpr int kStageKeys = kPagesPerStage * kPage;          // 128
constexpr int kStageBytes = kStageKeys * kDim + kStageKeys * 4;  // 16896
constexpr int kStages = 4;
constexpr int kChunksPerPage = kPage * kDim / 16 + kPage * 4 / 16;  // 512 key chunks + 16 scale chunks

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Issue the copies of stage `step` (pages 2 * step, 2 * step + 1 of this CTA's chunk) into `stage`.
__device__ __forceinline__ void issue_stage(const Params& p, int req, int first_page, int n_pages, int step,
                                            unsigned char* stage) {
  for (int i = threadIdx.x; i < kPagesPerStage * kChunksPerPage; i += kThreads) {
    const int sub = i / kChunksPerPage, c = i % kChunksPerPage;
    const int local_page = step * kPagesPerStage + sub;
    if (local_page >= n_pages) continue;
    const int page = p.block_table[(long long)req * p.bt_stride + first_page + local_page];
    const unsigned char* src = p.kv + (long long)page * kPageBytes;
    if (c < kPage * kDim / 16) {
      const int row = c / 8, chunk = c % 8;
      const int srow = sub * kPage + row;
      cp_async16(stage + srow * kDim + ((chunk ^ ((srow & 1) * 4)) * 16), src + row * kDim + chunk * 16);
    } else {
      const int sc = c - kPage * kDim / 16;  // 16 chunks of 4 scales
      cp_async16(stage + kStageKeys * kDim + sub * kPage * 4 + sc * 16, src + kPage * kDim + sc * 16);
    }
  }
}

// Word w (4 bytes) of a key row's two 16-byte vectors: the K slots of MMA step w / 2 (see the design note).
__device__ __forceinline__ unsigned word(const uint4& lo, const uint4& hi, int w) {
  switch (w) {
    case 0: return lo.x;
    case 1: return lo.y;
    case 2: return lo.z;
    case 3: return lo.w;
    case 4: return hi.x;
    case 5: return hi.y;
    case 6: return hi.z;
    default: return hi.w;
  }
}

// Suffix scan helper: for per-thread counts v, the sum over threads above this one (higher t) in the block.
__device__ __forceinline__ int sum_above(int v, Smem& s) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  int incl = v;  // sum over lanes >= lane
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_down_sync(0xffffffffu, incl, off);
    if (lane + off < 32) incl += y;
  }
  if (lane == 0) s.warp_a[warp] = incl;
  __syncthreads();
  int above_warps = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) above_warps += (w > warp) ? s.warp_a[w] : 0;
  __syncthreads();
  return above_warps + incl - v;
}

// The key array's length: the chunk rounded up to whole 256-column warp ranges.
__host__ __device__ __forceinline__ int span_of(int chunk) {
  return ((chunk + 32 * kWarps - 1) / (32 * kWarps)) * 32 * kWarps;
}

__global__ void __launch_bounds__(kThreads, 1) lightning_decode_kernel(Params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  unsigned* keys = reinterpret_cast<unsigned*>(smem_raw + sizeof(Smem));
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();
  const int csize = (int)cluster.num_blocks();
  const int row = blockIdx.x / csize;
  if (row >= p.rows) return;  // whole clusters only: the grid is rows * csize
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int req = row / p.next_n;
  const int len = min(max(p.lens[row], 0), p.max_len);
  int* out_row = p.out + (long long)row * p.k;

  if (len <= p.k) {  // no selection: every visible column in order, then -1 (the same branch in every CTA)
    for (int i = rank * kThreads + t; i < p.k; i += csize * kThreads) out_row[i] = i < len ? out_value(i, req, p) : -1;
    if (p.logits_out == nullptr) return;
  }

  const int c_begin = rank * p.chunk;
  const int c_end = min(c_begin + p.chunk, len);
  const int n_local = max(c_end - c_begin, 0);

  // ---- logits of this CTA's chunk into shared memory ------------------------------------------------------
  {
    const int g = lane >> 2, tq = lane & 3;
    const uint8_t* q_row = p.q + (long long)row * kHeads * kDim;
    unsigned qw[8][8];
    float w0[8], w1[8];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const uint8_t* head = q_row + (nt * 8 + g) * kDim;
      const uint4 lo = __ldg(reinterpret_cast<const uint4*>(head + 16 * tq));
      const uint4 hi = __ldg(reinterpret_cast<const uint4*>(head + 64 + 16 * tq));
#pragma unroll
      for (int w = 0; w < 8; ++w) qw[nt][w] = word(lo, hi, w);
      w0[nt] = p.weights[(long long)row * kHeads + nt * 8 + tq * 2];
      w1[nt] = p.weights[(long long)row * kHeads + nt * 8 + tq * 2 + 1];
    }
    unsigned char* stages = smem_raw + sizeof(Smem) + (size_t)span_of(p.chunk) * sizeof(unsigned);
    const int first_page = c_begin / kPage;
    const int n_pages = (n_local + kPage - 1) / kPage;
    const int steps = (n_pages + kPagesPerStage - 1) / kPagesPerStage;
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < steps) issue_stage(p, req, first_page, n_pages, st, stages + st * kStageBytes);
      cp_async_commit();
    }
    // Warp w takes keys [16 w, 16 w + 16) of each stage: rows srow0 = 16 w + g and srow0 + 8 (same parity).
    const int srow0 = warp * 16 + g;
    const int swz = (srow0 & 1) * 4;
#pragma unroll 1
    for (int step = 0; step < steps; ++step) {
      if (step + kStages - 1 < steps)
        issue_stage(p, req, first_page, n_pages, step + kStages - 1,
                    stages + ((step + kStages - 1) % kStages) * kStageBytes);
      cp_async_commit();
      cp_async_wait<kStages - 1>();
      __syncthreads();
      const unsigned char* stage = stages + (step % kStages) * kStageBytes;
      const uint4 lo0 = *reinterpret_cast<const uint4*>(stage + srow0 * kDim + ((tq ^ swz) * 16));
      const uint4 hi0 = *reinterpret_cast<const uint4*>(stage + srow0 * kDim + (((4 + tq) ^ swz) * 16));
      const uint4 lo1 = *reinterpret_cast<const uint4*>(stage + (srow0 + 8) * kDim + ((tq ^ swz) * 16));
      const uint4 hi1 = *reinterpret_cast<const uint4*>(stage + (srow0 + 8) * kDim + (((4 + tq) ^ swz) * 16));
      const float* scale = reinterpret_cast<const float*>(stage + kStageKeys * kDim);
      float part0 = 0.f, part1 = 0.f;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          mma_e4m3(acc, word(lo0, hi0, 2 * ks), word(lo1, hi1, 2 * ks), word(lo0, hi0, 2 * ks + 1),
                   word(lo1, hi1, 2 * ks + 1), qw[nt][2 * ks], qw[nt][2 * ks + 1]);
        }
        part0 += relu_keep_nan(acc[0]) * w0[nt] + relu_keep_nan(acc[1]) * w1[nt];
        part1 += relu_keep_nan(acc[2]) * w0[nt] + relu_keep_nan(acc[3]) * w1[nt];
      }
      part0 += __shfl_xor_sync(0xffffffffu, part0, 1);
      part0 += __shfl_xor_sync(0xffffffffu, part0, 2);
      part1 += __shfl_xor_sync(0xffffffffu, part1, 1);
      part1 += __shfl_xor_sync(0xffffffffu, part1, 2);
      if (tq < 2) {
        const int srow = srow0 + 8 * tq;
        const int local = step * kStageKeys + srow;
        const float logit = (tq == 0 ? part0 : part1) * scale[srow];
        if (local < n_local) {
          keys[local] = order_key(logit);
          if (p.logits_out != nullptr) p.logits_out[(long long)row * p.logits_stride + c_begin + local] = logit;
        }
      }
      __syncthreads();  // the stage is refilled by the next iteration's copies
    }
    cp_async_wait<0>();
  }
  if (len <= p.k) return;  // only here for the logits output (tests)
  // Columns of the chunk's last warp range past the row: key 0 (below every real key, never counted).
  const int span = span_of(p.chunk);
  for (int i = n_local + t; i < span; i += kThreads) keys[i] = 0u;
  for (int i = t; i < 3 * kBins; i += kThreads) (&s.hist[0][0])[i] = 0;
  __syncthreads();

  // ---- radix select over the cluster ------------------------------------------------------------------------
  unsigned prefix = 0u, mask = 0u;
  int k_rem = p.k;
#pragma unroll 1
  for (int level = 0; level < 3; ++level) {
    const int shift = level == 0 ? 21 : (level == 1 ? 10 : 0);  // 11 / 11 / 10-bit digits
    const unsigned digit_mask = level == 2 ? 0x3ffu : 0x7ffu;
    int* hist = s.hist[level];
    // Real logits crowd into few bins at the top levels: one atomic per distinct bin per warp (match_any), not
    // one per key, or same-address atomics serialise the pass.
    for (int i = t; i < span; i += kThreads) {
      const unsigned key = keys[i];
      const bool counted = key != 0u && (key & mask) == prefix;
      const int bin = counted ? (int)((key >> shift) & digit_mask) : -1;
      const unsigned same = __match_any_sync(0xffffffffu, bin);
      if (counted && lane == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
    }
    cluster.sync();  // every CTA's histogram of this level is complete
    // All peers' bins requested before any is added (the loads are in flight together), 16 bytes at a time.
    int4 part_a[kMaxCluster], part_b[kMaxCluster];
#pragma unroll
    for (int q = 0; q < kMaxCluster; ++q) {
      if (q < csize) {
        const int4* peer = reinterpret_cast<const int4*>(cluster.map_shared_rank(hist, q)) + 2 * t;
        part_a[q] = peer[0];
        part_b[q] = peer[1];
      }
    }
    int v[kBinsPerThread] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int q = 0; q < kMaxCluster; ++q) {
      if (q < csize) {
        v[0] += part_a[q].x; v[1] += part_a[q].y; v[2] += part_a[q].z; v[3] += part_a[q].w;
        v[4] += part_b[q].x; v[5] += part_b[q].y; v[6] += part_b[q].z; v[7] += part_b[q].w;
      }
    }
    int mine = 0;
#pragma unroll
    for (int i = 0; i < kBinsPerThread; ++i) mine += v[i];
    int above = sum_above(mine, s);
#pragma unroll
    for (int i = kBinsPerThread - 1; i >= 0; --i) {
      if (above < k_rem && above + v[i] >= k_rem) {
        s.found[0] = t * kBinsPerThread + i;
        s.found[1] = k_rem - above;
      }
      above += v[i];
    }
    __syncthreads();
    prefix |= (unsigned)s.found[0] << shift;
    mask |= digit_mask << shift;
    k_rem = s.found[1];
    __syncthreads();
  }
  const unsigned threshold = prefix;  // the exact k-th key; take the k_rem lowest columns equal to it
  const int taken_above = p.k - k_rem;

  // ---- ordered output ---------------------------------------------------------------------------------------
  const int per_warp = span / kWarps;  // a multiple of 32
  const int w_begin = warp * per_warp;
  int n_above = 0, n_equal = 0;
  for (int i = w_begin + lane; i < w_begin + per_warp; i += 32) {
    const unsigned key = keys[i];
    n_above += __popc(__ballot_sync(0xffffffffu, key > threshold));
    n_equal += __popc(__ballot_sync(0xffffffffu, key == threshold));
  }
  if (lane == 0) {
    s.warp_a[warp] = n_above;
    s.warp_b[warp] = n_equal;
  }
  __syncthreads();
  int base_above = 0, base_equal = 0, cta_above = 0, cta_equal = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    base_above += w < warp ? s.warp_a[w] : 0;
    base_equal += w < warp ? s.warp_b[w] : 0;
    cta_above += s.warp_a[w];
    cta_equal += s.warp_b[w];
  }
  if (t == 0) {
    s.totals[0] = cta_above;
    s.totals[1] = cta_equal;
  }
  cluster.sync();  // every CTA's totals are visible
  int2 lower[kMaxCluster];
#pragma unroll
  for (int q = 0; q < kMaxCluster; ++q)
    if (q < rank) lower[q] = *reinterpret_cast<const int2*>(cluster.map_shared_rank(s.totals, q));
#pragma unroll
  for (int q = 0; q < kMaxCluster; ++q) {
    if (q < rank) {
      base_above += lower[q].x;
      base_equal += lower[q].y;
    }
  }
  const unsigned lt = (1u << lane) - 1u;
  for (int i = w_begin + lane; i < w_begin + per_warp; i += 32) {
    const unsigned key = keys[i];
    const unsigned a = __ballot_sync(0xffffffffu, key > threshold);
    const unsigned e = __ballot_sync(0xffffffffu, key == threshold);
    const int col = c_begin + i;
    if (key > threshold) {
      out_row[base_above + __popc(a & lt)] = out_value(col, req, p);
    } else if (key == threshold) {
      const int rank_eq = base_equal + __popc(e & lt);
      if (rank_eq < k_rem) out_row[taken_above + rank_eq] = out_value(col, req, p);
    }
    base_above += __popc(a);
    base_equal += __popc(e);
  }
  cluster.sync();  // no CTA leaves while a peer may still read its shared memory
}

}  // namespace

extern "C" {

long long dsa_lightning_decode_smem_bytes(int chunk) {
  return (long long)sizeof(Smem) + (long long)span_of(chunk) * sizeof(unsigned) + (long long)kStages * kStageBytes;
}

int dsa_lightning_decode_max_cluster() { return kMaxCluster; }

// Returns 0 or a cudaError_t.
int dsa_lightning_decode_launch(const void* q, const void* kv, const float* weights, const int* lens,
                                const int* block_table, long long bt_stride, int rows, int next_n, int max_len,
                                int k, int chunk, int cluster, int slots, int* out, float* logits_out,
                                long long logits_stride, void* stream) {
  if (rows <= 0) return 0;
  if (cluster < 1 || cluster > kMaxCluster || chunk <= 0 || chunk % kPage != 0) return (int)cudaErrorInvalidValue;
  Params p{static_cast<const uint8_t*>(q), static_cast<const uint8_t*>(kv), weights, lens, block_table, bt_stride,
           rows, next_n, max_len, k, chunk, slots, out, logits_out, logits_stride};
  const long long smem = dsa_lightning_decode_smem_bytes(chunk);
  cudaError_t err = cudaFuncSetAttribute(lightning_decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem);
  if (err != cudaSuccess) return (int)err;
  err = launch_in_clusters(lightning_decode_kernel, dim3((unsigned)(rows * cluster), 1, 1), kThreads,
                           (unsigned)cluster, (size_t)smem, static_cast<cudaStream_t>(stream), p);
  if (err != cudaSuccess) return (int)err;
  return (int)cudaGetLastError();
}

const char* dsa_lightning_decode_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

}  // extern "C"
