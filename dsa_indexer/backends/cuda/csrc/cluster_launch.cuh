// A kernel launch in thread-block clusters of `cluster` CTAs along x, shared by the kernels of csrc/ (each .cu is
// built alone; jit.py hashes this header with every source, so an edit here rebuilds them all).
#pragma once
#include <cuda_runtime.h>

template <class Kernel, class Arg>
inline cudaError_t launch_in_clusters(Kernel kernel, dim3 grid, unsigned threads, unsigned cluster, size_t smem,
                                      cudaStream_t stream, const Arg& arg) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads, 1, 1);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, arg);
}
