/* guardian.c: `krex`, the one guardian of `krex run` (a Python guardian would cost every
 * benchmarked command ~125 ms of interpreter start and imports).
 *
 * It runs every admitted command itself:
 *     krex [-q] run [--device D] [--gpu N] [--freeze P] [--tenant T] [--report F] [--keep-leftovers] [--] CMD...
 * (the options: krex/proc/runopts.py GUARDIAN). Every other command line goes, unchanged,
 * to the Python CLI (`python -m krex.cli.lean ARGV`), which keeps all messages and exit
 * statuses: help, other commands, -v, --no-daemon, an option or value it does not know, a
 * --report path Python would refuse, a command it cannot resolve, a socket it does not
 * trust. So does a run where Python must act first: no daemon answering (Python starts
 * one), a file naming __cudaRegisterFatBinary (Python's ELF check warns about static
 * cudart), a KREX_COPY_CHUNK_BYTES the shim will not take (Python warns). Python then
 * execs this program again with KREX_GUARDIAN_PREPARED (krex.proc.launcher.exec_guardian),
 * and this run goes back to Python no more. All of it is decided before the command holds
 * a slot; an admit krexd refuses is said here, in the words Python's client would raise.
 * Where it cannot put the command into its slot itself (the signal freezer, a slot cgroup
 * it may not write or cannot see), the child waits before exec while krexd moves it.
 *
 * Three files, one program: this one (the command line, the run), guardian_wire.c (krexd's
 * socket and segment, the reply frames, read through wire.c, the shim's framing code too),
 * guardian_proc.c (the command's environment, the child, the watch); guardian.h holds what
 * they share.
 *
 * What to give the command and what to print come from krexd (one Python function
 * each, krex/node/optin.py): the admit reply's env_set/env_prepend/notes, the
 * release reply's notes, and the whole --report (krexd makes it; this file writes its text,
 * and reads or writes no JSON). This file applies and prints them; it never restates them.
 * What goes back to Python after admission: krexd went away while the command ran (no
 * release reply, so no notes and no report): once the command has ended, this process execs
 * `python -m krex.proc.finish`, which journals a region the loss cut and prints the notes
 * from the journal; and a --report of a run KREX failed (`python -m krex.proc.error_report`).
 *
 * Single-threaded: one poll() on a signalfd (SIGCHLD and the forwarded signals) and
 * the admission connection (POLLRDHUP: krexd died), with a timeout to check krexd's
 * heartbeat in the segment (I5: a command is never left frozen by KREX's failure).
 * Every descriptor is O_CLOEXEC; the child closes the ones it inherited. */
#define _GNU_SOURCE
#include "guardian.h"

char **g_argv;       /* our own argv, for the fallback */
const char *g_entry; /* `krex --entry PYTHON ...` (krex.runner): that Python and its library entry */
int g_quiet;         /* -q: no notices */
sigset_t g_oldmask;  /* the signal mask we started with (the child and any exec get it back) */
int g_chld_ign;      /* SIGCHLD was ignored by our caller: the command gets that back */
/* On a terminal (stdin a tty whose foreground group is ours) the command stays in our process
 * group, as the bare command would be in its caller's: the terminal's Ctrl-C and Ctrl-Z reach
 * it directly and stop or interrupt the whole job, and its reads are a foreground job's.
 * Elsewhere it gets a group of its own, and signals go to that whole group. */
int g_shared_group;
/* Started by Python's `krex run` (krex.proc.launcher.run_command) after what only it does
 * (start krexd, the static-cudart and chunk warnings): KREX_GUARDIAN_PREPARED holds its Python,
 * its krex/_lib and the report's extra members (Python's text, passed on unread), one a line.
 * Then nothing goes back to Python before the command's end: what would, is an error here. */
int g_prepared;
const char *g_python;         /* that Python (the finisher's, KREX_DAEMON_CMD's) */
const char *g_prepared_lib;   /* its krex/_lib */
static const char *g_extra;   /* members for the report (krexd or the finisher merges them) */
/* KREX_RUN_TRACE: CLOCK_MONOTONIC stamps of the steps, written to stderr at the end. */
static struct {
    const char *step;
    uint64_t ns;
} g_trace[16];
static int g_traced, g_tracing;

static void mark(const char *step) {
    if (g_tracing && g_traced < 16) g_trace[g_traced].step = step, g_trace[g_traced++].ns = now_ns();
}

/* ------------------------------------------------------------------ small helpers */

uint64_t now_ns(void) { /* the segment's clock (krex_core.c krex_now_ns) */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void say(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
}

void note(const char *text) {
    if (!g_quiet) say("%s", text);
}


void buf_add(struct buf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = (b->n + n + 1) * 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            say("krex: error: out of memory");
            _exit(EXIT_KREX);
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void buf_str(struct buf *b, const char *s) { buf_add(b, s, strlen(s)); }

/* ------------------------------------------------------------------ the fallback */

/* `python -c PY_BOOT MODULE ARGS...` runs MODULE as `python -m` would, but with the current
 * directory off sys.path: under -m a `krex/` folder where the user stands (a clone of KREX, a
 * project) shadows the installed package. -P does that only from Python 3.11 on, and the
 * version of the Python found here is not known. The same text as krex/pystart.py's BOOT. */
#define PY_BOOT                                                                                  \
    "import sys; sys.path[:] = [p for p in sys.path if p]; import runpy; "                       \
    "runpy._run_module_as_main(sys.argv.pop(1))"

/* Exec MODULE (as above) with the Python that has krex: KREX_PYTHON, else python3/python
 * beside this executable (a venv's bin/), else python3 on PATH. */
static void exec_python(const char *module, char *const *args) {
    int n = 0;
    while (args[n]) n++;
    char **av = calloc((size_t)n + 5, sizeof *av);
    if (!av) _exit(EXIT_KREX);
    av[1] = "-c";
    av[2] = PY_BOOT;
    av[3] = (char *)module;
    memcpy(av + 4, args, (size_t)n * sizeof *av);
    const char *py = g_entry ? g_entry : g_python ? g_python : getenv("KREX_PYTHON");
    if (py && *py) {
        av[0] = (char *)py;
        if (strchr(py, '/')) execv(py, av);
        else execvp(py, av); /* a bare name, as subprocess would find it */
        say("krex: error: cannot run %s=%s: %s\n  fix: point it at the Python that has krex installed",
            g_entry ? "--entry" : g_python ? "the Python of `krex run`" : "KREX_PYTHON", py, strerror(errno));
        _exit(EXIT_KREX);
    }
    static char self[PATH_MAX], cand[PATH_MAX + 16];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len > 0) {
        self[len] = 0;
        char *slash = strrchr(self, '/');
        if (slash) *slash = 0;
        const char *names[] = {"python3", "python"};
        for (int i = 0; i < 2; i++) {
            snprintf(cand, sizeof cand, "%s/%s", self, names[i]);
            if (access(cand, X_OK) == 0) {
                av[0] = cand;
                execv(cand, av);
            }
        }
    }
    av[0] = "python3";
    execvp("python3", av);
    say("krex: error: cannot find the Python that has krex installed (%s)\n"
        "  fix: set KREX_PYTHON to it, or put it on PATH as python3", strerror(errno));
    _exit(EXIT_KREX);
}

/* Hand the whole command line to the Python CLI (the door the console script used), or,
 * spawned by krex.runner, to the library's entry: a library process never reaches the CLI. */
static void fallback(void) {
    if (g_prepared) { /* Python has done its part: going back would only loop */
        say("krex: error: the native guardian could not run the command Python prepared\n"
            "  fix: run it again (krexd may have gone away meanwhile)");
        _exit(EXIT_KREX);
    }
    if (g_entry) exec_python("krex.proc.launcher", g_argv + 3);
    exec_python("krex.cli.lean", g_argv + 1);
}

/* ------------------------------------------------------------------ the command line */

#include "krex_runopts.h" /* KREX_RUNOPTS: generated from krex/proc/runopts.py at build */

/* One member per option of runopts.GUARDIAN (an option added there without one here fails to
 * build): a value option's text, or NULL (device NULL: "auto"; gpu digits; freeze NULL: the
 * daemon's policy; tenant NULL: krexd names it after the user), a flag's 1. */
struct opts {
#define KREX_OPT_FIELD(dest, flag, takes_value) const char *dest;
    KREX_RUNOPTS(KREX_OPT_FIELD)
#undef KREX_OPT_FIELD
    char **cmd;
};

static const struct {
    const char *flag;
    int takes_value;
    size_t at; /* offsetof(struct opts, dest) */
} k_opts[] = {
#define KREX_OPT_ROW(dest, flag, takes_value) {flag, takes_value, offsetof(struct opts, dest)},
    KREX_RUNOPTS(KREX_OPT_ROW)
#undef KREX_OPT_ROW
};



/* --report FILE as launcher._check_report_path takes it: not a directory, in an existing
 * directory we may write, and writable if it exists. Anything else is Python's to explain. */
static int report_path_ok(const char *path) {
    struct stat st;
    if (!*path || (stat(path, &st) == 0 && (S_ISDIR(st.st_mode) || access(path, W_OK)))) return 0;
    char *dir = strdup(path), *slash = strrchr(dir, '/');
    if (slash) *(slash == dir ? slash + 1 : slash) = 0;
    const char *d = slash ? dir : ".";
    int ok = stat(d, &st) == 0 && S_ISDIR(st.st_mode) && access(d, W_OK | X_OK) == 0;
    free(dir);
    return ok;
}

/* The value of `--flag V` or `--flag=V` at argv[*i], or NULL when argv[*i] is not that flag. */
static const char *opt_value(char **argv, int *i, const char *flag) {
    size_t n = strlen(flag);
    if (strncmp(argv[*i], flag, n) != 0) return NULL;
    if (argv[*i][n] == '=') return argv[*i] + n + 1;
    if (argv[*i][n] != 0 || !argv[*i + 1]) return NULL;
    return argv[++*i];
}

/* `krex [-q] run [OPTIONS] [--] CMD...` as the lean door reads it (krex/proc/runopts.py
 * RUN, click-like: the first word that is not an option starts CMD), or, after
 * `--entry PYTHON`, the library entry's `OPTIONS -- CMD...` (runopts.ENTRY: `--flag value`
 * only, and only `--` ends them). 0 when Python must handle the line.
 * tests/integration/test_native_guardian.py checks these flags against RUN. */
static int parse(char **argv, struct opts *o) {
    int i = 1;
    memset(o, 0, sizeof *o);
    if (g_entry) {
        i = 2;
    } else {
        for (; argv[i] && strcmp(argv[i], "run") != 0; i++) {
            const char *a = argv[i];
            if (strcmp(a, "--quiet") && !(a[0] == '-' && a[1] == 'q' && strspn(a + 1, "q") == strlen(a + 1)))
                return 0;
            g_quiet = 1;
        }
        if (!argv[i]) return 0;
    }
    int ended = 0; /* an explicit `--` */
    for (i++; argv[i]; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "--")) {
            i++;
            ended = 1;
            break;
        }
        if (a[0] != '-' || !strcmp(a, "-")) break;
        if (g_entry && strchr(a, '=')) return 0; /* the entry takes no --flag=value */
        size_t k = 0;
        for (; k < sizeof k_opts / sizeof *k_opts; k++) {
            const char **slot = (const char **)((char *)o + k_opts[k].at);
            if (!k_opts[k].takes_value && !strcmp(a, k_opts[k].flag)) *slot = "1";
            else if (!k_opts[k].takes_value || !(v = opt_value(argv, &i, k_opts[k].flag))) continue;
            else *slot = v;
            break;
        }
        if (k == sizeof k_opts / sizeof *k_opts) return 0; /* --no-daemon, the daemon's settings, -h, unknown: Python */
    }
    if (!argv[i] || !argv[i][0] || (g_entry && !ended)) return 0;
    if (o->device && !*o->device) return 0; /* click refuses an empty choice: its message */
    if (o->report && !g_prepared && !report_path_ok(o->report)) return 0; /* Python says what is wrong with it */
    if (o->gpu) { /* click takes only an integer; a huge one is krexd's "unknown GPU" */
        size_t n = strlen(o->gpu);
        if (n == 0 || n > 9 || strspn(o->gpu, "0123456789") != n) return 0;
    }
    o->cmd = argv + i;
    return 1;
}

/* Strict UTF-8 (no overlong forms, surrogates or code points past U+10FFFF), as Python
 * decodes the environment without escapes; krexd takes only UTF-8 texts. */
static int utf8_ok(const unsigned char *p) {
    while (*p) {
        unsigned c = *p++, n = c < 0x80 ? 0 : (c & 0xE0) == 0xC0 ? 1 : (c & 0xF0) == 0xE0 ? 2 : (c & 0xF8) == 0xF0 ? 3 : 9;
        if (n == 9) return 0;
        unsigned cp = n ? c & (0x3F >> n) : c;
        for (unsigned i = 0; i < n; i++, p++) {
            if ((*p & 0xC0) != 0x80) return 0;
            cp = cp << 6 | (*p & 0x3F);
        }
        static const unsigned min[] = {0, 0x80, 0x800, 0x10000};
        if (cp < min[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    }
    return 1;
}

/* The environment that makes Python handle a run (its output needs Python). */
static int env_needs_python(void) {
    /* A chunk size the shim will not take as given: Python warns (launcher.chunk_setting_note,
     * krex_chunk_bytes's rule). Only "0" or digits at or above the minimum stay here. */
    const char *ck = getenv("KREX_COPY_CHUNK_BYTES");
    if (ck && *ck) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(ck, &end, 10);
        if (*ck < '0' || *ck > '9' || errno || *end || (v && v < KREX_COPY_CHUNK_MIN_BYTES)) return 1;
    }
    return 0;
}

/* KREX_AUTO_REGION as krexd can take it: UTF-8 (a byte that is not: U+FFFD) of at most 4 KiB
 * (its notes and report, escaped twice, must fit a reply frame). */
static char *auto_value_for_krexd(const char *v) {
    struct buf b = {0};
    buf_str(&b, "");
    for (const unsigned char *p = (const unsigned char *)v; *p && b.n < 4096;) {
        char one[5] = {0};
        size_t n = 1;
        for (; n <= 4 && p[n - 1]; n++) {
            memcpy(one, p, n);
            one[n] = 0;
            if (utf8_ok((const unsigned char *)one)) break;
        }
        if (n > 4 || !p[n - 1]) {
            buf_str(&b, "\xef\xbf\xbd");
            p++;
        } else {
            buf_add(&b, one, n);
            p += n;
        }
    }
    return b.p;
}

/* ------------------------------------------------------------------ the command */

/* The executable as execvp would find it (launcher.resolve_command); NULL when Python
 * must say why not (not found, not executable). */
static char *resolve(const char *name) {
    struct stat st;
    if (strchr(name, '/')) {
        if (stat(name, &st) || S_ISDIR(st.st_mode) || access(name, X_OK)) return NULL;
        return strdup(name);
    }
    const char *path = getenv("PATH");
    if (!path) path = "/bin:/usr/bin"; /* os.defpath, as os.get_exec_path */
    for (const char *p = path;; p++) {
        const char *end = strchrnul(p, ':');
        struct buf b = {0};
        buf_add(&b, p, (size_t)(end - p));
        if (end > p) buf_str(&b, "/");
        buf_str(&b, name);
        if (access(b.p, X_OK) == 0 && !(stat(b.p, &st) == 0 && S_ISDIR(st.st_mode))) return b.p;
        free(b.p);
        if (!*end) return NULL;
        p = end;
    }
}

/* Does the file name __cudaRegisterFatBinary? Then Python's ELF check (static cudart
 * warning, krex/device/elfcheck.py) decides what to say: a cheap filter, not the check. */
static int mentions_cudart(const char *exe) {
    static const char sym[] = "__cudaRegisterFatBinary";
    int fd = open(exe, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    struct stat st;
    if (fd < 0) return 0;
    int hit = 0;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
        void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m != MAP_FAILED) {
            hit = memmem(m, (size_t)st.st_size, sym, sizeof sym - 1) != NULL;
            munmap(m, (size_t)st.st_size);
        }
    }
    close(fd);
    return hit;
}

/* ------------------------------------------------------------------ the run */

/* --report: krexd's report (optin.run_report, the exit status, daemon events and the
 * caller's members: the whole text), written as it is. 0, or EXIT_KREX after saying why not. */
static int write_report(const char *path, const char *text, int status) {
    size_t n = strlen(text);
    FILE *f = fopen(path, "w");
    int bad = !f || fwrite(text, 1, n, f) != n;
    if (f && fclose(f)) bad = 1;
    int e = errno;
    if (!bad) return 0;
    say("krex: error: cannot write the report %s: %s (the command exited %d)\n  fix: give --report a writable path",
        path, strerror(e), status);
    return EXIT_KREX;
}

/* A request answered within the reply timeout: 0 ok, 1 refused (`why`: krexd's error), -1 no
 * answer (`why`). The reply's body is freed unless `r` keeps it. */
static int ask(struct conn *c, enum krex_op op, const void *body, uint32_t len, const struct krex_tail *tail,
               struct reply *r, char *why, size_t n) {
    struct reply own;
    if (!r) r = &own;
    memset(r, 0, sizeof *r);
    if (send_request(c, op, body, len, tail)) return -1;
    int k = recv_reply(c, op, (uint64_t)KREX_REPLY_TIMEOUT_MS * 1000000ull, r, why, n, NULL);
    if (k == 1) {
        struct error_texts e;
        reply_error(r, &e);
        snprintf(why, n, "%s", e.error ? e.error : "refused");
    }
    if (r == &own) free(own.body);
    return k;
}


/* spawn()'s `moved`: ask krexd to move the waiting child into its slot. 0 when it did. */
struct join_ask {
    struct conn *c;
    char *why;
    size_t n;
};

static int join_started(pid_t pid, void *arg) {
    struct join_ask *j = arg;
    struct krex_req_started st = {.pid = (int32_t)pid, .join = 1};
    int k = ask(j->c, KREX_OP_STARTED, &st, sizeof st, NULL, NULL, j->why, j->n);
    if (k == -1 && !j->why[0]) snprintf(j->why, j->n, "the connection to krexd failed (%s)", strerror(errno));
    return k;
}

/* Before handing over to the finisher: an empty auto dir goes now (a full one it reads). */
static void drop_empty(const char *auto_dir, int full) {
    if (auto_dir && !full) remove_dir(auto_dir);
}

/* The finisher ends the run (krex/proc/finish.py): krexd sent no report (it went away, failed
 * the release or had no record left) or no notes. It gets the admission to make the report
 * from, as argv texts; `released`: krexd did release the slot (its records may be gone). */
static void finish_in_python(const struct admission *a, const struct opts *o, pid_t pid, int status,
                             const struct lost *lo, double t_start, const char *auto_dir, int released, int quiet) {
    static char v[10][64];
    snprintf(v[0], 64, "%d", a->slot);
    snprintf(v[1], 64, "%d", a->gpu);
    snprintf(v[2], 64, "%.6f", t_start);
    snprintf(v[3], 64, "%d", status);
    snprintf(v[4], 64, "%d", (int)pid);
    snprintf(v[5], 64, "%.6f", lo->region_cut ? lo->region_s : -1.0);
    snprintf(v[6], 64, "%.6f", lo->ts);
    snprintf(v[7], 64, "%d", quiet);
    snprintf(v[8], 64, "%s", lo->why);
    snprintf(v[9], 64, "%.6f", a->wait_s);
    const char *dev = a->device ? a->device : "gpu";
    int sim = !strcmp(dev, "sim") || (o->device && !strcmp(o->device, "sim"));
    char *args[] = {v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], (char *)(auto_dir ? auto_dir : ""),
                    (char *)(o->report ? o->report : ""), v[9], (char *)dev, sim ? "1" : "0", (char *)a->shm,
                    released ? "1" : "0", (char *)(g_extra ? g_extra : ""), NULL};
    fflush(NULL);
    sigprocmask(SIG_SETMASK, &g_oldmask, NULL);
    exec_python("krex.proc.finish", args);
}

/* KREX failed the run (`status`: 125, or 126/127 for the command's exec): said already; the
 * report (krex/proc/error_report.py writes it, as launcher.run_command does) when asked for
 * one, else `status`. Python starts only on these rare paths. */
static int failed(const struct opts *o, int status, const char *kind, const char *msg, const char *fix) {
    if (!o->report) return status;
    char num[16];
    snprintf(num, sizeof num, "%d", status);
    char *args[] = {(char *)o->report, num, (char *)kind, (char *)msg, (char *)fix,
                    (char *)(g_extra ? g_extra : ""), NULL};
    fflush(NULL);
    sigprocmask(SIG_SETMASK, &g_oldmask, NULL);
    exec_python("krex.proc.error_report", args);
    return EXIT_KREX; /* not reached: exec_python exits when it cannot exec */
}

/* SIGINT before admission (Ctrl-C while the queue waits): what Python's KeyboardInterrupt
 * prints there (cli.lean; launcher.main for --entry), and 130. Nothing is held yet: krexd
 * drops the queued request when the connection closes. */
static void on_sigint_waiting(int sig) {
    static const char cli[] = "\nkrex: aborted\n", entry[] = "krex: aborted\n";
    (void)sig;
    if (g_entry) (void)!write(2, entry, sizeof entry - 1);
    else (void)!write(2, cli, sizeof cli - 1);
    _exit(130);
}

/* A hand-over after the forwarded signals were blocked: a Ctrl-C that came meanwhile is
 * the abort it would have been; the rest of the mask goes back for Python. */
static void fallback_unblocked(void) {
    sigset_t pending;
    struct sigaction sa;
    if (sigpending(&pending) == 0 && sigismember(&pending, SIGINT) && sigaction(SIGINT, NULL, &sa) == 0 &&
        sa.sa_handler == SIG_DFL)
        on_sigint_waiting(SIGINT);
    sigprocmask(SIG_SETMASK, &g_oldmask, NULL);
    fallback();
}

/* krexd refused the admission (nothing is held): its error, fix and kind as Python's client
 * raises them (krex/proc/client.py _KINDS; another kind is a KrexError), printed as `krex run`
 * prints a KREX error and written to the report; 125 (errors.run_exit_code). */
static int refused(const struct opts *o, const struct reply *r) {
    static const char *kinds[] = {"UsageError", "NotFound", "Busy", "Timeout", "PermissionDenied", "DaemonLost"};
    struct error_texts e;
    reply_error(r, &e);
    const char *msg = e.error, *fix = e.fix, *kind = e.kind, *k = "KrexError";
    for (size_t i = 0; kind && i < sizeof kinds / sizeof *kinds; i++)
        if (!strcmp(kind, kinds[i])) k = kinds[i];
    if (!msg) msg = "request failed";
    say("krex: error: %s", msg);
    if (fix && *fix) say("  fix: %s", fix);
    return failed(o, EXIT_KREX, k, msg, fix ? fix : "");
}

/* How the command ended, for krexd (`release`'s exit_*; its exit status is exit_status): its
 * pid, the signal that killed it (0: none) and its command line, cut short. Under MPS a client killed inside its
 * kernels fails the GPU's other clients for a while: krexd records it and tells them. */
static void exit_fields(struct krex_req_release *rel, struct krex_tail *tail, char *line, size_t cap, pid_t pid,
                        int ws, char **cmd) {
    rel->has_exit_pid = rel->has_exit_signal = 1;
    rel->exit_pid = (int32_t)pid;
    rel->exit_signal = WIFSIGNALED(ws) ? WTERMSIG(ws) : 0;
    /* ASCII only ('?' for any other byte): a cut or foreign encoding never makes the frame
     * text that is not UTF-8. */
    size_t n = 0;
    for (char **a = cmd; a && *a && n + 1 < cap; a++) {
        if (a != cmd) line[n++] = ' ';
        for (const unsigned char *c = (const unsigned char *)*a; *c && n + 1 < cap; c++)
            line[n++] = *c >= 0x20 && *c < 0x7f ? (char)*c : '?';
    }
    line[n] = 0;
    krex_tail_put(tail, &rel->exit_command_str, line);
}

static int run(struct opts *o) {
    char *exe = resolve(o->cmd[0]);
    if (!exe || (!g_prepared && mentions_cudart(exe))) fallback();
    mark("resolved");
    /* Python keeps an ignored SIGINT ignored (a background job): so do we. */
    struct sigaction old_int, on_int = {.sa_handler = on_sigint_waiting};
    sigemptyset(&on_int.sa_mask);
    int int_set = sigaction(SIGINT, NULL, &old_int) == 0 && old_int.sa_handler != SIG_IGN &&
                  sigaction(SIGINT, &on_int, NULL) == 0;
    struct conn c;
    memset(&c, 0, sizeof c);
    if (!own_install() || daemon_connect(&c)) fallback();
    mark("connected");

    struct krex_req_admit req = {.has_gpu = o->gpu != NULL, .gpu = o->gpu ? atoi(o->gpu) : 0};
    struct krex_tail tail = {0};
    krex_tail_put(&tail, &req.guardian_str, "native");
    krex_tail_put(&tail, &req.device_str, o->device ? o->device : "auto");
    krex_tail_put(&tail, &req.freeze_str, o->freeze);
    krex_tail_put(&tail, &req.tenant_str, o->tenant); /* krexd checks the name (and refuses a bad one with the fix) */
    /* krexd keeps it (stripped, as Python's str.strip) for the release's notes and report. */
    const char *av = getenv("KREX_AUTO_REGION");
    char *sent = av && *av ? auto_value_for_krexd(av) : NULL;
    krex_tail_put(&tail, &req.auto_value_str, sent);
    free(sent);
    char why[512] = "";
    struct reply adm;
    if (send_request(&c, KREX_OP_ADMIT, &req, sizeof req, &tail)) fallback();
    free(tail.p);
    int rc = recv_reply(&c, KREX_OP_ADMIT, 0, &adm, why, sizeof why, on_queue_event);
    /* From here the forwarded signals wait, blocked, for the signalfd (and the command):
     * blocked before the handler goes, so none can kill us in between. */
    sigset_t fwd;
    sigemptyset(&fwd);
    int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCONT, SIGCHLD}; /* launcher.FORWARDED + SIGCHLD */
    for (size_t i = 0; i < sizeof sigs / sizeof *sigs; i++) sigaddset(&fwd, sigs[i]);
    sigprocmask(SIG_BLOCK, &fwd, &g_oldmask);
    if (int_set) sigaction(SIGINT, &old_int, NULL);
    if (rc == 1) { /* refused, nothing claimed: krexd's words, as Python's client raises them */
        close(c.fd);
        sigprocmask(SIG_SETMASK, &g_oldmask, NULL);
        return refused(o, &adm);
    }
    if (rc && g_prepared) { /* no answer, and Python has just found krexd: client.py's words */
        const char *cut = strstr(why, "closed the connection");
        say("krex: error: %s\n  fix: %s", why,
            cut ? "check `krex daemon status`"
                : "`kill -CONT` krexd if it was stopped; else `krex daemon stop` (a new one starts on demand)");
        return failed(o, EXIT_KREX, cut ? "DaemonLost" : "Timeout", why, "");
    }
    if (rc) { /* no answer: Python starts a krexd if none is left */
        close(c.fd);
        fallback_unblocked();
    }
    mark("admitted");
    /* Admitted: from here on every way out releases the slot. */
    struct admission a;
    struct krex_req_release rel = {.report = o->report != NULL};
    struct krex_tail rel_tail = {0};
    krex_tail_put(&rel_tail, &rel.leftovers_str, o->keep_leftovers ? "keep" : "kill");
    if (read_admission(&adm, &a)) {
        struct krex_req_release plain = {0};
        send_request(&c, KREX_OP_RELEASE, &plain, sizeof plain, NULL);
        const char *msg = "krexd's admit reply is malformed (a krexd of another version?)",
                   *fix = "restart krexd (`krex daemon stop`; it starts on demand)";
        say("krex: error: %s\n  fix: %s", msg, fix);
        return failed(o, EXIT_KREX, "KrexError", msg, fix);
    }
    print_notes(a.notes);
    if (strcmp(a.shm, c.seg_name)) { /* the admitted segment, as _Guardian watches */
        const struct krex_shm *s = seg_map(a.shm);
        if (s) c.seg = s;
    }

    struct launch l;
    memset(&l, 0, sizeof l);
    l.exe = exe;
    l.argv = o->cmd;
    l.group = a.group;
    /* The child waits before exec while krexd moves it (`started` with join) where this
     * guardian cannot put it into its slot itself: the signal freezer (krexd must know the
     * pid to stop it), and a slot cgroup not visible or not writable here (a member of a
     * shared daemon's group, a container without the host's cgroup tree). */
    l.daemon_join = !strcmp(a.freezer, "signal") || !cgroup_joinable(a.group);
    l.has_cpus = admission_cpus(&a, &l.cpus);
    char *auto_dir = private_tmpdir(a.slot);
    l.envp = command_env(&a, auto_dir);

    /* Signals for the command go through the signalfd from now on (blocked since admission). */
    int sfd = signalfd(-1, &fwd, SFD_CLOEXEC | SFD_NONBLOCK);
    int err = sfd < 0 ? errno : 0;

    struct timespec t0;
    clock_gettime(CLOCK_REALTIME, &t0);
    why[0] = 0;
    struct join_ask ja = {&c, why, sizeof why};
    mark("env");
    pid_t pid = sfd < 0 ? -1 : spawn(&l, a.freezer, &err, join_started, &ja);
    int status, ws = -1;
    struct lost lo = {0};
    if (pid < 0) {
        status = err == -1 ? EXIT_KREX : err == ENOENT ? 127 : 126;
    } else if (l.daemon_join) { /* krexd has it since the join */
        mark("spawned");
        ws = wait_command(&a, &c, pid, sfd, &lo);
        status = ws == -1 ? EXIT_KREX : WIFSIGNALED(ws) ? 128 + WTERMSIG(ws) : WEXITSTATUS(ws);
        if (ws == -1) say("krex: error: the command's exit status was lost (another process reaped it)");
    } else {
        struct krex_req_started st = {.pid = (int32_t)pid};
        mark("spawned");
        int k = ask(&c, KREX_OP_STARTED, &st, sizeof st, NULL, NULL, why, sizeof why);
        mark("started");
        if (k == -1 && !why[0]) snprintf(why, sizeof why, "the connection to krexd failed (%s)", strerror(errno));
        if (k && !g_quiet) say("krex: warning: krexd did not take the command into its slot: %s", why);
        ws = wait_command(&a, &c, pid, sfd, &lo);
        if (ws == -1) {
            say("krex: error: the command's exit status was lost (another process reaped it)");
            status = EXIT_KREX;
        } else {
            status = WIFSIGNALED(ws) ? 128 + WTERMSIG(ws) : WEXITSTATUS(ws);
        }
    }
    mark("exited");
    /* The command has ended: nothing is left to forward to, and the guardian must stay
     * killable while it releases and writes the report (a --report FIFO nobody reads blocks
     * its open). Signals still pending were the command's: dropped, then the mask goes back. */
    if (sfd >= 0) {
        struct signalfd_siginfo si;
        while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
        }
        close(sfd);
    }
    sigprocmask(SIG_SETMASK, &g_oldmask, NULL);

    int auto_full = auto_dir && dir_has_entries(auto_dir);
    if (lo.happened) { /* the finisher removes a full one after reading it */
        drop_empty(auto_dir, auto_full);
        /* No krexd removes the command's group now: left empty in the caller's job or pod
         * cgroup, it would keep the scheduler from removing that. Busy, it stays (EBUSY). */
        rmdir(a.group);
        finish_in_python(&a, o, pid, status, &lo, t0.tv_sec + t0.tv_nsec / 1e9, auto_full ? auto_dir : NULL, 0,
                         g_quiet);
    }
    krex_tail_put(&rel_tail, &rel.auto_dir_str, auto_full ? auto_dir : NULL);
    krex_tail_put(&rel_tail, &rel.extra_str, g_extra && *g_extra ? g_extra : NULL);
    rel.exit_status = status; /* for krexd's report: it writes the whole of it */
    rel.has_stalled_ts = rel.has_stall_age_s = g_stall.stalled != 0;
    rel.stalled_ts = g_stall.stalled_ts, rel.stall_age_s = g_stall.age_s;
    rel.has_resumed_ts = g_stall.resumed != 0;
    rel.resumed_ts = g_stall.resumed_ts;
    char line[200];
    if (ws != -1) exit_fields(&rel, &rel_tail, line, sizeof line, pid, ws, o->cmd);
    struct reply r;
    struct timespec t_rel;
    clock_gettime(CLOCK_REALTIME, &t_rel);
    int k = ask(&c, KREX_OP_RELEASE, &rel, sizeof rel, &rel_tail, &r, why, sizeof why);
    mark("released");
    struct text notes = {0};
    const char *body = NULL;
    if (k == 0 && read_release(&r, &notes, &body)) { /* a reply it cannot read: as none */
        k = -1;
        snprintf(why, sizeof why, "krexd's release reply is malformed (a krexd of another version?)");
    }
    if (k != 0 && pid >= 0) { /* no release reply: the journal has the rest */
        drop_empty(auto_dir, auto_full);
        lo.happened = 1;
        /* An error reply is krexd's answer, not its loss: no daemon event. */
        lo.why = k == 1 ? "" : "krexd did not answer the release";
        lo.ts = t_rel.tv_sec + t_rel.tv_nsec / 1e9;
        finish_in_python(&a, o, pid, status, &lo, lo.ts, auto_full ? auto_dir : NULL, 1, g_quiet);
    }
    if (auto_dir) remove_dir(auto_dir); /* krexd has read it (notes, the report's auto_region) */
    if (pid < 0 && err == -1) { /* krexd did not move it into its slot: it never ran */
        char msg[700];
        const char *fix = "see krexd.log";
        snprintf(msg, sizeof msg, "krexd could not move the command into its slot: %s", why);
        say("krex: error: %s\n  fix: %s", msg, fix);
        return failed(o, status, "KrexError", msg, fix);
    }
    if (pid < 0) { /* the exec failed: launcher's CommandNotFound / NotExecutable */
        char msg[PATH_MAX + 300];
        const char *kind = err == ENOENT ? "CommandNotFound" : "NotExecutable",
                   *fix = err == ENOENT ? "check the path" : "run it through its interpreter, or chmod +x it";
        if (err == ENOENT) snprintf(msg, sizeof msg, "command not found: %s", exe);
        else snprintf(msg, sizeof msg, "cannot execute %s: %s", exe, strerror(err));
        say("krex: error: %s\n  fix: %s", msg, fix);
        return failed(o, status, kind, msg, fix);
    }
    print_notes(notes);
    if (o->report) {
        if (!body) { /* krexd released the slot but sent no report (no record of it left): the finisher makes it */
            lo.why = "";
            lo.ts = t_rel.tv_sec + t_rel.tv_nsec / 1e9;
            finish_in_python(&a, o, pid, status, &lo, t0.tv_sec + t0.tv_nsec / 1e9, NULL, 1, 1);
        }
        int w = write_report(o->report, body, status);
        if (w) return w;
    }
    return status;
}

/* Read KREX_GUARDIAN_PREPARED (PYTHON, LIB_DIR, EXTRA: one a line) and take it out of the
 * environment the command inherits. */
static void prepared(void) {
    const char *v = getenv("KREX_GUARDIAN_PREPARED");
    if (!v) return;
    char *copy = strdup(v), *lib = copy ? strchr(copy, '\n') : NULL, *extra = lib ? strchr(lib + 1, '\n') : NULL;
    unsetenv("KREX_GUARDIAN_PREPARED");
    if (!extra) return; /* not Python's: as if not set */
    *lib++ = 0, *extra++ = 0;
    g_prepared = 1;
    g_python = copy[0] == '/' ? copy : NULL;
    g_prepared_lib = lib[0] == '/' ? lib : NULL;
    g_extra = extra;
}

int main(int argc, char **argv) {
    (void)argc;
    g_argv = argv;
    /* A closed 0-2 would be taken by the daemon socket, and notes written into it. */
    for (int fd = 0; fd < 3; fd++)
        if (fcntl(fd, F_GETFD) < 0 && errno == EBADF && open("/dev/null", O_RDWR) != fd) return EXIT_KREX;
    /* An ignored SIGCHLD (inherited over exec) makes the kernel reap the command: we would
     * never see it end. Ours is the default; the command gets the caller's back. */
    struct sigaction sa;
    g_chld_ign = sigaction(SIGCHLD, NULL, &sa) == 0 && sa.sa_handler == SIG_IGN;
    signal(SIGCHLD, SIG_DFL);
    /* Notes to a stderr whose reader is gone (`krex run ... 2>&1 | head -1`) must not kill the
     * guardian: the command's status and report matter more. The command gets SIGPIPE's
     * default back (child()), and Python, where we hand over, ignores it too. */
    signal(SIGPIPE, SIG_IGN);
    g_shared_group = isatty(0) && tcgetpgrp(0) == getpgrp();
    /* `krex --entry PYTHON ENTRY-ARGS...`: krex.runner's guardian (bench, batch); what this
     * file does not run itself goes to `PYTHON -m krex.proc.launcher ENTRY-ARGS...`. */
    if (argv[1] && !strcmp(argv[1], "--entry")) {
        if (!argv[2] || !argv[2][0]) {
            say("krex: error: --entry needs the Python that has krex\n  fix: krex --entry PYTHON OPTIONS -- CMD...");
            return EXIT_KREX;
        }
        g_entry = argv[2];
    }
    prepared();
    const char *t = getenv("KREX_RUN_TRACE");
    g_tracing = t && *t;
    mark("main");
    struct opts o;
    if (!parse(argv, &o) || (!g_prepared && env_needs_python())) fallback();
    int status = run(&o);
    mark("exit");
    if (g_tracing) {
        fprintf(stderr, "krex-trace");
        for (int i = 0; i < g_traced; i++) fprintf(stderr, " %s=%llu", g_trace[i].step, (unsigned long long)g_trace[i].ns);
        fprintf(stderr, "\n");
    }
    return status;
}
