// Kernel launches in thread-block clusters of `cluster` CTAs along x, shared by the kernels of csrc/ (each .cu is
// built alone; jit.py hashes this header with every source, so an edit here rebuilds them all).
#pragma once
#include <cuda_runtime.h>

// The launch configuration; `attr` (the caller's, alive until the launch or query) holds the cluster dimension.
inline cudaLaunchConfig_t cluster_launch_config(dim3 grid, unsigned threads, unsigned cluster, size_t smem,
                                                cudaStream_t stream, cudaLaunchAttribute (&attr)[1]) {
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
  return config;
}

template <class Kernel, class Arg>
inline cudaError_t launch_in_clusters(Kernel kernel, dim3 grid, unsigned threads, unsigned cluster, size_t smem,
                                      cudaStream_t stream, const Arg& arg) {
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t config = cluster_launch_config(grid, threads, cluster, smem, stream, attr);
  return cudaLaunchKernelEx(&config, kernel, arg);
}
