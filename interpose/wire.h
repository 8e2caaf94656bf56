/* wire.h: the frames of krexd's socket (krex_abi.h, "the wire") for every C client, the
 * shim (client.c) and the guardian (guardian_wire.c): one way to connect to krexd, to send a request frame (its
 * struct and text tail), to read a reply's bytes while krexd may still answer, to find the
 * reply's header past the event frames before it, and to read a body's texts. */
#ifndef KREX_WIRE_H
#define KREX_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "krex_abi.h"

/* Asked each KREX_CLIENT_POLL_NS that a read waits: nonzero gives up (-ETIMEDOUT). */
typedef int (*krex_wire_stuck)(void *arg);
/* Reads the rest of an event frame (its body, then drops its JSON) from `fd`: 0, or a
 * negative errno. */
typedef int (*krex_wire_event)(int fd, const struct krex_msg_hdr *h, void *arg);

/* A body's text tail being built (malloc'd; free p after the send). `err`: out of memory or
 * past KREX_WIRE_MAX, the send refuses it. */
struct krex_tail {
    char *p;
    size_t n, cap;
    int err;
};
/* Append `s` and its NUL to the tail as a string of the text whose byte count is `*len` (a
 * NAME_str or NAME_strs member). s NULL: nothing (none). */
void krex_tail_put(struct krex_tail *t, uint32_t *len, const char *s);

/* A connection to krexd's socket at `path` (shorter than sun_path: the caller checks),
 * bounded by KREX_CONNECT_TIMEOUT_MS (a full backlog), to a daemon run by us or by root only:
 * another user's would learn our regions and hand us its answers (the Python client's
 * _check_daemon_identity). The fd (close-on-exec), or a negative errno (-EACCES: another
 * user's daemon, its uid in *peer_uid); *peer_pid: the daemon's pid. */
int krex_wire_connect(const char *path, pid_t *peer_pid, uid_t *peer_uid);

/* One request frame: the header, the op's struct (`body_len` bytes), then the tail. No JSON
 * (json_len 0). Never SIGPIPE (MSG_NOSIGNAL). 0, or a negative errno (-ETIMEDOUT: the
 * socket's send timeout; -EMSGSIZE: longer than KREX_WIRE_MAX or a tail that failed). */
int krex_wire_send(int fd, enum krex_op op, const void *body, uint32_t body_len, const struct krex_tail *tail);
/* Read exactly n bytes (buf NULL: read and drop them), waiting while `stuck` says krexd may
 * still answer. 0; -EPIPE: krexd closed the connection; -ETIMEDOUT: `stuck` gave up. */
int krex_wire_recv(int fd, void *buf, size_t n, krex_wire_stuck stuck, void *arg);
/* The header of the next frame that is not an event (each event goes to `on_event`, or is
 * dropped without one). -EPROTO for a frame of another KREX version (bad magic, longer than
 * KREX_WIRE_MAX): the stream cannot be read on. */
int krex_wire_header(int fd, struct krex_msg_hdr *h, krex_wire_stuck stuck, void *arg, krex_wire_event on_event);

/* The next text of a body's tail: `len` bytes at *at (moved past them), which must end
 * before `end` and in a NUL. *ok becomes 0 when they do not; NULL for none (len 0). A list
 * text's strings: s, then s + strlen(s) + 1 while below the text's end. */
const char *krex_wire_text(const char **at, const char *end, uint32_t len, int *ok);

#endif
