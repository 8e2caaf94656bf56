/* The simulated GPU's device model (libkrexsim.so). It stands in for the GPU
 * only: every process on the node shares one timeline per simulated GPU through
 * shared memory, so kernels of different processes never overlap and a
 * kernel's measured time grows when another process's work runs in between.
 * It models time, not data: copies move no bytes (unless KREX_SIM_MOVE_BYTES=1). */
#ifndef KREX_SIMGPU_H
#define KREX_SIMGPU_H
#include <stddef.h>
#include <stdint.h>

#define SIMGPU_MAX 16

/* Enqueue one operation on the calling process's current device. Returns its
 * end time (CLOCK_MONOTONIC ns). sync: block the caller until it has finished. */
uint64_t simgpu_submit(const char *api, int cls, const void *stream, uint64_t cost_ns,
                       uint64_t arghash, int sync);
uint64_t simgpu_stream_tail(const void *stream); /* when work queued on it ends */
void simgpu_sync_stream(const void *stream);
void simgpu_sync_all(const char *who);          /* wait for this process's work (not its green contexts') */
/* Green contexts, by number (1..SIMGPU_GREENS): a stream bound to one queues that context's
 * work, which only a sync of that context waits for (and a primary one's with
 * KREX_SIM_PRIMARY_SYNCS_GREEN=1). */
#define SIMGPU_GREENS 64
int simgpu_stream_bind(const void *stream, int green); /* 0, or 1: the table is full */
void simgpu_sync_green(int green, const char *who);
uint64_t simgpu_green_tail(int green);           /* when its queued work ends */
int simgpu_device_count(void);
int simgpu_get_device(void);
int simgpu_set_device(int dev);                  /* 0 or an error */
int simgpu_ctx_active(int dev);
void simgpu_ctx_activate(int dev);               /* a first one holds the driver lock (KREX_SIM_CTX_MS) */
void simgpu_ctx_query(void);                     /* a context query waits in that lock's queue */
int simgpu_ctx_ms(void);                         /* KREX_SIM_CTX_MS (0: no such lock) */
int simgpu_rc(void);                             /* what every simulated call returns */
void simgpu_set_return(int rc);
int simgpu_gated_rc(void);                       /* a gated call's: KREX_SIM_RC[_AFTER] */
int simgpu_moves_bytes(void);                    /* KREX_SIM_MOVE_BYTES: copies move bytes */
void *simgpu_alloc(size_t n);                   /* "device" memory (mmap'd host pages) */
void simgpu_free(void *p);                       /* ... and back (NULL: nothing) */
int simgpu_alloc_range(const void *p, void **base, size_t *size); /* its allocation: 0, else 1 */
void simgpu_life_host_time(void);               /* KREX_SIM_LIFE_MS: a module load's host time */
uint64_t simgpu_now(void);
void simgpu_sleep_until(uint64_t t);
void simgpu_trace(const char *json_fields);      /* append {"pid":..,<fields>} */

#endif
