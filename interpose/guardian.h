/* guardian.h: the parts of the native `krex` (guardian.c, guardian_wire.c, guardian_proc.c)
 * one another use. One program: these are not a library's interface. */
#ifndef KREX_GUARDIAN_H
#define KREX_GUARDIAN_H
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "krex_abi.h"
#include "krex_env.h"
#include "wire.h"

extern char **environ;

#define EXIT_KREX 125 /* `krex run`: KREX itself failed (krex/errors.py RUN_FAILURE) */

extern char **g_argv;
extern const char *g_entry;
extern int g_quiet;
extern sigset_t g_oldmask;
extern int g_chld_ign;
extern int g_shared_group;
extern int g_prepared;
extern const char *g_python, *g_prepared_lib;

/* A growable string (environment entries, the report). */
struct buf {
    char *p;
    size_t n, cap;
};

/* A list text of a reply's body (krex_abi.h, "Text tails"): `n` bytes of NUL-ended strings
 * at p (NULL: empty). TEXT_EACH(s, t) { ... } visits each string. */
struct text {
    const char *p;
    uint32_t n;
};
#define TEXT_EACH(s, t) for (const char *s = (t).p; s && s < (t).p + (t).n; s += strlen(s) + 1)

/* A reply frame: its header and body (the struct and its tail, malloc'd, NUL-ended past its
 * end); its JSON part was dropped unread. */
struct reply {
    struct krex_msg_hdr h;
    char *body;
};

/* An error reply's texts (krex_rep_error), NULL where it has none. */
struct error_texts {
    const char *error, *fix, *kind;
};

struct conn {
    int fd;
    pid_t daemon_pid;
    const struct krex_shm *seg; /* for its heartbeat; NULL if it cannot be mapped */
    char seg_name[128];
    uint64_t stopped_since;     /* when krexd was first seen stopped (state T), 0: not */
    int owed_op, owed;          /* replies to a request we stopped waiting for (krexd stopped):
                                 * they may still come, before the next one's */
};

/* The admit reply this guardian needs (krex_rep_admit; pointers into the reply's body). */
struct admission {
    int slot, gpu;
    double wait_s;
    const char *device, *shm, *group, *freezer;
    struct text env_set, env_prepend, cpus, notes;
};

struct launch {
    char *exe;
    char **argv, **envp;
    const char *group; /* the slot's cgroup directory */
    cpu_set_t cpus;
    int has_cpus;
    int join; /* write our pid into group/cgroup.procs before exec (not cloned into it) */
    int errw; /* the pipe that carries an errno back when exec fails */
    /* krexd moves the command (`started` with join): the child waits before exec for a byte
     * on go_r ('1': moved; anything else or EOF: not, so it never runs outside its slot). */
    int daemon_join, go_r, go_w;
};

struct lost { /* what the Python finisher needs to journal a region the loss cut */
    int happened, region_cut;
    double region_s, ts;
    const char *why;
};

struct stall { /* krexd's stall while the command ran, for the report (guardian_proc.c) */
    int stalled, resumed;
    double stalled_ts, age_s, resumed_ts;
};
extern struct stall g_stall;

uint64_t now_ns(void);
void say(const char *fmt, ...);
void note(const char *text);
void buf_add(struct buf *b, const char *s, size_t n);
void buf_str(struct buf *b, const char *s);
void seg_remap(void);
const struct krex_shm *seg_map(const char *name);
double heartbeat_age(const struct conn *c);
int daemon_connect(struct conn *c);
int send_request(struct conn *c, enum krex_op op, const void *body, uint32_t len, const struct krex_tail *tail);
int recv_reply(struct conn *c, enum krex_op op, uint64_t cap_ns, struct reply *out, char *why, size_t why_n,
               void (*on_event)(const char *note));
void reply_error(const struct reply *r, struct error_texts *e);
void on_queue_event(const char *note);
int read_admission(const struct reply *r, struct admission *a);
int read_release(const struct reply *r, struct text *notes, const char **report_json);
int admission_cpus(const struct admission *a, cpu_set_t *set);
void print_notes(struct text notes);
int own_install(void);
char **command_env(const struct admission *a, const char *auto_dir);
char *private_tmpdir(int slot);
int dir_has_entries(const char *d);
void remove_dir(const char *d);
int cgroup_joinable(const char *group);
pid_t spawn(struct launch *l, const char *freezer, int *err, int (*moved)(pid_t, void *), void *arg);
int wait_command(const struct admission *a, struct conn *c, pid_t pid, int sfd, struct lost *lo);

#endif
