/*
 * bunshin-agent: the agent inside every Bunshin workspace. A static executable: it needs nothing from the image
 * (no interpreter, no shared library, no shell; the shell tools use /bin/bash when the image has it, else /bin/sh).
 *
 * bunshin-init (pid 1) starts it with the ready pipe on descriptor 3; it writes "R" there once it listens on
 * /run/bunshin/agent.sock, which the host reaches through /proc/<pid 1>/root. Frames are a 4-byte big-endian length
 * and a msgpack body holding exactly the messages of bunshin_async/_protocol.py (msgspec's encoding: a Struct is a
 * map whose tag field, "op" for requests and "kind" for responses, names the message; bytes are bin; an optional
 * field is absent or nil). Anything else gets a Failure frame with error "protocol".
 *
 * One thread serves each connection; the host opens one connection per request in flight, so requests run
 * concurrently. The threads are a pool made at start-up, before any workspace process, so that they take no pid
 * from the workspace's sequence later ("connection threads" below). A hang-up of the host during an exec or a
 * shell command kills what it runs (cancellation). File tools are confined to BUNSHIN_WORKDIR (no ".." or symlink
 * leads out); commands are not (the whole workspace is the sandbox). Children are started with
 * clone(CLONE_VM | CLONE_VFORK) like posix_spawn, and the child calls only raw system calls: in a CLONE_VM child
 * glibc's setuid() would broadcast the change to the agent's own threads.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <malloc.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PROTOCOL_VERSION 2 /* _protocol.PROTOCOL_VERSION */
#define DEFAULT_MAX_OUTPUT (1 << 20)
#define SOCKET_DIR "/run/bunshin"
#define SOCKET_PATH SOCKET_DIR "/agent.sock"
#define MAX_REQUEST (256u << 20)   /* largest request frame (a write_file's data); larger ones are refused */
#define MAX_FILE_DATA (512u << 20) /* largest read_file answer without max_bytes */
#define MAX_LISTING (64u << 20)    /* largest list_dir answer (_client.LISTING_MAX): a larger directory is refused */
#define STALL_SECONDS 10           /* a frame begun must go on arriving: a peer silent this long mid-frame is cut */
#define CHUNK (256u << 10)
#define THREAD_STACK (256u << 10)
#define MAX_DEPTH 16
#define BASE_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define MAX_GROUPS 64

static const char *workdir = "/workspace";
static size_t workdir_len;

/* ------------------------------------------------------------------------------------------------ buffers */

struct buf {
	uint8_t *p;
	size_t len, cap;
};

static void buf_reserve(struct buf *b, size_t more)
{
	if (b->len + more <= b->cap)
		return;
	size_t cap = b->cap ? b->cap : 256;
	while (cap < b->len + more)
		cap *= 2;
	uint8_t *p = realloc(b->p, cap);
	if (!p)
		abort(); /* out of memory in the workspace's cgroup: pid 1 then ends the workspace */
	b->p = p;
	b->cap = cap;
}

static void buf_put(struct buf *b, const void *data, size_t n)
{
	if (!n)
		return;
	buf_reserve(b, n);
	memcpy(b->p + b->len, data, n);
	b->len += n;
}

static void buf_byte(struct buf *b, uint8_t c)
{
	buf_put(b, &c, 1);
}

static void buf_free(struct buf *b)
{
	free(b->p);
	b->p = NULL;
	b->len = b->cap = 0;
}

/* ------------------------------------------------------------------------------------------------ msgpack out */

static void be(struct buf *b, uint64_t v, int n)
{
	uint8_t tmp[8];
	for (int i = 0; i < n; i++)
		tmp[i] = (uint8_t)(v >> (8 * (n - 1 - i)));
	buf_put(b, tmp, (size_t)n);
}

static void mp_map(struct buf *b, uint32_t n)
{
	if (n < 16)
		buf_byte(b, (uint8_t)(0x80 | n));
	else {
		buf_byte(b, 0xde);
		be(b, n, 2);
	}
}

static void mp_array(struct buf *b, uint32_t n)
{
	if (n < 16)
		buf_byte(b, (uint8_t)(0x90 | n));
	else if (n < 65536) {
		buf_byte(b, 0xdc);
		be(b, n, 2);
	} else {
		buf_byte(b, 0xdd);
		be(b, n, 4);
	}
}

static void mp_str_header(struct buf *b, size_t n)
{
	if (n < 32)
		buf_byte(b, (uint8_t)(0xa0 | n));
	else if (n < 256) {
		buf_byte(b, 0xd9);
		be(b, n, 1);
	} else if (n < 65536) {
		buf_byte(b, 0xda);
		be(b, n, 2);
	} else {
		buf_byte(b, 0xdb);
		be(b, n, 4);
	}
}

/* Decode bytes as UTF-8 the way Python's bytes.decode("utf-8", "replace") does: each maximal invalid subpart becomes
 * one U+FFFD (Unicode 15, 3.9 "U+FFFD Substitution of Maximal Subparts"). */
static void utf8_replace(struct buf *out, const uint8_t *s, size_t n)
{
	static const uint8_t fffd[3] = {0xef, 0xbf, 0xbd};
	size_t i = 0;
	while (i < n) {
		size_t run = i;
		while (run < n && s[run] < 0x80)
			run++;
		buf_put(out, s + i, run - i);
		if ((i = run) >= n)
			break;
		uint8_t c = s[i];
		int need;
		uint8_t lo = 0x80, hi = 0xbf;
		if (c >= 0xc2 && c <= 0xdf)
			need = 1;
		else if (c >= 0xe0 && c <= 0xef) {
			need = 2;
			if (c == 0xe0)
				lo = 0xa0;
			else if (c == 0xed)
				hi = 0x9f;
		} else if (c >= 0xf0 && c <= 0xf4) {
			need = 3;
			if (c == 0xf0)
				lo = 0x90;
			else if (c == 0xf4)
				hi = 0x8f;
		} else {
			buf_put(out, fffd, 3);
			i++;
			continue;
		}
		size_t k = 1;
		for (; k <= (size_t)need && i + k < n; k++) {
			uint8_t d = s[i + k];
			if (k == 1 ? (d < lo || d > hi) : (d < 0x80 || d > 0xbf))
				break;
		}
		if (k == (size_t)need + 1)
			buf_put(out, s + i, k);
		else
			buf_put(out, fffd, 3);
		i += k;
	}
}

static int utf8_valid(const uint8_t *s, size_t n)
{
	struct buf tmp = {0};
	utf8_replace(&tmp, s, n);
	int ok = tmp.len == n && (n == 0 || memcmp(tmp.p, s, n) == 0);
	buf_free(&tmp);
	return ok;
}

static void mp_strn(struct buf *b, const void *s, size_t n)
{
	const uint8_t *u = s;
	size_t i = 0;
	while (i < n && u[i] < 0x80)
		i++;
	if (i == n) {
		mp_str_header(b, n);
		buf_put(b, s, n);
		return;
	}
	struct buf tmp = {0};
	utf8_replace(&tmp, u, n);
	mp_str_header(b, tmp.len);
	buf_put(b, tmp.p, tmp.len);
	buf_free(&tmp);
}

static void mp_str(struct buf *b, const char *s)
{
	mp_strn(b, s, strlen(s));
}

static void mp_bin(struct buf *b, const void *data, size_t n)
{
	if (n < 256) {
		buf_byte(b, 0xc4);
		be(b, n, 1);
	} else if (n < 65536) {
		buf_byte(b, 0xc5);
		be(b, n, 2);
	} else {
		buf_byte(b, 0xc6);
		be(b, n, 4);
	}
	buf_put(b, data, n);
}

static void mp_int(struct buf *b, int64_t v)
{
	if (v >= 0 && v < 128)
		buf_byte(b, (uint8_t)v);
	else if (v < 0 && v >= -32)
		buf_byte(b, (uint8_t)(0xe0 | (v + 32)));
	else if (v >= 0) {
		buf_byte(b, 0xcf);
		be(b, (uint64_t)v, 8);
	} else {
		buf_byte(b, 0xd3);
		be(b, (uint64_t)v, 8);
	}
}

static void mp_float(struct buf *b, double d)
{
	uint64_t v;
	memcpy(&v, &d, 8);
	buf_byte(b, 0xcb);
	be(b, v, 8);
}

static void mp_bool(struct buf *b, int v)
{
	buf_byte(b, v ? 0xc3 : 0xc2);
}

static void mp_nil(struct buf *b)
{
	buf_byte(b, 0xc0);
}

static void mp_kv_str(struct buf *b, const char *key, const char *val)
{
	mp_str(b, key);
	if (val)
		mp_str(b, val);
	else
		mp_nil(b);
}

/* ------------------------------------------------------------------------------------------------ failures */

enum { E_TIMEOUT, E_PATH_OUTSIDE, E_NOT_FOUND, E_INVALID, E_OS, E_PROTOCOL, E_INTERNAL, E_NAME_TOO_LONG };
static const char *const error_kinds[] = {"timeout", "path_outside", "not_found", "invalid",
					  "os",      "protocol",     "internal",  "name_too_long"};

/* What a handler reports when it fails: a Failure message (_protocol.Failure). */
struct fail {
	int kind;
	char message[1024];
	const char *path;
	struct buf out, err; /* partial output of a command that timed out (raw bytes) */
};

__attribute__((format(printf, 4, 5))) static int failf(struct fail *f, int kind, const char *path, const char *fmt,
							 ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(f->message, sizeof(f->message), fmt, ap);
	va_end(ap);
	f->kind = kind;
	f->path = path;
	return -1;
}

/* An OSError as _guest._os_fail mapped it: a missing file is not_found, a wrong kind of file is invalid. */
static int fail_errno(struct fail *f, int err, const char *path)
{
	if (err == ENOENT)
		return failf(f, E_NOT_FOUND, path, "no such file or directory: '%s'", path);
	if (err == ENAMETOOLONG) /* the host's PathTooLong: never cut short, which would name another file */
		return failf(f, E_NAME_TOO_LONG, path, "file name too long: a path of %zu bytes, over PATH_MAX (%d) "
			     "with the workspace directory and symlinks resolved", path ? strlen(path) : 0, PATH_MAX);
	if (err == EISDIR || err == ENOTDIR || err == EEXIST || err == ENOTEMPTY)
		return failf(f, E_INVALID, path, "%s: '%s'", strerror(err), path);
	return failf(f, E_OS, path, "%s: '%s'", strerror(err), path);
}

static int open_regular(const char *path, int flags, mode_t mode, const char *name, struct fail *f);

static void encode_failure(struct buf *b, const struct fail *f)
{
	mp_map(b, 6);
	mp_kv_str(b, "kind", "failure");
	mp_kv_str(b, "error", error_kinds[f->kind]);
	mp_kv_str(b, "message", f->message);
	mp_kv_str(b, "path", f->path);
	mp_str(b, "stdout");
	mp_strn(b, f->out.p ? (const char *)f->out.p : "", f->out.len);
	mp_str(b, "stderr");
	mp_strn(b, f->err.p ? (const char *)f->err.p : "", f->err.len);
}

/* ------------------------------------------------------------------------------------------------ msgpack in */

struct rd {
	const uint8_t *p, *end;
};

static int rd_be(struct rd *r, int n, uint64_t *v)
{
	if (r->end - r->p < n)
		return -1;
	*v = 0;
	for (int i = 0; i < n; i++)
		*v = (*v << 8) | *r->p++;
	return 0;
}

static const char *mp_type_name(uint8_t c)
{
	if (c <= 0x7f || c >= 0xe0 || (c >= 0xcc && c <= 0xd3))
		return "int";
	if ((c >= 0x80 && c <= 0x8f) || c == 0xde || c == 0xdf)
		return "object";
	if ((c >= 0x90 && c <= 0x9f) || c == 0xdc || c == 0xdd)
		return "array";
	if ((c >= 0xa0 && c <= 0xbf) || (c >= 0xd9 && c <= 0xdb))
		return "str";
	if (c == 0xc0)
		return "null";
	if (c == 0xc2 || c == 0xc3)
		return "bool";
	if (c >= 0xc4 && c <= 0xc6)
		return "bytes";
	if (c == 0xca || c == 0xcb)
		return "float";
	if ((c >= 0xc7 && c <= 0xc9) || (c >= 0xd4 && c <= 0xd8))
		return "ext";
	return "invalid";
}

/* Each reader consumes one value of its type, or returns -1 leaving the type byte in place (the caller reports). */
static int rd_map(struct rd *r, uint32_t *n)
{
	if (r->p >= r->end)
		return -1;
	uint8_t c = *r->p;
	uint64_t v;
	const uint8_t *save = r->p++;
	if (c >= 0x80 && c <= 0x8f)
		v = c & 0x0f;
	else if (c == 0xde ? rd_be(r, 2, &v) == 0 : c == 0xdf ? rd_be(r, 4, &v) == 0 : 0)
		;
	else {
		r->p = save;
		return -1;
	}
	/* every entry takes at least two bytes: a count beyond what is left is a lie (bounds allocations) */
	if (v > (uint64_t)(r->end - r->p) / 2) {
		r->p = save;
		return -1;
	}
	*n = (uint32_t)v;
	return 0;
}

static int rd_array(struct rd *r, uint32_t *n)
{
	if (r->p >= r->end)
		return -1;
	uint8_t c = *r->p;
	uint64_t v;
	const uint8_t *save = r->p++;
	if (c >= 0x90 && c <= 0x9f)
		v = c & 0x0f;
	else if (c == 0xdc ? rd_be(r, 2, &v) == 0 : c == 0xdd ? rd_be(r, 4, &v) == 0 : 0)
		;
	else {
		r->p = save;
		return -1;
	}
	if (v > (uint64_t)(r->end - r->p)) {
		r->p = save;
		return -1;
	}
	*n = (uint32_t)v;
	return 0;
}

static int rd_raw(struct rd *r, int bin, const uint8_t **s, size_t *n)
{
	if (r->p >= r->end)
		return -1;
	uint8_t c = *r->p;
	uint64_t v;
	const uint8_t *save = r->p++;
	int ok;
	if (!bin && c >= 0xa0 && c <= 0xbf) {
		v = c & 0x1f;
		ok = 1;
	} else if (!bin && c >= 0xd9 && c <= 0xdb)
		ok = rd_be(r, 1 << (c - 0xd9), &v) == 0;
	else if (bin && c >= 0xc4 && c <= 0xc6)
		ok = rd_be(r, 1 << (c - 0xc4), &v) == 0;
	else
		ok = 0;
	if (!ok || v > (uint64_t)(r->end - r->p)) {
		r->p = save;
		return -1;
	}
	*s = r->p;
	*n = (size_t)v;
	r->p += v;
	return 0;
}

static int rd_int(struct rd *r, int64_t *out)
{
	if (r->p >= r->end)
		return -1;
	uint8_t c = *r->p;
	const uint8_t *save = r->p++;
	uint64_t v;
	if (c <= 0x7f) {
		*out = c;
		return 0;
	}
	if (c >= 0xe0) {
		*out = (int8_t)c;
		return 0;
	}
	if (c >= 0xcc && c <= 0xcf) {
		if (rd_be(r, 1 << (c - 0xcc), &v) < 0)
			goto bad;
		*out = v > INT64_MAX ? INT64_MAX : (int64_t)v; /* msgspec takes a uint64; no field needs one */
		return 0;
	}
	if (c >= 0xd0 && c <= 0xd3) {
		int n = 1 << (c - 0xd0);
		if (rd_be(r, n, &v) < 0)
			goto bad;
		if (n < 8 && (v >> (8 * n - 1)) & 1)
			v |= ~(uint64_t)0 << (8 * n); /* sign-extend */
		*out = (int64_t)v;
		return 0;
	}
bad:
	r->p = save;
	return -1;
}

static int rd_float(struct rd *r, double *out)
{
	int64_t i;
	if (rd_int(r, &i) == 0) { /* msgspec accepts an int where a float is expected */
		*out = (double)i;
		return 0;
	}
	if (r->p >= r->end)
		return -1;
	uint8_t c = *r->p;
	const uint8_t *save = r->p++;
	uint64_t v;
	if (c == 0xca && rd_be(r, 4, &v) == 0) {
		uint32_t u = (uint32_t)v;
		float f;
		memcpy(&f, &u, 4);
		*out = f;
		return 0;
	}
	if (c == 0xcb && rd_be(r, 8, &v) == 0) {
		memcpy(out, &v, 8);
		return 0;
	}
	r->p = save;
	return -1;
}

/* Skip one value of any type (used to find the tag, which need not come first). */
static int rd_skip(struct rd *r, int depth)
{
	if (r->p >= r->end || depth > MAX_DEPTH)
		return -1;
	uint8_t c = *r->p;
	uint32_t n;
	const uint8_t *s;
	size_t len;
	int64_t i;
	double d;
	if (rd_map(r, &n) == 0) {
		for (uint32_t k = 0; k < 2 * n; k++)
			if (rd_skip(r, depth + 1) < 0)
				return -1;
		return 0;
	}
	if (rd_array(r, &n) == 0) {
		for (uint32_t k = 0; k < n; k++)
			if (rd_skip(r, depth + 1) < 0)
				return -1;
		return 0;
	}
	if (rd_raw(r, 0, &s, &len) == 0 || rd_raw(r, 1, &s, &len) == 0 || rd_float(r, &d) == 0 || rd_int(r, &i) == 0)
		return 0;
	if (c == 0xc0 || c == 0xc2 || c == 0xc3) {
		r->p++;
		return 0;
	}
	return -1; /* ext types and 0xc1 are not part of the protocol */
}

/* ------------------------------------------------------------------------------------------------ requests */

enum op { OP_PING, OP_EXEC, OP_SHELL_OPEN, OP_SHELL_RUN, OP_SHELL_CLOSE, OP_READ_FILE, OP_WRITE_FILE, OP_LIST_DIR,
	  OP_REMOVE, OP_SPAWN, OP_SIGNAL, OP_POLL, OP_COUNT };
static const char *const op_names[] = {"ping",       "exec",     "shell_open", "shell_run", "shell_close",
				       "read_file",  "write_file", "list_dir", "remove",    "spawn",
				       "signal",     "poll"};

enum ftype { T_INT, T_FLOAT, T_BOOL, T_STR, T_BYTES, T_STRLIST, T_STRMAP };
enum fid { F_VERSION, F_ARGV, F_COMMAND, F_CWD, F_ENV, F_STDIN, F_TIMEOUT, F_MAX_OUTPUT, F_USER, F_SHELL_ID, F_PATH,
	   F_MAX_BYTES, F_DATA, F_APPEND, F_MODE, F_MAKE_PARENTS, F_RECURSIVE, F_LOG_PATH, F_PID, F_SIGNAL, F_COUNT };

struct fspec {
	const char *name;
	enum ftype type;
	unsigned char nullable, required;
};

static const struct fspec fields[F_COUNT] = {
	[F_VERSION] = {"version", T_INT, 0, 0},	     [F_ARGV] = {"argv", T_STRLIST, 1, 0},
	[F_COMMAND] = {"command", T_STR, 1, 0},	     [F_CWD] = {"cwd", T_STR, 1, 0},
	[F_ENV] = {"env", T_STRMAP, 1, 0},	     [F_STDIN] = {"stdin", T_BYTES, 1, 0},
	[F_TIMEOUT] = {"timeout", T_FLOAT, 1, 0},    [F_MAX_OUTPUT] = {"max_output", T_INT, 0, 0},
	[F_USER] = {"user", T_STR, 1, 0},	     [F_SHELL_ID] = {"shell_id", T_INT, 0, 1},
	[F_PATH] = {"path", T_STR, 0, 1},	     [F_MAX_BYTES] = {"max_bytes", T_INT, 1, 0},
	[F_DATA] = {"data", T_BYTES, 0, 1},	     [F_APPEND] = {"append", T_BOOL, 0, 0},
	[F_MODE] = {"mode", T_INT, 1, 0},	     [F_MAKE_PARENTS] = {"make_parents", T_BOOL, 0, 0},
	[F_RECURSIVE] = {"recursive", T_BOOL, 0, 0}, [F_LOG_PATH] = {"log_path", T_STR, 1, 0},
	[F_PID] = {"pid", T_INT, 0, 1},		     [F_SIGNAL] = {"signal", T_INT, 0, 1},
};

/* The fields of each request, as _protocol.py declares them (a field of the shared command set is named once). */
#define CMD_FIELDS F_ARGV, F_COMMAND, F_CWD, F_ENV
static const int op_fields[OP_COUNT][10] = {
	[OP_PING] = {F_VERSION, -1},
	[OP_EXEC] = {CMD_FIELDS, F_STDIN, F_TIMEOUT, F_MAX_OUTPUT, F_USER, -1},
	[OP_SHELL_OPEN] = {F_CWD, F_ENV, F_USER, -1},
	[OP_SHELL_RUN] = {F_SHELL_ID, F_COMMAND, F_TIMEOUT, F_MAX_OUTPUT, -1},
	[OP_SHELL_CLOSE] = {F_SHELL_ID, -1},
	[OP_READ_FILE] = {F_PATH, F_MAX_BYTES, -1},
	[OP_WRITE_FILE] = {F_PATH, F_DATA, F_APPEND, F_MODE, F_MAKE_PARENTS, -1},
	[OP_LIST_DIR] = {F_PATH, -1},
	[OP_REMOVE] = {F_PATH, F_RECURSIVE, -1},
	[OP_SPAWN] = {CMD_FIELDS, F_LOG_PATH, F_USER, -1},
	[OP_SIGNAL] = {F_PID, F_SIGNAL, -1},
	[OP_POLL] = {F_PID, -1},
};

struct str {
	char *s; /* NUL-terminated copy */
	size_t len;
	int has_nul; /* the value itself holds a NUL byte (refused where it would reach the kernel) */
};

struct req {
	enum op op;
	unsigned present;		     /* bit per fid: given and not nil */
	int64_t ints[F_COUNT];		     /* F_VERSION, F_MAX_OUTPUT, F_SHELL_ID, F_MAX_BYTES, F_MODE, F_PID, F_SIGNAL */
	double timeout;			     /* F_TIMEOUT */
	int bools[F_COUNT];		     /* F_APPEND, F_MAKE_PARENTS, F_RECURSIVE */
	struct str strs[F_COUNT];	     /* F_COMMAND, F_CWD, F_USER, F_PATH, F_LOG_PATH */
	const uint8_t *bytes[F_COUNT];	     /* F_STDIN, F_DATA (into the frame) */
	size_t bytes_len[F_COUNT];
	struct str *argv;		     /* F_ARGV */
	uint32_t argc;
	struct str *env;		     /* F_ENV, as "KEY=VALUE" */
	uint32_t nenv;
	int env_bad;			     /* a key holds '=' or NUL, or a value NUL */
};

#define HAS(r, f) (((r)->present >> (f)) & 1u)

static void req_free(struct req *r)
{
	for (int i = 0; i < F_COUNT; i++)
		free(r->strs[i].s);
	for (uint32_t i = 0; i < r->argc; i++)
		free(r->argv[i].s);
	free(r->argv);
	for (uint32_t i = 0; i < r->nenv; i++)
		free(r->env[i].s);
	free(r->env);
}

/* ShellRun.command is a required str, where Exec's and Spawn's is optional. */
static int strict_command(enum op op, int fid)
{
	return op == OP_SHELL_RUN && fid == F_COMMAND;
}

static void clear_field(struct req *q, int fid)
{
	q->present &= ~(1u << fid);
	free(q->strs[fid].s);
	memset(&q->strs[fid], 0, sizeof(q->strs[fid]));
	if (fields[fid].type == T_STRLIST) {
		for (uint32_t i = 0; i < q->argc; i++)
			free(q->argv[i].s);
		free(q->argv);
		q->argv = NULL;
		q->argc = 0;
	} else if (fields[fid].type == T_STRMAP) {
		for (uint32_t i = 0; i < q->nenv; i++)
			free(q->env[i].s);
		free(q->env);
		q->env = NULL;
		q->nenv = 0;
		q->env_bad = 0;
	}
}

static int take_str(struct rd *r, struct str *out)
{
	const uint8_t *s;
	size_t n;
	if (rd_raw(r, 0, &s, &n) < 0)
		return -1;
	if (!utf8_valid(s, n)) {
		r->p = s - 1; /* reported as an invalid str */
		return -2;
	}
	out->s = malloc(n + 1);
	if (!out->s)
		abort();
	memcpy(out->s, s, n);
	out->s[n] = 0;
	out->len = n;
	out->has_nul = memchr(s, 0, n) != NULL;
	return 0;
}

static int proto(struct fail *f, const char *fmt, const char *a, const char *b)
{
	failf(f, E_PROTOCOL, NULL, fmt, a, b);
	return -1;
}

static int decode_field(struct rd *r, struct req *q, int fid, struct fail *f)
{
	const struct fspec *spec = &fields[fid];
	if (r->p < r->end && *r->p == 0xc0) {
		if (!spec->nullable || strict_command(q->op, fid))
			return proto(f, "Expected `%s`, got `null` - at `$.%s`",
				     spec->type == T_INT ? "int" : spec->type == T_BOOL ? "bool" : "str", spec->name);
		r->p++;
		return 0;
	}
	const char *want = "str";
	int rc = -1;
	switch (spec->type) {
	case T_INT:
		want = "int";
		rc = rd_int(r, &q->ints[fid]);
		break;
	case T_FLOAT:
		want = "float";
		rc = rd_float(r, &q->timeout);
		break;
	case T_BOOL:
		want = "bool";
		if (r->p < r->end && (*r->p == 0xc2 || *r->p == 0xc3)) {
			q->bools[fid] = *r->p++ == 0xc3;
			rc = 0;
		}
		break;
	case T_STR:
		rc = take_str(r, &q->strs[fid]);
		break;
	case T_BYTES:
		want = "bytes";
		rc = rd_raw(r, 1, &q->bytes[fid], &q->bytes_len[fid]);
		break;
	case T_STRLIST: {
		uint32_t n;
		want = "array";
		if (rd_array(r, &n) < 0)
			break;
		q->argv = calloc(n ? n : 1, sizeof(*q->argv));
		if (!q->argv)
			abort();
		for (; q->argc < n; q->argc++) {
			int e = take_str(r, &q->argv[q->argc]);
			if (e < 0) {
				if (r->p >= r->end)
					return proto(f, "Input data was truncated%s%s", "", "");
				return proto(f, "Expected `str`, got `%s` - at `$.%s[...]`",
					     e == -2 ? "invalid utf-8" : mp_type_name(*r->p), spec->name);
			}
		}
		rc = 0;
		break;
	}
	case T_STRMAP: {
		uint32_t n;
		want = "object";
		if (rd_map(r, &n) < 0)
			break;
		q->env = calloc(n ? n : 1, sizeof(*q->env));
		if (!q->env)
			abort();
		for (; q->nenv < n; q->nenv++) {
			struct str k = {0}, v = {0};
			int e = take_str(r, &k);
			if (e == 0)
				e = take_str(r, &v);
			if (e < 0) {
				free(k.s);
				if (r->p >= r->end)
					return proto(f, "Input data was truncated%s%s", "", "");
				return proto(f, "Expected `str`, got `%s` - at `$.%s[...]`",
					     e == -2 ? "invalid utf-8" : mp_type_name(*r->p), spec->name);
			}
			if (k.has_nul || v.has_nul || !k.len || memchr(k.s, '=', k.len))
				q->env_bad = 1;
			struct str *kv = &q->env[q->nenv];
			kv->len = k.len + 1 + v.len;
			kv->s = malloc(kv->len + 1);
			if (!kv->s)
				abort();
			memcpy(kv->s, k.s, k.len);
			kv->s[k.len] = '=';
			memcpy(kv->s + k.len + 1, v.s, v.len + 1);
			free(k.s);
			free(v.s);
		}
		rc = 0;
		break;
	}
	}
	if (rc < 0) {
		if (r->p >= r->end)
			return proto(f, "Input data was truncated%s%s", "", "");
		char got[32];
		snprintf(got, sizeof(got), "%s", rc == -2 ? "invalid utf-8" : mp_type_name(*r->p));
		failf(f, E_PROTOCOL, NULL, "Expected `%s`, got `%s` - at `$.%s`", want, got, spec->name);
		return -1;
	}
	q->present |= 1u << fid;
	return 0;
}

/* Decode one request frame into q, as msgspec's Decoder(AnyRequest) with forbid_unknown_fields would. */
static int decode_request(const uint8_t *p, size_t n, struct req *q, struct fail *f)
{
	struct rd r = {p, p + n};
	uint32_t count;
	memset(q, 0, sizeof(*q));
	q->ints[F_VERSION] = PROTOCOL_VERSION;
	q->ints[F_MAX_OUTPUT] = DEFAULT_MAX_OUTPUT;
	q->bools[F_MAKE_PARENTS] = 1;
	if (!n)
		return proto(f, "Input data was truncated%s%s", "", "");
	if (rd_map(&r, &count) < 0)
		return proto(f, "Expected `object`, got `%s`%s", mp_type_name(*p), "");
	const uint8_t *fields_start = r.p;
	/* First pass: find the tag (msgspec writes it first, but a map has no order). */
	int op = -1;
	for (uint32_t k = 0; k < count; k++) {
		const uint8_t *key;
		size_t klen;
		if (rd_raw(&r, 0, &key, &klen) < 0) {
			if (r.p >= r.end)
				return proto(f, "Input data was truncated%s%s", "", "");
			return proto(f, "Expected `str`, got `%s` - at `key in $`%s", mp_type_name(*r.p), "");
		}
		if (klen == 2 && !memcmp(key, "op", 2)) {
			const uint8_t *val;
			size_t vlen;
			if (rd_raw(&r, 0, &val, &vlen) < 0)
				return proto(f, "Expected `str`, got `%s` - at `$.op`%s",
					     r.p < r.end ? mp_type_name(*r.p) : "nothing", "");
			int this_op = -1;
			for (int o = 0; o < OP_COUNT; o++)
				if (strlen(op_names[o]) == vlen && !memcmp(op_names[o], val, vlen))
					this_op = o;
			if (this_op < 0 || (op >= 0 && this_op != op)) { /* a repeated tag must repeat the value */
				char tag[64];
				size_t m = vlen < sizeof(tag) - 1 ? vlen : sizeof(tag) - 1;
				memcpy(tag, val, m);
				tag[m] = 0;
				for (size_t i = 0; i < m; i++)
					if (!isprint((unsigned char)tag[i]))
						tag[i] = '?';
				return proto(f, "Invalid value '%s' - at `$.op`%s", tag, "");
			}
			op = this_op;
		} else if (rd_skip(&r, 1) < 0) {
			return proto(f, r.p >= r.end ? "Input data was truncated%s%s" : "MessagePack data is malformed%s%s",
				     "", "");
		}
	}
	if (r.p != r.end)
		return proto(f, "Trailing bytes after the message%s%s", "", "");
	if (op < 0)
		return proto(f, "Object missing required field `op`%s%s", "", "");
	q->op = (enum op)op;
	/* Second pass: the fields of that request. */
	r.p = fields_start;
	for (uint32_t k = 0; k < count; k++) {
		const uint8_t *key;
		size_t klen;
		rd_raw(&r, 0, &key, &klen); /* checked by the first pass */
		if (klen == 2 && !memcmp(key, "op", 2)) {
			rd_skip(&r, 1);
			continue;
		}
		int fid = -1;
		for (const int *fp = op_fields[op]; *fp >= 0; fp++)
			if (strlen(fields[*fp].name) == klen && !memcmp(fields[*fp].name, key, klen))
				fid = *fp;
		if (fid < 0) {
			char name[64];
			size_t m = klen < sizeof(name) - 1 ? klen : sizeof(name) - 1;
			memcpy(name, key, m);
			name[m] = 0;
			for (size_t i = 0; i < m; i++)
				if (!isprint((unsigned char)name[i]))
					name[i] = '?';
			return proto(f, "Object contains unknown field `%s`%s", name, "");
		}
		clear_field(q, fid); /* a repeated key: the last value wins, as in msgspec */
		if (decode_field(&r, q, fid, f) < 0)
			return -1;
	}
	for (const int *fp = op_fields[op]; *fp >= 0; fp++)
		if ((fields[*fp].required || strict_command(q->op, *fp)) && !HAS(q, *fp))
			return proto(f, "Object missing required field `%s`%s", fields[*fp].name, "");
	return 0;
}

/* ------------------------------------------------------------------------------------------------ paths */

static int within(const char *path, const char *root, size_t root_len)
{
	if (strncmp(path, root, root_len))
		return 0;
	return path[root_len] == 0 || path[root_len] == '/' || (root_len == 1 && root[0] == '/');
}

/* snprintf that reports a cut: a path that does not fit is ENAMETOOLONG, never a shorter path naming another file. */
__attribute__((format(printf, 3, 4))) static int path_fmt(char *out, size_t cap, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(out, cap, fmt, ap);
	va_end(ap);
	return n < 0 || (size_t)n >= cap ? ENAMETOOLONG : 0;
}

/* Lexical normalisation of an absolute path (os.path.normpath): no ".", "..", or repeated slashes. A result that
 * does not fit in cap is ENAMETOOLONG (so is a path that only fits after a later ".."; the kernel refuses those). */
static int normpath(const char *in, char *out, size_t cap)
{
	size_t len = 0;
	out[len++] = '/';
	const char *p = in;
	while (*p) {
		while (*p == '/')
			p++;
		const char *s = p;
		while (*p && *p != '/')
			p++;
		size_t n = (size_t)(p - s);
		if (!n || (n == 1 && s[0] == '.'))
			continue;
		if (n == 2 && s[0] == '.' && s[1] == '.') {
			while (len > 1 && out[len - 1] != '/')
				len--;
			if (len > 1)
				len--;
			continue;
		}
		if (len + n + 2 > cap) {
			out[0] = 0;
			return ENAMETOOLONG;
		}
		if (len > 1)
			out[len++] = '/';
		memcpy(out + len, s, n);
		len += n;
	}
	out[len] = 0;
	return 0;
}

static int join_tool_path(const char *path, char *out, size_t cap)
{
	char joined[PATH_MAX * 2];
	int err = path[0] == '/' ? path_fmt(joined, sizeof(joined), "%s", path)
				 : path_fmt(joined, sizeof(joined), "%s/%s", workdir, path);
	return err ? err : normpath(joined, out, cap);
}

/* os.path.realpath (not strict): follow every symlink that exists, keep the missing rest as it is. */
static int realpath_lax(const char *path, char *out, size_t cap)
{
	char rest[PATH_MAX * 2], link[PATH_MAX];
	int links = 0;
	size_t len = 1;
	if (path_fmt(rest, sizeof(rest), "%s", path))
		return ENAMETOOLONG;
	out[0] = '/';
	out[1] = 0;
	char *p = rest;
	while (*p) {
		while (*p == '/')
			p++;
		char *s = p;
		while (*p && *p != '/')
			p++;
		size_t n = (size_t)(p - s);
		if (!n || (n == 1 && s[0] == '.'))
			continue;
		if (n == 2 && s[0] == '.' && s[1] == '.') {
			while (len > 1 && out[len - 1] != '/')
				len--;
			if (len > 1)
				len--;
			out[len] = 0;
			continue;
		}
		size_t mark = len;
		if (len + n + 2 > cap)
			return ENAMETOOLONG;
		if (len > 1)
			out[len++] = '/';
		memcpy(out + len, s, n);
		len += n;
		out[len] = 0;
		struct stat st;
		if (lstat(out, &st) < 0 || !S_ISLNK(st.st_mode))
			continue;
		if (++links > 40)
			return ELOOP;
		ssize_t m = readlink(out, link, sizeof(link) - 1);
		if (m < 0)
			return errno;
		link[m] = 0;
		/* splice: rest = link + remaining */
		char tail[PATH_MAX * 2];
		if (path_fmt(tail, sizeof(tail), "%s/%s", link, p) || path_fmt(rest, sizeof(rest), "%s", tail))
			return ENAMETOOLONG;
		p = rest;
		if (link[0] == '/')
			len = 1;
		else
			len = mark;
		out[len] = 0;
	}
	return 0;
}

/* Map a tool path onto the workspace directory, refusing ".." and symlinks that lead outside it (_guest.resolve). */
static int resolve(const struct str *path, char *out, size_t cap, struct fail *f)
{
	char norm[PATH_MAX];
	if (!path->len || path->has_nul)
		return failf(f, E_INVALID, path->s, "invalid path '%s'", path->s);
	int err = join_tool_path(path->s, norm, sizeof(norm));
	if (err)
		return fail_errno(f, err, path->s);
	if (!within(norm, workdir, workdir_len))
		return failf(f, E_PATH_OUTSIDE, path->s, "'%s' is outside the workspace directory %s", path->s,
			     workdir);
	err = realpath_lax(norm, out, cap);
	if (err)
		return fail_errno(f, err, path->s);
	if (!within(out, workdir, workdir_len))
		return failf(f, E_PATH_OUTSIDE, path->s, "'%s' resolves to '%s', outside %s", path->s, out, workdir);
	return 0;
}

/* ------------------------------------------------------------------------------------------------ users */

struct cred {
	int set; /* 0: stay root, as the agent */
	uid_t uid;
	gid_t gid;
	gid_t groups[MAX_GROUPS];
	int ngroups;
	char home[PATH_MAX];
};

static int parse_id(const char *s, size_t n, unsigned long *out)
{
	if (!n || n > 10)
		return -1;
	unsigned long v = 0;
	for (size_t i = 0; i < n; i++) {
		if (!isdigit((unsigned char)s[i]))
			return -1;
		v = v * 10 + (unsigned long)(s[i] - '0');
	}
	if (v > 0xfffffffeUL)
		return -1;
	*out = v;
	return 0;
}

/* The n-th ':'-separated field of a passwd/group line, as [start, len). */
static int line_field(const char *line, int nth, const char **start, size_t *len)
{
	const char *p = line;
	for (int i = 0; i < nth; i++) {
		p = strchr(p, ':');
		if (!p)
			return -1;
		p++;
	}
	const char *e = strchr(p, ':');
	*start = p;
	*len = e ? (size_t)(e - p) : strlen(p);
	return 0;
}

/* Read a small database file of the image (/etc/passwd, /etc/group) as one NUL-terminated string. */
static char *read_db(const char *path)
{
	/* the image's file, so the workspace's: a fifo or a device there must not block the agent */
	int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
	if (fd < 0)
		return NULL;
	struct stat st;
	if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
		close(fd);
		return NULL;
	}
	struct buf b = {0};
	char chunk[4096];
	ssize_t n;
	while ((n = read(fd, chunk, sizeof(chunk))) > 0 && b.len < (16u << 20))
		buf_put(&b, chunk, (size_t)n);
	close(fd);
	buf_byte(&b, 0);
	return (char *)b.p;
}

/* Resolve "user[:group]" (names or numbers) from the image's /etc/passwd and /etc/group, as container engines do:
 * a user found by name or uid gets its primary group, its home and the groups listing it; an explicit group replaces
 * all of them; a uid the image does not know gets gid 0. No NSS: a static binary cannot load the image's modules. */
static int resolve_user(const struct str *spec, struct cred *c, struct fail *f)
{
	memset(c, 0, sizeof(*c));
	if (!spec->len || spec->has_nul)
		return failf(f, E_INVALID, NULL, "invalid user '%s'", spec->s);
	const char *colon = strchr(spec->s, ':');
	size_t ulen = colon ? (size_t)(colon - spec->s) : spec->len;
	const char *grp = colon ? colon + 1 : NULL;
	if (!ulen || (grp && !*grp) || (grp && strchr(grp, ':')))
		return failf(f, E_INVALID, NULL, "invalid user '%s': give NAME, UID, or either with :GROUP or :GID",
			     spec->s);
	unsigned long num;
	int numeric = parse_id(spec->s, ulen, &num) == 0;
	char name[256] = "";
	int found = 0;
	snprintf(c->home, sizeof(c->home), "/");
	char *db = read_db("/etc/passwd");
	for (char *line = db, *next; line && *line; line = next) {
		next = strchr(line, '\n');
		if (next)
			*next++ = 0;
		else
			next = line + strlen(line);
		const char *fname, *fuid, *fgid, *fhome;
		size_t lname, luid, lgid, lhome;
		unsigned long uid, gid;
		if (line_field(line, 0, &fname, &lname) || line_field(line, 2, &fuid, &luid) ||
		    line_field(line, 3, &fgid, &lgid) || parse_id(fuid, luid, &uid) || parse_id(fgid, lgid, &gid))
			continue;
		if (numeric ? uid != num : (lname != ulen || memcmp(fname, spec->s, ulen)))
			continue;
		found = 1;
		c->uid = (uid_t)uid;
		c->gid = (gid_t)gid;
		if (!line_field(line, 5, &fhome, &lhome) && lhome &&
		    path_fmt(c->home, sizeof(c->home), "%.*s", (int)lhome, fhome)) {
			int rc = failf(f, E_INVALID, NULL, "the home directory of user '%.*s' is longer than PATH_MAX",
				       (int)(lname < 64 ? lname : 64), fname);
			free(db); /* after the message: fname points into db */
			return rc;
		}
		if (path_fmt(name, sizeof(name), "%.*s", (int)lname, fname)) {
			int rc = failf(f, E_INVALID, NULL, "user name '%.64s...' is longer than %zu bytes", fname,
				       sizeof(name) - 1);
			free(db); /* after the message: fname points into db */
			return rc;
		}
		break;
	}
	free(db);
	if (!found) {
		if (!numeric)
			return failf(f, E_INVALID, NULL, "no user '%.*s' in the image's /etc/passwd", (int)ulen, spec->s);
		c->uid = (uid_t)num;
		c->gid = 0;
	}
	int gnumeric = grp && parse_id(grp, strlen(grp), &num) == 0;
	if (gnumeric)
		c->gid = (gid_t)num;
	if (grp || name[0]) {
		int gfound = gnumeric;
		db = read_db("/etc/group");
		for (char *line = db, *next; line && *line; line = next) {
			next = strchr(line, '\n');
			if (next)
				*next++ = 0;
			else
				next = line + strlen(line);
			const char *fname, *fgid, *fmem;
			size_t lname, lgid, lmem;
			unsigned long gid;
			if (line_field(line, 0, &fname, &lname) || line_field(line, 2, &fgid, &lgid) ||
			    parse_id(fgid, lgid, &gid))
				continue;
			if (grp) {
				if (!gnumeric && lname == strlen(grp) && !memcmp(fname, grp, lname)) {
					c->gid = (gid_t)gid;
					gfound = 1;
				}
				continue;
			}
			if (line_field(line, 3, &fmem, &lmem))
				continue;
			size_t nlen = strlen(name);
			for (const char *m = fmem; m < fmem + lmem;) {
				const char *e = memchr(m, ',', (size_t)(fmem + lmem - m));
				size_t ml = e ? (size_t)(e - m) : (size_t)(fmem + lmem - m);
				if (ml == nlen && !memcmp(m, name, nlen) && c->ngroups < MAX_GROUPS - 1 &&
				    (gid_t)gid != c->gid)
					c->groups[c->ngroups++] = (gid_t)gid;
				m += ml + 1;
			}
		}
		free(db);
		if (grp && !gfound)
			return failf(f, E_INVALID, NULL, "no group '%s' in the image's /etc/group", grp);
	}
	c->groups[c->ngroups++] = c->gid;
	c->set = 1;
	return 0;
}

/* ------------------------------------------------------------------------------------------------ children */

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static const char *shell_path(void)
{
	if (access("/bin/bash", X_OK) == 0)
		return "/bin/bash";
	if (access("/bin/sh", X_OK) == 0)
		return "/bin/sh";
	return NULL;
}

struct spawn_args {
	const char *exe, *cwd;
	char *const *argv, *const *envp;
	int fds[3];
	const struct cred *cred;
	int err;	  /* written by the child (shared memory): errno of the step that failed */
	const char *step; /* and which step */
};

/* Runs in the CLONE_VM | CLONE_VFORK child on its own small stack: raw system calls only, then exec. */
static int child_main(void *arg)
{
	struct spawn_args *a = arg;
	struct sigaction dfl = {.sa_handler = SIG_DFL};
	sigset_t none;
	sigemptyset(&none);
	/* SIGPIPE is the one signal the agent ignores (exec keeps ignored signals ignored); handlers reset on exec. */
	syscall(SYS_rt_sigaction, SIGPIPE, &dfl, NULL, _NSIG / 8);
	syscall(SYS_rt_sigprocmask, SIG_SETMASK, &none, NULL, _NSIG / 8);
	if (syscall(SYS_setsid) < 0) {
		a->step = "setsid";
		goto fail;
	}
	/* Sources below 3 first move above: dup3 onto 0-2 must not overwrite a source still to be placed. */
	int src[3];
	for (int i = 0; i < 3; i++) {
		src[i] = a->fds[i] < 3 ? (int)syscall(SYS_fcntl, a->fds[i], F_DUPFD_CLOEXEC, 3) : a->fds[i];
		if (src[i] < 0) {
			a->step = "dup";
			goto fail;
		}
	}
	for (int i = 0; i < 3; i++)
		if (syscall(SYS_dup3, src[i], i, 0) < 0) {
			a->step = "dup";
			goto fail;
		}
	if (a->cwd && syscall(SYS_chdir, a->cwd) < 0) {
		a->step = "chdir";
		goto fail;
	}
	if (a->cred && a->cred->set) {
		if (syscall(SYS_setgroups, a->cred->ngroups, a->cred->groups) < 0 ||
		    syscall(SYS_setresgid, a->cred->gid, a->cred->gid, a->cred->gid) < 0 ||
		    syscall(SYS_setresuid, a->cred->uid, a->cred->uid, a->cred->uid) < 0) {
			a->step = "switch user";
			goto fail;
		}
	}
	syscall(SYS_execve, a->exe, a->argv, a->envp);
	a->step = "exec";
fail:
	a->err = errno ? errno : EINVAL;
	syscall(SYS_exit, 127);
	return 127;
}

/* Start argv in a new session with fds on 0, 1, 2. Returns the pid, or -1 with f filled. */
static pid_t spawn_child(struct spawn_args *a, struct fail *f)
{
	size_t stack_size = 64 << 10;
	char *stack = malloc(stack_size);
	if (!stack)
		abort();
	a->err = 0;
	a->step = NULL;
	pid_t pid = clone(child_main, stack + stack_size, CLONE_VM | CLONE_VFORK | SIGCHLD, a);
	int clone_err = errno;
	free(stack);
	if (pid < 0)
		return failf(f, E_OS, a->argv[0], "cannot run '%s': %s", a->argv[0], strerror(clone_err));
	if (a->err) {
		waitpid(pid, NULL, 0);
		if (!strcmp(a->step, "chdir"))
			return fail_errno(f, a->err, a->cwd);
		return failf(f, E_OS, a->argv[0], "cannot run '%s' (%s): %s", a->argv[0], a->step, strerror(a->err));
	}
	return pid;
}

static int pidfd_open_(pid_t pid)
{
	return (int)syscall(SYS_pidfd_open, pid, 0);
}

static int exit_code(int status)
{
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	if (WIFSIGNALED(status))
		return 128 + WTERMSIG(status);
	return -1;
}

/* What a command needs beyond its request: argv with the shell prepended, env, the executable found on PATH. */
struct cmd {
	char **argv;
	char **envp;
	char exe[PATH_MAX];
	char cwd[PATH_MAX];
	const char *shell; /* the shell a string command runs through, or NULL for an argv */
	struct cred cred;
};

static void cmd_free(struct cmd *c)
{
	free(c->argv);
	free(c->envp);
}

/* The file `name` runs, found as execvp would (relative names against cwd): _guest._which. */
static int find_exe(const char *name, const char *path, const char *cwd, char *out, struct fail *f)
{
	char cand[PATH_MAX * 2];
	const char *p = path;
	for (;;) {
		int err;
		if (strchr(name, '/')) {
			if (name[0] == '/')
				err = path_fmt(cand, sizeof(cand), "%s", name);
			else
				err = path_fmt(cand, sizeof(cand), "%s/%s", cwd, name);
			if (err) /* a name of its own: say so; a PATH entry too long to hold it is only skipped */
				return fail_errno(f, err, name);
		} else {
			const char *e = strchr(p, ':');
			size_t n = e ? (size_t)(e - p) : strlen(p);
			if (n && p[0] == '/')
				err = path_fmt(cand, sizeof(cand), "%.*s/%s", (int)n, p, name);
			else if (n)
				err = path_fmt(cand, sizeof(cand), "%s/%.*s/%s", cwd, (int)n, p, name);
			else
				err = path_fmt(cand, sizeof(cand), "%s/%s", cwd, name);
			p = e ? e + 1 : NULL;
		}
		struct stat st;
		if (!err && stat(cand, &st) == 0 && S_ISREG(st.st_mode)) {
			if (access(cand, X_OK) < 0)
				return failf(f, E_INVALID, name, "cannot execute '%s': permission denied", name);
			err = normpath(cand, out, PATH_MAX);
			return err ? fail_errno(f, err, name) : 0;
		}
		if (strchr(name, '/') || !p)
			break;
	}
	return failf(f, E_NOT_FOUND, name, "command not found: '%s'", name);
}

static const char *const base_env[] = {"PATH=" BASE_PATH, "HOME=/root", "LANG=C.UTF-8", "TERM=xterm"};

/* Build a command from the shared fields of exec, spawn and shell_open (argv or command, cwd, env, user). */
static int prepare(const struct req *q, int want_argv, struct cmd *c, struct fail *f)
{
	memset(c, 0, sizeof(*c));
	if (want_argv) {
		int has_argv = q->argv != NULL && HAS(q, F_ARGV), has_cmd = HAS(q, F_COMMAND);
		if (has_argv == has_cmd)
			return failf(f, E_INVALID, NULL, "give exactly one of argv or command");
		if (has_argv) {
			if (!q->argc)
				return failf(f, E_INVALID, NULL, "invalid argv []");
			for (uint32_t i = 0; i < q->argc; i++)
				if (q->argv[i].has_nul)
					return failf(f, E_INVALID, NULL, "invalid argv: argument %u holds a NUL byte", i);
		} else {
			if (q->strs[F_COMMAND].has_nul)
				return failf(f, E_INVALID, NULL, "command contains a NUL byte");
			c->shell = shell_path();
			if (!c->shell)
				return failf(f, E_NOT_FOUND, "/bin/sh",
					     "the image has no shell (/bin/bash or /bin/sh) to run a command string; "
					     "pass an argv");
		}
	}
	const char *cwd = HAS(q, F_CWD) ? q->strs[F_CWD].s : workdir;
	if (HAS(q, F_CWD) && q->strs[F_CWD].has_nul)
		return failf(f, E_INVALID, NULL, "invalid working directory");
	struct stat st;
	if (cwd[0] && stat(cwd, &st) < 0 && errno == ENAMETOOLONG)
		return fail_errno(f, ENAMETOOLONG, cwd);
	if (!cwd[0] || stat(cwd, &st) < 0 || !S_ISDIR(st.st_mode))
		return failf(f, E_NOT_FOUND, cwd, "working directory '%s' does not exist", cwd);
	char joined[PATH_MAX * 2];
	int err = cwd[0] == '/' ? path_fmt(joined, sizeof(joined), "%s", cwd)
				: path_fmt(joined, sizeof(joined), "%s/%s", workdir, cwd);
	if (!err)
		err = realpath_lax(joined, c->cwd, sizeof(c->cwd));
	if (err == ENAMETOOLONG)
		return fail_errno(f, err, cwd);
	if (err)
		return failf(f, E_INVALID, cwd, "cannot resolve working directory '%s'", cwd);
	if (q->env_bad)
		return failf(f, E_INVALID, NULL, "invalid environment: a name is empty or holds '=' or NUL, or a value NUL");
	if (HAS(q, F_USER) && resolve_user(&q->strs[F_USER], &c->cred, f) < 0)
		return -1;
	/* env: the base, then HOME of the user, then the request's, later keys replacing earlier ones */
	size_t nbase = sizeof(base_env) / sizeof(base_env[0]);
	c->envp = calloc(nbase + 1 + q->nenv + 1, sizeof(char *));
	if (!c->envp)
		abort();
	size_t n = 0;
	static __thread char home[PATH_MAX + 8];
	for (size_t i = 0; i < nbase; i++)
		c->envp[n++] = (char *)base_env[i];
	if (c->cred.set) {
		snprintf(home, sizeof(home), "HOME=%s", c->cred.home);
		c->envp[1] = home;
	}
	const char *path = BASE_PATH;
	for (uint32_t i = 0; i < q->nenv; i++) {
		char *kv = q->env[i].s;
		size_t klen = (size_t)(strchr(kv, '=') - kv) + 1;
		size_t j = 0;
		for (; j < n; j++)
			if (!strncmp(c->envp[j], kv, klen))
				break;
		c->envp[j] = kv;
		if (j == n)
			n++;
		if (klen == 5 && !strncmp(kv, "PATH=", 5))
			path = kv + 5;
	}
	c->envp[n] = NULL;
	if (!want_argv)
		return 0;
	uint32_t argc = q->argv && HAS(q, F_ARGV) ? q->argc : 3;
	c->argv = calloc(argc + 1, sizeof(char *));
	if (!c->argv)
		abort();
	if (c->shell) {
		c->argv[0] = (char *)c->shell;
		c->argv[1] = "-c";
		c->argv[2] = q->strs[F_COMMAND].s;
	} else {
		for (uint32_t i = 0; i < argc; i++)
			c->argv[i] = q->argv[i].s;
	}
	return find_exe(c->argv[0], path, c->cwd, c->exe, f);
}

/* ------------------------------------------------------------------------------------------------ exec */

/* Keeps the first cap bytes of a stream and counts the rest. */
struct collect {
	struct buf kept;
	size_t cap;
	int truncated;
};

static void collect_add(struct collect *c, const uint8_t *p, size_t n)
{
	size_t room = c->cap > c->kept.len ? c->cap - c->kept.len : 0;
	buf_put(&c->kept, p, n < room ? n : room);
	if (n > room)
		c->truncated = 1;
}

static int hung_up(int conn)
{
	char c;
	ssize_t n = recv(conn, &c, 1, MSG_PEEK | MSG_DONTWAIT);
	return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

static int read_into(int fd, struct collect *c, uint8_t *scratch)
{
	ssize_t n = read(fd, scratch, CHUNK);
	if (n > 0) {
		/* A full default pipe (64 KiB): a flood. A 1 MiB pipe makes it a sixteenth of the wake-ups; a command
		 * with little output never pays for the larger buffer. */
		if (n >= 64 << 10)
			fcntl(fd, F_SETPIPE_SZ, 1 << 20);
		collect_add(c, scratch, (size_t)n);
		return 1;
	}
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return 0;
	return -1; /* EOF or error */
}

static int poll_ms(double deadline)
{
	if (deadline <= 0)
		return -1;
	double left = deadline - now();
	if (left <= 0)
		return 0;
	return left > 3600 ? 3600000 : (int)(left * 1000) + 1;
}

static void set_nonblock(int fd)
{
	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

/* After a SIGKILL to a process group: wait (up to a second) until pid 1 has reaped its last member, so that the
 * host's ToolTimeout or cancellation returns once they are gone, not just doomed. */
static void wait_group_gone(pid_t pgid)
{
	for (int i = 0; i < 1000 && !(kill(-pgid, 0) < 0 && errno == ESRCH); i++)
		usleep(1000);
}

/* Feed stdin and collect output until the process exits (not until EOF: a background child may keep the pipes
 * open). Returns 1 if the deadline passed and the group was killed. A hang-up on conn (the host cancelled) kills
 * the process group too. */
static int pump(pid_t pid, int pidfd, int out_r, int err_r, int *in_w, const uint8_t *in, size_t in_len,
		struct collect *out, struct collect *err, double deadline, int conn, uint8_t *scratch)
{
	struct pollfd fds[5] = {{pidfd, POLLIN, 0}, {out_r, POLLIN, 0}, {err_r, POLLIN, 0}, {conn, POLLIN, 0},
				{*in_w, POLLOUT, 0}};
	struct collect *sinks[3] = {NULL, out, err};
	size_t sent = 0;
	int timed_out = 0, exited = 0, killed = 0;
	if (*in_w >= 0 && !in_len) {
		close(*in_w);
		*in_w = fds[4].fd = -1;
	}
	while (!exited) {
		int wait = poll_ms(deadline);
		if (wait == 0) {
			timed_out = killed = 1;
			kill(-pid, SIGKILL);
			break;
		}
		if (poll(fds, 5, wait) < 0) {
			if (errno == EINTR)
				continue;
			break;
		}
		if (fds[0].revents)
			exited = 1;
		for (int i = 1; i <= 2; i++)
			if (fds[i].revents && read_into(fds[i].fd, sinks[i], scratch) < 0)
				fds[i].fd = -1;
		if (fds[3].revents) {
			if (hung_up(conn)) {
				kill(-pid, SIGKILL);
				exited = killed = 1;
			} else {
				fds[3].fd = -1; /* the host sent more than one request: it gets this answer first */
			}
		}
		if (fds[4].revents) {
			ssize_t n = write(*in_w, in + sent, in_len - sent);
			if (n > 0)
				sent += (size_t)n;
			if ((n < 0 && errno != EAGAIN && errno != EINTR) || sent == in_len) {
				close(*in_w);
				*in_w = fds[4].fd = -1;
			}
		}
	}
	if (!timed_out)
		for (int i = 1; i <= 2; i++)
			while (fds[i].fd >= 0 && read_into(fds[i].fd, sinks[i], scratch) > 0)
				;
	int status;
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	if (killed)
		wait_group_gone(pid);
	return timed_out ? -1 : exit_code(status);
}

struct pipes {
	int in_r, in_w, out_r, out_w, err_r, err_w, null;
};

static void close_fd(int *fd)
{
	if (*fd >= 0)
		close(*fd);
	*fd = -1;
}

static void pipes_close(struct pipes *p)
{
	close_fd(&p->in_r);
	close_fd(&p->in_w);
	close_fd(&p->out_r);
	close_fd(&p->out_w);
	close_fd(&p->err_r);
	close_fd(&p->err_w);
	close_fd(&p->null);
}

static int pipes_open(struct pipes *p, int with_stdin, struct fail *f)
{
	int a[2], b[2], c[2] = {-1, -1};
	memset(p, -1, sizeof(*p));
	p->null = open("/dev/null", O_RDWR | O_CLOEXEC);
	if (pipe2(a, O_CLOEXEC) < 0)
		return failf(f, E_OS, NULL, "pipe: %s", strerror(errno));
	p->out_r = a[0];
	p->out_w = a[1];
	if (pipe2(b, O_CLOEXEC) < 0) {
		pipes_close(p);
		return failf(f, E_OS, NULL, "pipe: %s", strerror(errno));
	}
	p->err_r = b[0];
	p->err_w = b[1];
	if (with_stdin && pipe2(c, O_CLOEXEC) < 0) {
		pipes_close(p);
		return failf(f, E_OS, NULL, "pipe: %s", strerror(errno));
	}
	p->in_r = c[0];
	p->in_w = c[1];
	if (p->null < 0 && !with_stdin) {
		pipes_close(p);
		return failf(f, E_OS, NULL, "/dev/null: %s", strerror(errno));
	}
	return 0;
}

static void encode_exec_result(struct buf *b, int code, struct collect *out, struct collect *err, double duration,
			       const char *shell)
{
	mp_map(b, 7);
	mp_kv_str(b, "kind", "exec_result");
	mp_str(b, "exit_code");
	mp_int(b, code);
	mp_str(b, "stdout");
	mp_strn(b, out->kept.p ? (char *)out->kept.p : "", out->kept.len);
	mp_str(b, "stderr");
	mp_strn(b, err->kept.p ? (char *)err->kept.p : "", err->kept.len);
	mp_str(b, "duration");
	mp_float(b, duration);
	mp_str(b, "truncated");
	mp_bool(b, out->truncated || err->truncated);
	mp_kv_str(b, "shell", shell);
}

static double deadline_of(const struct req *q, double start)
{
	if (!HAS(q, F_TIMEOUT) || isinf(q->timeout))
		return 0;
	return start + q->timeout;
}

static int check_timeout(const struct req *q, struct fail *f)
{
	if (HAS(q, F_TIMEOUT) && !(q->timeout > 0))
		return failf(f, E_INVALID, NULL, "timeout must be positive, not %g", q->timeout);
	return 0;
}

static int do_exec(const struct req *q, int conn, struct buf *resp, struct fail *f)
{
	struct cmd c;
	struct pipes p;
	int rc = -1;
	if (check_timeout(q, f) < 0)
		return -1;
	if (prepare(q, 1, &c, f) < 0) {
		cmd_free(&c);
		return -1;
	}
	double start = now();
	int with_stdin = HAS(q, F_STDIN);
	if (pipes_open(&p, with_stdin, f) < 0) {
		cmd_free(&c);
		return -1;
	}
	struct spawn_args a = {.exe = c.exe,
			       .cwd = c.cwd,
			       .argv = c.argv,
			       .envp = c.envp,
			       .fds = {with_stdin ? p.in_r : p.null, p.out_w, p.err_w},
			       .cred = &c.cred};
	pid_t pid = spawn_child(&a, f);
	close_fd(&p.in_r);
	close_fd(&p.out_w);
	close_fd(&p.err_w);
	close_fd(&p.null);
	if (pid < 0)
		goto out;
	int pidfd = pidfd_open_(pid);
	set_nonblock(p.out_r);
	set_nonblock(p.err_r);
	if (p.in_w >= 0)
		set_nonblock(p.in_w);
	struct collect out = {.cap = q->ints[F_MAX_OUTPUT] > 0 ? (size_t)q->ints[F_MAX_OUTPUT] : 0};
	struct collect err = {.cap = out.cap};
	uint8_t *scratch = malloc(CHUNK);
	if (!scratch)
		abort();
	int code = pump(pid, pidfd, p.out_r, p.err_r, &p.in_w, q->bytes[F_STDIN], q->bytes_len[F_STDIN], &out, &err,
			deadline_of(q, start), conn, scratch);
	free(scratch);
	close(pidfd);
	if (code == -1 && HAS(q, F_TIMEOUT)) {
		failf(f, E_TIMEOUT, NULL, "command timed out after %g s", q->timeout);
		f->out = out.kept;
		f->err = err.kept;
		goto out;
	}
	encode_exec_result(resp, code, &out, &err, now() - start, c.shell);
	buf_free(&out.kept);
	buf_free(&err.kept);
	rc = 0;
out:
	pipes_close(&p);
	cmd_free(&c);
	return rc;
}

/* ------------------------------------------------------------------------------------------------ agent state */

struct shell {
	int64_t id;
	pid_t pid;
	int exited, code; /* reaped, and its exit code */
	int in_w, out_r, err_r;
	int refs;	  /* the table's and each request using it */
	int closed;	  /* removed from the table */
	const char *path; /* /bin/bash or /bin/sh */
	pthread_mutex_t lock; /* one command at a time */
};

struct bg {
	pid_t pid;
	int reaped, code;
};

static pthread_mutex_t state_lock = PTHREAD_MUTEX_INITIALIZER;
static struct shell **shells;
static size_t nshells, cap_shells;
static int64_t next_shell = 1;
static struct bg *bgs;
static size_t nbgs, cap_bgs;

/* Collect background processes that exited (they are our children, not pid 1's). */
static void reap_background(void)
{
	pthread_mutex_lock(&state_lock);
	for (size_t i = 0; i < nbgs; i++) {
		int status;
		if (!bgs[i].reaped && waitpid(bgs[i].pid, &status, WNOHANG) == bgs[i].pid) {
			bgs[i].reaped = 1;
			bgs[i].code = exit_code(status);
		}
	}
	pthread_mutex_unlock(&state_lock);
}

/* The latest process started with this pid (an earlier one may have exited and its pid been reused). */
static struct bg *find_bg(pid_t pid)
{
	for (size_t i = nbgs; i-- > 0;)
		if (bgs[i].pid == pid)
			return &bgs[i];
	return NULL;
}

static void shell_unref(struct shell *s)
{
	pthread_mutex_lock(&state_lock);
	int last = --s->refs == 0;
	pthread_mutex_unlock(&state_lock);
	if (!last)
		return;
	if (!s->exited) {
		kill(-s->pid, SIGKILL);
		while (waitpid(s->pid, NULL, 0) < 0 && errno == EINTR)
			;
	}
	close_fd(&s->in_w);
	close_fd(&s->out_r);
	close_fd(&s->err_r);
	pthread_mutex_destroy(&s->lock);
	free(s);
}

static struct shell *find_shell(int64_t id, int remove)
{
	struct shell *found = NULL;
	pthread_mutex_lock(&state_lock);
	for (size_t i = 0; i < nshells; i++)
		if (shells[i]->id == id) {
			found = shells[i];
			if (remove) {
				shells[i] = shells[--nshells];
				found->closed = 1; /* the table's reference passes to the caller */
			} else {
				found->refs++;
			}
			break;
		}
	pthread_mutex_unlock(&state_lock);
	return found;
}

/* ------------------------------------------------------------------------------------------------ shells */

static int do_shell_open(const struct req *q, struct buf *resp, struct fail *f)
{
	struct cmd c;
	struct pipes p;
	if (prepare(q, 0, &c, f) < 0) {
		cmd_free(&c);
		return -1;
	}
	const char *sh = shell_path();
	if (!sh) {
		cmd_free(&c);
		return failf(f, E_NOT_FOUND, "/bin/sh", "the image has no shell (/bin/bash or /bin/sh)");
	}
	char *argv_bash[] = {(char *)sh, "--noprofile", "--norc", NULL};
	char *argv_sh[] = {(char *)sh, NULL};
	if (pipes_open(&p, 1, f) < 0) {
		cmd_free(&c);
		return -1;
	}
	struct spawn_args a = {.exe = sh,
			       .cwd = c.cwd,
			       .argv = strcmp(sh, "/bin/bash") ? argv_sh : argv_bash,
			       .envp = c.envp,
			       .fds = {p.in_r, p.out_w, p.err_w},
			       .cred = &c.cred};
	pid_t pid = spawn_child(&a, f);
	cmd_free(&c);
	close_fd(&p.in_r);
	close_fd(&p.out_w);
	close_fd(&p.err_w);
	close_fd(&p.null);
	if (pid < 0) {
		pipes_close(&p);
		return -1;
	}
	struct shell *s = calloc(1, sizeof(*s));
	if (!s)
		abort();
	s->pid = pid;
	s->in_w = p.in_w;
	s->out_r = p.out_r;
	s->err_r = p.err_r;
	s->refs = 1;
	s->path = sh;
	pthread_mutex_init(&s->lock, NULL);
	set_nonblock(s->out_r);
	set_nonblock(s->err_r);
	pthread_mutex_lock(&state_lock);
	if (nshells == cap_shells) {
		cap_shells = cap_shells ? 2 * cap_shells : 8;
		shells = realloc(shells, cap_shells * sizeof(*shells));
		if (!shells)
			abort();
	}
	s->id = next_shell++;
	shells[nshells++] = s;
	pthread_mutex_unlock(&state_lock);
	mp_map(resp, 3);
	mp_kv_str(resp, "kind", "shell_opened");
	mp_str(resp, "shell_id");
	mp_int(resp, s->id);
	mp_kv_str(resp, "shell", sh);
	return 0;
}

/* Quote s for eval in any POSIX shell: single quotes keep every byte but the quote itself, written '\''. */
static void sh_quote(struct buf *b, const char *s, size_t n)
{
	buf_byte(b, '\'');
	for (size_t i = 0; i < n; i++) {
		if (s[i] == '\'')
			buf_put(b, "'\\''", 4);
		else
			buf_byte(b, (uint8_t)s[i]);
	}
	buf_byte(b, '\'');
}

/* SIGKILL every descendant of pid, found through /proc/<p>/task/<t>/children (read whole: a cut list would miss
 * children, or name a wrong pid by a cut number). */
static void kill_descendants(pid_t pid)
{
	struct buf stack = {0}; /* pids still to visit */
	buf_put(&stack, &pid, sizeof(pid));
	int first = 1;
	while (stack.len) {
		pid_t p;
		stack.len -= sizeof(p);
		memcpy(&p, stack.p + stack.len, sizeof(p));
		if (!first)
			kill(p, SIGKILL);
		first = 0;
		char path[64];
		snprintf(path, sizeof(path), "/proc/%d/task", p);
		DIR *d = opendir(path);
		if (!d)
			continue;
		struct dirent *e;
		while ((e = readdir(d))) {
			if (e->d_name[0] == '.')
				continue;
			char cpath[320];
			snprintf(cpath, sizeof(cpath), "/proc/%d/task/%s/children", p, e->d_name); /* d_name < 256 */
			int fd = open(cpath, O_RDONLY | O_CLOEXEC);
			if (fd < 0)
				continue;
			struct buf data = {0};
			ssize_t len;
			do {
				buf_reserve(&data, 4096);
				len = read(fd, data.p + data.len, 4096);
				if (len > 0)
					data.len += (size_t)len;
			} while (len > 0 || (len < 0 && errno == EINTR));
			close(fd);
			buf_byte(&data, 0);
			char *save = NULL;
			for (char *tok = strtok_r((char *)data.p, " \n", &save); tok; tok = strtok_r(NULL, " \n", &save)) {
				pid_t c = (pid_t)atoi(tok);
				buf_put(&stack, &c, sizeof(c));
			}
			buf_free(&data);
		}
		closedir(d);
	}
	buf_free(&stack);
}

/* One stream of a shell command: its first cap bytes, and where the end marker appeared in it. */
struct marked {
	struct collect c;
	uint64_t total;		     /* bytes seen */
	char tail[96];		     /* the last bytes seen, to find a marker split across reads */
	size_t tail_len;
	int64_t mark_at;	     /* stream offset of the marker, -1 before it */
	char after[24];		     /* what follows the marker (stdout: the exit status and a newline) */
	size_t after_len;
	int done;
};

static void marked_add(struct marked *m, const uint8_t *p, size_t n, const char *mark, size_t mlen, int need_nl)
{
	if (m->done)
		return; /* a background child of the command writing after the marker */
	uint64_t base = m->total;
	collect_add(&m->c, p, n);
	m->total += n;
	if (m->mark_at < 0) {
		size_t keep = m->tail_len;
		uint8_t *joined = malloc(keep + n);
		if (!joined)
			abort();
		memcpy(joined, m->tail, keep);
		memcpy(joined + keep, p, n);
		uint8_t *hit = memmem(joined, keep + n, mark, mlen);
		if (hit) {
			m->mark_at = (int64_t)(base - keep + (uint64_t)(hit - joined));
			size_t rest = (size_t)(joined + keep + n - (hit + mlen));
			size_t take = rest < sizeof(m->after) - 1 ? rest : sizeof(m->after) - 1;
			memcpy(m->after, hit + mlen, take);
			m->after_len = take;
		} else {
			size_t t = keep + n < mlen - 1 ? keep + n : mlen - 1;
			memcpy(m->tail, joined + keep + n - t, t);
			m->tail_len = t;
		}
		free(joined);
	} else {
		size_t room = sizeof(m->after) - 1 - m->after_len;
		size_t take = n < room ? n : room;
		memcpy(m->after + m->after_len, p, take);
		m->after_len += take;
	}
	if (m->mark_at >= 0 && (!need_nl || memchr(m->after, '\n', m->after_len)))
		m->done = 1;
}

static void marked_result(struct marked *m, int64_t cap)
{
	uint64_t end = m->mark_at >= 0 ? (uint64_t)m->mark_at : m->total;
	m->c.truncated = end > (uint64_t)(cap > 0 ? cap : 0);
	if (m->c.kept.len > end)
		m->c.kept.len = (size_t)end;
}

static int shell_run(struct shell *s, const struct req *q, int conn, struct buf *resp, struct fail *f)
{
	int status;
	if (!s->exited && waitpid(s->pid, &status, WNOHANG) == s->pid) {
		s->exited = 1;
		s->code = exit_code(status);
	}
	if (s->exited)
		return failf(f, E_INVALID, NULL, "the shell session has exited");
	if (q->strs[F_COMMAND].has_nul)
		return failf(f, E_INVALID, NULL, "command contains a NUL byte");
	uint8_t rnd[10];
	if (getrandom(rnd, sizeof(rnd), 0) != sizeof(rnd))
		return failf(f, E_INTERNAL, NULL, "getrandom: %s", strerror(errno));
	char mark[64];
	int ml = snprintf(mark, sizeof(mark), "__bunshin_");
	for (size_t i = 0; i < sizeof(rnd); i++)
		ml += snprintf(mark + ml, sizeof(mark) - (size_t)ml, "%02x", rnd[i]);
	ml += snprintf(mark + ml, sizeof(mark) - (size_t)ml, "__");
	struct buf script = {0};
	buf_put(&script, "eval ", 5);
	sh_quote(&script, q->strs[F_COMMAND].s, q->strs[F_COMMAND].len);
	char tail[256];
	int tl = snprintf(tail, sizeof(tail), " </dev/null\nprintf '%s%%d\\n' $?\nprintf '%s\\n' >&2\n", mark, mark);
	buf_put(&script, tail, (size_t)tl);
	double start = now();
	size_t sent = 0;
	while (sent < script.len) {
		ssize_t n = write(s->in_w, script.p + sent, script.len - sent);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			buf_free(&script);
			return failf(f, E_INVALID, NULL, "the shell session has exited");
		}
		sent += (size_t)n;
	}
	buf_free(&script);
	double deadline = deadline_of(q, start);
	int pidfd = pidfd_open_(s->pid);
	struct marked out = {.c.cap = q->ints[F_MAX_OUTPUT] > 0 ? (size_t)q->ints[F_MAX_OUTPUT] : 0, .mark_at = -1};
	struct marked err = {.c.cap = out.c.cap, .mark_at = -1};
	struct pollfd fds[4] = {{s->out_r, POLLIN, 0}, {s->err_r, POLLIN, 0}, {pidfd, POLLIN, 0}, {conn, POLLIN, 0}};
	struct marked *sinks[2] = {&out, &err};
	uint8_t *scratch = malloc(CHUNK);
	if (!scratch)
		abort();
	int killed = 0, shell_gone = 0;
	while (!(out.done && err.done)) {
		int wait = poll_ms(deadline);
		if (wait == 0) {
			if (killed) { /* the shell itself does not answer: end it */
				kill(-s->pid, SIGKILL);
				shell_gone = 1;
				break;
			}
			killed = 1;
			kill_descendants(s->pid);
			deadline = now() + 2.0;
			continue;
		}
		if (poll(fds, 4, wait) < 0) {
			if (errno == EINTR)
				continue;
			break;
		}
		for (int i = 0; i < 2; i++) {
			if (!fds[i].revents)
				continue;
			ssize_t n = read(fds[i].fd, scratch, CHUNK);
			if (n > 0)
				marked_add(sinks[i], scratch, (size_t)n, mark, (size_t)ml, i == 0);
			else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
				fds[i].fd = -1; /* the shell exited (`exit`, or killed) */
				sinks[i]->done = 1;
			}
		}
		if (fds[2].revents) { /* the shell exited: take what is left, then stop */
			for (int i = 0; i < 2; i++) {
				ssize_t n;
				while (fds[i].fd >= 0 && !sinks[i]->done && (n = read(fds[i].fd, scratch, CHUNK)) > 0)
					marked_add(sinks[i], scratch, (size_t)n, mark, (size_t)ml, i == 0);
				sinks[i]->done = 1;
			}
			shell_gone = 1;
		}
		if (fds[3].revents) {
			fds[3].fd = -1;
			if (hung_up(conn) && !killed) { /* cancelled: end the command, keep the session */
				killed = 1;
				kill_descendants(s->pid);
				deadline = now() + 2.0;
			}
		}
	}
	free(scratch);
	if (!shell_gone && out.mark_at < 0 && pidfd >= 0) { /* its pipes closed: the shell is exiting (`exit 4`) */
		struct pollfd pfd = {pidfd, POLLIN, 0};
		shell_gone = poll(&pfd, 1, 5000) == 1;
	}
	if (pidfd >= 0)
		close(pidfd);
	if (shell_gone && !s->exited) {
		while (waitpid(s->pid, &status, 0) < 0 && errno == EINTR)
			;
		s->exited = 1;
		s->code = exit_code(status);
	}
	marked_result(&out, q->ints[F_MAX_OUTPUT]);
	marked_result(&err, q->ints[F_MAX_OUTPUT]);
	if (killed) {
		failf(f, E_TIMEOUT, NULL, "shell command timed out after %g s", HAS(q, F_TIMEOUT) ? q->timeout : 0.0);
		f->out = out.c.kept;
		f->err = err.c.kept;
		return -1;
	}
	int code;
	if (out.mark_at >= 0) {
		out.after[out.after_len] = 0;
		code = atoi(out.after);
	} else {
		code = s->exited ? s->code : -1;
	}
	encode_exec_result(resp, code, &out.c, &err.c, now() - start, s->path);
	buf_free(&out.c.kept);
	buf_free(&err.c.kept);
	return 0;
}

/* Calls waiting in lock_session, reported by ping ("waiting"): what a test sees to know a call is queued. */
static int session_waiters;

/* Take the session's lock (one command at a time) while the host still waits for this call: a call queued behind
 * a running command and cancelled meanwhile (the host hung up) must not run later, when that command ends; and a
 * pool thread stuck there would stay "about to be free" (hand_over) for as long. 0 once held, -1 if cancelled. */
static int lock_session_wait(struct shell *s, int conn)
{
	for (;;) {
		struct timespec until;
		clock_gettime(CLOCK_REALTIME, &until); /* a mutex's timed lock counts on CLOCK_REALTIME */
		until.tv_nsec += 100 * 1000000L;
		if (until.tv_nsec >= 1000000000L) {
			until.tv_sec++;
			until.tv_nsec -= 1000000000L;
		}
		int rc = pthread_mutex_timedlock(&s->lock, &until);
		if (hung_up(conn)) {
			if (rc == 0)
				pthread_mutex_unlock(&s->lock);
			return -1;
		}
		if (rc == 0)
			return 0;
	}
}

static int lock_session(struct shell *s, int conn)
{
	__atomic_add_fetch(&session_waiters, 1, __ATOMIC_SEQ_CST);
	int rc = lock_session_wait(s, conn);
	__atomic_sub_fetch(&session_waiters, 1, __ATOMIC_SEQ_CST);
	return rc;
}

static int do_shell_run(const struct req *q, int conn, struct buf *resp, struct fail *f)
{
	if (check_timeout(q, f) < 0)
		return -1;
	struct shell *s = find_shell(q->ints[F_SHELL_ID], 0);
	if (!s)
		return failf(f, E_INVALID, NULL, "no shell session %lld", (long long)q->ints[F_SHELL_ID]);
	if (lock_session(s, conn) < 0) {
		shell_unref(s);
		return failf(f, E_INVALID, NULL, "cancelled while another command of the session ran");
	}
	int rc = s->closed ? failf(f, E_INVALID, NULL, "the shell session is closed") : shell_run(s, q, conn, resp, f);
	pthread_mutex_unlock(&s->lock);
	shell_unref(s);
	return rc;
}

static int do_shell_close(const struct req *q, struct buf *resp)
{
	struct shell *s = find_shell(q->ints[F_SHELL_ID], 1);
	if (s) {
		kill(-s->pid, SIGKILL); /* a command in flight ends now; the last user closes the pipes */
		shell_unref(s);
	}
	mp_map(resp, 1);
	mp_kv_str(resp, "kind", "ok");
	return 0;
}

/* ------------------------------------------------------------------------------------------------ spawn */

static int do_spawn(const struct req *q, struct buf *resp, struct fail *f)
{
	struct cmd c;
	char log[PATH_MAX];
	if (prepare(q, 1, &c, f) < 0) {
		cmd_free(&c);
		return -1;
	}
	if (HAS(q, F_LOG_PATH) && resolve(&q->strs[F_LOG_PATH], log, sizeof(log), f) < 0) {
		cmd_free(&c);
		return -1;
	}
	int out = HAS(q, F_LOG_PATH) ? open_regular(log, O_WRONLY | O_CREAT | O_APPEND, 0644, q->strs[F_LOG_PATH].s, f)
				     : open("/dev/null", O_WRONLY | O_CLOEXEC);
	if (out < 0) {
		cmd_free(&c);
		return HAS(q, F_LOG_PATH) ? -1 : fail_errno(f, errno, "/dev/null");
	}
	int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
	struct spawn_args a = {
		.exe = c.exe, .cwd = c.cwd, .argv = c.argv, .envp = c.envp, .fds = {null, out, out}, .cred = &c.cred};
	pthread_mutex_lock(&state_lock); /* no reap may see the pid before it is recorded */
	pid_t pid = spawn_child(&a, f);
	if (pid > 0) {
		if (nbgs == cap_bgs) {
			cap_bgs = cap_bgs ? 2 * cap_bgs : 16;
			bgs = realloc(bgs, cap_bgs * sizeof(*bgs));
			if (!bgs)
				abort();
		}
		bgs[nbgs++] = (struct bg){.pid = pid};
	}
	pthread_mutex_unlock(&state_lock);
	close(out);
	if (null >= 0)
		close(null);
	cmd_free(&c);
	if (pid < 0)
		return -1;
	mp_map(resp, 2);
	mp_kv_str(resp, "kind", "spawned");
	mp_str(resp, "pid");
	mp_int(resp, pid);
	return 0;
}

static int do_poll(const struct req *q, struct buf *resp, struct fail *f)
{
	int64_t pid = q->ints[F_PID];
	pthread_mutex_lock(&state_lock);
	struct bg *b = pid > 0 && pid <= INT_MAX ? find_bg((pid_t)pid) : NULL;
	int reaped = b ? b->reaped : 0, code = b ? b->code : 0;
	pthread_mutex_unlock(&state_lock);
	if (!b)
		return failf(f, E_INVALID, NULL, "no background process %lld", (long long)pid);
	mp_map(resp, 2);
	mp_kv_str(resp, "kind", "poll_result");
	mp_str(resp, "returncode");
	if (reaped)
		mp_int(resp, code);
	else
		mp_nil(resp);
	return 0;
}

static int do_signal(const struct req *q, struct buf *resp, struct fail *f)
{
	int64_t pid = q->ints[F_PID], sig = q->ints[F_SIGNAL];
	pthread_mutex_lock(&state_lock);
	struct bg *b = pid > 0 && pid <= INT_MAX ? find_bg((pid_t)pid) : NULL;
	int reaped = b ? b->reaped : 0;
	pthread_mutex_unlock(&state_lock);
	if (!b)
		return failf(f, E_INVALID, NULL, "no background process %lld", (long long)pid);
	if (sig < 0 || sig >= _NSIG)
		return failf(f, E_INVALID, NULL, "cannot send signal %lld: invalid signal", (long long)sig);
	/* A reaped pid may be reused: never signal it. */
	if (!reaped && kill(-(pid_t)pid, (int)sig) < 0 && errno != ESRCH)
		return failf(f, E_INVALID, NULL, "cannot send signal %lld: %s", (long long)sig, strerror(errno));
	mp_map(resp, 1);
	mp_kv_str(resp, "kind", "ok");
	return 0;
}

/* ------------------------------------------------------------------------------------------------ files */

static const char *file_kind(mode_t m)
{
	if (S_ISDIR(m))
		return "a directory";
	if (S_ISFIFO(m))
		return "a fifo";
	if (S_ISSOCK(m))
		return "a socket";
	if (S_ISCHR(m))
		return "a character device";
	if (S_ISBLK(m))
		return "a block device";
	if (S_ISLNK(m))
		return "a symlink";
	return "not a regular file";
}

/* Open a file of the workspace the agent reads or writes for a tool (resolve() has followed its symlinks): only a
 * regular file. A fifo would block the agent's thread until someone opens its other end, a device's open or read
 * may never end (or do something), a socket cannot be opened at all: each is refused with "invalid" (the host's
 * InvalidArgument), looked at with lstat before any open, and again with fstat on what was opened, since the
 * workspace may swap the name in between. O_NONBLOCK makes that open return at once whatever it meets; O_NOFOLLOW
 * refuses a symlink put there after resolve(); O_NOCTTY, a terminal. */
static int open_regular(const char *path, int flags, mode_t mode, const char *name, struct fail *f)
{
	struct stat st;
	if (lstat(path, &st) == 0 && !S_ISREG(st.st_mode))
		return failf(f, E_INVALID, name, "'%s' is %s, not a regular file", name, file_kind(st.st_mode));
	int fd = open(path, flags | O_NONBLOCK | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC, mode);
	if (fd < 0) {
		int e = errno;
		if (e == ELOOP || e == ENXIO || e == ENODEV)
			return failf(f, E_INVALID, name, "'%s' is not a regular file (it changed while it was opened: %s)",
				     name, strerror(e));
		return fail_errno(f, e, name);
	}
	if (fstat(fd, &st) < 0) {
		int e = errno;
		close(fd);
		return fail_errno(f, e, name);
	}
	if (!S_ISREG(st.st_mode)) {
		close(fd);
		return failf(f, E_INVALID, name, "'%s' is %s, not a regular file", name, file_kind(st.st_mode));
	}
	int fl = fcntl(fd, F_GETFL);
	if (fl >= 0)
		fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
	return fd;
}

static int do_read_file(const struct req *q, struct buf *resp, struct fail *f)
{
	char path[PATH_MAX];
	const char *name = q->strs[F_PATH].s;
	if (resolve(&q->strs[F_PATH], path, sizeof(path), f) < 0)
		return -1;
	int64_t max = HAS(q, F_MAX_BYTES) ? q->ints[F_MAX_BYTES] : -1;
	if (HAS(q, F_MAX_BYTES) && max < 0)
		return failf(f, E_INVALID, name, "max_bytes must not be negative");
	size_t limit = max >= 0 && (uint64_t)max < MAX_FILE_DATA ? (size_t)max : MAX_FILE_DATA;
	int fd = open_regular(path, O_RDONLY, 0, name, f);
	if (fd < 0)
		return -1;
	struct stat st;
	if (max < 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_size > MAX_FILE_DATA) {
		close(fd);
		return failf(f, E_INVALID, name, "'%s' is larger than %u MiB; read it in parts with max_bytes", name,
			     MAX_FILE_DATA >> 20);
	}
	struct buf data = {0};
	int truncated = 0;
	for (;;) {
		buf_reserve(&data, CHUNK);
		size_t room = limit + 1 - data.len; /* one byte more than allowed says "truncated" */
		ssize_t n = read(fd, data.p + data.len, room < CHUNK ? room : CHUNK);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			int e = errno;
			close(fd);
			buf_free(&data);
			return fail_errno(f, e, name);
		}
		if (n == 0)
			break;
		data.len += (size_t)n;
		if (data.len > limit) {
			data.len = limit;
			truncated = 1;
			break;
		}
	}
	close(fd);
	if (truncated && max < 0) {
		buf_free(&data);
		return failf(f, E_INVALID, name, "'%s' is larger than %u MiB; read it in parts with max_bytes", name,
			     MAX_FILE_DATA >> 20);
	}
	mp_map(resp, 3);
	mp_kv_str(resp, "kind", "file_data");
	mp_str(resp, "data");
	mp_bin(resp, data.p, data.len);
	mp_str(resp, "truncated");
	mp_bool(resp, truncated);
	buf_free(&data);
	return 0;
}

static int mkdirs(char *path)
{
	for (char *p = path + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = 0;
		int r = mkdir(path, 0777);
		int e = errno;
		*p = '/';
		if (r < 0 && e != EEXIST)
			return e;
	}
	struct stat st;
	if (mkdir(path, 0777) < 0 && errno != EEXIST)
		return errno;
	if (stat(path, &st) < 0)
		return errno;
	return S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
}

static int do_write_file(const struct req *q, struct buf *resp, struct fail *f)
{
	char path[PATH_MAX];
	const char *name = q->strs[F_PATH].s;
	if (resolve(&q->strs[F_PATH], path, sizeof(path), f) < 0)
		return -1;
	if (!strcmp(path, workdir))
		return failf(f, E_INVALID, name, "cannot write the workspace directory itself");
	int has_mode = HAS(q, F_MODE);
	int64_t mode = q->ints[F_MODE];
	if (has_mode && (mode < 0 || mode > 07777))
		return failf(f, E_INVALID, name, "invalid mode %lld", (long long)mode);
	if (q->bools[F_MAKE_PARENTS]) {
		char dir[PATH_MAX];
		memcpy(dir, path, strlen(path) + 1); /* path came from resolve(): shorter than PATH_MAX */
		*strrchr(dir, '/') = 0;
		int e = dir[0] ? mkdirs(dir) : 0;
		if (e)
			return fail_errno(f, e, name);
	}
	int flags = O_WRONLY | O_CREAT | (q->bools[F_APPEND] ? O_APPEND : O_TRUNC);
	int fd = open_regular(path, flags, has_mode ? (mode_t)mode : 0644, name, f);
	if (fd < 0)
		return -1;
	const uint8_t *p = q->bytes[F_DATA];
	size_t left = q->bytes_len[F_DATA];
	while (left) {
		ssize_t n = write(fd, p, left);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			int e = errno;
			close(fd);
			return fail_errno(f, e, name);
		}
		p += n;
		left -= (size_t)n;
	}
	if (has_mode && fchmod(fd, (mode_t)mode) < 0) {
		int e = errno;
		close(fd);
		return fail_errno(f, e, name);
	}
	if (close(fd) < 0)
		return fail_errno(f, errno, name);
	mp_map(resp, 1);
	mp_kv_str(resp, "kind", "ok");
	return 0;
}

struct entry {
	char *name;
	const char *kind;
	int64_t size;
};

static int entry_cmp(const void *a, const void *b)
{
	return strcmp(((const struct entry *)a)->name, ((const struct entry *)b)->name);
}

static int do_list_dir(const struct req *q, struct buf *resp, struct fail *f)
{
	char path[PATH_MAX];
	const char *name = q->strs[F_PATH].s;
	if (resolve(&q->strs[F_PATH], path, sizeof(path), f) < 0)
		return -1;
	int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd < 0)
		return fail_errno(f, errno, name);
	DIR *d = fdopendir(dfd);
	if (!d) {
		int e = errno;
		close(dfd);
		return fail_errno(f, e, name);
	}
	struct entry *ents = NULL;
	size_t n = 0, cap = 0, total = 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
			continue;
		total += 3 * strlen(e->d_name) + 40; /* what its entry takes in the answer at most (U+FFFD: 3 bytes) */
		if (total > MAX_LISTING) {
			closedir(d);
			for (size_t i = 0; i < n; i++)
				free(ents[i].name);
			free(ents);
			return failf(f, E_INVALID, name, "'%s' holds more entries than one listing carries (%u MiB); "
				     "list it with exec", name, MAX_LISTING >> 20);
		}
		struct stat st;
		if (fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
			continue; /* removed meanwhile */
		if (n == cap) {
			cap = cap ? 2 * cap : 64;
			ents = realloc(ents, cap * sizeof(*ents));
			if (!ents)
				abort();
		}
		ents[n].name = strdup(e->d_name);
		if (!ents[n].name)
			abort();
		ents[n].kind = S_ISLNK(st.st_mode)   ? "symlink"
			       : S_ISDIR(st.st_mode) ? "dir"
			       : S_ISREG(st.st_mode) ? "file"
						     : "other";
		ents[n].size = st.st_size;
		n++;
	}
	closedir(d);
	if (n)
		qsort(ents, n, sizeof(*ents), entry_cmp);
	mp_map(resp, 2);
	mp_kv_str(resp, "kind", "dir_listing");
	mp_str(resp, "entries");
	mp_array(resp, (uint32_t)n);
	for (size_t i = 0; i < n; i++) {
		mp_map(resp, 3);
		mp_kv_str(resp, "name", ents[i].name);
		mp_kv_str(resp, "kind", ents[i].kind);
		mp_str(resp, "size");
		mp_int(resp, ents[i].size);
		free(ents[i].name);
	}
	free(ents);
	return 0;
}

/* rm -r below an open directory, never following a symlink (unlinkat removes the link itself). */
static int remove_tree(int parent, const char *name, int depth)
{
	if (depth > 256)
		return ELOOP;
	int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return errno == ENOTDIR || errno == ELOOP ? (unlinkat(parent, name, 0) < 0 ? errno : 0) : errno;
	DIR *d = fdopendir(fd);
	if (!d) {
		int e = errno;
		close(fd);
		return e;
	}
	struct dirent *e;
	int err = 0;
	while (!err && (e = readdir(d))) {
		if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
			continue;
		if (e->d_type == DT_DIR || e->d_type == DT_UNKNOWN)
			err = remove_tree(fd, e->d_name, depth + 1);
		else if (unlinkat(fd, e->d_name, 0) < 0 && errno != ENOENT)
			err = errno;
	}
	closedir(d);
	if (!err && unlinkat(parent, name, AT_REMOVEDIR) < 0 && errno != ENOENT)
		err = errno;
	return err;
}

static int do_remove(const struct req *q, struct buf *resp, struct fail *f)
{
	const struct str *p = &q->strs[F_PATH];
	if (!p->len || p->has_nul)
		return failf(f, E_INVALID, p->s, "invalid path '%s'", p->s);
	char norm[PATH_MAX], parent[PATH_MAX], path[PATH_MAX * 2];
	int jerr = join_tool_path(p->s, norm, sizeof(norm));
	if (jerr)
		return fail_errno(f, jerr, p->s);
	if (!within(norm, workdir, workdir_len))
		return failf(f, E_PATH_OUTSIDE, p->s, "'%s' is outside the workspace directory %s", p->s, workdir);
	if (!strcmp(norm, workdir))
		return failf(f, E_INVALID, p->s, "cannot remove the workspace directory itself");
	/* A symlink is removed itself, never followed: resolve only its parent. */
	char *slash = strrchr(norm, '/');
	struct str dir = {.s = norm, .len = (size_t)(slash - norm)};
	*slash = 0;
	if (!dir.len) {
		dir.s = "/";
		dir.len = 1;
	}
	jerr = realpath_lax(dir.s, parent, sizeof(parent));
	if (jerr == ENAMETOOLONG)
		return fail_errno(f, jerr, p->s);
	if (jerr || !within(parent, workdir, workdir_len))
		return failf(f, E_PATH_OUTSIDE, p->s, "cannot remove '%s': it lies outside %s", p->s, workdir);
	if (path_fmt(path, sizeof(path), "%s/%s", parent, slash + 1))
		return fail_errno(f, ENAMETOOLONG, p->s);
	struct stat st;
	if (lstat(path, &st) < 0)
		return fail_errno(f, errno, p->s);
	int err = 0;
	if (S_ISDIR(st.st_mode)) {
		if (q->bools[F_RECURSIVE]) {
			int pfd = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
			if (pfd < 0)
				return fail_errno(f, errno, p->s);
			err = remove_tree(pfd, slash + 1, 0);
			close(pfd);
		} else if (rmdir(path) < 0)
			err = errno;
	} else if (unlink(path) < 0)
		err = errno;
	if (err)
		return fail_errno(f, err, p->s);
	mp_map(resp, 1);
	mp_kv_str(resp, "kind", "ok");
	return 0;
}

/* ------------------------------------------------------------------------------------------------ server */

static int do_ping(const struct req *q, struct buf *resp, struct fail *f)
{
	if (q->ints[F_VERSION] != PROTOCOL_VERSION)
		return failf(f, E_PROTOCOL, NULL, "host speaks protocol %lld, agent %d", (long long)q->ints[F_VERSION],
			     PROTOCOL_VERSION);
	const char *sh = shell_path();
	mp_map(resp, 5);
	mp_kv_str(resp, "kind", "pong");
	mp_str(resp, "version");
	mp_int(resp, PROTOCOL_VERSION);
	mp_str(resp, "pid");
	mp_int(resp, getpid());
	mp_kv_str(resp, "shell", sh);
	mp_str(resp, "waiting");
	mp_int(resp, __atomic_load_n(&session_waiters, __ATOMIC_SEQ_CST));
	return 0;
}

static int dispatch(const struct req *q, int conn, struct buf *resp, struct fail *f)
{
	reap_background();
	switch (q->op) {
	case OP_PING:
		return do_ping(q, resp, f);
	case OP_EXEC:
		return do_exec(q, conn, resp, f);
	case OP_SHELL_OPEN:
		return do_shell_open(q, resp, f);
	case OP_SHELL_RUN:
		return do_shell_run(q, conn, resp, f);
	case OP_SHELL_CLOSE:
		return do_shell_close(q, resp);
	case OP_READ_FILE:
		return do_read_file(q, resp, f);
	case OP_WRITE_FILE:
		return do_write_file(q, resp, f);
	case OP_LIST_DIR:
		return do_list_dir(q, resp, f);
	case OP_REMOVE:
		return do_remove(q, resp, f);
	case OP_SPAWN:
		return do_spawn(q, resp, f);
	case OP_SIGNAL:
		return do_signal(q, resp, f);
	case OP_POLL:
		return do_poll(q, resp, f);
	case OP_COUNT:
		break;
	}
	return failf(f, E_INVALID, NULL, "unknown request");
}

/* Read exactly n bytes. 0: done; 1: clean EOF before the first byte (when allowed); -1: EOF mid-way, error, or
 * the peer went silent for STALL_SECONDS mid-frame. */
static int recv_exact(int conn, uint8_t *p, size_t n, int eof_ok)
{
	size_t got = 0;
	while (got < n) {
		if (got || !eof_ok) {
			struct pollfd pfd = {conn, POLLIN, 0};
			int r = poll(&pfd, 1, STALL_SECONDS * 1000);
			if (r < 0 && errno == EINTR)
				continue;
			if (r <= 0)
				return -1;
		}
		ssize_t m = recv(conn, p + got, n - got, 0);
		if (m < 0 && errno == EINTR)
			continue;
		if (m == 0 && got == 0 && eof_ok)
			return 1;
		if (m <= 0)
			return -1;
		got += (size_t)m;
	}
	return 0;
}

static int send_all(int conn, const uint8_t *p, size_t n)
{
	while (n) {
		ssize_t m = send(conn, p, n, MSG_NOSIGNAL);
		if (m < 0 && errno == EINTR)
			continue;
		if (m <= 0)
			return -1;
		p += m;
		n -= (size_t)m;
	}
	return 0;
}

static int send_frame(int conn, struct buf *body)
{
	uint8_t hdr[4] = {(uint8_t)(body->len >> 24), (uint8_t)(body->len >> 16), (uint8_t)(body->len >> 8),
			  (uint8_t)body->len};
	return send_all(conn, hdr, 4) < 0 || send_all(conn, body->p, body->len) < 0 ? -1 : 0;
}

static void serve(int conn)
{
	for (;;) {
		uint8_t hdr[4];
		if (recv_exact(conn, hdr, 4, 1) != 0)
			break;
		uint32_t len = (uint32_t)hdr[0] << 24 | (uint32_t)hdr[1] << 16 | (uint32_t)hdr[2] << 8 | hdr[3];
		struct fail f = {0};
		struct buf resp = {0};
		uint8_t *body = NULL;
		if (len > MAX_REQUEST) {
			/* Refuse without reading it: the stream cannot be trusted to resynchronise, so answer and hang up. */
			failf(&f, E_PROTOCOL, NULL, "frame of %u bytes is larger than the agent accepts (%u MiB)", len,
			      MAX_REQUEST >> 20);
			encode_failure(&resp, &f);
			send_frame(conn, &resp);
			buf_free(&resp);
			break;
		}
		body = malloc(len ? len : 1);
		if (!body)
			abort();
		if (recv_exact(conn, body, len, 0) != 0) {
			free(body);
			break;
		}
		struct req q;
		int rc = decode_request(body, len, &q, &f);
		if (rc == 0)
			rc = dispatch(&q, conn, &resp, &f);
		if (rc < 0) {
			resp.len = 0;
			encode_failure(&resp, &f);
		}
		buf_free(&f.out);
		buf_free(&f.err);
		req_free(&q);
		free(body);
		int sent = send_frame(conn, &resp);
		buf_free(&resp);
		if (sent < 0)
			break;
	}
}

/* ------------------------------------------------------------------------------------------------ connection threads */

/* A thread is a task of the workspace's pid namespace: making one takes the namespace's next pid (kernel/pid.c,
 * alloc_pid), as a process does. Every snapshot closes the host's connections (_client.AgentClient.quiesce) and the
 * next call opens a new one, so an agent that made a thread per connection moved the workspace's pid sequence once
 * per dump in its line's history (issue #38: `cmd & echo $!` printed another pid after a committed fork). The pool
 * below is made before the agent reports ready, when no workspace process exists yet, and lives as long as the
 * agent: its threads keep their pids (3, 4, ...; pid 1 is bunshin-init, 2 the agent) in every snapshot, copy and
 * rollback. A connection that finds every pool thread busy gets a thread of its own, which ends with it (as every
 * connection did before): the sequence then moves, but only when the host runs more calls at once than the pool
 * holds (_client.agent_threads sizes it). The host never waits for a thread that is serving a live connection, so
 * a command that runs for ever cannot keep a signal or a poll from reaching the agent; it waits only for one whose
 * connection the host has closed (hand_over). */
#define DEFAULT_THREADS 6 /* _client.AGENT_THREADS */
#define MAX_THREADS 64
#define FREE_WAIT_SECONDS 2 /* how long a connection waits for a pool thread about to be free (hand_over) */

struct worker {
	pthread_cond_t wake;
	int conn; /* the connection handed over; -1 while idle */
};

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_idle; /* a worker went idle (CLOCK_MONOTONIC; only the main thread waits on it) */
static struct worker workers[MAX_THREADS];
static int npool;
/* The idle workers, a stack: the last one to finish serves the next connection, so that calls one at a time keep
 * reusing one thread's stack pages and the others' stay untouched (the workspace's memory counts them, and every
 * dump writes them). */
static struct worker *idle[MAX_THREADS];
static int nidle;

static void go_idle(struct worker *w)
{
	pthread_mutex_lock(&pool_lock);
	w->conn = -1;
	idle[nidle++] = w;
	pthread_cond_signal(&pool_idle);
	pthread_mutex_unlock(&pool_lock);
}

static void *pool_thread(void *arg)
{
	struct worker *w = arg;
	go_idle(w);
	for (;;) {
		pthread_mutex_lock(&pool_lock);
		while (w->conn < 0)
			pthread_cond_wait(&w->wake, &pool_lock);
		int conn = w->conn;
		pthread_mutex_unlock(&pool_lock);
		serve(conn);
		go_idle(w);
		close(conn);
	}
	return NULL;
}

static void *extra_thread(void *arg)
{
	int conn = (int)(intptr_t)arg;
	serve(conn);
	close(conn);
	return NULL;
}

/* The pool's size: BUNSHIN_AGENT_THREADS (the host's, sized below the workspace's pids limit), else the default. */
static int pool_size(void)
{
	const char *v = getenv("BUNSHIN_AGENT_THREADS");
	if (!v || !*v || strlen(v) > 2)
		return DEFAULT_THREADS;
	int n = 0;
	for (const char *c = v; *c; c++) {
		if (*c < '0' || *c > '9')
			return DEFAULT_THREADS;
		n = n * 10 + (*c - '0');
	}
	return n >= 1 && n <= MAX_THREADS ? n : DEFAULT_THREADS;
}

/* Make the pool and wait until every thread of it waits for a connection: one arriving before would get a thread
 * of its own, a pid the next start-up would not take. A pool thread that cannot be made (a pids limit below the
 * pool) leaves a smaller pool. */
static void start_pool(const pthread_attr_t *attr)
{
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&pool_idle, &ca);
	int n = pool_size();
	for (; npool < n; npool++) {
		pthread_cond_init(&workers[npool].wake, NULL);
		workers[npool].conn = -1;
		pthread_t t;
		if (pthread_create(&t, attr, pool_thread, &workers[npool]) != 0)
			break;
	}
	pthread_mutex_lock(&pool_lock);
	while (nidle < npool)
		pthread_cond_wait(&pool_idle, &pool_lock);
	pthread_mutex_unlock(&pool_lock);
}

/* Whether a busy pool thread is about to be free: the host hung up its connection (the thread then reads the end,
 * or kills what the connection ran, and goes idle). With pool_lock held: a thread holding a connection has not
 * closed it yet (go_idle comes first), so its descriptor is still that connection. */
static int finishing(void)
{
	for (int i = 0; i < npool; i++)
		if (workers[i].conn >= 0 && hung_up(workers[i].conn))
			return 1;
	return 0;
}

static void hand_over(int conn, const pthread_attr_t *attr)
{
	pthread_mutex_lock(&pool_lock);
	if (!nidle && finishing()) {
		/* A dump closed every connection the pool served and the host connects again at once: take the thread
		 * about to be free, not a new one (a pid). The host closed before it connected (a Unix socket's close
		 * is seen at once), so this does not depend on which thread runs first. Bounded: a command that
		 * outlives its SIGKILL (uninterruptible sleep) does not hold the host up for long. */
		struct timespec until;
		clock_gettime(CLOCK_MONOTONIC, &until);
		until.tv_sec += FREE_WAIT_SECONDS;
		while (!nidle && pthread_cond_timedwait(&pool_idle, &pool_lock, &until) != ETIMEDOUT)
			;
	}
	if (nidle) {
		struct worker *w = idle[--nidle];
		w->conn = conn;
		pthread_cond_signal(&w->wake);
		pthread_mutex_unlock(&pool_lock);
		return;
	}
	pthread_mutex_unlock(&pool_lock);
	pthread_t t;
	if (pthread_create(&t, attr, extra_thread, (void *)(intptr_t)conn) != 0)
		close(conn); /* no thread (pids limit): the client sees a hang-up, WorkspaceClosed */
}

int main(void)
{
	signal(SIGPIPE, SIG_IGN);
	/* Idle agents should hold few pages (every workspace has one, every fork dumps it): one malloc arena, large
	 * buffers mmapped and returned when freed. */
	mallopt(M_ARENA_MAX, 1);
	mallopt(M_MMAP_THRESHOLD, 128 << 10);
	mallopt(M_TRIM_THRESHOLD, 128 << 10);
	const char *wd = getenv("BUNSHIN_WORKDIR");
	if (wd && wd[0] == '/')
		workdir = wd;
	char wdbuf[PATH_MAX / 2];
	if (path_fmt(wdbuf, sizeof(wdbuf), "%s", workdir)) { /* tool paths are joined to it: leave them room */
		dprintf(3, "E workdir of %zu bytes is longer than %d\n", strlen(workdir), PATH_MAX / 2 - 1);
		return 1;
	}
	workdir_len = strlen(workdir);
	mkdir(SOCKET_DIR, 0700);
	mkdirs(wdbuf);
	if (chdir(workdir) < 0) {
		dprintf(3, "E chdir %s: %s\n", workdir, strerror(errno));
		return 1;
	}
	unlink(SOCKET_PATH);
	int srv = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", SOCKET_PATH);
	if (srv < 0 || bind(srv, (struct sockaddr *)&addr, sizeof(addr)) < 0 || listen(srv, 128) < 0) {
		dprintf(3, "E agent socket %s: %s\n", SOCKET_PATH, strerror(errno));
		return 1;
	}
	pthread_attr_t attr;
	pthread_attr_init(&attr);
	pthread_attr_setstacksize(&attr, THREAD_STACK);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	start_pool(&attr);
	if (write(3, "R", 1) == 1) /* started by bunshin-init: the ready pipe */
		close(3);
	for (;;) {
		int conn = accept4(srv, NULL, NULL, SOCK_CLOEXEC);
		if (conn < 0) {
			if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS)
				usleep(10000); /* a flood of connections: let the existing ones finish */
			continue;
		}
		hand_over(conn, &attr);
	}
}
