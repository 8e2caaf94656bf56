/* wire.h: the frames of krexd's socket (krex_abi.h, "the wire") for every C client, the
 * shim (client.c) and the guardian (guardian_wire.c): one way to send a request frame, to
 * read a reply's bytes while krexd may still answer, and to find the reply's header past
 * the event frames before it. */
#ifndef KREX_WIRE_H
#define KREX_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "krex_abi.h"

/* Asked each KREX_CLIENT_POLL_NS that a read waits: nonzero gives up (-ETIMEDOUT). */
typedef int (*krex_wire_stuck)(void *arg);
/* Reads the rest of an event frame (its body and JSON) from `fd`: 0, or a negative errno. */
typedef int (*krex_wire_event)(int fd, const struct krex_msg_hdr *h, void *arg);

/* One request frame: the header, `body_len` bytes of the op's fixed body, `json_len` bytes
 * of its JSON object. Never SIGPIPE (MSG_NOSIGNAL). 0, or a negative errno (-ETIMEDOUT: the
 * socket's send timeout). */
int krex_wire_send(int fd, enum krex_op op, const void *body, uint32_t body_len, const void *json,
                   uint32_t json_len);
/* Read exactly n bytes (buf NULL: read and drop them), waiting while `stuck` says krexd may
 * still answer. 0; -EPIPE: krexd closed the connection; -ETIMEDOUT: `stuck` gave up. */
int krex_wire_recv(int fd, void *buf, size_t n, krex_wire_stuck stuck, void *arg);
/* The header of the next frame that is not an event (each event goes to `on_event`, or is
 * dropped without one). -EPROTO for a frame of another KREX version (bad magic, longer than
 * KREX_WIRE_MAX): the stream cannot be read on. */
int krex_wire_header(int fd, struct krex_msg_hdr *h, krex_wire_stuck stuck, void *arg, krex_wire_event on_event);

#endif
