/* guardian_proc.c: the native `krex`'s command: its own installation's code in the command's
 * environment, the child made into its slot (clone3, a join, or krexd moving it), and the
 * watch until it ends (signals forwarded, krexd's loss or stall thaws it: I5). */
#define _GNU_SOURCE
#include "guardian.h"
/* ------------------------------------------------------------------ our own installation */

/* What this guardian gives a command to load comes from its own installation, whatever
 * krexd answers (krex_env.h): the shim, the hook directory and the simulated GPU of the
 * krex/_lib directory this executable belongs to, and KREX_DAEMON_CMD only with a Python
 * of its own directory (krex/node/optin.py own_env reads the same rule in Python). */
static struct {
    char lib[PATH_MAX];     /* krex/_lib */
    char shim[PATH_MAX];    /* krex/_lib/libkrex_interpose.so */
    char hook[PATH_MAX];    /* krex/proc/_hook */
    char pydir[2][PATH_MAX]; /* where a Python of ours lives: beside us, KREX_PYTHON's */
} g_own;

/* Ours or root's, and writable by nobody else: nothing another user could swap. */
static int owned_safely(const char *path, int dir) {
    struct stat st;
    if (stat(path, &st) || (dir ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode))) return 0;
    return (st.st_uid == 0 || st.st_uid == geteuid()) && !(st.st_mode & (S_IWGRP | S_IWOTH));
}

static int lib_dir_ok(const char *dir) {
    char shim[PATH_MAX + 32];
    snprintf(shim, sizeof shim, "%s/libkrex_interpose.so", dir);
    return owned_safely(dir, 1) && owned_safely(shim, 0);
}

static void dir_of(const char *path, char *out, size_t n) {
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s", path);
    char *slash = strrchr(tmp, '/');
    if (slash) *(slash == tmp ? slash + 1 : slash) = 0;
    if (!realpath(slash ? tmp : ".", out)) out[0] = 0;
    (void)n;
}

/* The krex/_lib this executable belongs to: its own directory (krex/_lib/krex), the
 * site-packages beside the bin/ it was installed into, or the tree it was built in (an
 * editable install's bin/krex), or the one Python's `krex run` names (prepared). 0 when none
 * is found: Python's door prepares the run and names its own. */
int own_install(void) {
    char exe[PATH_MAX], exedir[PATH_MAX], found[PATH_MAX] = "";
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len <= 0) return 0;
    exe[len] = 0;
    dir_of(exe, exedir, sizeof exedir);
    if (!exedir[0]) return 0;
    if (lib_dir_ok(exedir)) snprintf(found, sizeof found, "%s", exedir);
    const char *pats[] = {"%s/../lib*/python3*/site-packages/krex/_lib", "%s/../lib*/python3*/dist-packages/krex/_lib"};
    for (size_t i = 0; !found[0] && i < sizeof pats / sizeof *pats; i++) {
        char pat[PATH_MAX + 64];
        snprintf(pat, sizeof pat, pats[i], exedir);
        glob_t g;
        if (glob(pat, 0, NULL, &g) == 0)
            for (size_t k = 0; !found[0] && k < g.gl_pathc; k++)
                if (lib_dir_ok(g.gl_pathv[k])) snprintf(found, sizeof found, "%s", g.gl_pathv[k]);
        globfree(&g);
    }
    /* Python's `krex run` names the krex/_lib whose code it runs itself (a prepared run). */
    char shim[PATH_MAX + 32];
    snprintf(shim, sizeof shim, "%s/libkrex_interpose.so", g_prepared_lib ? g_prepared_lib : "");
    if (!found[0] && g_prepared_lib && access(shim, R_OK) == 0) snprintf(found, sizeof found, "%s", g_prepared_lib);
#ifdef KREX_BUILT_LIB_DIR
    if (!found[0] && lib_dir_ok(KREX_BUILT_LIB_DIR)) snprintf(found, sizeof found, "%s", KREX_BUILT_LIB_DIR);
#endif
    if (!found[0] || !realpath(found, g_own.lib)) return 0;
    snprintf(g_own.shim, sizeof g_own.shim, "%.*s/libkrex_interpose.so", PATH_MAX - 32, g_own.lib);
    char hook[PATH_MAX + 32];
    snprintf(hook, sizeof hook, "%s/../proc/_hook", g_own.lib);
    if (!realpath(hook, g_own.hook)) return 0;
    snprintf(g_own.pydir[0], PATH_MAX, "%s", exedir);
    const char *py = g_entry ? g_entry : g_python ? g_python : getenv("KREX_PYTHON");
    if (py && py[0] == '/') dir_of(py, g_own.pydir[1], PATH_MAX);
    return 1;
}

/* krexd's KREX_DAEMON_CMD in the one form it writes, with a Python of ours (krex_env.h). */
static int daemon_cmd_ok(const char *v) {
    size_t h = strlen(KREX_DAEMON_CMD_HEAD), m = strlen(KREX_DAEMON_CMD_MODULE);
    if (strncmp(v, KREX_DAEMON_CMD_HEAD, h) || v[h] != '/') return 0;
    const char *py = v + h;
    size_t n = strspn(py, KREX_SHELL_SAFE);
    const char *rest = py + n;
    size_t sp = strlen(KREX_DAEMON_CMD_SAFE_PATH);
    if (!strncmp(rest, KREX_DAEMON_CMD_SAFE_PATH, sp) && rest[sp] == ' ') rest += sp;
    if (strncmp(rest, KREX_DAEMON_CMD_MODULE, m) || (rest[m] && rest[m] != ' ')) return 0;
    for (const char *p = rest + m; *p; p++)
        if (*p != ' ' && !strchr(KREX_SHELL_SAFE, *p)) return 0;
    char path[PATH_MAX], dir[PATH_MAX];
    if (n >= sizeof path) return 0;
    memcpy(path, py, n);
    path[n] = 0;
    dir_of(path, dir, sizeof dir);
    for (int i = 0; i < 2; i++)
        if (dir[0] && g_own.pydir[i][0] && !strcmp(dir, g_own.pydir[i])) return 1;
    return 0;
}

static int daemon_env_name(const char *name) {
    size_t n = strlen(name);
    for (const char *p = KREX_DAEMON_ENV; *p;) {
        size_t k = strcspn(p, " ");
        if (k == n && !strncmp(p, name, n)) return 1;
        p += k;
        while (*p == ' ') p++;
    }
    return 0;
}

/* ------------------------------------------------------------------ the environment */

/* `value` first in the list `old` split at any of `seps`, empty entries and other copies
 * of `value` dropped, joined with ':' (krex/node/optin.py prepend, the one rule). */
static char *prepend(const char *old, const char *value, const char *seps) {
    struct buf b = {0};
    buf_str(&b, value);
    const char *p = old ? old : "";
    while (*p) {
        size_t n = strcspn(p, seps);
        if (n && !(n == strlen(value) && !strncmp(p, value, n))) {
            buf_str(&b, ":");
            buf_add(&b, p, n);
        }
        p += n;
        if (*p) p++;
    }
    return b.p;
}

/* Set NAME=value in an envp array we own (malloc'd, NULL-terminated). Every earlier
 * copy of NAME goes: an environment can hold one twice, and ld.so reads the last
 * LD_PRELOAD, so a stale second copy would start the command without the shim. */
static void env_put(char ***envp, size_t *n, const char *name, const char *value) {
    size_t len = strlen(name);
    struct buf e = {0};
    buf_str(&e, name);
    buf_str(&e, "=");
    buf_str(&e, value);
    size_t k = 0;
    for (size_t i = 0; i < *n; i++)
        if (strncmp((*envp)[i], name, len) || (*envp)[i][len] != '=') (*envp)[k++] = (*envp)[i];
    *n = k;
    (*envp)[k] = NULL;
    char **grown = realloc(*envp, (*n + 2) * sizeof **envp);
    if (!grown) _exit(EXIT_KREX);
    *envp = grown;
    (*envp)[(*n)++] = e.p;
    (*envp)[*n] = NULL;
}

static const char *env_get(char **envp, size_t n, const char *name) { /* the last copy, as ld.so */
    size_t len = strlen(name);
    const char *v = NULL;
    for (size_t i = 0; i < n; i++)
        if (!strncmp(envp[i], name, len) && envp[i][len] == '=') v = envp[i] + len + 1;
    return v;
}

/* Our environment plus krexd's env_prepend and env_set (launcher: apply_env), as
 * krex_env.h lets a guardian take them: every path to code is our own installation's. */
char **command_env(const struct admission *a, const char *auto_dir) {
    size_t n = 0;
    while (environ[n]) n++;
    char **envp = calloc(n + 1, sizeof *envp);
    if (!envp) _exit(EXIT_KREX);
    memcpy(envp, environ, n * sizeof *envp);
    envp[n] = NULL;
    env_put(&envp, &n, "LD_PRELOAD", prepend(env_get(envp, n, "LD_PRELOAD"), g_own.shim, ": "));
    int i = 0; /* env_prepend: NAME, value, separators (read_admission checked the count) */
    TEXT_EACH(name, a->env_prepend) {
        if (i++ % 3) continue;
        const char *own = !strcmp(name, "PYTHONPATH")        ? g_own.hook
                          : !strcmp(name, "LD_LIBRARY_PATH") ? g_own.lib
                                                             : NULL;
        if (own) env_put(&envp, &n, name, prepend(env_get(envp, n, name), own, ":"));
    }
    const char *name = NULL; /* env_set: NAME, value */
    TEXT_EACH(s, a->env_set) {
        if (!name) {
            name = s;
            continue;
        }
        if (daemon_env_name(name) || (!strcmp(name, "KREX_DAEMON_CMD") && daemon_cmd_ok(s))) env_put(&envp, &n, name, s);
        name = NULL;
    }
    /* Processes that use KREX_AUTO_REGION (ours, or set by the command) leave their status here. */
    if (auto_dir) env_put(&envp, &n, "KREX_AUTO_STATUS_DIR", auto_dir);
    /* For tests: proof that this guardian, not the Python one, ran the command. */
    if (getenv("KREX_NATIVE_MARK")) env_put(&envp, &n, "KREX_NATIVE_MARK", "native");
    return envp;
}

/* A fresh private directory (mkdtemp, mode 0700) where launcher._private_tmpdir makes one. */
char *private_tmpdir(int slot) {
    const char *bases[] = {getenv("TMPDIR"), getenv("TEMP"), getenv("TMP"), "/tmp", "/var/tmp", "."};
    for (size_t i = 0; i < sizeof bases / sizeof *bases; i++) {
        if (!bases[i] || !*bases[i]) continue;
        char t[PATH_MAX];
        snprintf(t, sizeof t, "%s/krex-auto-%d-XXXXXX", bases[i], slot);
        if (mkdtemp(t)) {
            if (t[0] == '/') return strdup(t);
            char *abs = realpath(t, NULL); /* "." : krexd needs an absolute path */
            if (abs) return abs;
            rmdir(t);
        }
    }
    return NULL;
}

/* Is the directory empty? Then remove it; else leave it for the release (krexd reads it). */
int dir_has_entries(const char *d) {
    DIR *dir = opendir(d);
    int any = 0;
    if (!dir) return 0;
    for (struct dirent *e; !any && (e = readdir(dir));) any = strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(dir);
    return any;
}

/* Empty `dirfd` (closed here) recursively without following links (shutil.rmtree's
 * job in Python); depth-bounded: a command may nest directories in it. */
static void empty_dir(int dirfd, int depth) {
    DIR *dir = dirfd >= 0 ? fdopendir(dirfd) : NULL;
    if (!dir) {
        if (dirfd >= 0) close(dirfd);
        return;
    }
    for (struct dirent *e; (e = readdir(dir));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (unlinkat(dirfd, e->d_name, 0) == 0 || errno != EISDIR || depth > 32) continue;
        empty_dir(openat(dirfd, e->d_name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW), depth + 1);
        unlinkat(dirfd, e->d_name, AT_REMOVEDIR);
    }
    closedir(dir);
}

void remove_dir(const char *d) {
    empty_dir(open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW), 0);
    rmdir(d);
}

/* Send `sig` to the command: its whole process group, or, sharing ours, the command alone. */
static void signal_command(pid_t pid, int sig) { kill(g_shared_group ? pid : -pid, sig); }

/* ------------------------------------------------------------------ the child */


/* In the child, before exec: as spawn_and_wait's preexec (own process group, the slot's
 * cgroup, the CPU slice), then exec. Only async-signal-safe calls. */
static void child(const struct launch *l) {
    int err;
    if (!g_shared_group) setpgid(0, 0);
    if (g_chld_ign) signal(SIGCHLD, SIG_IGN);
    signal(SIGPIPE, SIG_DFL); /* subprocess's restore_signals */
    signal(SIGXFSZ, SIG_DFL);
    sigprocmask(SIG_SETMASK, &g_oldmask, NULL);
    if (l->daemon_join) {
        char go = 0;
        close(l->go_w); /* only the guardian holds it: a guardian that dies ends this wait (EOF) */
        while (read(l->go_r, &go, 1) < 0 && errno == EINTR) {
        }
        if (go != '1') _exit(EXIT_KREX);
        close(l->go_r);
    }
    if (l->join) {
        char path[PATH_MAX], pid[24];
        int n = snprintf(pid, sizeof pid, "%d", (int)getpid());
        strcpy(path, l->group);
        strcat(path, "/cgroup.procs");
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, pid, (size_t)n) != n) goto fail;
        close(fd);
    }
    if (l->has_cpus && sched_setaffinity(0, sizeof l->cpus, &l->cpus)) goto fail;
    /* Nothing of the caller's beyond stdio (close_fds, as subprocess); errw is O_CLOEXEC. */
    if (syscall(SYS_close_range, 3, l->errw - 1, 0) == 0) {
        syscall(SYS_close_range, l->errw + 1, ~0U, 0);
    } else {
        for (int fd = 3; fd < 65536; fd++)
            if (fd != l->errw) close(fd);
    }
    execve(l->exe, l->argv, l->envp);
fail:
    err = errno;
    if (write(l->errw, &err, sizeof err) < 0) _exit(127);
    _exit(127);
}

struct clone_args_ { /* linux/sched.h struct clone_args (Linux 5.7: with cgroup) */
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid, set_tid_size,
        cgroup;
};
#define CLONE_INTO_CGROUP_ 0x200000000ULL
#ifndef SYS_clone3
#define SYS_clone3 435 /* the same on x86_64 and aarch64 (asm-generic) */
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

/* Whether this process may put a command into the cgroup `group` itself (launcher._can_join). */
int cgroup_joinable(const char *group) {
    char path[PATH_MAX];
    struct stat st;
    if ((size_t)snprintf(path, sizeof path, "%s/cgroup.procs", group) >= sizeof path) return 0;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, W_OK) == 0;
}

/* Start the command in its slot: cgroup v2 forks straight into it (clone3
 * CLONE_INTO_CGROUP: no cgroup.procs write, which queues 16 starting guardians on a
 * global lock); else fork and the child joins. Returns the pid, or -1 with *err the
 * errno of the failed exec (or join) . */
pid_t spawn(struct launch *l, const char *freezer, int *err, int (*moved)(pid_t, void *), void *arg) {
    int p[2], go[2] = {-1, -1};
    if (pipe2(p, O_CLOEXEC) || (l->daemon_join && pipe2(go, O_CLOEXEC))) {
        *err = errno;
        return -1;
    }
    l->errw = p[1];
    l->go_r = go[0], l->go_w = go[1];
    pid_t pid = -1;
    if (!l->daemon_join && !strcmp(freezer, "cgroup2")) {
        int cg = open(l->group, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (cg >= 0) {
            struct clone_args_ ca;
            memset(&ca, 0, sizeof ca);
            ca.flags = CLONE_INTO_CGROUP_;
            ca.exit_signal = SIGCHLD;
            ca.cgroup = (uint64_t)cg;
            pid = (pid_t)syscall(SYS_clone3, &ca, sizeof ca);
            if (pid == 0) child(l);
            close(cg);
        }
    }
    if (pid < 0) { /* ENOSYS, EINVAL, EBUSY, cgroup v1: fork and join (or krexd moves it) */
        l->join = !l->daemon_join;
        pid = fork();
        if (pid == 0) child(l);
    }
    int fork_err = errno;
    close(p[1]);
    if (go[0] >= 0) close(go[0]);
    if (pid < 0) {
        *err = fork_err;
        close(p[0]);
        if (go[1] >= 0) close(go[1]);
        return -1;
    }
    if (!g_shared_group) setpgid(pid, pid); /* also here: a signal forwarded at once finds the group */
    if (l->daemon_join) { /* krexd moves it into the slot (and knows its pid) before it may exec */
        int ok = moved(pid, arg) == 0;
        (void)!write(go[1], ok ? "1" : "0", 1);
        close(go[1]);
        if (!ok) {
            close(p[0]);
            waitpid(pid, NULL, 0);
            *err = -1; /* not an exec error: krexd did not take it (the caller says why) */
            return -1;
        }
    }
    ssize_t n;
    while ((n = read(p[0], err, sizeof *err)) < 0 && errno == EINTR) {
    }
    close(p[0]);
    if (n == (ssize_t)sizeof *err) {
        waitpid(pid, NULL, 0);
        return -1;
    }
    return pid;
}

/* ------------------------------------------------------------------ watching */


/* SIGCONT every descendant of `root` (the signal freezer stops whole process trees, and a
 * descendant may have left the command's process group). */
static void cont_descendants(pid_t root) {
    size_t n = 0, cap = 0;
    pid_t(*pp)[2] = NULL; /* {pid, ppid} of every process */
    DIR *d = opendir("/proc");
    for (struct dirent *e; d && (e = readdir(d));) {
        char path[64], b[512];
        if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
        snprintf(path, sizeof path, "/proc/%.20s/stat", e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        ssize_t k = fd < 0 ? -1 : read(fd, b, sizeof b - 1);
        if (fd >= 0) close(fd);
        if (k <= 0) continue;
        b[k] = 0;
        char *r = strrchr(b, ')');
        int ppid;
        if (!r || sscanf(r + 1, " %*c %d", &ppid) != 1) continue;
        if (n == cap) {
            void *g = realloc(pp, (cap = cap ? cap * 2 : 256) * sizeof *pp);
            if (!g) break;
            pp = g;
        }
        pp[n][0] = (pid_t)atoi(e->d_name), pp[n][1] = (pid_t)ppid, n++;
    }
    if (d) closedir(d);
    char *in = calloc(n + 1, 1); /* in[i]: pp[i] descends from root */
    for (int grew = 1; in && grew;) {
        grew = 0;
        for (size_t i = 0; i < n; i++) {
            if (in[i]) continue;
            int parent_in = pp[i][1] == root;
            for (size_t j = 0; !parent_in && j < n; j++) parent_in = in[j] && pp[j][0] == pp[i][1];
            if (parent_in) in[i] = 1, grew = 1, kill(pp[i][0], SIGCONT);
        }
    }
    free(in);
    free(pp);
}

/* Thaw our own command without krexd (I5; launcher.with_contextlib_thaw): the cgroup's freeze
 * file (krexd hands it to a member's uid), then SIGCONT to the command, its group and, under
 * the signal freezer, every descendant. */
static void thaw(const struct admission *a, pid_t pid) {
    char path[PATH_MAX];
    int v2 = !strcmp(a->freezer, "cgroup2"), sig = !strcmp(a->freezer, "signal");
    snprintf(path, sizeof path, "%s/%s", a->group, v2 ? "cgroup.freeze" : "freezer.state");
    int fd = sig ? -1 : open(path, O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        const char *w = v2 ? "0" : "THAWED";
        if (write(fd, w, strlen(w)) < 0) { /* nothing more to do: SIGCONT below */
        }
        close(fd);
    }
    signal_command(pid, SIGCONT);
    if (sig) {
        kill(pid, SIGCONT);
        cont_descendants(pid);
    }
}

/* Under the signal freezer: does krexd hold the group stopped (a region of another command)?
 * Then a forwarded SIGCONT would thaw it inside that region: it waits for krexd's thaw. krexd
 * keeps a marker beside the group's state file while it holds it (sigfreezer.FROZEN_SUFFIX):
 * made before its first SIGSTOP, gone before its first SIGCONT. One that cannot be asked
 * (a path too long, a denied directory) counts as held. */
static int signal_group_frozen(const struct admission *a) {
    char p[PATH_MAX];
    if (snprintf(p, sizeof p, "%s.frozen", a->group) >= (int)sizeof p) return 1;
    return access(p, F_OK) == 0 || errno != ENOENT;
}

/* krexd's end closed: thaw, and note whether it held our region (_Guardian._lost). */
static void daemon_lost(const struct admission *a, const struct conn *c, pid_t pid, struct lost *lo) {
    thaw(a, pid);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    lo->happened = 1;
    lo->why = "krexd exited";
    lo->ts = (double)ts.tv_sec + ts.tv_nsec / 1e9;
    if (c->seg) {
        const struct krex_gpu *g = &c->seg->gpus[a->gpu];
        uint32_t gate = __atomic_load_n(&g->gate, __ATOMIC_ACQUIRE);
        if (gate != KREX_GATE_OPEN && g->holder == KREX_HOLDER_REGION && g->owner_slot == a->slot) {
            lo->region_cut = 1;
            lo->region_s = (double)(now_ns() - g->closed_ns) / 1e9;
        }
    }
    note("krex: the daemon went away; your command was thawed and keeps running");
}

/* Wait for the command: forward signals to its group, watch krexd. Its wait status. */
/* A pre-warmed command (krexd's prewarm) still waiting for its slot: its first GPU call is
 * blocked in the shim, where a Python command cannot run its SIGINT handler. */
static int still_warm(const struct admission *a, const struct conn *c) {
    return c->seg && __atomic_load_n(&c->seg->slots[a->slot].warm, __ATOMIC_ACQUIRE) != 0;
}

/* krexd stopped beating while the command ran, and beat again (the first of each: the
 * release carries them to krexd, which puts them in the report's daemon_events). */
struct stall g_stall;

static double wall_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

int wait_command(const struct admission *a, struct conn *c, pid_t pid, int sfd, struct lost *lo) {
    int stale = 0, status = 0;
    uint64_t kill_at = 0; /* a stop signal came while the command waited pre-warmed: SIGKILL then */
    for (;;) {
        struct pollfd pf[2] = {{sfd, POLLIN, 0}, {lo->happened ? -1 : c->fd, POLLRDHUP, 0}};
        int r = poll(pf, 2, (int)(KREX_GUARDIAN_POLL_NS / 1000000));
        if (r < 0 && errno != EINTR) return -1;
        if (r > 0 && (pf[0].revents & POLLIN)) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
                /* A terminal's signal (SI_KERNEL) went to our whole group, the command included. */
                int held = si.ssi_signo == SIGCONT && !strcmp(a->freezer, "signal") && signal_group_frozen(a);
                if (si.ssi_signo != SIGCHLD && !(g_shared_group && si.ssi_code == SI_KERNEL) && !held)
                    signal_command(pid, (int)si.ssi_signo);
                /* SIGCONT (after `timeout`'s SIGTERM, or `kill -CONT`) resumes; it stops nothing. */
                if (si.ssi_signo != SIGCHLD && si.ssi_signo != SIGCONT && !kill_at && still_warm(a, c))
                    kill_at = now_ns() + KREX_WARM_KILL_NS;
            }
        }
        /* Nothing of it reached the GPU yet: stopping it for good loses nothing. */
        if (kill_at && now_ns() >= kill_at) {
            if (still_warm(a, c)) signal_command(pid, SIGKILL);
            kill_at = 0;
        }
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w < 0 && errno == ECHILD) return -1; /* reaped by someone else: its status is lost */
        if (w == pid) return status;
        if (r > 0 && pf[1].revents & (POLLRDHUP | POLLHUP | POLLERR)) daemon_lost(a, c, pid, lo);
        if (lo->happened) continue;
        seg_remap();
        double age = heartbeat_age(c);
        if (age > KREX_HEARTBEAT_TIMEOUT_NS / 1e9 && !stale) {
            stale = 1;
            thaw(a, pid);
            if (!g_stall.stalled) g_stall.stalled = 1, g_stall.stalled_ts = wall_s(), g_stall.age_s = age;
            if (!g_quiet)
                say("krex: krexd (pid %d) stopped beating (%.1f s); your command was thawed and keeps running",
                    (int)c->daemon_pid, age);
        } else if (age >= 0 && age <= KREX_HEARTBEAT_TIMEOUT_NS / 1e9) {
            if (stale && !g_stall.resumed) g_stall.resumed = 1, g_stall.resumed_ts = wall_s();
            stale = 0;
        }
    }
}
