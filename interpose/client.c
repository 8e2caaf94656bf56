/* The krexd client of the shim: self-registration of opt-in processes and the
 * C/C++ region markers (krex.h). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "shim_fastpath.h"
#include "wire.h"

extern char **environ;
char g_sock_path[108];
char g_daemon_cmd[1024];
int g_need_selfreg;
static int g_selfreg;                     /* atomic: 0 not yet, 1 in progress, 2 done, 3 failed */
static int g_reg_conn = -1;               /* self-registration: krexd keeps our slot while it is open */
static int g_spawned;                     /* atomic: this process already started krexd once */
static __thread int t_region_depth;
static __thread int t_region_fd = -1;     /* the connection that began this thread's region */

/* One frame each way over the daemon's Unix socket, as krex_abi.h defines it (the
 * header, then the op's struct and its text tail; C writes no JSON part and drops a
 * reply's unread), sent and read through wire.c (the guardian's framing code too).
 * The daemon learns who we are from SO_PEERCRED; the message carries only what it
 * cannot know.
 *
 * Nothing here can kill or hang the application: sends use MSG_NOSIGNAL (a
 * vanished krexd is EPIPE, never SIGPIPE), connecting and sending time out after
 * KREX_CONNECT_TIMEOUT_MS, and a wait for a reply re-checks krexd's heartbeat
 * every KREX_CLIENT_POLL_NS and gives up once it is older than the timeout. No
 * lock is held across any of it: each region has a connection of its own. */

/* Start krexd (KREX_DAEMON_CMD) in its own session, with /dev/null for stdin,
 * stdout and stderr and none of our other descriptors: an inherited pipe would
 * keep whoever reads our output waiting until krexd exits. */
static void spawn_daemon(void) {
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t at;
    posix_spawn_file_actions_init(&fa);
    posix_spawnattr_init(&at);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
    posix_spawn_file_actions_addclosefrom_np(&fa, 3);
#else
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        for (struct dirent *e; (e = readdir(d));) {
            int fd = atoi(e->d_name);
            if (fd > 2 && fd != dirfd(d)) posix_spawn_file_actions_addclose(&fa, fd);
        }
        closedir(d);
    }
#endif
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    posix_spawnattr_setsigmask(&at, &none);  /* not the application's blocked signals */
    posix_spawnattr_setsigdefault(&at, &all); /* nor its ignored ones (SIGTERM must stop krexd) */
    posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    char *argv[] = {"/bin/sh", "-c", g_daemon_cmd, NULL};
    pid_t pid;
    int rc = posix_spawn(&pid, "/bin/sh", &fa, &at, argv, environ);
    posix_spawnattr_destroy(&at);
    posix_spawn_file_actions_destroy(&fa);
    klog("starting krexd: %s (%s)", g_daemon_cmd, rc ? strerror(rc) : "ok");
}

/* One connect attempt (krex_wire_connect: bounded, our daemon or root's only). */
static int conn_try(void) {
    uid_t uid = (uid_t)-1;
    int fd = krex_wire_connect(g_sock_path, NULL, &uid); /* length checked at init */
    if (fd == -EACCES && uid != (uid_t)-1)
        klog("refusing the daemon at %s: it runs as uid %d, neither as us (uid %d) nor as root", g_sock_path,
             (int)uid, (int)geteuid());
    return fd;
}

/* A new connection to krexd, starting it (once per process) if nobody listens. */
static int conn_open(void) {
    if (!g_sock_path[0]) return -ENOENT;
    uint64_t deadline = krex_now_ns() + (uint64_t)KREX_DAEMON_START_WAIT_MS * 1000000ull;
    for (;;) {
        int fd = conn_try();
        if (fd >= 0) return fd;
        if ((fd != -ENOENT && fd != -ECONNREFUSED) || !g_daemon_cmd[0]) return fd;
        int expect = 0;
        if (__atomic_compare_exchange_n(&g_spawned, &expect, 1, 0, __ATOMIC_ACQ_REL, ACQUIRE)) spawn_daemon();
        if (krex_now_ns() > deadline) return fd;
        usleep(50000);
    }
}

/* Is krexd dead or hung: its heartbeat older than the timeout? 0 when unknown. As long
 * as krexd beats, a read waits (a region may queue behind others). */
static int daemon_stale(void *unused) {
    (void)unused;
    struct krex_shm *shm = attach_shm();
    if (!shm) return 0;
    return krex_heartbeat_stale(shm, krex_now_ns(), 0);
}

static int recv_full(int fd, void *buf, size_t n) { return krex_wire_recv(fd, buf, n, daemon_stale, NULL); }

static int send_msg(int fd, enum krex_op op, const void *body, uint32_t len) {
    return krex_wire_send(fd, op, body, len, NULL);
}

/* Read the reply to a request: event frames are skipped; an ok reply's fixed body
 * (exactly `len` bytes, else -EPROTO) goes to `body`; an error reply's krex_rep_error
 * text (what went wrong) goes to `why`, for the log; the JSON part is dropped unread.
 * Returns the header's status (KREX_ST_*) or a negative errno. */
static int recv_reply(int fd, void *body, uint32_t len, char *why, size_t why_n) {
    if (why_n) why[0] = 0;
    struct krex_msg_hdr h;
    int rc = krex_wire_header(fd, &h, daemon_stale, NULL, NULL); /* events are dropped */
    if (rc) return rc;
    if (h.status == KREX_ST_OK && h.body_len != len) return -EPROTO;
    if (h.status == KREX_ST_OK) {
        rc = recv_full(fd, body, len);
    } else {
        char *raw = malloc((size_t)h.body_len + 1);
        rc = raw ? recv_full(fd, raw, h.body_len) : recv_full(fd, NULL, h.body_len);
        struct krex_rep_error e;
        if (!rc && raw && why_n && h.body_len >= sizeof e) {
            memcpy(&e, raw, sizeof e);
            const char *at = raw + sizeof e, *end = raw + h.body_len;
            int ok = 1;
            const char *msg = krex_wire_text(&at, end, e.error_str, &ok);
            if (ok && msg) snprintf(why, why_n, "%s", msg);
        }
        free(raw);
    }
    if (rc) return rc;
    if ((rc = recv_full(fd, NULL, h.json_len))) return rc;
    return h.status;
}

/* A region's label as krexd takes it: bytes outside printable ASCII as '?', at most 255. */
static void label_text(char *out, size_t n, const char *label) {
    size_t o = 0;
    for (const unsigned char *c = (const unsigned char *)(label ? label : ""); *c && o + 1 < n && o < 255; c++)
        out[o++] = *c >= 0x20 && *c < 0x7f ? (char)*c : '?';
    out[o] = 0;
}

static int first_visible_gpu(void) {
    return g_gpu >= 0 ? g_gpu : 0;
}

/* Opt-in processes (krex env, no KREX_SLOT) ask krexd for a slot once; the
 * connection stays open for the process's life (krexd frees the slot when it
 * closes). One thread registers; the others wait for it, holding no lock. */
int krex_self_register(void) {
    if (!g_need_selfreg) return 0;
    int expect = 0;
    if (!__atomic_compare_exchange_n(&g_selfreg, &expect, 1, 0, __ATOMIC_ACQ_REL, ACQUIRE)) {
        while (__atomic_load_n(&g_selfreg, ACQUIRE) == 1) usleep(1000);
        return __atomic_load_n(&g_selfreg, ACQUIRE) == 2 ? 0 : -1;
    }
    int ok = -1, fd = conn_open();
    if (fd >= 0) {
        struct krex_req_register req = {.gpu = first_visible_gpu()};
        struct krex_rep_register rep;
        char why[256];
        int rc = send_msg(fd, KREX_OP_REGISTER, &req, sizeof req);
        if (rc == 0) rc = recv_reply(fd, &rep, sizeof rep, why, sizeof why);
        if (rc == KREX_ST_OK) {
            g_slot = rep.slot;
            g_gpu = rep.gpu;
            g_reg_conn = fd;
            ok = 0;
        } else {
            klog("register refused (%d): %s", rc, why);
            close(fd);
        }
    }
    __atomic_store_n(&g_selfreg, ok == 0 ? 2 : 3, RELEASE);
    return ok;
}

/* Regions are lost (krexd gone, hung or stopping) without harming the caller:
 * the marker returns an error and the process record says so. */
static void region_lost(const char *what, int rc) {
    set_flag(KREX_PF_DAEMON_LOST);
    klog("region %s: lost krexd (%s); the region is not exclusive", what, strerror(-rc));
}

/* Regions handed over by their thread (krex_region_handover), so that another thread
 * may end them: an NVTX range started on one thread and ended on another. While one is
 * open, a region its thread begins is nested in it (a region of its own would queue
 * behind it). Few at once: one region per GPU is granted, the rest wait. */
#define HANDED_MAX 16
#define FD_NESTED_IN_HANDED (-2) /* t_region_fd of a thread nested in its handed region */
static struct {
    int fd;      /* -1: free */
    pid_t tid;
} g_handed[HANDED_MAX] = {[0 ... HANDED_MAX - 1] = {-1, 0}};
static pthread_mutex_t g_handed_lock = PTHREAD_MUTEX_INITIALIZER;

static int holds_handed(pid_t tid) {
    int found = 0;
    pthread_mutex_lock(&g_handed_lock);
    for (int i = 0; i < HANDED_MAX && !found; i++) found = g_handed[i].fd >= 0 && g_handed[i].tid == tid;
    pthread_mutex_unlock(&g_handed_lock);
    return found;
}

static int region_begin(const char *label);

/* The C/C++ region markers (krex.h) resolve these at run time. 0 = granted or
 * not under KREX; negative = refused or lost (errno value). A nested begin on the
 * same thread is a no-op. */
KREX_EXPORT int krex_region_begin(void) { return region_begin(NULL); }

/* krex_region_begin with a label, which the region's journal record and report carry
 * (the NVTX injection: "nvtx:NAME"). */
KREX_EXPORT int krex_region_begin_label(const char *label) { return region_begin(label); }

static int region_begin(const char *label) {
    /* Meant to be under KREX but not attached (segment gone or damaged): say so, never
     * pretend a region happened. */
    if (mode_on() && !__atomic_load_n(&g_fast.gate, ACQUIRE)) krex_register();
    if (__atomic_load_n(&g_attach_err, RELAXED)) return -__atomic_load_n(&g_attach_err, RELAXED);
    if (!mode_on() || !g_sock_path[0]) return 0;
    if (t_region_depth++ > 0) return 0;
    pid_t tid = (pid_t)syscall(SYS_gettid);
    if (holds_handed(tid)) {
        t_region_fd = FD_NESTED_IN_HANDED;
        return 0;
    }
    /* Register first: krexd frees a slot made on a region's own connection with it. */
    if (krex_self_register() != 0) {
        t_region_depth = 0;
        region_lost("begin", -ECONNREFUSED);
        return -ECONNREFUSED;
    }
    struct krex_req_begin req = {.tid = (int64_t)tid, .gpu = first_visible_gpu()};
    struct krex_rep_begin rep;
    char why[512], text[256];
    label_text(text, sizeof text, label);
    struct krex_tail tail = {0};
    krex_tail_put(&tail, &req.label_str, text[0] ? text : NULL);
    int fd = conn_open();
    int rc = fd < 0 ? fd : krex_wire_send(fd, KREX_OP_BEGIN, &req, sizeof req, &tail);
    free(tail.p);
    if (rc == 0) rc = recv_reply(fd, &rep, sizeof rep, why, sizeof why);
    if (rc != KREX_ST_OK) {
        if (fd >= 0) close(fd);
        t_region_depth = 0;
        if (rc < 0) {
            region_lost("begin", rc);
            return rc;
        }
        klog("region refused: %s", why);
        return -EIO;
    }
    klog("region granted: slot %d gpu %d", rep.slot, rep.gpu);
    t_region_fd = fd;
    return 0;
}

/* 0 = the region was exclusive from BEGIN to END. -ETIMEDOUT = krexd cut it at
 * --max-region before END (what ran after the cut was not protected). 1 = it ended
 * but krexd flagged it (contaminated; `krex journal` says why). Other negative
 * values: krexd was lost or did not answer. */
static int region_end_fd(int fd);

KREX_EXPORT int krex_region_end(void) {
    if (__atomic_load_n(&g_attach_err, RELAXED)) return -__atomic_load_n(&g_attach_err, RELAXED);
    if (!mode_on() || !g_sock_path[0]) return 0;
    if (t_region_depth <= 0) return -EINVAL;
    if (--t_region_depth > 0) return 0;
    int fd = t_region_fd;
    t_region_fd = -1;
    if (fd == FD_NESTED_IN_HANDED) return 0;
    return region_end_fd(fd);
}

/* Hand the calling thread's region over: when the thread is in exactly one region
 * (its outermost, just begun), its connection is returned (>= 0) and the thread is out
 * of it, except that its own later regions nest in it until krex_region_end_handed.
 * -EBUSY when the thread's region is nested (depth > 1: nothing of its own to hand),
 * -EINVAL when it is in none, -ENOSPC when too many are handed over, 0 ... never. */
KREX_EXPORT int krex_region_handover(void) {
    if (t_region_depth > 1 || t_region_fd == FD_NESTED_IN_HANDED) return -EBUSY;
    if (t_region_depth != 1 || t_region_fd < 0) return -EINVAL;
    pid_t tid = (pid_t)syscall(SYS_gettid);
    int fd = t_region_fd, slot = -1;
    pthread_mutex_lock(&g_handed_lock);
    for (int i = 0; i < HANDED_MAX && slot < 0; i++)
        if (g_handed[i].fd < 0) slot = i;
    if (slot >= 0) g_handed[slot].fd = fd, g_handed[slot].tid = tid;
    pthread_mutex_unlock(&g_handed_lock);
    if (slot < 0) return -ENOSPC;
    t_region_depth = 0;
    t_region_fd = -1;
    return fd;
}

/* End a region handed over by krex_region_handover, from any thread. Returns what
 * krex_region_end returns; -EINVAL for a connection that is not a handed region. */
KREX_EXPORT int krex_region_end_handed(int fd) {
    int found = 0;
    pthread_mutex_lock(&g_handed_lock);
    for (int i = 0; i < HANDED_MAX; i++)
        if (fd >= 0 && g_handed[i].fd == fd) g_handed[i].fd = -1, found = 1;
    pthread_mutex_unlock(&g_handed_lock);
    return found ? region_end_fd(fd) : -EINVAL;
}

static int region_end_fd(int fd) {
    if (fd < 0) return -EIO;
    struct krex_rep_end rep;
    char why[512];
    int rc = send_msg(fd, KREX_OP_END, NULL, 0);
    if (rc == 0) rc = recv_reply(fd, &rep, sizeof rep, why, sizeof why);
    close(fd);
    if (rc < 0) {
        region_lost("end", rc);
        return rc;
    }
    if (rc != KREX_ST_OK) {
        klog("region end refused: %s", why);
        return -EIO;
    }
    if (rep.cut) return -ETIMEDOUT;
    return rep.clean ? 0 : 1;
}

/* fork: the parent's connections stay the parent's; the child registers anew. */
void krex_client_after_fork(void) {
    if (g_reg_conn >= 0) close(g_reg_conn);
    g_reg_conn = -1;
    if (g_need_selfreg) g_selfreg = 0;
    if (t_region_fd >= 0) close(t_region_fd);
    t_region_fd = -1;
    t_region_depth = 0;
    for (int i = 0; i < HANDED_MAX; i++) { /* the parent's regions, never the child's to end */
        if (g_handed[i].fd >= 0) close(g_handed[i].fd);
        g_handed[i].fd = -1;
    }
    pthread_mutex_init(&g_handed_lock, NULL);
    g_spawned = 0;
}
