/*
 * device.c — finding CUDA devices, and page-locked host memory for batches. Counting never
 * fails: without a driver or a device the answer is 0, so "auto" quietly falls back to the
 * CPU. The backend itself is in cuda_backend.c.
 */
#include <cuda_runtime_api.h>
#include <string.h>

#include "../backend.h"

int32_t m3_cuda_count_devices(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError(); /* clear the non-sticky error so later calls start clean */
    return 0;
  }
  return n;
}

int32_t m3_cuda_device_capability(int32_t index) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return 10 * major + minor;
}

void *m3_cuda_host_alloc(size_t bytes) {
  void *p = NULL;
  if (cudaMallocHost(&p, bytes ? bytes : 1) != cudaSuccess) {
    cudaGetLastError();
    return NULL;
  }
  memset(p, 0, bytes);
  return p;
}

void m3_cuda_host_free(void *p) {
  if (p) cudaFreeHost(p);
}
