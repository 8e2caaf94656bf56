/* wire.c: see wire.h. Used by the shim (in the application: nothing here may kill or hang
 * it, so sends never raise SIGPIPE and every wait asks `stuck`) and by the guardian. */
#define _GNU_SOURCE
#include "wire.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

int krex_wire_connect(const char *path, pid_t *peer_pid, uid_t *peer_uid) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -errno;
    struct timeval tv = {KREX_CONNECT_TIMEOUT_MS / 1000, (KREX_CONNECT_TIMEOUT_MS % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    memcpy(a.sun_path, path, strlen(path) + 1);
    struct ucred cr = {0, (uid_t)-1, (gid_t)-1};
    socklen_t len = sizeof cr;
    if (connect(fd, (struct sockaddr *)&a, sizeof a) || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len)) {
        int e = errno;
        close(fd);
        return -e;
    }
    if (peer_pid) *peer_pid = cr.pid;
    if (peer_uid) *peer_uid = cr.uid;
    if (cr.uid != 0 && cr.uid != geteuid()) {
        close(fd);
        return -EACCES;
    }
    return fd;
}

static int send_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno == EAGAIN ? -ETIMEDOUT : -errno;
        }
        if (w == 0) return -EPIPE;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

void krex_tail_put(struct krex_tail *t, uint32_t *len, const char *s) {
    if (!s || t->err) return;
    size_t k = strlen(s) + 1;
    if (t->n + k > KREX_WIRE_MAX) {
        t->err = 1;
        return;
    }
    if (t->n + k > t->cap) {
        size_t cap = (t->n + k) * 2;
        char *p = realloc(t->p, cap);
        if (!p) {
            t->err = 1;
            return;
        }
        t->p = p;
        t->cap = cap;
    }
    memcpy(t->p + t->n, s, k);
    t->n += k;
    *len += (uint32_t)k;
}

int krex_wire_send(int fd, enum krex_op op, const void *body, uint32_t body_len, const struct krex_tail *tail) {
    struct {
        struct krex_msg_hdr h;
        char rest[576];
    } f;
    size_t tail_n = tail ? tail->n : 0;
    if ((tail && tail->err) || (uint64_t)body_len + tail_n > KREX_WIRE_MAX) return -EMSGSIZE;
    memset(&f.h, 0, sizeof f.h);
    f.h.magic = KREX_WIRE_MAGIC;
    f.h.op = (uint16_t)op;
    f.h.body_len = body_len + (uint32_t)tail_n;
    if ((size_t)body_len + tail_n <= sizeof f.rest) { /* the common case: one send */
        if (body_len) memcpy(f.rest, body, body_len);
        if (tail_n) memcpy(f.rest + body_len, tail->p, tail_n);
        return send_all(fd, (const char *)&f, sizeof f.h + body_len + tail_n);
    }
    int rc = send_all(fd, (const char *)&f.h, sizeof f.h);
    if (!rc && body_len) rc = send_all(fd, body, body_len);
    if (!rc && tail_n) rc = send_all(fd, tail->p, tail_n);
    return rc;
}

const char *krex_wire_text(const char **at, const char *end, uint32_t len, int *ok) {
    const char *s = *at;
    if (!len) return NULL;
    if (len > (size_t)(end - s) || s[len - 1]) {
        *ok = 0;
        *at = end;
        return NULL;
    }
    *at = s + len;
    return s;
}

int krex_wire_recv(int fd, void *buf, size_t n, krex_wire_stuck stuck, void *arg) {
    char sink[512];
    size_t got = 0;
    while (got < n) {
        struct pollfd pf = {fd, POLLIN, 0};
        int r = poll(&pf, 1, (int)(KREX_CLIENT_POLL_NS / 1000000));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) {
            if (stuck && stuck(arg)) return -ETIMEDOUT;
            continue;
        }
        size_t want = n - got;
        if (!buf && want > sizeof sink) want = sizeof sink;
        ssize_t k = recv(fd, buf ? (char *)buf + got : sink, want, 0);
        if (k == 0) return -EPIPE;
        if (k < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            return -errno;
        }
        got += (size_t)k;
    }
    return 0;
}

int krex_wire_header(int fd, struct krex_msg_hdr *h, krex_wire_stuck stuck, void *arg, krex_wire_event on_event) {
    for (;;) {
        int rc = krex_wire_recv(fd, h, sizeof *h, stuck, arg);
        if (rc) return rc;
        if (h->magic != KREX_WIRE_MAGIC || (uint64_t)h->body_len + h->json_len > KREX_WIRE_MAX) return -EPROTO;
        if (h->op != KREX_OP_EVENT) return 0;
        rc = on_event ? on_event(fd, h, arg) : krex_wire_recv(fd, NULL, (size_t)h->body_len + h->json_len, stuck, arg);
        if (rc) return rc;
    }
}
