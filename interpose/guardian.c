/* guardian.c: the native `krex` command (a Python guardian would cost every
 * benchmarked command ~125 ms of interpreter start and imports).
 *
 * It runs the common case itself:
 *     krex [-q] run [--device D] [--gpu N] [--freeze P] [--tenant T] [--report F] [--keep-leftovers] [--] CMD...
 * and hands EVERY other command line, unchanged, to the Python CLI
 * (`python -m krex.cli.lean ARGV`, the door the Python console script used), which keeps
 * all messages and exit statuses: help, other commands, -v, --no-daemon, an option or
 * value it does not know, a --report path Python would refuse, no daemon answering (Python
 * starts one), a socket it does not trust, a command it cannot resolve, KREX_RUN_TRACE
 * set, a KREX_AUTO_REGION not UTF-8 or over 4 KiB, an admit that krexd refuses (krexd
 * refuses `"guardian": "native"` where only the Python guardian can go on: the signal
 * freezer, a group member's guardian, a simulated daemon under --device gpu), a file naming __cudaRegisterFatBinary (Python's
 * ELF check warns about static cudart), KREX_NATIVE_OFF set. All of these are decided
 * before the command holds a slot.
 *
 * What to give the command and what to print come from krexd (one Python function
 * each, krex/node/optin.py): the admit reply's env_set/env_prepend/notes, the
 * release reply's notes. This file applies and prints them; it never restates them.
 * The one case that goes back to Python after admission: krexd went away while the
 * command ran (no release reply, so no notes): once the command has ended, this
 * process execs `python -m krex.proc.finish`, which journals a region the loss cut
 * and prints the notes from the journal, as the Python guardian does.
 *
 * Single-threaded: one poll() on a signalfd (SIGCHLD and the forwarded signals) and
 * the admission connection (POLLRDHUP: krexd died), with a timeout to check krexd's
 * heartbeat in the segment (I5: a command is never left frozen by KREX's failure).
 * Every descriptor is O_CLOEXEC; the child closes the ones it inherited. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
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

extern char **environ;

#define EXIT_KREX 125 /* `krex run`: KREX itself failed (krex/errors.py RUN_FAILURE) */

static char **g_argv;       /* our own argv, for the fallback */
static const char *g_entry; /* `krex --entry PYTHON ...` (krex.runner): that Python and its library entry */
static int g_quiet;         /* -q: no notices */
static sigset_t g_oldmask;  /* the signal mask we started with (the child and any exec get it back) */
static int g_chld_ign;      /* SIGCHLD was ignored by our caller: the command gets that back */
/* On a terminal (stdin a tty whose foreground group is ours) the command stays in our process
 * group, as the bare command would be in its caller's: the terminal's Ctrl-C and Ctrl-Z reach
 * it directly and stop or interrupt the whole job, and its reads are a foreground job's.
 * Elsewhere it gets a group of its own, and signals go to that whole group. */
static int g_shared_group;

/* ------------------------------------------------------------------ small helpers */

static uint64_t now_ns(void) { /* the segment's clock (krex_core.c krex_now_ns) */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void say(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
}

static void note(const char *text) {
    if (!g_quiet) say("%s", text);
}

/* A growable string (JSON requests, environment entries). */
struct buf {
    char *p;
    size_t n, cap;
};

static void buf_add(struct buf *b, const char *s, size_t n) {
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

static void buf_str(struct buf *b, const char *s) { buf_add(b, s, strlen(s)); }

/* A JSON string literal (what a user typed goes into requests). */
static void buf_json_str(struct buf *b, const char *s) {
    buf_str(b, "\"");
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        char esc[8];
        if (*c == '"' || *c == '\\') {
            esc[0] = '\\', esc[1] = (char)*c, esc[2] = 0;
            buf_str(b, esc);
        } else if (*c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", *c);
            buf_str(b, esc);
        } else {
            buf_add(b, (const char *)c, 1);
        }
    }
    buf_str(b, "\"");
}

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
    const char *py = g_entry ? g_entry : getenv("KREX_PYTHON");
    if (py && *py) {
        av[0] = (char *)py;
        if (strchr(py, '/')) execv(py, av);
        else execvp(py, av); /* a bare name, as subprocess would find it */
        say("krex: error: cannot run %s=%s: %s\n  fix: point it at the Python that has krex installed",
            g_entry ? "--entry" : "KREX_PYTHON", py, strerror(errno));
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
    if (g_entry) exec_python("krex.proc.launcher", g_argv + 3);
    exec_python("krex.cli.lean", g_argv + 1);
}

/* ------------------------------------------------------------------ the command line */

struct opts {
    const char *device; /* NULL: "auto" */
    const char *gpu;    /* digits, or NULL */
    const char *freeze; /* NULL: the daemon's policy */
    const char *tenant; /* NULL: krexd names it after the user */
    const char *report; /* --report FILE, or NULL */
    int keep_leftovers;
    char **cmd;
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
        if ((v = opt_value(argv, &i, "--device"))) o->device = v;
        else if ((v = opt_value(argv, &i, "--gpu"))) o->gpu = v;
        else if ((v = opt_value(argv, &i, "--freeze"))) o->freeze = v;
        else if ((v = opt_value(argv, &i, "--tenant"))) o->tenant = v;
        else if ((v = opt_value(argv, &i, "--report"))) o->report = v;
        else if (!strcmp(a, "--keep-leftovers")) o->keep_leftovers = 1;
        else return 0; /* --no-daemon, the daemon's settings, -h, an unknown option: Python */
    }
    if (!argv[i] || !argv[i][0] || (g_entry && !ended)) return 0;
    if (o->device && !*o->device) return 0; /* click refuses an empty choice: its message */
    if (o->report && !report_path_ok(o->report)) return 0; /* Python says what is wrong with it */
    if (o->gpu) { /* click takes only an integer; a huge one is krexd's "unknown GPU" */
        size_t n = strlen(o->gpu);
        if (n == 0 || n > 9 || strspn(o->gpu, "0123456789") != n) return 0;
    }
    o->cmd = argv + i;
    return 1;
}

/* Strict UTF-8 (no overlong forms, surrogates or code points past U+10FFFF), as Python
 * decodes the environment without escapes; krexd takes only UTF-8 JSON. */
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
    const char *t = getenv("KREX_RUN_TRACE"), *a = getenv("KREX_AUTO_REGION");
    if (t && *t) return 1; /* the step stamps (launcher.TRACE) */
    /* A chunk size the shim will not take as given: Python warns (launcher.chunk_setting_note,
     * krex_chunk_bytes's rule). Only "0" or digits at or above the minimum stay here. */
    const char *ck = getenv("KREX_COPY_CHUNK_BYTES");
    if (ck && *ck) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(ck, &end, 10);
        if (*ck < '0' || *ck > '9' || errno || *end || (v && v < KREX_COPY_CHUNK_MIN_BYTES)) return 1;
    }
    /* A value krexd could not take as it is (Python escapes what is not UTF-8), or one so
     * long that its notes and report, escaped twice, could outgrow a reply frame. */
    return a && (strlen(a) > 4096 || !utf8_ok((const unsigned char *)a));
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

/* ------------------------------------------------------------------ JSON (replies only)
 * krexd's replies are one JSON object (krex/protocol.py). A strict reader: a tree of
 * values; anything malformed is an error. Strings are decoded (escapes, \u to UTF-8);
 * a NUL inside one is refused (it could not reach an environment). */

enum jtype { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ };
struct jv {
    enum jtype t;
    int b;
    double num;
    char *s;         /* J_STR: decoded, NUL-terminated */
    char *key;       /* the member's name inside an object */
    struct jv *kid;  /* J_ARR / J_OBJ: the first element */
    struct jv *next; /* the next element of the parent */
};

struct jparse {
    const char *p, *end;
    int depth;
};

static void jfree(struct jv *v) {
    while (v) {
        struct jv *n = v->next;
        jfree(v->kid);
        free(v->s);
        free(v->key);
        free(v);
        v = n;
    }
}

static void jws(struct jparse *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

static int hex4(const char *p, unsigned *out) {
    *out = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        *out = *out << 4 | (unsigned)d;
    }
    return 0;
}

static void put_utf8(struct buf *b, unsigned cp) {
    char u[4];
    size_t n;
    if (cp < 0x80) u[0] = (char)cp, n = 1;
    else if (cp < 0x800) u[0] = (char)(0xC0 | cp >> 6), u[1] = (char)(0x80 | (cp & 63)), n = 2;
    else if (cp < 0x10000)
        u[0] = (char)(0xE0 | cp >> 12), u[1] = (char)(0x80 | (cp >> 6 & 63)), u[2] = (char)(0x80 | (cp & 63)), n = 3;
    else
        u[0] = (char)(0xF0 | cp >> 18), u[1] = (char)(0x80 | (cp >> 12 & 63)), u[2] = (char)(0x80 | (cp >> 6 & 63)),
        u[3] = (char)(0x80 | (cp & 63)), n = 4;
    buf_add(b, u, n);
}

static char *jstring(struct jparse *j) { /* at the opening quote */
    struct buf b = {0};
    buf_str(&b, "");
    for (j->p++; j->p < j->end; j->p++) {
        unsigned char c = (unsigned char)*j->p;
        if (c == '"') {
            j->p++;
            return b.p;
        }
        if (c < 0x20) break;
        if (c != '\\') {
            buf_add(&b, j->p, 1);
            continue;
        }
        if (++j->p >= j->end) break;
        const char *simple = strchr("\"\\/bfnrt", *j->p);
        if (simple && *j->p) {
            static const char to[] = "\"\\/\b\f\n\r\t";
            buf_add(&b, &to[simple - "\"\\/bfnrt"], 1);
            continue;
        }
        unsigned cp, lo;
        if (*j->p != 'u' || j->end - j->p < 5 || hex4(j->p + 1, &cp)) break;
        j->p += 4;
        if (cp >= 0xD800 && cp < 0xDC00) { /* a surrogate pair */
            if (j->end - j->p < 7 || j->p[1] != '\\' || j->p[2] != 'u' || hex4(j->p + 3, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                break;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            j->p += 6;
        } else if ((cp >= 0xDC00 && cp < 0xE000) || cp == 0) {
            break;
        }
        put_utf8(&b, cp);
    }
    free(b.p);
    return NULL;
}

static struct jv *jvalue(struct jparse *j);

static struct jv *jcontainer(struct jparse *j, struct jv *v, char close) {
    struct jv **tail = &v->kid;
    j->p++;
    jws(j);
    if (j->p < j->end && *j->p == close) {
        j->p++;
        return v;
    }
    for (;;) {
        char *key = NULL;
        jws(j);
        if (close == '}') {
            if (j->p >= j->end || *j->p != '"' || !(key = jstring(j))) return NULL;
            jws(j);
            if (j->p >= j->end || *j->p++ != ':') {
                free(key);
                return NULL;
            }
        }
        struct jv *k = jvalue(j);
        if (!k) {
            free(key);
            return NULL;
        }
        k->key = key;
        *tail = k;
        tail = &k->next;
        jws(j);
        if (j->p < j->end && *j->p == ',') {
            j->p++;
            continue;
        }
        if (j->p < j->end && *j->p == close) {
            j->p++;
            return v;
        }
        return NULL;
    }
}

static int jnumber(struct jparse *j, struct jv *v) {
    const char *s = j->p;
    if (j->p < j->end && *j->p == '-') j->p++;
    if (j->p >= j->end || *j->p < '0' || *j->p > '9') return -1;
    if (*j->p == '0') j->p++;
    else
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9') j->p++;
    if (j->p < j->end && *j->p == '.') {
        if (++j->p >= j->end || *j->p < '0' || *j->p > '9') return -1;
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9') j->p++;
    }
    if (j->p < j->end && (*j->p == 'e' || *j->p == 'E')) {
        j->p++;
        if (j->p < j->end && (*j->p == '+' || *j->p == '-')) j->p++;
        if (j->p >= j->end || *j->p < '0' || *j->p > '9') return -1;
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9') j->p++;
    }
    char tmp[64];
    size_t n = (size_t)(j->p - s);
    if (n >= sizeof tmp) n = sizeof tmp - 1; /* precision beyond this is never needed */
    memcpy(tmp, s, n);
    tmp[n] = 0;
    v->num = strtod(tmp, NULL);
    return 0;
}

static struct jv *jvalue(struct jparse *j) {
    struct jv *v = calloc(1, sizeof *v);
    if (!v) return NULL;
    jws(j);
    struct jv *ok = v;
    if (++j->depth > 32 || j->p >= j->end) {
        ok = NULL;
    } else if (*j->p == '{') {
        v->t = J_OBJ;
        ok = jcontainer(j, v, '}');
    } else if (*j->p == '[') {
        v->t = J_ARR;
        ok = jcontainer(j, v, ']');
    } else if (*j->p == '"') {
        v->t = J_STR;
        ok = (v->s = jstring(j)) ? v : NULL;
    } else if (j->end - j->p >= 4 && !memcmp(j->p, "true", 4)) {
        v->t = J_BOOL, v->b = 1, j->p += 4;
    } else if (j->end - j->p >= 5 && !memcmp(j->p, "false", 5)) {
        v->t = J_BOOL, j->p += 5;
    } else if (j->end - j->p >= 4 && !memcmp(j->p, "null", 4)) {
        v->t = J_NULL, j->p += 4;
    } else {
        v->t = J_NUM;
        ok = jnumber(j, v) ? NULL : v;
    }
    j->depth--;
    if (!ok) jfree(v);
    return ok;
}

/* The whole text as one JSON object, or NULL. */
static struct jv *jparse_object(const char *s, size_t n) {
    struct jparse j = {s, s + n, 0};
    jws(&j);
    if (j.p >= j.end || *j.p != '{') return NULL;
    struct jv *v = jvalue(&j);
    jws(&j);
    if (v && j.p != j.end) {
        jfree(v);
        return NULL;
    }
    return v;
}

static struct jv *jget(const struct jv *obj, const char *key) {
    if (!obj || obj->t != J_OBJ) return NULL;
    for (struct jv *k = obj->kid; k; k = k->next)
        if (!strcmp(k->key, key)) return k; /* the last one would win in Python; krexd never repeats */
    return NULL;
}

static const char *jstr(const struct jv *obj, const char *key) {
    struct jv *v = jget(obj, key);
    return v && v->t == J_STR ? v->s : NULL;
}

/* An integer member in [lo, hi], or -1 (the callers' values are never negative). */
static long long jint(const struct jv *obj, const char *key, long long lo, long long hi) {
    struct jv *v = jget(obj, key);
    if (!v || v->t != J_NUM || v->num != (double)(long long)v->num || v->num < lo || v->num > hi) return -1;
    return (long long)v->num;
}

/* ------------------------------------------------------------------ our own installation */

/* What this guardian gives a command to load comes from its own installation, whatever
 * krexd answers (krex_env.h): the shim, the hook directory and the simulated GPU of the
 * krex/_lib directory this executable belongs to, and KREX_DAEMON_CMD only with a Python
 * of its own directory (krex/node/optin.py own_env is the Python guardian's copy). */
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
 * editable install's bin/krex). 0 when none is found: Python's guardian runs instead. */
static int own_install(void) {
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
#ifdef KREX_BUILT_LIB_DIR
    if (!found[0] && lib_dir_ok(KREX_BUILT_LIB_DIR)) snprintf(found, sizeof found, "%s", KREX_BUILT_LIB_DIR);
#endif
    if (!found[0] || !realpath(found, g_own.lib)) return 0;
    snprintf(g_own.shim, sizeof g_own.shim, "%.*s/libkrex_interpose.so", PATH_MAX - 32, g_own.lib);
    char hook[PATH_MAX + 32];
    snprintf(hook, sizeof hook, "%s/../proc/_hook", g_own.lib);
    if (!realpath(hook, g_own.hook)) return 0;
    snprintf(g_own.pydir[0], PATH_MAX, "%s", exedir);
    const char *py = g_entry ? g_entry : getenv("KREX_PYTHON");
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

/* ------------------------------------------------------------------ the daemon's socket */

struct conn {
    int fd;
    pid_t daemon_pid;
    const struct krex_shm *seg; /* for its heartbeat; NULL if it cannot be mapped */
    char seg_name[128];
    uint64_t stopped_since;     /* when krexd was first seen stopped (state T), 0: not */
};

/* Same rules as krex/paths.py socket_path(). Empty string when Python must say why. */
static void socket_path(char *out, size_t n, int *explicit_) {
    const char *s = getenv("KREX_SOCKET"), *d = getenv("KREX_STATE_DIR"), *x = getenv("XDG_RUNTIME_DIR");
    *explicit_ = (s && *s) || (d && *d);
    out[0] = 0;
    if (s && *s) {
        if (strlen(s) <= 100) snprintf(out, n, "%s", s);
    } else if (d && *d) {
        snprintf(out, n, "%s/krexd.sock", d);
    } else if (geteuid() == 0) {
        snprintf(out, n, "/run/krex/krexd.sock");
    } else if (x && *x) {
        snprintf(out, n, "%s/krex/krexd.sock", x);
    } else {
        snprintf(out, n, "/tmp/krex-%u/krexd.sock", (unsigned)getuid());
    }
}

/* paths.check_for_client(): the socket's directory is a real directory of ours or root's
 * (any owner if the user named it) that others may not write. Fails closed: Python then
 * gives the precise refusal. */
static int dir_trusted(const char *sock, int explicit_, uid_t *dir_uid) {
    char d[PATH_MAX];
    snprintf(d, sizeof d, "%s", sock);
    char *slash = strrchr(d, '/');
    if (!slash) snprintf(d, sizeof d, ".");
    else if (slash == d) d[1] = 0;
    else *slash = 0;
    struct stat st;
    if (lstat(d, &st) || !S_ISDIR(st.st_mode)) return 0;
    *dir_uid = st.st_uid;
    if (!explicit_ && st.st_uid != geteuid() && st.st_uid != 0) return 0;
    return !(st.st_mode & (explicit_ ? S_IWOTH : S_IWOTH | S_IWGRP));
}

/* A segment shrunk under us (`truncate -s 0` by anyone who may write it) faults every
 * read past its new end with SIGBUS. The handler maps the file again at the same address
 * once its size is back (krexd and every shim give it back when they touch it), else zero
 * pages, which read as "no daemon" (heartbeat unknown: the process state still tells a
 * stopped krexd); the watch loop maps the file again later (seg_remap). */
#define SEG_MAPS 4
static struct {
    void *addr;
    char path[160];
} g_maps[SEG_MAPS];
static volatile sig_atomic_t g_seg_zeroed;

static int map_file_at(void *base, const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return 0;
    struct stat st;
    void *m = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(struct krex_shm))
        m = mmap(base, sizeof(struct krex_shm), PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0);
    close(fd);
    return m != MAP_FAILED;
}

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
    (void)uc;
    int saved = errno;
    char *a = si->si_addr;
    for (int i = 0; si->si_code > 0 && i < SEG_MAPS; i++) {
        char *base = g_maps[i].addr;
        if (!base || a < base || a >= base + sizeof(struct krex_shm)) continue;
        if (!map_file_at(base, g_maps[i].path)) {
            mmap(base, sizeof(struct krex_shm), PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            g_seg_zeroed = 1;
        }
        errno = saved;
        return;
    }
    signal(sig, SIG_DFL); /* not ours: what SIGBUS would have done */
    if (si->si_code <= 0) raise(sig);
    errno = saved;
}

static void seg_guard(void *m, const char *path) {
    static int installed;
    if (!installed) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_sigbus;
        sa.sa_flags = SA_SIGINFO | SA_RESTART;
        sigfillset(&sa.sa_mask);
        installed = sigaction(SIGBUS, &sa, NULL) == 0;
    }
    for (int i = 0; i < SEG_MAPS; i++)
        if (!g_maps[i].addr) {
            snprintf(g_maps[i].path, sizeof g_maps[i].path, "%s", path);
            g_maps[i].addr = m;
            return;
        }
}

/* After a fault found no file to map: try again (the watch loop, every poll). */
static void seg_remap(void) {
    if (!g_seg_zeroed) return;
    g_seg_zeroed = 0;
    for (int i = 0; i < SEG_MAPS; i++)
        if (g_maps[i].addr && !map_file_at(g_maps[i].addr, g_maps[i].path)) g_seg_zeroed = 1;
}

/* The segment read-only, for krexd's heartbeat and gates (krex_abi.h's layout). */
static const struct krex_shm *seg_map(const char *name) {
    char path[160];
    if (!name || name[0] != '/' || strchr(name + 1, '/') || strlen(name) > 100) return NULL;
    snprintf(path, sizeof path, "/dev/shm%s", name);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return NULL;
    struct stat st;
    void *m = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(struct krex_shm))
        m = mmap(NULL, sizeof(struct krex_shm), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return NULL;
    seg_guard(m, path); /* before the first read: the file may shrink at any time */
    const struct krex_shm *s = m;
    if (s->hdr.magic != KREX_MAGIC || s->hdr.abi_version != KREX_ABI_VERSION) {
        for (int i = 0; i < SEG_MAPS; i++)
            if (g_maps[i].addr == m) g_maps[i].addr = NULL;
        munmap(m, sizeof(struct krex_shm));
        return NULL;
    }
    return s;
}

/* Seconds since krexd's last beat, or -1 when unknown (Segment.heartbeat_age). */
static double heartbeat_age(const struct conn *c) {
    if (!c->seg || __atomic_load_n(&c->seg->hdr.daemon_pid, __ATOMIC_ACQUIRE) != c->daemon_pid) return -1;
    uint64_t hb = __atomic_load_n(&c->seg->hdr.heartbeat_ns, __ATOMIC_ACQUIRE);
    return hb ? (double)(int64_t)(now_ns() - hb) / 1e9 : -1;
}

static char proc_state(pid_t pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *r = strrchr(buf, ')');
    return r && r[1] == ' ' ? r[2] : 0;
}

/* Why krexd will not answer (gone, hung, stopped past the heartbeat timeout), or NULL
 * (client.py Client._stuck). */
static const char *daemon_stuck(struct conn *c, char *why, size_t n) {
    char st = proc_state(c->daemon_pid);
    if (!st || st == 'Z' || st == 'X') {
        snprintf(why, n, "the KREX daemon (pid %d) is gone", (int)c->daemon_pid);
        return why;
    }
    double age = heartbeat_age(c);
    if (st == 'T' || st == 't') {
        if (!c->stopped_since) c->stopped_since = now_ns();
    } else {
        c->stopped_since = 0;
    }
    if (age > KREX_HEARTBEAT_TIMEOUT_NS / 1e9) {
        snprintf(why, n, "the KREX daemon (pid %d) is not responding: no heartbeat for %.1f s", (int)c->daemon_pid, age);
        return why;
    }
    if (c->stopped_since && now_ns() - c->stopped_since > (uint64_t)KREX_HEARTBEAT_TIMEOUT_NS) {
        snprintf(why, n, "the KREX daemon (pid %d) is stopped (state %c)", (int)c->daemon_pid, st);
        return why;
    }
    return NULL;
}

/* Connect and check who serves the socket (client.py _connect, _check_daemon_identity).
 * -1 when Python must handle it (nobody listens, not trusted, timeouts). */
static int daemon_connect(struct conn *c) {
    char path[PATH_MAX];
    int explicit_;
    uid_t dir_uid = (uid_t)-1;
    socket_path(path, sizeof path, &explicit_);
    if (!path[0] || strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) return -1;
    if (!dir_trusted(path, explicit_, &dir_uid)) return -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct timeval tv = {KREX_CONNECT_TIMEOUT_MS / 1000, (KREX_CONNECT_TIMEOUT_MS % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    memcpy(a.sun_path, path, strlen(path) + 1);
    struct ucred cr;
    socklen_t len = sizeof cr;
    if (connect(fd, (struct sockaddr *)&a, sizeof a) || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len)) {
        close(fd);
        return -1;
    }
    if (cr.uid != geteuid() && cr.uid != 0) {
        close(fd); /* another user's daemon: Python refuses it with the reason */
        return -1;
    }
    c->fd = fd;
    c->daemon_pid = cr.pid;
    const char *shm = getenv("KREX_SHM"); /* shm.default_name(), as the Python client */
    if (shm && *shm) snprintf(c->seg_name, sizeof c->seg_name, "%s", shm);
    else snprintf(c->seg_name, sizeof c->seg_name, "/krex-%u", (unsigned)getuid());
    c->seg = seg_map(c->seg_name);
    return 0;
}

static int send_all(int fd, const void *p, size_t n) {
    const char *s = p;
    while (n) {
        ssize_t w = send(fd, s, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        s += w;
        n -= (size_t)w;
    }
    return 0;
}

/* One request: header (op, no fixed body) and its JSON object (krex/protocol.py). */
static int send_request(struct conn *c, enum krex_op op, const struct buf *json) {
    struct krex_msg_hdr h;
    memset(&h, 0, sizeof h);
    h.magic = KREX_WIRE_MAGIC;
    h.op = (uint16_t)op;
    h.json_len = (uint32_t)json->n;
    return send_all(c->fd, &h, sizeof h) || send_all(c->fd, json->p, json->n) ? -1 : 0;
}

/* Read n bytes; waits while krexd beats. `cap_ns`: give up after this long (0: never).
 * 0, or -1 with `why` set. */
static int recv_full(struct conn *c, void *buf, size_t n, uint64_t cap_ns, char *why, size_t why_n) {
    uint64_t t0 = now_ns();
    size_t got = 0;
    while (got < n) {
        struct pollfd pf = {c->fd, POLLIN, 0};
        int r = poll(&pf, 1, (int)(KREX_CLIENT_POLL_NS / 1000000));
        if (r < 0 && errno == EINTR) {
            snprintf(why, why_n, "interrupted");
            return -1;
        }
        if (r == 0) {
            if (daemon_stuck(c, why, why_n)) return -1;
            if (cap_ns && now_ns() - t0 > cap_ns) {
                snprintf(why, why_n, "the KREX daemon (pid %d) did not answer within %d s", (int)c->daemon_pid,
                         KREX_REPLY_TIMEOUT_MS / 1000);
                return -1;
            }
            continue;
        }
        ssize_t k = recv(c->fd, (char *)buf + got, n - got, 0);
        if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (k <= 0) {
            snprintf(why, why_n, "the KREX daemon (pid %d) closed the connection", (int)c->daemon_pid);
            return -1;
        }
        got += (size_t)k;
    }
    return 0;
}

/* The reply to `op`: its JSON object (events go to on_event). Returns 0 (ok reply), 1 (an
 * error reply: `err` holds its object) or -1 (no usable reply: `why`). */
static int recv_reply(struct conn *c, enum krex_op op, uint64_t cap_ns, struct jv **out, char *why, size_t why_n,
                      void (*on_event)(const struct jv *)) {
    /* cap_ns bounds the whole exchange: events must not restart it (a krexd that sends
     * events forever would hold us for ever). 0: no bound (admission may queue). */
    uint64_t end = cap_ns ? now_ns() + cap_ns : 0;
#define KREX_LEFT() (end ? (end > now_ns() ? end - now_ns() : 1) : 0)
    for (;;) {
        struct krex_msg_hdr h;
        if (recv_full(c, &h, sizeof h, KREX_LEFT(), why, why_n)) return -1;
        if (h.magic != KREX_WIRE_MAGIC || h.body_len != 0 || h.json_len > KREX_WIRE_MAX ||
            (h.status != KREX_ST_OK && h.status != KREX_ST_ERROR) ||
            (h.op != op && h.op != KREX_OP_EVENT && h.op != KREX_OP_NONE)) {
            snprintf(why, why_n, "krexd's reply is not a frame of this KREX version (op %u, status %u, %u+%u bytes)",
                     h.op, h.status, h.body_len, h.json_len);
            return -1;
        }
        char *js = malloc((size_t)h.json_len + 1);
        if (!js || recv_full(c, js, h.json_len, KREX_LEFT(), why, why_n)) {
            free(js);
            return -1;
        }
        struct jv *v = h.json_len ? jparse_object(js, h.json_len) : calloc(1, sizeof *v);
        free(js);
        if (!v) {
            snprintf(why, why_n, "krexd's reply is not a JSON object");
            return -1;
        }
        if (!h.json_len) v->t = J_OBJ;
        if (h.op == KREX_OP_EVENT) {
            if (on_event) on_event(v);
            jfree(v);
            continue;
        }
        *out = v;
        return h.status == KREX_ST_OK && h.op == op ? 0 : 1;
    }
#undef KREX_LEFT
}

/* ------------------------------------------------------------------ admission */

static void on_queue_event(const struct jv *ev) {
    static int told;
    const char *text = jstr(ev, "note"); /* optin.queue_note, rendered by krexd */
    if (!told && text) note(text);
    told = 1;
}

/* The admit reply this guardian needs; -1 when it is malformed. */
struct admission {
    int slot, gpu;
    const char *shm, *group, *freezer;
    const struct jv *env_set, *env_prepend, *cpus, *notes;
};

static int read_admission(const struct jv *r, struct admission *a) {
    a->slot = (int)jint(r, "slot", 0, KREX_MAX_SLOTS - 1);
    a->gpu = (int)jint(r, "gpu", 0, KREX_MAX_GPUS - 1);
    a->shm = jstr(r, "shm");
    a->group = jstr(r, "group");
    a->freezer = jstr(r, "freezer");
    a->env_set = jget(r, "env_set");
    a->env_prepend = jget(r, "env_prepend");
    a->cpus = jget(r, "shared_cpus");
    a->notes = jget(r, "notes");
    if (a->slot < 0 || a->gpu < 0 || !a->shm || !a->group || !a->freezer) return -1;
    if (!a->env_set || a->env_set->t != J_OBJ || !a->env_prepend || a->env_prepend->t != J_OBJ) return -1;
    for (struct jv *k = a->env_set->kid; k; k = k->next)
        if (k->t != J_STR || !k->key[0] || strchr(k->key, '=')) return -1;
    for (struct jv *k = a->env_prepend->kid; k; k = k->next) {
        struct jv *v = k->kid; /* [value, separators] */
        if (k->t != J_ARR || !k->key[0] || strchr(k->key, '=') || !v || v->t != J_STR || !v->next ||
            v->next->t != J_STR || v->next->next)
            return -1;
    }
    if (a->cpus && a->cpus->t != J_NULL) {
        if (a->cpus->t != J_ARR) return -1;
        for (struct jv *k = a->cpus->kid; k; k = k->next)
            if (k->t != J_NUM || k->num < 0 || k->num >= CPU_SETSIZE || k->num != (int)k->num) return -1;
    }
    if (a->notes && a->notes->t != J_ARR) return -1;
    return 0;
}

static void print_notes(const struct jv *notes) {
    for (const struct jv *k = notes ? notes->kid : NULL; k; k = k->next)
        if (k->t == J_STR) note(k->s);
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
static char **command_env(const struct admission *a, const char *auto_dir) {
    size_t n = 0;
    while (environ[n]) n++;
    char **envp = calloc(n + 1, sizeof *envp);
    if (!envp) _exit(EXIT_KREX);
    memcpy(envp, environ, n * sizeof *envp);
    envp[n] = NULL;
    env_put(&envp, &n, "LD_PRELOAD", prepend(env_get(envp, n, "LD_PRELOAD"), g_own.shim, ": "));
    for (struct jv *k = a->env_prepend->kid; k; k = k->next) {
        const char *own = !strcmp(k->key, "PYTHONPATH")        ? g_own.hook
                          : !strcmp(k->key, "LD_LIBRARY_PATH") ? g_own.lib
                                                               : NULL;
        if (own) env_put(&envp, &n, k->key, prepend(env_get(envp, n, k->key), own, ":"));
    }
    for (struct jv *k = a->env_set->kid; k; k = k->next)
        if (daemon_env_name(k->key) || (!strcmp(k->key, "KREX_DAEMON_CMD") && daemon_cmd_ok(k->s)))
            env_put(&envp, &n, k->key, k->s);
    /* Processes that use KREX_AUTO_REGION (ours, or set by the command) leave their status here. */
    if (auto_dir) env_put(&envp, &n, "KREX_AUTO_STATUS_DIR", auto_dir);
    /* For tests: proof that this guardian, not the Python one, ran the command. */
    if (getenv("KREX_NATIVE_MARK")) env_put(&envp, &n, "KREX_NATIVE_MARK", "native");
    return envp;
}

/* A fresh private directory (mkdtemp, mode 0700) where launcher._private_tmpdir makes one. */
static char *private_tmpdir(int slot) {
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
static int dir_has_entries(const char *d) {
    DIR *dir = opendir(d);
    int any = 0;
    if (!dir) return 0;
    for (struct dirent *e; !any && (e = readdir(dir));) any = strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(dir);
    return any;
}

/* Empty `dirfd` (closed here) recursively without following links (shutil.rmtree's
 * job in the Python guardian); depth-bounded: a command may nest directories in it. */
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

static void remove_dir(const char *d) {
    empty_dir(open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW), 0);
    rmdir(d);
}

/* Send `sig` to the command: its whole process group, or, sharing ours, the command alone. */
static void signal_command(pid_t pid, int sig) { kill(g_shared_group ? pid : -pid, sig); }

/* ------------------------------------------------------------------ the child */

struct launch {
    char *exe;
    char **argv, **envp;
    const char *group; /* the slot's cgroup directory */
    cpu_set_t cpus;
    int has_cpus;
    int join; /* write our pid into group/cgroup.procs before exec (not cloned into it) */
    int errw; /* the pipe that carries an errno back when exec fails */
};

/* In the child, before exec: as spawn_and_wait's preexec (own process group, the slot's
 * cgroup, the CPU slice), then exec. Only async-signal-safe calls. */
static void child(const struct launch *l) {
    int err;
    if (!g_shared_group) setpgid(0, 0);
    if (g_chld_ign) signal(SIGCHLD, SIG_IGN);
    signal(SIGPIPE, SIG_DFL); /* subprocess's restore_signals */
    signal(SIGXFSZ, SIG_DFL);
    sigprocmask(SIG_SETMASK, &g_oldmask, NULL);
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
static int cgroup_joinable(const char *group) {
    char path[PATH_MAX];
    struct stat st;
    if ((size_t)snprintf(path, sizeof path, "%s/cgroup.procs", group) >= sizeof path) return 0;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, W_OK) == 0;
}

/* Start the command in its slot: cgroup v2 forks straight into it (clone3
 * CLONE_INTO_CGROUP: no cgroup.procs write, which queues 16 starting guardians on a
 * global lock); else fork and the child joins. Returns the pid, or -1 with *err the
 * errno of the failed exec (or join) . */
static pid_t spawn(struct launch *l, const char *freezer, int *err) {
    int p[2];
    if (pipe2(p, O_CLOEXEC)) {
        *err = errno;
        return -1;
    }
    l->errw = p[1];
    pid_t pid = -1;
    if (!strcmp(freezer, "cgroup2")) {
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
    if (pid < 0) { /* ENOSYS, EINVAL, EBUSY, cgroup v1: fork and join */
        l->join = 1;
        pid = fork();
        if (pid == 0) child(l);
    }
    int fork_err = errno;
    close(p[1]);
    if (pid < 0) {
        *err = fork_err;
        close(p[0]);
        return -1;
    }
    if (!g_shared_group) setpgid(pid, pid); /* also here: a signal forwarded at once finds the group */
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

struct lost { /* what the Python finisher needs to journal a region the loss cut */
    int happened, region_cut;
    double region_s, ts;
    const char *why;
};

/* Thaw our own command without krexd (I5; launcher.with_contextlib_thaw for the cgroup
 * freezers, the only ones this guardian runs under). */
static void thaw(const struct admission *a, pid_t pid) {
    char path[PATH_MAX];
    int v2 = !strcmp(a->freezer, "cgroup2");
    snprintf(path, sizeof path, "%s/%s", a->group, v2 ? "cgroup.freeze" : "freezer.state");
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        const char *w = v2 ? "0" : "THAWED";
        if (write(fd, w, strlen(w)) < 0) { /* nothing more to do: SIGCONT below */
        }
        close(fd);
    }
    signal_command(pid, SIGCONT);
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

static int wait_command(const struct admission *a, struct conn *c, pid_t pid, int sfd, struct lost *lo) {
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
                if (si.ssi_signo != SIGCHLD && !(g_shared_group && si.ssi_code == SI_KERNEL))
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
            if (!g_quiet)
                say("krex: krexd (pid %d) stopped beating (%.1f s); your command was thawed and keeps running",
                    (int)c->daemon_pid, age);
        } else if (age >= 0 && age <= KREX_HEARTBEAT_TIMEOUT_NS / 1e9) {
            stale = 0;
        }
    }
}

/* ------------------------------------------------------------------ the run */

/* krexd went away: the notes come from the journal. `python -m krex.proc.finish` journals
 * a region the loss cut, prints the notes and exits with the command's status. */
/* A request answered within the reply timeout: 0 ok, 1 refused (*r says why), -1 no answer. */
/* --report: `body` (krexd's optin.run_report as JSON text, else NULL) with the command's exit
 * status added, or, when KREX failed (err_kind set), the status and the error, as
 * launcher.run_command writes them. 0, or EXIT_KREX after saying why it could not. */
static int write_report(const char *path, const char *body, int status, const char *err_kind, const char *err_msg,
                        const char *err_fix) {
    struct buf b = {0};
    char num[32];
    snprintf(num, sizeof num, "%d", status);
    const char *end = body && body[0] == '{' ? strrchr(body, '}') : NULL;
    size_t keep = end ? (size_t)(end - body) : 0;
    while (keep > 1 && strchr(" \t\r\n", body[keep - 1])) keep--;
    if (keep > 1) { /* a non-empty object: its members, then ours */
        buf_add(&b, body, keep);
        buf_str(&b, ",\n  \"exit_status\": ");
    } else {
        buf_str(&b, "{\n  \"exit_status\": ");
    }
    buf_str(&b, num);
    if (err_kind) {
        buf_str(&b, ",\n  \"krex_error\": {\"kind\": ");
        buf_json_str(&b, err_kind);
        buf_str(&b, ", \"message\": ");
        buf_json_str(&b, err_msg);
        buf_str(&b, ", \"fix\": ");
        buf_json_str(&b, err_fix);
        buf_str(&b, "}");
    }
    buf_str(&b, "\n}\n");
    FILE *f = fopen(path, "w");
    int bad = !f || fwrite(b.p, 1, b.n, f) != b.n;
    if (f && fclose(f)) bad = 1;
    int e = errno;
    free(b.p);
    if (!bad) return 0;
    say("krex: error: cannot write the report %s: %s (the command exited %d)\n  fix: give --report a writable path",
        path, strerror(e), status);
    return EXIT_KREX;
}

static int ask(struct conn *c, enum krex_op op, const struct buf *json, struct jv **r, char *why, size_t n) {
    if (send_request(c, op, json)) return -1;
    return recv_reply(c, op, (uint64_t)KREX_REPLY_TIMEOUT_MS * 1000000ull, r, why, n, NULL);
}

/* Before handing over to the finisher: an empty auto dir goes now (a full one it reads). */
static void drop_empty(const char *auto_dir, int full) {
    if (auto_dir && !full) remove_dir(auto_dir);
}

/* The finisher ends the run (krex/proc/finish.py). `report`: --report's path; `base`: the
 * admission as JSON, for it to make the whole report (krexd sent none: it went away, failed
 * the release or sent no report), or a file holding krexd's report without its regions. */
static void finish_in_python(const struct admission *a, pid_t pid, int status, const struct lost *lo,
                             double t_start, const char *auto_dir, const char *report, const char *base, int quiet) {
    static char v[9][64];
    snprintf(v[0], 64, "%d", a->slot);
    snprintf(v[1], 64, "%d", a->gpu);
    snprintf(v[2], 64, "%.6f", t_start);
    snprintf(v[3], 64, "%d", status);
    snprintf(v[4], 64, "%d", (int)pid);
    snprintf(v[5], 64, "%.6f", lo->region_cut ? lo->region_s : -1.0);
    snprintf(v[6], 64, "%.6f", lo->ts);
    snprintf(v[7], 64, "%d", quiet);
    snprintf(v[8], 64, "%s", lo->why);
    char *args[] = {v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], (char *)(auto_dir ? auto_dir : ""),
                    (char *)(report ? report : ""), (char *)(base ? base : ""), NULL};
    fflush(NULL);
    sigprocmask(SIG_SETMASK, &g_oldmask, NULL);
    exec_python("krex.proc.finish", args);
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

static int run(struct opts *o) {
    char *exe = resolve(o->cmd[0]);
    if (!exe || mentions_cudart(exe)) fallback();
    /* Python keeps an ignored SIGINT ignored (a background job): so do we. */
    struct sigaction old_int, on_int = {.sa_handler = on_sigint_waiting};
    sigemptyset(&on_int.sa_mask);
    int int_set = sigaction(SIGINT, NULL, &old_int) == 0 && old_int.sa_handler != SIG_IGN &&
                  sigaction(SIGINT, &on_int, NULL) == 0;
    struct conn c;
    memset(&c, 0, sizeof c);
    if (!own_install() || daemon_connect(&c)) fallback();

    struct buf req = {0};
    buf_str(&req, "{\"guardian\":\"native\",\"gpu\":");
    buf_str(&req, o->gpu ? o->gpu : "null");
    buf_str(&req, ",\"freeze\":");
    if (o->freeze) buf_json_str(&req, o->freeze);
    else buf_str(&req, "null");
    buf_str(&req, ",\"device\":");
    buf_json_str(&req, o->device ? o->device : "auto");
    if (o->tenant) { /* krexd checks the name (and refuses a bad one with the fix) */
        buf_str(&req, ",\"tenant\":");
        buf_json_str(&req, o->tenant);
    }
    /* krexd keeps it (stripped, as Python's str.strip) for the release's notes and report. */
    const char *av = getenv("KREX_AUTO_REGION");
    if (av && !*av) av = NULL;
    if (av) {
        buf_str(&req, ",\"auto_value\":");
        buf_json_str(&req, av);
    }
    buf_str(&req, "}");
    char why[512] = "";
    struct jv *adm = NULL;
    if (send_request(&c, KREX_OP_ADMIT, &req)) fallback();
    int rc = recv_reply(&c, KREX_OP_ADMIT, 0, &adm, why, sizeof why, on_queue_event);
    /* From here the forwarded signals wait, blocked, for the signalfd (and the command):
     * blocked before the handler goes, so none can kill us in between. */
    sigset_t fwd;
    sigemptyset(&fwd);
    int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCONT, SIGCHLD}; /* launcher.FORWARDED + SIGCHLD */
    for (size_t i = 0; i < sizeof sigs / sizeof *sigs; i++) sigaddset(&fwd, sigs[i]);
    sigprocmask(SIG_BLOCK, &fwd, &g_oldmask);
    if (int_set) sigaction(SIGINT, &old_int, NULL);
    if (rc) { /* refused (nothing claimed) or no answer: Python redoes it and says why */
        close(c.fd);
        fallback_unblocked();
    }
    const struct jv *ack = jget(adm, "auto_value");
    if (av && !(ack && ack->t == J_BOOL && ack->b)) { /* a krexd from before auto_value: */
        struct jv *r = NULL; /* give the slot back (no command has run) and let Python do it */
        ask(&c, KREX_OP_RELEASE, &(struct buf){(char *)"{}", 2, 3}, &r, why, sizeof why);
        jfree(r);
        close(c.fd);
        fallback_unblocked();
    }
    /* Admitted: from here on every way out releases the slot. */
    struct admission a;
    struct buf rel = {0};
    buf_str(&rel, o->keep_leftovers ? "{\"leftovers\":\"keep\"" : "{\"leftovers\":\"kill\"");
    if (read_admission(adm, &a)) {
        send_request(&c, KREX_OP_RELEASE, &(struct buf){(char *)"{}", 2, 3});
        const char *msg = "krexd's admit reply is malformed (a krexd of another version?)",
                   *fix = "restart krexd (`krex daemon stop`; it starts on demand)";
        say("krex: error: %s\n  fix: %s", msg, fix);
        if (o->report) write_report(o->report, NULL, EXIT_KREX, "KrexError", msg, fix);
        return EXIT_KREX;
    }
    /* A slot cgroup this guardian cannot join (not visible here: a container without the
     * host's cgroup tree, an unprivileged benchmark pod; or not writable): krexd must move the
     * command, as it does for the Python guardian's children. Give the slot back (no command
     * has run) and let Python do it, instead of running the command outside its slot. */
    if (strcmp(a.freezer, "signal") && !cgroup_joinable(a.group)) {
        struct jv *r = NULL;
        ask(&c, KREX_OP_RELEASE, &(struct buf){(char *)"{}", 2, 3}, &r, why, sizeof why);
        jfree(r);
        close(c.fd);
        fallback_unblocked();
    }
    print_notes(a.notes);
    /* The finisher's report when krexd cannot send one: the admission as the Python
     * guardian's report has it, and the segment to read the gate counters from. */
    struct buf base = {0};
    {
        const char *dev = jstr(adm, "device");
        const struct jv *w = jget(adm, "admission_wait_s");
        char num[64];
        snprintf(num, sizeof num, "%.6f", w && w->t == J_NUM ? w->num : 0.0);
        int sim = (dev && !strcmp(dev, "sim")) || (o->device && !strcmp(o->device, "sim"));
        buf_str(&base, "{\"admission_wait_s\": ");
        buf_str(&base, num);
        buf_str(&base, ", \"device\": ");
        buf_json_str(&base, dev ? dev : "gpu");
        buf_str(&base, sim ? ", \"simulated\": true, \"shm\": " : ", \"simulated\": false, \"shm\": ");
        buf_json_str(&base, a.shm);
    }
    /* After a failed release the slot's records may be gone or another command's. */
    struct buf base_released = {0};
    buf_str(&base_released, base.p);
    buf_str(&base_released, ", \"released\": true}");
    buf_str(&base, "}");
    if (strcmp(a.shm, c.seg_name)) { /* the admitted segment, as _Guardian watches */
        const struct krex_shm *s = seg_map(a.shm);
        if (s) c.seg = s;
    }

    struct launch l;
    memset(&l, 0, sizeof l);
    l.exe = exe;
    l.argv = o->cmd;
    l.group = a.group;
    CPU_ZERO(&l.cpus);
    for (struct jv *k = a.cpus && a.cpus->t == J_ARR ? a.cpus->kid : NULL; k; k = k->next) {
        CPU_SET((int)k->num, &l.cpus);
        l.has_cpus = 1;
    }
    char *auto_dir = private_tmpdir(a.slot);
    l.envp = command_env(&a, auto_dir);

    /* Signals for the command go through the signalfd from now on (blocked since admission). */
    int sfd = signalfd(-1, &fwd, SFD_CLOEXEC | SFD_NONBLOCK);
    int err = sfd < 0 ? errno : 0;

    struct timespec t0;
    clock_gettime(CLOCK_REALTIME, &t0);
    pid_t pid = sfd < 0 ? -1 : spawn(&l, a.freezer, &err);
    int status;
    struct lost lo = {0};
    if (pid < 0) {
        status = err == ENOENT ? 127 : 126;
    } else {
        struct buf st = {0};
        char num[32];
        snprintf(num, sizeof num, "%d", (int)pid);
        buf_str(&st, "{\"pid\":");
        buf_str(&st, num);
        buf_str(&st, "}");
        struct jv *r = NULL;
        int k = ask(&c, KREX_OP_STARTED, &st, &r, why, sizeof why);
        if (k == 1) snprintf(why, sizeof why, "%s", jstr(r, "error") ? jstr(r, "error") : "refused");
        if (k == -1 && !why[0]) snprintf(why, sizeof why, "the connection to krexd failed (%s)", strerror(errno));
        if (k && !g_quiet) say("krex: warning: krexd did not take the command into its slot: %s", why);
        jfree(r);
        int ws = wait_command(&a, &c, pid, sfd, &lo);
        if (ws == -1) {
            say("krex: error: the command's exit status was lost (another process reaped it)");
            status = EXIT_KREX;
        } else {
            status = WIFSIGNALED(ws) ? 128 + WTERMSIG(ws) : WEXITSTATUS(ws);
        }
    }
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
        finish_in_python(&a, pid, status, &lo, t0.tv_sec + t0.tv_nsec / 1e9, auto_full ? auto_dir : NULL, o->report,
                         base.p, g_quiet);
    }
    if (auto_full) {
        buf_str(&rel, ",\"auto_dir\":");
        buf_json_str(&rel, auto_dir);
    }
    if (o->report) buf_str(&rel, ",\"report\":true");
    buf_str(&rel, "}");
    struct jv *r = NULL;
    struct timespec t_rel;
    clock_gettime(CLOCK_REALTIME, &t_rel);
    int k = ask(&c, KREX_OP_RELEASE, &rel, &r, why, sizeof why);
    if (k != 0 && pid >= 0) { /* no release reply (as the Python guardian): the journal has the rest */
        drop_empty(auto_dir, auto_full);
        lo.happened = 1;
        /* An error reply is krexd's answer, not its loss (the Python guardian notes no event). */
        lo.why = k == 1 ? "" : "krexd did not answer the release";
        lo.ts = t_rel.tv_sec + t_rel.tv_nsec / 1e9;
        finish_in_python(&a, pid, status, &lo, lo.ts, auto_full ? auto_dir : NULL, o->report, base_released.p,
                         g_quiet);
    }
    if (auto_dir) remove_dir(auto_dir); /* krexd has read it (notes, the report's auto_region) */
    if (pid < 0) { /* the exec failed: launcher's CommandNotFound / NotExecutable */
        char msg[PATH_MAX + 300];
        const char *kind = err == ENOENT ? "CommandNotFound" : "NotExecutable",
                   *fix = err == ENOENT ? "check the path" : "run it through its interpreter, or chmod +x it";
        if (err == ENOENT) snprintf(msg, sizeof msg, "command not found: %s", exe);
        else snprintf(msg, sizeof msg, "cannot execute %s: %s", exe, strerror(err));
        say("krex: error: %s\n  fix: %s", msg, fix);
        if (o->report) write_report(o->report, NULL, status, kind, msg, fix);
        return status;
    }
    print_notes(jget(r, "notes"));
    if (o->report) {
        const char *body = jstr(r, "report_json");
        if (!body) { /* krexd released the slot but sent no report (no record of it left): the finisher makes it */
            lo.why = "";
            lo.ts = t_rel.tv_sec + t_rel.tv_nsec / 1e9;
            finish_in_python(&a, pid, status, &lo, t0.tv_sec + t0.tv_nsec / 1e9, NULL, o->report, base_released.p, 1);
        }
        int w = write_report(o->report, body, status, NULL, NULL, NULL);
        if (w) return w;
    }
    return status;
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
    struct opts o;
    /* KREX_NATIVE_OFF: the Python guardian throughout (tests compare the two). */
    const char *off = getenv("KREX_NATIVE_OFF");
    if ((off && *off && strcmp(off, "0")) || !parse(argv, &o) || env_needs_python()) fallback();
    return run(&o);
}
