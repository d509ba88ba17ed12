/* A running process to trace (compare.sh's running-process case):
 * `target THREADS` runs THREADS workers, each calling f0..f9 in turn, in
 * batches of 1000 calls with a 200 us sleep after each (so that the CPUs
 * are not all busy, and a thread that does not run is stalled, not
 * waiting for its turn), and a heartbeat thread that sleeps 1 ms at a
 * time. Every 50 ms it prints one line on standard output:
 *     T_NS CALLS MAX_GAP_US BATCH_NS BATCHES
 * (monotonic time, calls so far, the longest any thread went beyond its
 * sleep without finishing a batch or a heartbeat in those 50 ms: a stall,
 * and the time the batches of those 50 ms took, and how many). A line "K" on
 * standard input makes worker 0 run exactly K calls of f0 and answer
 * "done K" (a window the caller controls: the other workers wait). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define F(n)                                                                                      \
    __attribute__((noinline)) long f##n(long x)                                                   \
    {                                                                                             \
        __asm__ volatile("" ::: "memory");                                                        \
        return x + n;                                                                             \
    }
F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9)

static long (*const fs[10])(long) = {f0, f1, f2, f3, f4, f5, f6, f7, f8, f9};
static atomic_ulong calls;
static atomic_ulong max_gap_ns;
static atomic_ulong batch_ns, batches;
static atomic_int paused;

static unsigned long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long)t.tv_sec * 1000000000UL + (unsigned long)t.tv_nsec;
}

static void gap(unsigned long ns)
{
    unsigned long m = atomic_load_explicit(&max_gap_ns, memory_order_relaxed);
    while (ns > m && !atomic_compare_exchange_weak(&max_gap_ns, &m, ns))
        ;
}

static void *worker(void *arg)
{
    (void)arg;
    volatile long sink = 0;
    unsigned long last = now_ns();
    for (;;) {
        if (atomic_load_explicit(&paused, memory_order_relaxed)) {
            usleep(1000);
            last = now_ns();
            continue;
        }
        unsigned long t0 = now_ns();
        gap(t0 - last);
        for (int i = 0; i < 1000; i++)
            sink += fs[i % 10](i);
        unsigned long t1 = now_ns();
        atomic_fetch_add_explicit(&calls, 1000, memory_order_relaxed);
        atomic_fetch_add_explicit(&batch_ns, t1 - t0, memory_order_relaxed);
        atomic_fetch_add_explicit(&batches, 1, memory_order_relaxed);
        usleep(200);
        /* The sleep is not a stall: only what it overran by. */
        last = now_ns() - 200000 > t1 ? now_ns() - 200000 : t1;
    }
    return NULL;
}

static void *heartbeat(void *arg)
{
    (void)arg;
    unsigned long last = now_ns();
    for (;;) {
        usleep(1000);
        unsigned long t = now_ns();
        /* The sleep itself is not a stall. */
        gap(t - last > 1000000 ? t - last - 1000000 : 0);
        last = t;
    }
    return NULL;
}

static void *cues(void *arg)
{
    (void)arg;
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        long k = atol(line);
        atomic_store(&paused, 1);
        usleep(20000);
        volatile long sink = 0;
        for (long i = 0; i < k; i++)
            sink += f0(i);
        atomic_store(&paused, 0);
        printf("done %ld\n", k);
        fflush(stdout);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    int threads = argc > 1 ? atoi(argv[1]) : 8;
#ifdef PR_SET_PTRACER
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
#endif
    pthread_t t;
    for (int i = 0; i < threads; i++)
        pthread_create(&t, NULL, worker, NULL);
    pthread_create(&t, NULL, heartbeat, NULL);
    pthread_create(&t, NULL, cues, NULL);
    for (;;) {
        usleep(50000);
        unsigned long g = atomic_exchange(&max_gap_ns, 0);
        unsigned long b = atomic_exchange(&batch_ns, 0), n = atomic_exchange(&batches, 0);
        printf("%lu %lu %lu %lu %lu\n", now_ns(), atomic_load(&calls), g / 1000, b, n);
        fflush(stdout);
    }
}
