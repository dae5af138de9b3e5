/* What the guest test programs (tmpl_test.c, criu_test.c) share: the failure list their result line carries, a
 * monotonic clock in milliseconds, and the pattern their workloads fill memory with. */
#ifndef BUNSHIN_KMOD_GUEST_H
#define BUNSHIN_KMOD_GUEST_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static char failures[4096]; /* JSON strings, comma-separated: the result line's "failures" list */
static int nfail;

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char *fmt, ...)
{
	char msg[256];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	fprintf(stderr, "FAIL: %s\n", msg);
	for (char *p = msg; *p; p++) /* keep the result line valid JSON */
		if (*p == '"' || *p == '\\')
			*p = '\'';
	if (strlen(failures) + strlen(msg) + 4 < sizeof(failures))
		snprintf(failures + strlen(failures), sizeof(failures) - strlen(failures), "%s\"%s\"",
			 nfail ? "," : "", msg);
	nfail++;
}

static inline double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* The workloads' pattern (splitmix64): word i of a range holds mix(i), so a misplaced or zeroed page changes the
 * digest. */
static inline uint64_t mix(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ULL;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
	return x ^ (x >> 31);
}

#endif
