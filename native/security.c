/*
 * The workspace's security boundary, applied by bunshin-init's pid 1 (native/init.c) before it re-execs itself, so
 * every process of the workspace inherits it; CRIU dumps and restores all of it (mounts, rlimits, capability sets,
 * no_new_privs, seccomp filters: images/creds.proto, criu/pie/restorer.c), so copies keep it.
 *
 * What runc and the major engines do by default:
 * - /proc and /sys: runc's masked paths (a bind of /dev/null over a file, of an empty read-only directory over a
 *   directory, not a tmpfs: CRIU archives every tmpfs with tar at each dump and restore) and read-only paths.
 * - capabilities: every set (bounding, permitted, effective, inheritable, ambient) reduced to the container default
 *   set (moby's oci/caps/defaults.go, without NET_RAW: see _security.py), so a root process that execs keeps no more.
 * - no_new_privs, then a seccomp filter equivalent to moby's profiles/seccomp/default.json on x86-64: an allow-list,
 *   EPERM for everything else; syscalls that need a capability the profile gates (mount, unshare, bpf, reboot, ...)
 *   are allowed only when that capability is kept; clone without namespace flags; clone3 answers ENOSYS (so libc
 *   falls back to clone, whose flags the filter can see); socket without AF_VSOCK; personality only the values moby
 *   allows; io_uring (which would bypass the filter), keyctl, userfaultfd and kexec never. 32-bit and x32
 *   syscalls are denied outright (moby allows them; nothing in a workspace needs them).
 * The kernel caches the verdict of syscalls the filter allows without looking at arguments (seccomp's action
 * cache, 5.11+), so the filter costs nothing on them.
 */
#define _GNU_SOURCE
#include "security.h"

#include <errno.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Syscalls newer than the build host's headers (x86-64 numbers, arch/x86/entry/syscalls/syscall_64.tbl). */
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
#ifndef __NR_fchmodat2
#define __NR_fchmodat2 452
#endif
#ifndef __NR_map_shadow_stack
#define __NR_map_shadow_stack 453
#endif
#ifndef __NR_futex_wake
#define __NR_futex_wake 454
#endif
#ifndef __NR_futex_wait
#define __NR_futex_wait 455
#endif
#ifndef __NR_futex_requeue
#define __NR_futex_requeue 456
#endif
#ifndef __NR_uretprobe
#define __NR_uretprobe 335
#endif
#ifndef CAP_PERFMON
#define CAP_PERFMON 38
#endif
#ifndef CAP_BPF
#define CAP_BPF 39
#endif
#ifndef AF_VSOCK
#define AF_VSOCK 40
#endif

int security_arg(struct security *s, const char *key, const char *value)
{
	char *end;
	if (!strcmp(key, "--caps")) {
		s->caps = strtoull(value, &end, 16);
	} else if (!strcmp(key, "--seccomp")) {
		s->seccomp = (int)strtol(value, &end, 10);
	} else if (!strcmp(key, "--masks")) {
		s->masks = (int)strtol(value, &end, 10);
	} else if (!strcmp(key, "--nofile")) {
		s->nofile = strtol(value, &end, 10);
	} else {
		return 0;
	}
	s->set = 1;
	return (*value && !*end) ? 1 : -1;
}

/* ------------------------------------------------------------------------------------------------ mounts */

/* runc's defaults (libcontainer/specconv/example.go, moby's oci/defaults.go), plus /proc/kmsg: reading it needs
 * CAP_SYSLOG, which is dropped, but the node should not be there at all. Relative to the new root. */
static const char *const masked[] = {
	"proc/asound", "proc/acpi", "proc/interrupts", "proc/kcore", "proc/keys", "proc/latency_stats",
	"proc/timer_list", "proc/timer_stats", "proc/sched_debug", "proc/scsi", "proc/kmsg", "proc/sysrq-trigger",
	"sys/firmware", "sys/devices/virtual/powercap", "sys/kernel/security", "sys/kernel/debug", NULL,
};
static const char *const read_only[] = {"proc/bus", "proc/fs", "proc/irq", "proc/sys", NULL};

/* An empty directory of the agent layer (_image.agent_layer): what a masked directory shows. */
#define EMPTY_DIR "opt/bunshin/empty"

static int bind_ro(const char *src, const char *dst, unsigned long flags)
{
	if (mount(src, dst, NULL, MS_BIND | MS_REC, NULL) < 0)
		return -1;
	return mount(NULL, dst, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC | flags, NULL);
}

const char *security_mounts(const struct security *s)
{
	static char step[160];
	struct stat st;
	if (!s->masks)
		return NULL;
	for (int i = 0; read_only[i]; i++) {
		if (lstat(read_only[i], &st) < 0)
			continue;
		if (bind_ro(read_only[i], read_only[i], MS_NODEV) < 0) {
			snprintf(step, sizeof(step), "bind %s read-only", read_only[i]);
			return step;
		}
	}
	for (int i = 0; masked[i]; i++) {
		if (lstat(masked[i], &st) < 0)
			continue;
		/* a masked file reads as empty (dev/null, so not nodev), as in runc */
		int dir = S_ISDIR(st.st_mode);
		if (bind_ro(dir ? EMPTY_DIR : "dev/null", masked[i], dir ? MS_NODEV : 0) < 0) {
			snprintf(step, sizeof(step), "mask %s", masked[i]);
			return step;
		}
	}
	return NULL;
}

/* ------------------------------------------------------------------------------------------------ seccomp */

/* moby's default allow-list (profiles/seccomp/default.json, the unconditional part), the x86-64 names, with the
 * syscalls added to it since 6.x (cachestat, fchmodat2, futex2, map_shadow_stack, uretprobe). Left out on purpose:
 * io_uring_* (its operations bypass seccomp; moby dropped them too in 25.0) and name_to_handle_at (gated with its
 * pair open_by_handle_at, the "shocker" escape, on CAP_DAC_READ_SEARCH). Never allowed, whatever is kept: keyctl,
 * add_key, request_key, userfaultfd, kexec_*, pivot_root, swapon/swapoff, and anything not listed. */
static const int allowed[] = {
	__NR_accept, __NR_accept4, __NR_access, __NR_adjtimex, __NR_alarm, __NR_bind, __NR_brk, __NR_cachestat,
	__NR_capget, __NR_capset, __NR_chdir, __NR_chmod, __NR_chown, __NR_clock_adjtime, __NR_clock_getres,
	__NR_clock_gettime, __NR_clock_nanosleep, __NR_close, __NR_close_range, __NR_connect, __NR_copy_file_range,
	__NR_creat, __NR_dup, __NR_dup2, __NR_dup3, __NR_epoll_create, __NR_epoll_create1, __NR_epoll_ctl,
	__NR_epoll_ctl_old, __NR_epoll_pwait, __NR_epoll_pwait2, __NR_epoll_wait, __NR_epoll_wait_old, __NR_eventfd,
	__NR_eventfd2, __NR_execve, __NR_execveat, __NR_exit, __NR_exit_group, __NR_faccessat, __NR_faccessat2,
	__NR_fadvise64, __NR_fallocate, __NR_fanotify_mark, __NR_fchdir, __NR_fchmod, __NR_fchmodat, __NR_fchmodat2,
	__NR_fchown, __NR_fchownat, __NR_fcntl, __NR_fdatasync, __NR_fgetxattr, __NR_flistxattr, __NR_flock, __NR_fork,
	__NR_fremovexattr, __NR_fsetxattr, __NR_fstat, __NR_fstatfs, __NR_fsync, __NR_ftruncate, __NR_futex,
	__NR_futex_requeue, __NR_futex_wait, __NR_futex_waitv, __NR_futex_wake, __NR_futimesat, __NR_getcpu,
	__NR_getcwd, __NR_getdents, __NR_getdents64, __NR_getegid, __NR_geteuid, __NR_getgid, __NR_getgroups,
	__NR_getitimer, __NR_getpeername, __NR_getpgid, __NR_getpgrp, __NR_getpid, __NR_getppid, __NR_getpriority,
	__NR_getrandom, __NR_getresgid, __NR_getresuid, __NR_getrlimit, __NR_get_robust_list, __NR_getrusage,
	__NR_getsid, __NR_getsockname, __NR_getsockopt, __NR_get_thread_area, __NR_gettid, __NR_gettimeofday,
	__NR_getuid, __NR_getxattr, __NR_inotify_add_watch, __NR_inotify_init, __NR_inotify_init1,
	__NR_inotify_rm_watch, __NR_io_cancel, __NR_ioctl, __NR_io_destroy, __NR_io_getevents, __NR_io_pgetevents,
	__NR_ioprio_get, __NR_ioprio_set, __NR_io_setup, __NR_io_submit, __NR_kill, __NR_landlock_add_rule,
	__NR_landlock_create_ruleset, __NR_landlock_restrict_self, __NR_lchown, __NR_lgetxattr, __NR_link,
	__NR_linkat, __NR_listen, __NR_listxattr, __NR_llistxattr, __NR_lremovexattr, __NR_lseek, __NR_lsetxattr,
	__NR_lstat, __NR_madvise, __NR_map_shadow_stack, __NR_membarrier, __NR_memfd_create, __NR_memfd_secret,
	__NR_mincore, __NR_mkdir, __NR_mkdirat, __NR_mknod, __NR_mknodat, __NR_mlock, __NR_mlock2, __NR_mlockall,
	__NR_mmap, __NR_mprotect, __NR_mq_getsetattr, __NR_mq_notify, __NR_mq_open, __NR_mq_timedreceive,
	__NR_mq_timedsend, __NR_mq_unlink, __NR_mremap, __NR_msgctl, __NR_msgget, __NR_msgrcv, __NR_msgsnd,
	__NR_msync, __NR_munlock, __NR_munlockall, __NR_munmap, __NR_nanosleep, __NR_newfstatat, __NR_open,
	__NR_openat, __NR_openat2, __NR_pause, __NR_pidfd_open, __NR_pidfd_send_signal, __NR_pipe, __NR_pipe2,
	__NR_pkey_alloc, __NR_pkey_free, __NR_pkey_mprotect, __NR_poll, __NR_ppoll, __NR_prctl, __NR_pread64,
	__NR_preadv, __NR_preadv2, __NR_prlimit64, __NR_process_mrelease, __NR_pselect6, __NR_pwrite64, __NR_pwritev,
	__NR_pwritev2, __NR_read, __NR_readahead, __NR_readlink, __NR_readlinkat, __NR_readv, __NR_recvfrom,
	__NR_recvmmsg, __NR_recvmsg, __NR_remap_file_pages, __NR_removexattr, __NR_rename, __NR_renameat,
	__NR_renameat2, __NR_restart_syscall, __NR_rmdir, __NR_rseq, __NR_rt_sigaction, __NR_rt_sigpending, __NR_rt_sigprocmask,
	__NR_rt_sigqueueinfo, __NR_rt_sigreturn, __NR_rt_sigsuspend, __NR_rt_sigtimedwait, __NR_rt_tgsigqueueinfo,
	__NR_sched_getaffinity, __NR_sched_getattr, __NR_sched_getparam, __NR_sched_get_priority_max,
	__NR_sched_get_priority_min, __NR_sched_getscheduler, __NR_sched_rr_get_interval, __NR_sched_setaffinity,
	__NR_sched_setattr, __NR_sched_setparam, __NR_sched_setscheduler, __NR_sched_yield, __NR_seccomp,
	__NR_select, __NR_semctl, __NR_semget, __NR_semop, __NR_semtimedop, __NR_sendfile, __NR_sendmmsg,
	__NR_sendmsg, __NR_sendto, __NR_setfsgid, __NR_setfsuid, __NR_setgid, __NR_setgroups, __NR_setitimer,
	__NR_setpgid, __NR_setpriority, __NR_setregid, __NR_setresgid, __NR_setresuid, __NR_setreuid,
	__NR_setrlimit, __NR_set_robust_list, __NR_setsid, __NR_setsockopt, __NR_set_thread_area,
	__NR_set_tid_address, __NR_setuid, __NR_setxattr, __NR_shmat, __NR_shmctl, __NR_shmdt, __NR_shmget,
	__NR_shutdown, __NR_sigaltstack, __NR_signalfd, __NR_signalfd4, __NR_socketpair, __NR_splice, __NR_stat,
	__NR_statfs, __NR_statx, __NR_symlink, __NR_symlinkat, __NR_sync, __NR_sync_file_range, __NR_syncfs,
	__NR_sysinfo, __NR_tee, __NR_tgkill, __NR_time, __NR_timer_create, __NR_timer_delete, __NR_timer_getoverrun,
	__NR_timer_gettime, __NR_timer_settime, __NR_timerfd_create, __NR_timerfd_gettime, __NR_timerfd_settime,
	__NR_times, __NR_tkill, __NR_truncate, __NR_umask, __NR_uname, __NR_unlink, __NR_unlinkat, __NR_uretprobe,
	__NR_utime, __NR_utimensat, __NR_utimes, __NR_vfork, __NR_vmsplice, __NR_wait4, __NR_waitid, __NR_write,
	__NR_writev,
	/* x86-64 only (moby's amd64 block) */
	__NR_arch_prctl, __NR_modify_ldt,
	/* moby allows these without CAP_SYS_PTRACE on kernels >= 4.8, where ptrace can no longer bypass seccomp; only
	 * processes of the workspace's own pid namespace can be named. */
	__NR_ptrace, __NR_process_vm_readv, __NR_process_vm_writev,
};

/* moby's capability-gated rules: allowed only when the workspace keeps that capability (Security(capabilities=)). */
struct gated {
	int cap;
	int nrs[20];
};
static const struct gated gated[] = {
	{CAP_SYS_ADMIN,
	 {__NR_fanotify_init, __NR_fsconfig, __NR_fsmount, __NR_fsopen, __NR_fspick, __NR_lookup_dcookie, __NR_mount,
	  __NR_mount_setattr, __NR_move_mount, __NR_open_tree, __NR_quotactl, __NR_quotactl_fd, __NR_setdomainname,
	  __NR_sethostname, __NR_setns, __NR_umount2, __NR_unshare, 0}},
	{CAP_SYS_BOOT, {__NR_reboot, 0}},
	{CAP_SYS_CHROOT, {__NR_chroot, 0}},
	{CAP_SYS_MODULE, {__NR_delete_module, __NR_init_module, __NR_finit_module, 0}},
	{CAP_SYS_PACCT, {__NR_acct, 0}},
	{CAP_SYS_PTRACE, {__NR_kcmp, __NR_pidfd_getfd, __NR_process_madvise, 0}},
	{CAP_SYS_RAWIO, {__NR_iopl, __NR_ioperm, 0}},
	{CAP_SYS_TIME, {__NR_settimeofday, __NR_clock_settime, 0}},
	{CAP_SYS_TTY_CONFIG, {__NR_vhangup, 0}},
	{CAP_SYS_NICE, {__NR_get_mempolicy, __NR_mbind, __NR_set_mempolicy, __NR_set_mempolicy_home_node, 0}},
	{CAP_SYSLOG, {__NR_syslog, 0}},
	{CAP_BPF, {__NR_bpf, 0}},
	{CAP_PERFMON, {__NR_perf_event_open, 0}},
	{CAP_DAC_READ_SEARCH, {__NR_open_by_handle_at, __NR_name_to_handle_at, 0}},
};

#define MAX_INSNS 1024
#define NS_FLAGS 0x7E020000u /* CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET: moby's clone mask */
#define ARG0_LO offsetof(struct seccomp_data, args[0]) /* x86-64 is little-endian: the low 32 bits come first */

struct prog {
	struct sock_filter insns[MAX_INSNS];
	unsigned short len;
};

static void emit(struct prog *p, unsigned short code, unsigned char jt, unsigned char jf, unsigned int k)
{
	if (p->len < MAX_INSNS)
		p->insns[p->len++] = (struct sock_filter)BPF_JUMP(code, k, jt, jf);
}

#define RET(p, v) emit(p, BPF_RET | BPF_K, 0, 0, v)
#define EPERM_ (SECCOMP_RET_ERRNO | EPERM)
#define LOAD_NR(p) emit(p, BPF_LD | BPF_W | BPF_ABS, 0, 0, offsetof(struct seccomp_data, nr))
#define LOAD_ARG0(p) emit(p, BPF_LD | BPF_W | BPF_ABS, 0, 0, ARG0_LO)

/* "if nr == NR: <block of n instructions ending in RET>" */
#define IF_NR(p, nr, n) emit(p, BPF_JMP | BPF_JEQ | BPF_K, 0, n, nr)

static int has(uint64_t caps, int cap) { return (caps >> cap) & 1; }

static int cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

static struct run {
	int first, last;
} runs[512];

/* Instructions tree(lo, hi) emits: a leaf is 4, an inner node 1 plus its two subtrees. */
static int tree_len(int lo, int hi)
{
	if (lo == hi)
		return 4;
	int mid = (lo + hi + 1) / 2;
	return 1 + tree_len(lo, mid - 1) + tree_len(mid, hi);
}

/* nr is in one of runs[lo..hi], or denied. Jumps go forward only and skip at most 255 instructions (classic BPF):
 * the left subtree of the root of ~60 runs is ~120. */
static void tree(struct prog *p, int lo, int hi)
{
	if (lo == hi) {
		emit(p, BPF_JMP | BPF_JGE | BPF_K, 0, 2, (unsigned int)runs[lo].first);
		emit(p, BPF_JMP | BPF_JGT | BPF_K, 1, 0, (unsigned int)runs[lo].last);
		RET(p, SECCOMP_RET_ALLOW);
		RET(p, EPERM_);
		return;
	}
	int mid = (lo + hi + 1) / 2, left = tree_len(lo, mid - 1);
	if (left > 255) {
		p->len = MAX_INSNS; /* reported as E2BIG by security_apply */
		return;
	}
	emit(p, BPF_JMP | BPF_JGE | BPF_K, (unsigned char)left, 0, (unsigned int)runs[mid].first);
	tree(p, lo, mid - 1);
	tree(p, mid, hi);
}

static void build(struct prog *p, uint64_t caps)
{
	emit(p, BPF_LD | BPF_W | BPF_ABS, 0, 0, offsetof(struct seccomp_data, arch));
	emit(p, BPF_JMP | BPF_JEQ | BPF_K, 1, 0, AUDIT_ARCH_X86_64);
	RET(p, EPERM_);
	LOAD_NR(p);
	emit(p, BPF_JMP | BPF_JGE | BPF_K, 0, 1, 0x40000000u); /* __X32_SYSCALL_BIT */
	RET(p, EPERM_);

	if (has(caps, CAP_SYS_ADMIN)) {
		IF_NR(p, __NR_clone, 1);
		RET(p, SECCOMP_RET_ALLOW);
		IF_NR(p, __NR_clone3, 1);
		RET(p, SECCOMP_RET_ALLOW);
	} else {
		IF_NR(p, __NR_clone, 4); /* no new namespaces */
		LOAD_ARG0(p);
		emit(p, BPF_JMP | BPF_JSET | BPF_K, 0, 1, NS_FLAGS);
		RET(p, EPERM_);
		RET(p, SECCOMP_RET_ALLOW);
		IF_NR(p, __NR_clone3, 1); /* flags sit behind a pointer: ENOSYS, so libc falls back to clone */
		RET(p, SECCOMP_RET_ERRNO | ENOSYS);
	}
	IF_NR(p, __NR_socket, 4);
	LOAD_ARG0(p);
	emit(p, BPF_JMP | BPF_JEQ | BPF_K, 0, 1, AF_VSOCK);
	RET(p, EPERM_);
	RET(p, SECCOMP_RET_ALLOW);
	static const unsigned int personas[] = {0x0, 0x8, 0x20000, 0x20008, 0xffffffffu};
	IF_NR(p, __NR_personality, 8);
	LOAD_ARG0(p);
	for (int i = 0; i < 5; i++)
		emit(p, BPF_JMP | BPF_JEQ | BPF_K, (unsigned char)(5 - i), 0, personas[i]);
	RET(p, EPERM_);
	RET(p, SECCOMP_RET_ALLOW);

	/* The allow-list as a balanced tree over runs of consecutive syscall numbers: ~10 instructions a syscall
	 * instead of a scan of hundreds, so installing the filter (the kernel emulates it once per syscall number to
	 * fill its action cache, and every CRIU restore installs it again in each task) stays cheap. */
	int nrs[512], n = 0;
	for (size_t i = 0; i < sizeof(allowed) / sizeof(allowed[0]); i++)
		nrs[n++] = allowed[i];
	for (size_t g = 0; g < sizeof(gated) / sizeof(gated[0]); g++)
		if (has(caps, gated[g].cap))
			for (const int *nr = gated[g].nrs; *nr && n < 512; nr++)
				nrs[n++] = *nr;
	qsort(nrs, (size_t)n, sizeof(nrs[0]), cmp_int);
	int nruns = 0;
	for (int i = 0; i < n; i++) {
		if (nruns && nrs[i] <= runs[nruns - 1].last + 1) {
			if (nrs[i] > runs[nruns - 1].last)
				runs[nruns - 1].last = nrs[i];
		} else {
			runs[nruns].first = runs[nruns].last = nrs[i];
			nruns++;
		}
	}
	tree(p, 0, nruns - 1);
}

/* ------------------------------------------------------------------------------------------------ apply */

static const char *drop_caps(uint64_t keep)
{
	for (int cap = 0; cap <= 63; cap++) {
		if (has(keep, cap))
			continue;
		if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0) {
			if (errno == EINVAL) /* past the kernel's last capability */
				break;
			return "drop bounding capability";
		}
	}
	if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
		return "clear ambient capabilities";
	struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
	struct __user_cap_data_struct data[2] = {0};
	if (syscall(SYS_capget, &hdr, data) < 0)
		return "capget";
	for (int i = 0; i < 2; i++) {
		uint32_t k = (uint32_t)(keep >> (32 * i));
		data[i].effective &= k;
		data[i].permitted &= k;
		data[i].inheritable = 0; /* as moby since 23.0 (CVE-2022-24769) */
	}
	if (syscall(SYS_capset, &hdr, data) < 0)
		return "capset";
	return NULL;
}

const char *security_apply(const struct security *s)
{
	if (!s->set)
		return NULL;
	if (s->nofile > 0) {
		struct rlimit rl = {.rlim_cur = (rlim_t)s->nofile, .rlim_max = (rlim_t)s->nofile}, cur;
		/* Raising the hard limit needs CAP_SYS_RESOURCE, which a host in a container may lack: then the host's
		 * hard limit, lower than asked and so stricter, is the workspace's. */
		if (setrlimit(RLIMIT_NOFILE, &rl) < 0) {
			if (errno != EPERM || getrlimit(RLIMIT_NOFILE, &cur) < 0 || cur.rlim_max >= rl.rlim_max)
				return "setrlimit RLIMIT_NOFILE";
			rl.rlim_cur = rl.rlim_max = cur.rlim_max;
			if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
				return "setrlimit RLIMIT_NOFILE";
		}
	}
	const char *err = drop_caps(s->caps);
	if (err)
		return err;
	if (!s->seccomp)
		return NULL;
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		return "no_new_privs";
	static struct prog p;
	p.len = 0;
	build(&p, s->caps);
	if (p.len >= MAX_INSNS) {
		errno = E2BIG;
		return "seccomp filter";
	}
	struct sock_fprog fprog = {.len = p.len, .filter = p.insns};
	if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog, 0, 0) < 0)
		return "seccomp filter";
	return NULL;
}
