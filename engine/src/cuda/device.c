/*
 * device.c — finding CUDA devices. Counting never fails: without a driver or a device
 * the answer is 0, so "auto" quietly falls back to the CPU. The backend itself is in
 * cuda_backend.c.
 */
#include <cuda_runtime_api.h>

#include "../backend.h"

int32_t m3_cuda_count_devices(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError(); /* clear the non-sticky error so later calls start clean */
    return 0;
  }
  return n;
}
