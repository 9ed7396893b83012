/*
 * device.c — finding CUDA devices. Counting never fails: without a driver or a device
 * the answer is 0, so "auto" quietly falls back to the CPU.
 */
#include <cuda_runtime_api.h>

#include "../backend.h"
#include "../errors.h"

int32_t m3_cuda_count_devices(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError(); /* clear the non-sticky error so later calls start clean */
    return 0;
  }
  return n;
}

m3_status m3_cuda_backend_create(const backend_args *a, backend **out, const backend_ops **ops) {
  (void)a;
  (void)out;
  (void)ops;
  return m3_fail(M3_ERR_UNSUPPORTED, "the CUDA backend is not built yet");
}
