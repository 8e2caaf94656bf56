/* Generated-from-the-tables test driver: every entry of api_*.def, reached by
 * every path that can reach it, with the table's sample arguments.
 *
 *   table_driver list                  one JSON line per (entry, path)
 *   table_driver run PATHS [threads]   call each reachable entry via each path;
 *                                      "threads": one thread per call, all at once
 *
 * PATHS is a comma list of: direct dlsym dlvsym gpa gpa_pt gpa1 cudart_ep cudart_ep_pt hip_gpa hip_gpa_pt
 * (dlvsym: the versioned lookup, with the version node NVIDIA's and AMD's libraries name;
 * the simulated ones define no versions, which glibc's dlvsym accepts for any)
 * Each call prints {"name","path","rc","hash","t0","t1","tid"}; the simulated GPU
 * records the hash of the arguments it received, so the two can be compared. */
#define _GNU_SOURCE
#define SIM_SAMPLES_DEFINE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "krex_tables.h"
#include "sim/sim_samples.h"

extern uint64_t krex_now_ns(void);

/* Direct (PLT) references to every entry: only the shim or the simulated library satisfies them. */
#define X(name, lookup, variant, cls, params, args, stream, cost, sample, chunk) \
    extern int name params;                                               \
    static uint64_t hash_##name params { return KREX_HASH_ARGS args; }    \
    static int call_##name(void *fp) { return ((int(*) params)fp) sample; }
#include "api_cudart.def"
#include "api_driver.def"
#include "api_hip.def"
#undef X

typedef int (*caller_t)(void *);
typedef uint64_t (*hasher_t)(void);
static const caller_t callers[KREX_N_IDS] = {
#define X(name, ...) [KREX_ID_##name] = call_##name,
#include "api_cudart.def"
#include "api_driver.def"
#include "api_hip.def"
#undef X
};
#define X(name, lookup, variant, cls, params, args, stream, cost, sample, chunk) \
    static uint64_t samplehash_##name(void) { return hash_##name sample; }
#include "api_cudart.def"
#include "api_driver.def"
#include "api_hip.def"
#undef X
static const hasher_t hashers[KREX_N_IDS] = {
#define X(name, ...) [KREX_ID_##name] = samplehash_##name,
#include "api_cudart.def"
#include "api_driver.def"
#include "api_hip.def"
#undef X
};
static void *const direct[KREX_N_IDS] = {
#define X(name, ...) [KREX_ID_##name] = (void *)name,
#include "api_cudart.def"
#include "api_driver.def"
#include "api_hip.def"
#undef X
};

static const char *soname[KREX_N_APIS] = {"libcudart.so.13", "libcuda.so.1", "libamdhip64.so"};
static const char *version_node[KREX_N_APIS] = {"libcudart.so.13", "libcuda.so.1", "hip_4.2"};

static int is_gated(int id) { return krex_entries[id].cls < KREX_NGATED; }

static int version_of(const char *name) {
    const char *v = strstr(name, "_v");
    return v ? atoi(v + 2) : 1;
}

/* The entry a modern lookup of (lookup name, per-thread?) returns: the oracle. */
static int lookup_target(int api, const char *lookup, int pt) {
    int best = -1;
    for (int i = 0; i < KREX_N_IDS; i++) {
        const struct krex_entry *e = &krex_entries[i];
        if (!e->name || e->api != api || strcmp(e->lookup, lookup) || e->variant == KREX_VAR_V1) continue;
        if ((e->variant == KREX_VAR_PT) != pt) continue;
        if (best < 0 || version_of(e->name) > version_of(krex_entries[best].name)) best = i;
    }
    return best;
}

/* Can `path` reach entry `id`? Returns 1 and the function pointer to call. */
static int resolve(int id, const char *path, void **fp) {
    const struct krex_entry *e = &krex_entries[id];
    *fp = NULL;
    if (!strcmp(path, "direct")) {
        *fp = direct[id];
        return 1;
    }
    if (!strcmp(path, "dlsym") || !strcmp(path, "dlvsym")) {
        void *h = dlopen(soname[e->api], RTLD_NOW);
        if (!h) return 0;
        *fp = path[2] == 'v' ? dlvsym(h, e->name, version_node[e->api]) : dlsym(h, e->name);
        return *fp != NULL;
    }
    int pt = strstr(path, "_pt") != NULL;
    int want_api = !strncmp(path, "hip", 3) ? KREX_API_HIP : KREX_API_DRIVER;
    if (e->api != want_api || lookup_target(e->api, e->lookup, pt) != id) return 0;
    uint64_t flags = pt ? 2 : 0;
    int rc = -1;
    if (!strcmp(path, "gpa") || !strcmp(path, "gpa_pt"))
        rc = cuGetProcAddress_v2(e->lookup, fp, 13000, flags, NULL);
    else if (!strcmp(path, "gpa1"))
        rc = cuGetProcAddress(e->lookup, fp, 13000, 0);
    else if (!strcmp(path, "cudart_ep") || !strcmp(path, "cudart_ep_pt"))
        rc = cudaGetDriverEntryPoint(e->lookup, fp, flags, NULL);
    else if (!strcmp(path, "hip_gpa") || !strcmp(path, "hip_gpa_pt"))
        rc = hipGetProcAddress(e->lookup, fp, 600, flags, NULL);
    else
        return 0;
    return rc == 0 && *fp;
}

struct job { int id; const char *path; void *fp; };

static void *run_job(void *arg) {
    struct job *j = arg;
    uint64_t t0 = krex_now_ns();
    int rc = callers[j->id](j->fp);
    uint64_t t1 = krex_now_ns();
    printf("{\"name\":\"%s\",\"path\":\"%s\",\"rc\":%d,\"hash\":\"%016llx\",\"t0\":%llu,\"t1\":%llu,"
           "\"tid\":%d}\n",
           krex_entries[j->id].name, j->path, rc, (unsigned long long)hashers[j->id](),
           (unsigned long long)t0, (unsigned long long)t1, (int)syscall(SYS_gettid));
    fflush(stdout);
    return NULL;
}

static int count_threads(void) {
    int n = 0;
    DIR *d = opendir("/proc/self/task");
    if (!d) return -1;
    for (struct dirent *de; (de = readdir(d));) n += de->d_name[0] != '.';
    closedir(d);
    return n;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *us = getenv("SIM_US");
    if (us) sim_us = (unsigned)atoi(us);
    sim_samples_init();
    if (argc >= 2 && !strcmp(argv[1], "list")) {
        const char *paths[] = {"direct", "dlsym", "dlvsym", "gpa", "gpa_pt", "gpa1", "cudart_ep", "cudart_ep_pt",
                               "hip_gpa", "hip_gpa_pt"};
        for (int i = 0; i < KREX_N_IDS; i++) {
            if (!krex_entries[i].name || !is_gated(i)) continue;
            for (unsigned p = 0; p < sizeof paths / sizeof *paths; p++) {
                void *fp;
                if (resolve(i, paths[p], &fp))
                    printf("{\"name\":\"%s\",\"path\":\"%s\",\"api\":%d,\"cls\":%d}\n", krex_entries[i].name,
                           paths[p], krex_entries[i].api, krex_entries[i].cls);
            }
        }
        return 0;
    }
    if (argc < 3 || strcmp(argv[1], "run")) {
        fprintf(stderr, "usage: %s list | run PATHS [threads] [ONLY_NAME]\n", argv[0]);
        return 2;
    }
    int threaded = argc >= 4 && !strcmp(argv[3], "threads");
    const char *only = argc >= 5 ? argv[4] : NULL;
    static struct job jobs[KREX_N_IDS * 10];
    static pthread_t tids[KREX_N_IDS * 10];
    int n = 0;
    char *paths = strdup(argv[2]);
    for (char *p = strtok(paths, ","); p; p = strtok(NULL, ",")) {
        for (int i = 0; i < KREX_N_IDS; i++) {
            if (!krex_entries[i].name || !is_gated(i)) continue;
            if (only && strcmp(only, krex_entries[i].name)) continue;
            void *fp;
            if (!resolve(i, p, &fp)) continue;
            jobs[n] = (struct job){i, p, fp};
            n++;
        }
    }
    printf("{\"jobs\":%d}\n", n);
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setstacksize(&a, 64 * 1024);
    for (int k = 0; k < n; k++) {
        if (threaded) pthread_create(&tids[k], &a, run_job, &jobs[k]);
        else run_job(&jobs[k]);
    }
    if (threaded)
        for (int k = 0; k < n; k++) pthread_join(tids[k], NULL);
    printf("{\"done\":%d,\"threads\":%d}\n", n, count_threads());
    return 0;
}
