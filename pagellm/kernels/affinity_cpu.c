/* Pins each thread of the process's OpenMP pool (libgomp: the pool PyTorch's operators and every pagellm kernel
 * share) to one core of a list, so that a rank's kernel threads stay on its cores instead of migrating between
 * them (vLLM binds its CPU workers' OpenMP threads the same way, VLLM_CPU_OMP_THREADS_BIND). Linux only.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <stdint.h>

/* Thread t of a pool of n threads runs on cores[t]. Returns 0, or -1 when a thread could not be pinned. */
int pagellm_pin_threads(const int32_t *cores, int n) {
    int failed = 0;
#pragma omp parallel num_threads(n) reduction(| : failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cores[omp_get_thread_num()], &set);
        failed |= sched_setaffinity(0, sizeof(set), &set) != 0; /* 0: the calling thread */
    }
    return failed ? -1 : 0;
}
