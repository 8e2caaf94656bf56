/* The segment's SIGBUS guard: a mapping whose file another process shrank gets its size
 * back instead of killing this process (part of the core: krex_core.c maps, this guards). */
#include "krex_core.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define SEQ __ATOMIC_SEQ_CST

/* ------------------------------------------------------- a truncated segment
 * Anyone who may write the segment may also shrink it (`truncate -s 0`): every later
 * access to a page past the new end raises SIGBUS, which kills krexd, guardians and the
 * commands. Each mapping krex_shm_open makes is therefore registered here with a
 * descriptor of its own, and a SIGBUS handler gives the file its size back (the pages
 * come back zeroed) and lets the access complete; it sets KREX_HF_RESTORED so krexd
 * reports the incident, flags the region and repairs what the zeroes damaged. A mapping
 * whose file cannot be restored (descriptor closed by the application, another object
 * now) gets private zero pages instead: that process is detached from the segment, and
 * krexd flags regions while it lives (it lived through an incident). A SIGBUS anywhere
 * else goes to the handler installed before ours, or kills as it would have.
 * Nothing here is on the submission fast path: the handler runs only on a fault. */
#define SEG_GUARDS 64
struct seg_guard {
    void *addr; /* published last (release), cleared first */
    int fd;
    dev_t dev;
    ino_t ino;
    char path[96];
};
static struct seg_guard g_guards[SEG_GUARDS];
static struct sigaction g_bus_prev;
static int g_bus_installed; /* 0 no, 1 being installed, 2 installed */
static uint64_t g_seg_restores; /* faults this process resolved */

static int guard_fix_fd(int fd, const struct seg_guard *g) {
    struct stat st;
    return fd >= 0 && fstat(fd, &st) == 0 && st.st_dev == g->dev && st.st_ino == g->ino &&
           ftruncate(fd, (off_t)sizeof(struct krex_shm)) == 0;
}

static void chain_sigbus(int sig, siginfo_t *si, void *uc) {
    const struct sigaction *p = &g_bus_prev;
    if (p->sa_flags & SA_SIGINFO) {
        if (p->sa_sigaction) p->sa_sigaction(sig, si, uc);
        return;
    }
    if (p->sa_handler != SIG_DFL && p->sa_handler != SIG_IGN) {
        p->sa_handler(sig);
        return;
    }
    /* The default action: for a fault the access runs again and dies of it; for a sent
     * signal, raise it again (blocked until we return). */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGBUS, &dfl, NULL);
    if (si->si_code <= 0) raise(SIGBUS);
}

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
    int saved = errno;
    char *a = si->si_addr;
    for (int i = 0; si->si_code > 0 && i < SEG_GUARDS; i++) {
        struct seg_guard *g = &g_guards[i];
        char *base = __atomic_load_n(&g->addr, __ATOMIC_ACQUIRE);
        if (!base || base == (char *)1 || a < base || a >= base + sizeof(struct krex_shm)) continue;
        int fixed = guard_fix_fd(g->fd, g);
        if (!fixed && g->path[0]) {
            int fd = open(g->path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
            fixed = guard_fix_fd(fd, g);
            if (fd >= 0) close(fd);
        }
        if (fixed)
            __atomic_or_fetch(&((struct krex_shm *)base)->hdr.flags, (uint32_t)KREX_HF_RESTORED, SEQ);
        else
            mmap(base, sizeof(struct krex_shm), PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS,
                 -1, 0);
        __atomic_add_fetch(&g_seg_restores, 1, SEQ);
        errno = saved;
        return;
    }
    chain_sigbus(sig, si, uc);
    errno = saved;
}

static void guard_install(void) {
    int expect = 0;
    if (!__atomic_compare_exchange_n(&g_bus_installed, &expect, 1, 0, SEQ, SEQ)) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_RESTART | SA_ONSTACK;
    sigfillset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_bus_prev);
    __atomic_store_n(&g_bus_installed, 2, SEQ);
}

/* Keep `fd` for the mapping at `p` (0), or -1 when every guard is taken (the caller
 * closes it; that mapping is then unguarded). */
static int guard_add(void *p, int fd, const struct stat *st, const char *name) {
    for (int i = 0; i < SEG_GUARDS; i++) {
        struct seg_guard *g = &g_guards[i];
        void *none = NULL;
        /* Reserve the entry with a sentinel, fill it, then publish the address. */
        if (!__atomic_compare_exchange_n(&g->addr, &none, (void *)1, 0, SEQ, SEQ)) continue;
        g->fd = fd;
        g->dev = st->st_dev;
        g->ino = st->st_ino;
        snprintf(g->path, sizeof g->path, "/dev/shm%s", name[0] == '/' ? name : "");
        if (name[0] != '/' || strchr(name + 1, '/')) g->path[0] = 0;
        guard_install();
        __atomic_store_n(&g->addr, p, __ATOMIC_RELEASE);
        return 0;
    }
    return -1;
}

void krex_shm_guard(struct krex_shm *shm, int fd, const char *name) {
    struct stat st;
    if (fstat(fd, &st) != 0 || guard_add(shm, fd, &st, name)) close(fd);
}

void krex_shm_unguard(struct krex_shm *p) {
    for (int i = 0; i < SEG_GUARDS; i++) {
        struct seg_guard *g = &g_guards[i];
        if (__atomic_load_n(&g->addr, SEQ) != (void *)p) continue;
        int fd = g->fd;
        g->fd = -1;
        __atomic_store_n(&g->addr, NULL, SEQ);
        close(fd);
        return;
    }
}

uint64_t krex_seg_restores(void) { return __atomic_load_n(&g_seg_restores, SEQ); }
