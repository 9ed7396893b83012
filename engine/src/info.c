/*
 * info.c — library-wide facts and switches: ABI and version, the interrupt flag the
 * m3lua host sets from its signal handler, the CUDA build/device probe, pinned host memory, CPU
 * threads.
 */
#include <cblas.h>
#include <omp.h>
#include <signal.h>

#include "backend.h"
#include "errors.h"

static volatile sig_atomic_t interrupt_flag;

int32_t m3_abi_version(void) { return M3_ABI_VERSION; }

const char *m3_version(void) { return M3_VERSION; }

void m3_interrupt(void) { interrupt_flag = 1; }

void m3_interrupt_clear(void) { interrupt_flag = 0; }

int32_t m3_interrupted(void) { return interrupt_flag != 0; }

int32_t m3_has_cuda_build(void) {
#ifdef M3_HAVE_CUDA
  return 1;
#else
  return 0;
#endif
}

int32_t m3_cuda_device_count(void) {
#ifdef M3_HAVE_CUDA
  return m3_cuda_count_devices();
#else
  return 0;
#endif
}

void *m3_host_pinned_alloc(size_t bytes) {
#ifdef M3_HAVE_CUDA
  return m3_cuda_count_devices() > 0 ? m3_cuda_host_alloc(bytes) : NULL;
#else
  (void)bytes;
  return NULL;
#endif
}

void m3_host_pinned_free(void *p) {
#ifdef M3_HAVE_CUDA
  m3_cuda_host_free(p);
#else
  (void)p;
#endif
}

m3_status m3_cpu_set_threads(int32_t n) {
  const int32_t most = 4 * omp_get_num_procs();
  if (n > most)
    return m3_fail(M3_ERR_ARGUMENT, "cpu_threads: n = %d: at most %d (4 per core of the %d here)", n, most,
                   omp_get_num_procs());
  omp_set_num_threads(n <= 0 ? omp_get_num_procs() : n);
  return M3_OK;
}

int32_t m3_cpu_threads(void) { return omp_get_max_threads(); }

const char *m3_cpu_blas_core(void) { return openblas_get_corename(); }
