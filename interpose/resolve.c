/* Finding the real entry points behind our wrappers, and the dlsym we export.
 * glibc's own dlsym is found without calling dlsym (ours): by symbol version, else
 * from libc's dynamic symbol table. Everything here may run before our
 * constructor, or inside a sanitizer runtime's start-up. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <elf.h>
#include <link.h>
#include <pthread.h>
#include <string.h>

#include "shim.h"

static pthread_mutex_t g_dl_lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;

int krex_dl_iterate(int (*cb)(struct dl_phdr_info *, size_t, void *), void *data) {
    pthread_mutex_lock(&g_dl_lock);
    int r = dl_iterate_phdr(cb, data);
    pthread_mutex_unlock(&g_dl_lock);
    return r;
}

void krex_dl_fork_prepare(void) { pthread_mutex_lock(&g_dl_lock); }
void krex_dl_fork_parent(void) { pthread_mutex_unlock(&g_dl_lock); }
/* A recursive mutex names its owner by thread id, which the child's thread does not share. */
void krex_dl_fork_child(void) {
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&g_dl_lock, &a);
    pthread_mutexattr_destroy(&a);
}

void *krex_real[KREX_N_IDS][KREX_NSLOT];
uint32_t krex_real_gen; /* atomic: bumped as a real pointer is stored (vendor_sym's fallback reads them) */

typedef void *(*dlsym_fn)(void *, const char *);
typedef void *(*dlvsym_fn)(void *, const char *, const char *);
static dlsym_fn g_real_dlsym;   /* atomic */
static dlvsym_fn g_real_dlvsym; /* atomic */
/* Our own dlsym and dlvsym, by hidden names: a reference to "dlsym" could bind to libc's. */
extern void *krex_self_dlsym(void *, const char *) __attribute__((visibility("hidden")));
extern void *krex_self_dlvsym(void *, const char *, const char *) __attribute__((visibility("hidden")));
static dlvsym_fn real_dlvsym_fn(void);

/* glibc's dlsym by version: 2.34 moved it into libc; before that its base version
 * is the architecture's first glibc (2.2.5 x86_64, 2.17 aarch64, 2.0 i386, 2.3
 * ppc64, 2.4 arm, 2.27 riscv64, 2.36 loongarch64). Through glibc's own dlvsym: a call
 * of "dlvsym" from here would reach ours. */
KREX_NO_SANITIZE static void *libc_by_version(const char *name) {
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0",
                                           "GLIBC_2.3",  "GLIBC_2.4",   "GLIBC_2.27", "GLIBC_2.36",
                                           "GLIBC_2.1",  "GLIBC_2.29",  "GLIBC_2.35", NULL};
    dlvsym_fn v = real_dlvsym_fn();
    if (!v) return NULL;
    for (int i = 0; versions[i]; i++) {
        void *p = v(RTLD_NEXT, name, versions[i]);
        if (p && p != (void *)krex_self_dlsym && p != (void *)krex_self_dlvsym) return p;
    }
    return NULL;
}

KREX_NO_SANITIZE static void *dlsym_by_version(void) { return libc_by_version("dlsym"); }

/* glibc's own dlopen/dlclose for the RTLD_NEXT search below: a sanitizer runtime
 * intercepts them and may call our dlsym before its interceptors work. */
typedef void *(*dlopen_fn)(const char *, int);
typedef int (*dlclose_fn)(void *);
static dlopen_fn g_real_dlopen;
static dlclose_fn g_real_dlclose;

KREX_NO_SANITIZE static void real_dl_init(void) {
    if (__atomic_load_n(&g_real_dlclose, __ATOMIC_ACQUIRE)) return;
    dlopen_fn o = (dlopen_fn)libc_by_version("dlopen");
    dlclose_fn c = (dlclose_fn)libc_by_version("dlclose");
    __atomic_store_n(&g_real_dlopen, o ? o : dlopen, __ATOMIC_RELEASE);
    __atomic_store_n(&g_real_dlclose, c ? c : dlclose, __ATOMIC_RELEASE);
}

/* The fallback when no version above matches (a new architecture, another base):
 * read the default-versioned "dlsym" straight from libc's (or libdl's) dynamic
 * symbol table, through its GNU or SysV hash table. */
struct elf_find {
    const char *name;
    void *addr;
};

KREX_NO_SANITIZE static uint32_t elf_gnu_hash(const char *s) {
    uint32_t h = 5381;
    for (; *s; s++) h = h * 33 + (unsigned char)*s;
    return h;
}

/* String tests of our own: this runs inside a sanitizer runtime's start-up too, whose
 * strcmp/strstr interceptors do not work yet. */
KREX_NO_SANITIZE static int prefix_at(const char *s, const char *p) {
    while (*p && *s == *p) s++, p++;
    return *p == 0;
}

KREX_NO_SANITIZE static int same_str(const char *a, const char *b) {
    while (*a && *a == *b) a++, b++;
    return *a == *b;
}

KREX_NO_SANITIZE static int is_libc(const char *n) {
    if (!n) return 0;
    if (prefix_at(n, "libc.so")) return 1;
    for (; *n; n++)
        if (prefix_at(n, "/libc.so") || prefix_at(n, "/libdl.so")) return 1;
    return 0;
}

/* The default-versioned f->name in the object loaded at `base` with dynamic section `dyn`. */
KREX_NO_SANITIZE static int elf_find_in(ElfW(Addr) base, const ElfW(Dyn) *dyn, struct elf_find *f);

KREX_NO_SANITIZE static int elf_find_cb(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct elf_find *f = data;
    if (!is_libc(info->dlpi_name)) return 0;
    const ElfW(Dyn) *dyn = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    return dyn ? elf_find_in(info->dlpi_addr, dyn, f) : 0;
}

/* The same through the loader's list of objects (_r_debug), which no sanitizer intercepts:
 * our dlvsym answers a sanitizer runtime's own start-up lookups, before its dl_iterate_phdr
 * interceptor works. */
KREX_NO_SANITIZE static void elf_find_rdebug(struct elf_find *f) {
    for (struct link_map *l = _r_debug.r_map; l; l = l->l_next)
        if (is_libc(l->l_name) && l->l_ld && elf_find_in(l->l_addr, l->l_ld, f)) return;
}

KREX_NO_SANITIZE static int elf_find_in(ElfW(Addr) base, const ElfW(Dyn) *dyn, struct elf_find *f) {
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const uint32_t *gnu = NULL, *sysv = NULL;
    const ElfW(Half) *versym = NULL;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        /* Most ports relocate these to addresses; a few (RISC-V, MIPS) keep offsets. */
        ElfW(Addr) v = dyn->d_un.d_ptr;
        if (v < base) v += base;
        switch (dyn->d_tag) {
        case DT_SYMTAB: symtab = (const ElfW(Sym) *)v; break;
        case DT_STRTAB: strtab = (const char *)v; break;
        case DT_GNU_HASH: gnu = (const uint32_t *)v; break;
        case DT_HASH: sysv = (const uint32_t *)v; break;
        case DT_VERSYM: versym = (const ElfW(Half) *)v; break;
        default: break;
        }
    }
    if (!symtab || !strtab) return 0;
#define ELF_MATCH(i)                                                                             \
    (symtab[i].st_shndx != SHN_UNDEF && same_str(strtab + symtab[i].st_name, f->name) &&         \
     (!versym || !(versym[i] & 0x8000)))
    if (gnu) {
        uint32_t nb = gnu[0], off = gnu[1], bloom = gnu[2];
        const uint32_t *buckets = (const uint32_t *)((const ElfW(Addr) *)&gnu[4] + bloom);
        const uint32_t *chain = buckets + nb;
        uint32_t h = elf_gnu_hash(f->name);
        for (uint32_t i = nb ? buckets[h % nb] : 0; i >= off && i != 0; i++) {
            uint32_t h2 = chain[i - off];
            if ((h | 1) == (h2 | 1) && ELF_MATCH(i)) {
                f->addr = (void *)(base + symtab[i].st_value);
                return 1;
            }
            if (h2 & 1) break;
        }
    } else if (sysv) {
        for (uint32_t i = 0; i < sysv[1]; i++)
            if (ELF_MATCH(i)) {
                f->addr = (void *)(base + symtab[i].st_value);
                return 1;
            }
    }
#undef ELF_MATCH
    return 0;
}

KREX_NO_SANITIZE static void *dlsym_from_elf(void) {
    struct elf_find f = {"dlsym", NULL};
    krex_dl_iterate(elf_find_cb, &f);
    return f.addr != (void *)krex_self_dlsym ? f.addr : NULL;
}

/* glibc's own dlvsym: the default-versioned "dlvsym" of libc's (or libdl's) dynamic symbol
 * table (ours, exported, would answer any call of it by name). */
KREX_NO_SANITIZE static dlvsym_fn real_dlvsym_fn(void) {
    dlvsym_fn fn = __atomic_load_n(&g_real_dlvsym, ACQUIRE);
    if (UNLIKELY(!fn)) {
        struct elf_find f = {"dlvsym", NULL};
        elf_find_rdebug(&f);
        if (!f.addr || f.addr == (void *)krex_self_dlvsym) return NULL;
        fn = (dlvsym_fn)f.addr;
        __atomic_store_n(&g_real_dlvsym, fn, RELEASE);
    }
    return fn;
}

KREX_NO_SANITIZE static dlsym_fn find_real_dlsym(void) {
    void *p = dlsym_by_version();
    if (!p) p = dlsym_from_elf();
    return (dlsym_fn)p;
}

KREX_NO_SANITIZE static void *real_dlsym(void *h, const char *name) {
    dlsym_fn fn = __atomic_load_n(&g_real_dlsym, ACQUIRE);
    if (UNLIKELY(!fn)) {
        fn = find_real_dlsym();
        if (!fn) return NULL;
        __atomic_store_n(&g_real_dlsym, fn, RELEASE);
    }
    return fn(h, name);
}

/* The next definition of `name` after the shim (libc's, for the symbols it wraps). */
void *krex_next_sym(const char *name) { return real_dlsym(RTLD_NEXT, name); }

/* For tests: the real dlsym as each method finds it (0 by version, 1 from the ELF). */
KREX_EXPORT void *krex_shim_dlsym_probe(int method) { return method ? dlsym_from_elf() : dlsym_by_version(); }

static const char *const krex_sonames[KREX_N_APIS][4] = {
    {"libcudart.so.13", "libcudart.so.12", "libcudart.so", NULL},
    {"libcuda.so.1", "libcuda.so", NULL, NULL},
    {"libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", NULL},
};

/* Whether [p, p + n) lies in one of the object's loaded segments. */
static int in_object(const struct dl_phdr_info *info, ElfW(Addr) p, ElfW(Xword) n) {
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        ElfW(Addr) lo = info->dlpi_addr + ph->p_vaddr;
        if (ph->p_type == PT_LOAD && p >= lo && p - lo < ph->p_memsz && n <= ph->p_memsz - (p - lo)) return 1;
    }
    return 0;
}

/* A pointer of the object's dynamic section where it is in memory: glibc relocates them in
 * place only where that section is writable, and an object loaded below its link address
 * wraps base + pointer (so neither form is assumed: the one inside its segments). 0: neither. */
static ElfW(Addr) dyn_ptr(const struct dl_phdr_info *info, ElfW(Addr) v, ElfW(Xword) n) {
    if (in_object(info, v, n)) return v;
    return in_object(info, v + info->dlpi_addr, n) ? v + info->dlpi_addr : 0;
}

/* Whether the object defines `name` (its default version) in its dynamic symbol table, read
 * from memory through its hash table with every table bounded by its segments. It takes
 * none of the loader's locks (dlsym takes the one a dlopen holds through its constructors). */
int krex_object_defines(const struct dl_phdr_info *info, const char *name) {
    const ElfW(Dyn) *d = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            d = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    if (!d) return 0;
    ElfW(Addr) sym = 0, str = 0, gnu = 0, sysv = 0, ver = 0;
    ElfW(Xword) strsz = 0;
    for (; d->d_tag != DT_NULL; d++) {
        ElfW(Addr) v = d->d_un.d_ptr;
        switch (d->d_tag) {
        case DT_SYMTAB: sym = v; break;
        case DT_STRTAB: str = v; break;
        case DT_STRSZ: strsz = d->d_un.d_val; break;
        case DT_GNU_HASH: gnu = v; break;
        case DT_HASH: sysv = v; break;
        case DT_VERSYM: ver = v; break;
        default: break;
        }
    }
    str = strsz ? dyn_ptr(info, str, strsz) : 0;
    sym = dyn_ptr(info, sym, sizeof(ElfW(Sym)));
    gnu = gnu ? dyn_ptr(info, gnu, 16) : 0;
    sysv = sysv ? dyn_ptr(info, sysv, 8) : 0;
    ver = ver ? dyn_ptr(info, ver, sizeof(ElfW(Half))) : 0;
    if (!str || !sym || (!gnu && !sysv)) return 0;
    const ElfW(Sym) *symtab = (const ElfW(Sym) *)sym;
    const ElfW(Half) *versym = (const ElfW(Half) *)ver;
    const char *strtab = (const char *)str;
#define OBJ_MATCH(i)                                                                             \
    (in_object(info, (ElfW(Addr))&symtab[i], sizeof(ElfW(Sym))) && symtab[i].st_shndx != SHN_UNDEF && \
     symtab[i].st_name < strsz && memchr(strtab + symtab[i].st_name, 0, strsz - symtab[i].st_name) &&  \
     !strcmp(strtab + symtab[i].st_name, name) &&                                                    \
     (!versym || (in_object(info, (ElfW(Addr))&versym[i], sizeof *versym) && !(versym[i] & 0x8000))))
    if (gnu) {
        const uint32_t *g = (const uint32_t *)gnu;
        uint32_t nb = g[0], off = g[1], bloom = g[2];
        const uint32_t *buckets = (const uint32_t *)((const ElfW(Addr) *)&g[4] + bloom);
        if (!nb || !in_object(info, (ElfW(Addr))buckets, (ElfW(Xword))nb * 4)) return 0;
        const uint32_t *chain = buckets + nb;
        uint32_t h = elf_gnu_hash(name);
        for (uint32_t i = buckets[h % nb]; i >= off && i != 0; i++) {
            if (!in_object(info, (ElfW(Addr))&chain[i - off], 4)) return 0;
            uint32_t h2 = chain[i - off];
            if ((h | 1) == (h2 | 1) && OBJ_MATCH(i)) return 1;
            if (h2 & 1) break;
        }
    } else {
        const uint32_t *h = (const uint32_t *)sysv;
        for (uint32_t i = 0; i < h[1]; i++)
            if (OBJ_MATCH(i)) return 1;
    }
#undef OBJ_MATCH
    return 0;
}

/* The object's DT_SONAME in *out: 1 found, 0 none, -1 cannot be read (its string table is
 * not inside its segments, relocated or not: glibc relocates DT_STRTAB in place only where
 * the dynamic section is writable, not the vdso's). */
static int object_soname(const struct dl_phdr_info *info, const char **out) {
    for (int i = 0; i < info->dlpi_phnum; i++) {
        if (info->dlpi_phdr[i].p_type != PT_DYNAMIC) continue;
        const ElfW(Dyn) *d = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
        ElfW(Addr) tab = 0;
        ElfW(Xword) off = 0, size = 0;
        int has = 0;
        for (; d->d_tag != DT_NULL; d++) {
            if (d->d_tag == DT_STRTAB) tab = d->d_un.d_ptr;
            if (d->d_tag == DT_STRSZ) size = d->d_un.d_val;
            if (d->d_tag == DT_SONAME) off = d->d_un.d_val, has = 1;
        }
        if (!has) return 0;
        if (off >= size) return -1;
        if (!in_object(info, tab, size)) tab += info->dlpi_addr;
        if (!in_object(info, tab, size) || !memchr((const char *)tab + off, 0, size - off)) return -1;
        *out = (const char *)tab + off;
        return 1;
    }
    return 0;
}

/* `s` starts with the soname's stem ("libcuda.so" of "libcuda.so.1"). */
static int has_stem(const char *s, const char *soname) {
    const char *e = strstr(soname, ".so");
    size_t n = e ? (size_t)(e - soname) + 3 : strlen(soname);
    return !strncmp(s, soname, n);
}

struct so_probe {
    const char *const *sonames;
    int skip;   /* matching objects to pass over (the ones tried before) */
    char *path; /* PATH_MAX bytes: the next match's path, copied under the loader's lock */
};

/* The next loaded object (after `skip` of them) whose file name or DT_SONAME has one of the
 * sonames' stems, by its own path (which glibc matches without a search). */
static int so_probe_cb(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct so_probe *q = data;
    if (!info->dlpi_name || !strchr(info->dlpi_name, '/') || strlen(info->dlpi_name) >= PATH_MAX) return 0;
    const char *base = strrchr(info->dlpi_name, '/') + 1;
    const char *sn = NULL;
    int r = object_soname(info, &sn);
    for (int i = 0; q->sonames[i]; i++) {
        if (has_stem(base, q->sonames[i]) || (r > 0 && has_stem(sn, q->sonames[i]))) {
            if (q->skip-- > 0) return 0;
            strcpy(q->path, info->dlpi_name);
            return 1;
        }
    }
    return 0;
}

/* `name` in the library at `path` if it is loaded (its own name: no search), else NULL. */
static void *sym_in_loaded(const char *path, const char *name) {
    void *h = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return NULL;
    void *p = real_dlsym(h, name);
    dlclose(h);
    return p;
}

/* `name` in the library that already-resolved hooks of `api` call into, for one loaded
 * under a name no soname of ours matches (a file of another name with no DT_SONAME, reached
 * by a link). By the loader's name for it (dladdr's dli_fname is argv[0] for the main
 * program, which a dlopen would open), never the main program's. */
static void *sym_in_resolved(int api, const char *name, char *path) {
    for (int id = 0; id < KREX_N_IDS; id++) {
        if (krex_entries[id].api != api) continue;
        for (int k = 0; k < KREX_NSLOT; k++) {
            void *real = __atomic_load_n(&krex_real[id][k], ACQUIRE);
            Dl_info info;
            struct link_map *map = NULL;
            if (!real || !dladdr1(real, &info, (void **)&map, RTLD_DL_LINKMAP) || !map || !map->l_name ||
                !strchr(map->l_name, '/') || strlen(map->l_name) >= PATH_MAX)
                continue;
            strcpy(path, map->l_name); /* (copied before the dlopen: another thread may dlclose it) */
            void *p = sym_in_loaded(path, name);
            if (p) return p;
        }
    }
    return NULL;
}

/* Find `name` in an already-loaded vendor library by soname; never loads one, and never
 * searches the library path. */
static void *vendor_sym_by_soname(int api, const char *name) {
    for (int i = 0; krex_sonames[api][i]; i++) {
        void *h = dlopen(krex_sonames[api][i], RTLD_LAZY | RTLD_NOLOAD);
        if (!h) continue;
        void *p = real_dlsym(h, name);
        dlclose(h);
        if (p) return p;
    }
    return NULL;
}

/* The drain helper's and the pacer's lookups: never a library path search. A dlopen
 * (RTLD_NOLOAD) of a name no loaded object has searches the whole path and maps
 * ld.so.cache, taking the process's mmap lock for writing: a drain helper looking up HIP on
 * a CUDA node (again after every library load; torch.compile loads one per kernel) waited
 * there 0.1-0.4 s behind its own command's thread pinning pages for a copy (H200, session
 * 29). So the libraries are opened by their own paths: the loaded objects whose file name
 * or DT_SONAME has the library's stem (libcuda.so), else the one our hooks of that API
 * already call into. */
void *vendor_sym(int api, const char *name) {
    char path[PATH_MAX]; /* one path at a time: app threads (pacer, capture ends) call this too */
    for (int skip = 0; skip < 8; skip++) {
        struct so_probe q = {krex_sonames[api], skip, path};
        if (!krex_dl_iterate(so_probe_cb, &q)) break;
        void *p = sym_in_loaded(path, name);
        if (p) return p;
    }
    return sym_in_resolved(api, name, path);
}

/* Resolve slot 0 (the exported wrapper's target) by name. */
void *krex_resolve(int id, int k) {
    if (k != 0) return NULL; /* other slots are only ever bound, never resolved */
    const struct krex_entry *e = &krex_entries[id];
    void *p = real_dlsym(RTLD_NEXT, e->name);
    /* (By soname, searching the path if need be: an app thread's first call, once.) */
    if (!p || is_own_wrapper(p)) p = vendor_sym_by_soname(e->api, e->name);
    if (!p || is_own_wrapper(p)) {
        set_flag(KREX_PF_NO_REAL);
        klog("no real %s found", e->name);
        return NULL;
    }
    void *expect = NULL;
    if (!__atomic_compare_exchange_n(&krex_real[id][0], &expect, p, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return expect;
    __atomic_add_fetch(&krex_real_gen, 1, __ATOMIC_RELEASE);
    return p;
}

/* `name` in `h` (of `version`, NULL: dlsym's default) through glibc's own functions. */
KREX_NO_SANITIZE static void *real_lookup(void *h, const char *name, const char *version) {
    if (!version) return real_dlsym(h, name);
    dlvsym_fn v = real_dlvsym_fn();
    return v ? v(h, name, version) : NULL;
}

/* RTLD_NEXT relative to `caller`: real dlsym would take the caller to be us. `version`:
 * dlvsym's (NULL for dlsym). */
KREX_NO_SANITIZE static void *dlsym_next(struct link_map *caller, const char *name, const char *version) {
    Dl_info info;
    struct link_map *self = NULL;
    dladdr1((void *)krex_shim_active, &info, (void **)&self, RTLD_DL_LINKMAP);
    int self_after = 0;
    for (struct link_map *l = caller->l_next; l && self; l = l->l_next)
        if (l == self) self_after = 1;
    real_dl_init();
    dlopen_fn o = __atomic_load_n(&g_real_dlopen, __ATOMIC_ACQUIRE);
    dlclose_fn c = __atomic_load_n(&g_real_dlclose, __ATOMIC_ACQUIRE);
    void *p = NULL;
    /* The objects after the caller (and before us, when the caller precedes us), one
     * by one. dlopen(RTLD_NOLOAD) is never aimed at us: that would run our
     * constructor early when the caller is a preloaded library still initialising
     * (a sanitizer runtime resolves its interceptors like that). */
    for (struct link_map *l = caller->l_next; l && l != self && !p; l = l->l_next) {
        if (!l->l_name || !l->l_name[0]) continue;
        void *h = o(l->l_name, RTLD_LAZY | RTLD_NOLOAD);
        if (!h) continue;
        p = real_lookup(h, name, version);
        c(h);
    }
    if (p || !self_after) return p;
    /* Then us (what we export), then everything after us: plain RTLD_NEXT from here. */
    int id = krex_find(name);
    if (id >= 0) return krex_wrappers[id][0];
    return real_lookup(RTLD_NEXT, name, version);
}

/* dlsym and dlvsym: the real lookup, relative to the real caller for RTLD_NEXT; a table
 * entry's pointer comes back bound to its wrapper. */
KREX_NO_SANITIZE static void *lookup(void *handle, const char *name, const char *version, void *ret) {
    void *p;
    if (handle == RTLD_NEXT) {
        Dl_info info;
        struct link_map *lm = NULL;
        p = NULL;
        if (dladdr1(ret, &info, (void **)&lm, RTLD_DL_LINKMAP) && lm) p = dlsym_next(lm, name, version);
    } else {
        p = real_lookup(handle, name, version);
    }
    if (!p || !mode_on()) return p;
    int id = krex_find(name);
    return id < 0 ? p : krex_bind(id, p);
}

KREX_EXPORT KREX_NO_SANITIZE void *dlsym(void *handle, const char *name) {
    return lookup(handle, name, NULL, __builtin_return_address(0));
}

/* NVIDIA's and AMD's libraries version their symbols (cudaLaunchKernel@@libcudart.so.13):
 * a dlvsym() lookup must not reach an ungated entry point either. */
KREX_EXPORT KREX_NO_SANITIZE void *dlvsym(void *handle, const char *name, const char *version) {
    return lookup(handle, name, version, __builtin_return_address(0));
}
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpragmas"
#pragma GCC diagnostic ignored "-Wmissing-attributes" /* glibc's nonnull/leaf on dlsym: irrelevant here */
void *krex_self_dlsym(void *, const char *) __attribute__((alias("dlsym")));
void *krex_self_dlvsym(void *, const char *, const char *) __attribute__((alias("dlvsym")));
#pragma GCC diagnostic pop
