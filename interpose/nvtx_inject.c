/* libkrex_nvtx.so: KREX regions from NVTX ranges, for harnesses that cannot be changed.
 *
 * NVTX v3 (header-only: the NVTX of CUDA 12 and 13) loads the library named by
 * NVTX_INJECTION64_PATH at a process's first NVTX call and calls its
 * InitializeInjectionNvtx2(getExportTable). This one then takes the range slots of the
 * process's NVTX function tables: push/pop and start/end, ASCII, wide and registered
 * strings, the global domain and every other one. A range whose name matches
 * KREX_NVTX_REGION (a comma-separated list of globs, fnmatch(3), the whole name) is a
 * KREX region for as long as it is open, through the shim's region client: the same calls
 * as the C macros of krex.h (nested ranges nest, each thread has its own, a range that
 * starts on one thread and ends on another is handed over: krex_region_handover), labelled
 * "nvtx:NAME". Ranges that do not match, marks and names are left alone.
 *
 * Another tool (Nsight Systems sets NVTX_INJECTION64_PATH to its own library): the shim
 * moves that path to KREX_NVTX_NEXT when it puts this library in its place
 * (nvtx_env.c). This library initialises that tool first, with the process's own export
 * table, then takes the slots the tool filled and calls the tool's function from its own,
 * so both see every range, and handles and range ids are the tool's.
 *
 * It never prints unless KREX_LOG is set, never exits, and links nothing but libc: the
 * region calls are found in the shim at init (dlsym), and without the shim every range
 * passes through with no region. The NVTX ABI it relies on is declared below (the
 * layouts of NVTX v3's nvtxTypes.h and nvToolsExt.h); tests/c/nvtx_ranges.cpp checks it
 * against the real headers. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fnmatch.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <wchar.h>

#define EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------ the NVTX ABI */
typedef uint64_t nvtx_range_id;
typedef void *nvtx_domain;
typedef void *nvtx_string;
typedef void (*nvtx_fn)(void);
typedef const void *(*get_export_table_fn)(uint32_t id);

struct nvtx_attrs { /* nvtxEventAttributes_v2 */
    uint16_t version;
    uint16_t size;
    uint32_t category;
    int32_t color_type;
    uint32_t color;
    int32_t payload_type;
    int32_t reserved0;
    uint64_t payload;
    int32_t message_type; /* 1 ASCII, 2 wide, 3 registered */
    union {
        const char *ascii;
        const wchar_t *wide;
        nvtx_string registered;
    } message;
};
_Static_assert(offsetof(struct nvtx_attrs, message_type) == 32, "nvtxEventAttributes_v2 layout");
_Static_assert(offsetof(struct nvtx_attrs, message) == 40, "nvtxEventAttributes_v2 layout");

struct nvtx_callbacks { /* NvtxExportTableCallbacks */
    size_t struct_size;
    int (*get_module_function_table)(int module, nvtx_fn ***out_table, unsigned int *out_size);
};
struct nvtx_version_info { /* NvtxExportTableVersionInfo */
    size_t struct_size;
    uint32_t version;
    uint32_t reserved0;
    void (*set_injection_version)(uint32_t version);
};

enum { ETID_CALLBACKS = 1, ETID_VERSIONINFO = 3 };
enum { MODULE_CORE = 1, MODULE_CORE2 = 5 };
enum { /* NvtxCallbackIdCore */
    CORE_RANGE_START_EX = 4, CORE_RANGE_START_A = 5, CORE_RANGE_START_W = 6, CORE_RANGE_END = 7,
    CORE_RANGE_PUSH_EX = 8, CORE_RANGE_PUSH_A = 9, CORE_RANGE_PUSH_W = 10, CORE_RANGE_POP = 11,
};
enum { /* NvtxCallbackIdCore2 */
    CORE2_RANGE_START_EX = 2, CORE2_RANGE_END = 3, CORE2_RANGE_PUSH_EX = 4, CORE2_RANGE_POP = 5,
    CORE2_REGISTER_STRING_A = 10, CORE2_REGISTER_STRING_W = 11, CORE2_DOMAIN_CREATE_A = 12,
    CORE2_DOMAIN_CREATE_W = 13,
};
#define NVTX_INJECTION_VERSION 3

/* ------------------------------------------------------------------ logging, patterns */
static int g_log;
static void nlog(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void nlog(const char *fmt, ...) {
    if (!g_log) return;
    char buf[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "krex-nvtx[%d]: %s\n", (int)getpid(), buf);
}

#define MAX_PATTERNS 32
static char *g_patterns[MAX_PATTERNS];
static int g_npatterns;

static void parse_patterns(const char *value) {
    char *copy = strdup(value), *save = NULL;
    for (char *p = copy ? strtok_r(copy, ",", &save) : NULL; p && g_npatterns < MAX_PATTERNS;
         p = strtok_r(NULL, ",", &save)) {
        while (*p == ' ') p++;
        size_t n = strlen(p);
        while (n && p[n - 1] == ' ') p[--n] = 0;
        if (n) g_patterns[g_npatterns++] = strdup(p);
    }
    free(copy);
}

static int matches(const char *name) {
    if (!name) return 0;
    for (int i = 0; i < g_npatterns; i++)
        if (fnmatch(g_patterns[i], name, 0) == 0) return 1;
    return 0;
}

/* A wide name as UTF-8 (wchar_t is UTF-32 on Linux), truncated to fit. */
static const char *utf8(const wchar_t *w, char *buf, size_t n) {
    size_t o = 0;
    for (; w && *w && o + 5 < n; w++) {
        uint32_t c = (uint32_t)*w;
        if (c < 0x80) buf[o++] = (char)c;
        else if (c < 0x800) buf[o++] = (char)(0xc0 | c >> 6), buf[o++] = (char)(0x80 | (c & 0x3f));
        else if (c < 0x10000)
            buf[o++] = (char)(0xe0 | c >> 12), buf[o++] = (char)(0x80 | ((c >> 6) & 0x3f)),
            buf[o++] = (char)(0x80 | (c & 0x3f));
        else
            buf[o++] = (char)(0xf0 | c >> 18), buf[o++] = (char)(0x80 | ((c >> 12) & 0x3f)),
            buf[o++] = (char)(0x80 | ((c >> 6) & 0x3f)), buf[o++] = (char)(0x80 | (c & 0x3f));
    }
    buf[o] = 0;
    return buf;
}

/* ------------------------------------------------------------------ registered strings, domains */
struct handle_rec {
    void *handle; /* the next tool's handle, or this record itself */
    char *name;   /* a registered string's text (UTF-8); NULL for a domain */
    struct handle_rec *next;
};
static struct handle_rec *g_handles;
static pthread_mutex_t g_handles_lock = PTHREAD_MUTEX_INITIALIZER;

static void *remember(void *theirs, const char *name) {
    struct handle_rec *r = calloc(1, sizeof *r);
    if (!r) return theirs;
    r->handle = theirs ? theirs : (void *)r;
    r->name = name ? strdup(name) : NULL;
    pthread_mutex_lock(&g_handles_lock);
    r->next = g_handles;
    g_handles = r;
    pthread_mutex_unlock(&g_handles_lock);
    return r->handle;
}

static const char *registered_name(nvtx_string h) {
    const char *out = NULL;
    pthread_mutex_lock(&g_handles_lock);
    for (struct handle_rec *r = g_handles; r && !out; r = r->next)
        if (r->handle == h) out = r->name;
    pthread_mutex_unlock(&g_handles_lock);
    return out; /* never freed: registered strings live as long as the process */
}

static const char *attrs_name(const struct nvtx_attrs *a, char *buf, size_t n) {
    if (!a || a->size < offsetof(struct nvtx_attrs, message) + sizeof a->message) return NULL;
    switch (a->message_type) {
    case 1: return a->message.ascii;
    case 2: return utf8(a->message.wide, buf, n);
    case 3: return registered_name(a->message.registered);
    default: return NULL;
    }
}

/* ------------------------------------------------------------------ the shim's region client */
static int (*g_begin)(const char *label);
static int (*g_end)(void);
static int (*g_handover)(void);
static int (*g_end_handed)(int fd);

static void region_begin(const char *name) {
    char label[220];
    snprintf(label, sizeof label, "nvtx:%s", name);
    int rc = g_begin ? g_begin(label) : 0;
    if (rc) nlog("region for range \"%s\": begin returned %d (the range is not exclusive)", name, rc);
}

static void region_end(void) {
    int rc = g_end ? g_end() : 0;
    if (rc) nlog("region end returned %d (see the region's flags)", rc);
}

/* Push/pop ranges: a stack per thread and domain, with whether each level is a region. */
#define MAX_DOMAINS 8
#define MAX_DEPTH 256
struct stack {
    nvtx_domain domain;
    int used;
    int depth;
    uint64_t matched[MAX_DEPTH / 64];
};
static __thread struct stack t_stacks[MAX_DOMAINS];

static struct stack *stack_of(nvtx_domain d) {
    for (int i = 0; i < MAX_DOMAINS; i++)
        if (t_stacks[i].used && t_stacks[i].domain == d) return &t_stacks[i];
    for (int i = 0; i < MAX_DOMAINS; i++)
        if (!t_stacks[i].used) {
            t_stacks[i].used = 1;
            t_stacks[i].domain = d;
            return &t_stacks[i];
        }
    nlog("more than %d NVTX domains on one thread: their ranges are never regions", MAX_DOMAINS);
    return NULL;
}

static int push(nvtx_domain d, const char *name) {
    struct stack *s = stack_of(d);
    if (!s) return -1;
    int level = s->depth++;
    if (level < MAX_DEPTH) {
        uint64_t bit = 1ull << (level % 64);
        if (matches(name)) {
            s->matched[level / 64] |= bit;
            region_begin(name);
        } else {
            s->matched[level / 64] &= ~bit;
        }
    }
    return level;
}

static int pop(nvtx_domain d) {
    struct stack *s = stack_of(d);
    if (!s || s->depth <= 0) return -1; /* more pops than pushes: nothing of ours to end */
    int level = --s->depth;
    if (level < MAX_DEPTH && (s->matched[level / 64] >> (level % 64) & 1)) region_end();
    return level;
}

/* Start/end ranges: the open ones that are regions, by range id. */
#define MAX_OPEN 64
static struct {
    nvtx_range_id id; /* 0: free */
    int fd;           /* the handed-over region; -1: nested in another, nothing to end */
} g_open[MAX_OPEN];
static pthread_mutex_t g_open_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_next_id = 1;

static void start(nvtx_range_id id, const char *name) {
    if (!matches(name)) return;
    region_begin(name);
    int fd = g_handover ? g_handover() : -EINVAL;
    if (fd == -EBUSY) { /* nested in a region of this thread: undo the nesting level */
        region_end();
        fd = -1;
    } else if (fd < 0) {
        fd = -1;
    }
    pthread_mutex_lock(&g_open_lock);
    int put = 0;
    for (int i = 0; i < MAX_OPEN && !put; i++)
        if (g_open[i].id == 0) g_open[i].id = id, g_open[i].fd = fd, put = 1;
    pthread_mutex_unlock(&g_open_lock);
    if (!put) {
        nlog("more than %d matching start/end ranges open: range \"%s\" ends its region now", MAX_OPEN, name);
        if (fd >= 0 && g_end_handed) g_end_handed(fd);
    }
}

static void end(nvtx_range_id id) {
    int fd = -2;
    pthread_mutex_lock(&g_open_lock);
    for (int i = 0; i < MAX_OPEN && fd == -2; i++)
        if (g_open[i].id == id && id != 0) fd = g_open[i].fd, g_open[i].id = 0;
    pthread_mutex_unlock(&g_open_lock);
    if (fd >= 0 && g_end_handed) {
        int rc = g_end_handed(fd);
        if (rc) nlog("region end returned %d (see the region's flags)", rc);
    }
}

/* ------------------------------------------------------------------ the hooked slots */
/* The next tool's functions, by module and callback id (NULL: none, or it left the slot). */
static nvtx_fn g_next_core[16], g_next_core2[16];
#define NEXT(table, id, type) ((type)g_next_##table[id])

static nvtx_range_id new_id(void) { return __atomic_fetch_add(&g_next_id, 1, __ATOMIC_RELAXED); }

typedef nvtx_range_id (*start_ex_fn)(const struct nvtx_attrs *);
typedef nvtx_range_id (*start_a_fn)(const char *);
typedef nvtx_range_id (*start_w_fn)(const wchar_t *);
typedef void (*end_fn)(nvtx_range_id);
typedef int (*push_ex_fn)(const struct nvtx_attrs *);
typedef int (*push_a_fn)(const char *);
typedef int (*push_w_fn)(const wchar_t *);
typedef int (*pop_fn)(void);
typedef nvtx_range_id (*d_start_fn)(nvtx_domain, const struct nvtx_attrs *);
typedef void (*d_end_fn)(nvtx_domain, nvtx_range_id);
typedef int (*d_push_fn)(nvtx_domain, const struct nvtx_attrs *);
typedef int (*d_pop_fn)(nvtx_domain);
typedef nvtx_string (*reg_a_fn)(nvtx_domain, const char *);
typedef nvtx_string (*reg_w_fn)(nvtx_domain, const wchar_t *);
typedef nvtx_domain (*create_a_fn)(const char *);
typedef nvtx_domain (*create_w_fn)(const wchar_t *);

/* Push: the region first (it encloses the other tool's range); pop: the region last. */
static int k_push_ex(const struct nvtx_attrs *a) {
    char buf[512];
    int level = push(NULL, attrs_name(a, buf, sizeof buf));
    push_ex_fn n = NEXT(core, CORE_RANGE_PUSH_EX, push_ex_fn);
    return n ? n(a) : level;
}
static int k_push_a(const char *m) {
    int level = push(NULL, m);
    push_a_fn n = NEXT(core, CORE_RANGE_PUSH_A, push_a_fn);
    return n ? n(m) : level;
}
static int k_push_w(const wchar_t *m) {
    char buf[512];
    int level = push(NULL, utf8(m, buf, sizeof buf));
    push_w_fn n = NEXT(core, CORE_RANGE_PUSH_W, push_w_fn);
    return n ? n(m) : level;
}
static int k_pop(void) {
    pop_fn n = NEXT(core, CORE_RANGE_POP, pop_fn);
    int theirs = n ? n() : 0;
    int level = pop(NULL);
    return n ? theirs : level;
}
static nvtx_range_id k_start_ex(const struct nvtx_attrs *a) {
    char buf[512];
    start_ex_fn n = NEXT(core, CORE_RANGE_START_EX, start_ex_fn);
    nvtx_range_id id = n ? n(a) : new_id();
    start(id, attrs_name(a, buf, sizeof buf));
    return id;
}
static nvtx_range_id k_start_a(const char *m) {
    start_a_fn n = NEXT(core, CORE_RANGE_START_A, start_a_fn);
    nvtx_range_id id = n ? n(m) : new_id();
    start(id, m);
    return id;
}
static nvtx_range_id k_start_w(const wchar_t *m) {
    char buf[512];
    start_w_fn n = NEXT(core, CORE_RANGE_START_W, start_w_fn);
    nvtx_range_id id = n ? n(m) : new_id();
    start(id, utf8(m, buf, sizeof buf));
    return id;
}
static void k_end(nvtx_range_id id) {
    end_fn n = NEXT(core, CORE_RANGE_END, end_fn);
    if (n) n(id);
    end(id);
}
static nvtx_range_id k_d_start(nvtx_domain d, const struct nvtx_attrs *a) {
    char buf[512];
    d_start_fn n = NEXT(core2, CORE2_RANGE_START_EX, d_start_fn);
    nvtx_range_id id = n ? n(d, a) : new_id();
    start(id, attrs_name(a, buf, sizeof buf));
    return id;
}
static void k_d_end(nvtx_domain d, nvtx_range_id id) {
    d_end_fn n = NEXT(core2, CORE2_RANGE_END, d_end_fn);
    if (n) n(d, id);
    end(id);
}
static int k_d_push(nvtx_domain d, const struct nvtx_attrs *a) {
    char buf[512];
    int level = push(d, attrs_name(a, buf, sizeof buf));
    d_push_fn n = NEXT(core2, CORE2_RANGE_PUSH_EX, d_push_fn);
    return n ? n(d, a) : level;
}
static int k_d_pop(nvtx_domain d) {
    d_pop_fn n = NEXT(core2, CORE2_RANGE_POP, d_pop_fn);
    int theirs = n ? n(d) : 0;
    int level = pop(d);
    return n ? theirs : level;
}
static nvtx_string k_reg_a(nvtx_domain d, const char *s) {
    reg_a_fn n = NEXT(core2, CORE2_REGISTER_STRING_A, reg_a_fn);
    return remember(n ? n(d, s) : NULL, s ? s : "");
}
static nvtx_string k_reg_w(nvtx_domain d, const wchar_t *s) {
    char buf[512];
    reg_w_fn n = NEXT(core2, CORE2_REGISTER_STRING_W, reg_w_fn);
    return remember(n ? n(d, s) : NULL, utf8(s, buf, sizeof buf));
}
/* Domains get handles of their own (the next tool's, else a record): each domain has its
 * own push/pop stacks, as NVTX defines them. */
static nvtx_domain k_create_a(const char *name) {
    create_a_fn n = NEXT(core2, CORE2_DOMAIN_CREATE_A, create_a_fn);
    return remember(n ? n(name) : NULL, NULL);
}
static nvtx_domain k_create_w(const wchar_t *name) {
    create_w_fn n = NEXT(core2, CORE2_DOMAIN_CREATE_W, create_w_fn);
    return remember(n ? n(name) : NULL, NULL);
}

struct hook {
    int module, id;
    nvtx_fn fn;
};
static const struct hook HOOKS[] = {
    {MODULE_CORE, CORE_RANGE_START_EX, (nvtx_fn)k_start_ex},
    {MODULE_CORE, CORE_RANGE_START_A, (nvtx_fn)k_start_a},
    {MODULE_CORE, CORE_RANGE_START_W, (nvtx_fn)k_start_w},
    {MODULE_CORE, CORE_RANGE_END, (nvtx_fn)k_end},
    {MODULE_CORE, CORE_RANGE_PUSH_EX, (nvtx_fn)k_push_ex},
    {MODULE_CORE, CORE_RANGE_PUSH_A, (nvtx_fn)k_push_a},
    {MODULE_CORE, CORE_RANGE_PUSH_W, (nvtx_fn)k_push_w},
    {MODULE_CORE, CORE_RANGE_POP, (nvtx_fn)k_pop},
    {MODULE_CORE2, CORE2_RANGE_START_EX, (nvtx_fn)k_d_start},
    {MODULE_CORE2, CORE2_RANGE_END, (nvtx_fn)k_d_end},
    {MODULE_CORE2, CORE2_RANGE_PUSH_EX, (nvtx_fn)k_d_push},
    {MODULE_CORE2, CORE2_RANGE_POP, (nvtx_fn)k_d_pop},
    {MODULE_CORE2, CORE2_REGISTER_STRING_A, (nvtx_fn)k_reg_a},
    {MODULE_CORE2, CORE2_REGISTER_STRING_W, (nvtx_fn)k_reg_w},
    {MODULE_CORE2, CORE2_DOMAIN_CREATE_A, (nvtx_fn)k_create_a},
    {MODULE_CORE2, CORE2_DOMAIN_CREATE_W, (nvtx_fn)k_create_w},
};
#define N_HOOKS (int)(sizeof HOOKS / sizeof HOOKS[0])

/* The slot a hook takes, or NULL when this NVTX has no such slot. */
static nvtx_fn *slot_of(const struct nvtx_callbacks *cb, int module, int id) {
    nvtx_fn **table = NULL;
    unsigned int size = 0;
    if (!cb->get_module_function_table(module, &table, &size) || !table || (unsigned)id >= size) return NULL;
    return table[id];
}

/* Initialise the tool named by KREX_NVTX_NEXT (Nsight's, typically) on this process's
 * NVTX instance. 1: it took its slots; 0: none, or it failed (then ours alone). */
static int init_next(get_export_table_fn get) {
    const char *path = getenv("KREX_NVTX_NEXT");
    if (!path || !*path) return 0;
    void *h = dlopen(path, RTLD_LAZY);
    int (*init)(get_export_table_fn) = h ? (int (*)(get_export_table_fn))dlsym(h, "InitializeInjectionNvtx2") : NULL;
    if (!init) {
        nlog("KREX_NVTX_NEXT=%s: cannot load it or it has no InitializeInjectionNvtx2 (%s); NVTX goes to KREX "
             "alone",
             path, h ? "no symbol" : dlerror());
        if (h) dlclose(h);
        return 0;
    }
    if (!init(get)) {
        nlog("KREX_NVTX_NEXT=%s: its initialisation failed; NVTX goes to KREX alone", path);
        return 0;
    }
    nlog("chained to the NVTX tool %s", path);
    return 1;
}

EXPORT int InitializeInjectionNvtx2(get_export_table_fn get) {
    const char *lg = getenv("KREX_LOG");
    g_log = lg && *lg && strcmp(lg, "0") != 0;
    const struct nvtx_callbacks *cb = get ? (const struct nvtx_callbacks *)get(ETID_CALLBACKS) : NULL;
    if (!cb || cb->struct_size < sizeof *cb || !cb->get_module_function_table) {
        nlog("this NVTX has no callbacks export table; no regions from NVTX ranges");
        return 0;
    }
    const char *pat = getenv("KREX_NVTX_REGION");
    if (pat) parse_patterns(pat);
    if (!g_npatterns) { /* nothing to match: step aside for the next tool, if any */
        nlog("KREX_NVTX_REGION is empty: no ranges become regions");
        return init_next(get);
    }
    g_begin = (int (*)(const char *))dlsym(RTLD_DEFAULT, "krex_region_begin_label");
    g_end = (int (*)(void))dlsym(RTLD_DEFAULT, "krex_region_end");
    g_handover = (int (*)(void))dlsym(RTLD_DEFAULT, "krex_region_handover");
    g_end_handed = (int (*)(int))dlsym(RTLD_DEFAULT, "krex_region_end_handed");
    if (!g_begin || !g_end || !g_handover || !g_end_handed) {
        nlog("the KREX shim is not loaded in this process: NVTX ranges pass through with no region");
        g_begin = NULL, g_end = NULL, g_handover = NULL, g_end_handed = NULL;
    }
    nvtx_fn *slots[N_HOOKS];
    nvtx_fn before[N_HOOKS];
    for (int i = 0; i < N_HOOKS; i++) {
        slots[i] = slot_of(cb, HOOKS[i].module, HOOKS[i].id);
        before[i] = slots[i] ? *slots[i] : NULL;
    }
    if (init_next(get)) {
        /* A slot the tool changed is its function; one it left still holds NVTX's own
         * initialiser, which must never be called from here. */
        for (int i = 0; i < N_HOOKS; i++) {
            if (!slots[i] || *slots[i] == before[i]) continue;
            nvtx_fn *next = HOOKS[i].module == MODULE_CORE ? g_next_core : g_next_core2;
            next[HOOKS[i].id] = *slots[i];
        }
    }
    for (int i = 0; i < N_HOOKS; i++)
        if (slots[i]) *slots[i] = HOOKS[i].fn;
    const struct nvtx_version_info *vi = (const struct nvtx_version_info *)get(ETID_VERSIONINFO);
    if (vi && vi->struct_size >= sizeof *vi && vi->set_injection_version)
        vi->set_injection_version(NVTX_INJECTION_VERSION);
    nlog("NVTX ranges matching \"%s\" are KREX regions", pat);
    return 1;
}
