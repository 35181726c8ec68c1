// Kernel launches in thread-block clusters of `cluster` CTAs along x, shared by the kernels of csrc/ (each .cu is
// built alone; jit.py hashes this header with every source, so an edit here rebuilds them all).
#pragma once
#include <cuda_runtime.h>

// DSA_PDL=1: the build for programmatic dependent launch (DSA_INDEXER_PDL=1; backends/triton/pdl.py says why). Every
// launch below then lets its kernel start while the stream's previous kernel drains, and each kernel's first
// statement, pdl_wait(), returns once that kernel has completed and its writes are visible: results are unchanged.
// 0, the default build: plain launches, and pdl_wait() compiles to nothing.
#ifndef DSA_PDL
#define DSA_PDL 0
#endif
constexpr int kLaunchAttrs = 1 + DSA_PDL;

__device__ __forceinline__ void pdl_wait() {
#if DSA_PDL
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The launch configuration; `attr` (the caller's, alive until the launch or query) holds the cluster dimension
// (and, in the DSA_PDL build, the programmatic stream serialization).
inline cudaLaunchConfig_t cluster_launch_config(dim3 grid, unsigned threads, unsigned cluster, size_t smem,
                                                cudaStream_t stream, cudaLaunchAttribute (&attr)[kLaunchAttrs]) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads, 1, 1);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
#if DSA_PDL
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  config.numAttrs = 2;
#endif
  return config;
}

template <class Kernel, class Arg>
inline cudaError_t launch_in_clusters(Kernel kernel, dim3 grid, unsigned threads, unsigned cluster, size_t smem,
                                      cudaStream_t stream, const Arg& arg) {
  cudaLaunchAttribute attr[kLaunchAttrs];
  const cudaLaunchConfig_t config = cluster_launch_config(grid, threads, cluster, smem, stream, attr);
  return cudaLaunchKernelEx(&config, kernel, arg);
}

// A launch without clusters: `kernel<<<grid, threads, smem, stream>>>(arg)`, or in the DSA_PDL build the same with
// programmatic stream serialization.
template <class Kernel, class Arg>
inline cudaError_t launch_plain(Kernel kernel, dim3 grid, unsigned threads, size_t smem, cudaStream_t stream,
                                const Arg& arg) {
#if DSA_PDL
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads, 1, 1);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, arg);
#else
  kernel<<<grid, threads, smem, stream>>>(arg);
  return cudaSuccess;
#endif
}
