/* The workspace's security boundary as pid 1 applies it (native/security.c): masked and read-only /proc and /sys
 * paths, resource limits, the capability sets, no_new_privs and the seccomp filter. */
#ifndef BUNSHIN_SECURITY_H
#define BUNSHIN_SECURITY_H

#include <stdint.h>

struct security {
	int set;          /* any --caps/--seccomp/--masks/--nofile given; without them nothing is changed */
	uint64_t caps;    /* capabilities every set is reduced to (bit n = capability n) */
	int seccomp;      /* 1: install the default-profile filter (cap-gated syscalls follow `caps`) */
	int masks;        /* 1: mask and bind read-only the /proc and /sys paths runc does */
	long nofile;      /* RLIMIT_NOFILE soft and hard limit; 0 leaves it */
};

/* Parses one "--caps HEX" / "--seccomp 0|1" / "--masks 0|1" / "--nofile N" pair; 1 if it was one of ours, -1 on a
 * bad value, 0 for another option. */
int security_arg(struct security *s, const char *key, const char *value);

/* In the new mount namespace, cwd at the new root (before pivot_root), proc, sys and dev mounted below it. Returns
 * NULL, or the step that failed with errno set. */
const char *security_mounts(const struct security *s);

/* Right before pid 1 execs: limits, capabilities, no_new_privs, seccomp. Everything started in the workspace
 * afterwards inherits them (and CRIU restores them in copies). Returns NULL, or the failed step with errno set. */
const char *security_apply(const struct security *s);

#endif
