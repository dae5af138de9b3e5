// wptrack: can a host track a workspace process's writes without a kernel module (issue 39)?
//
// A child maps memory, registers it with a userfaultfd in async write-protect mode (UFFD_USER_MODE_ONLY,
// UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED, UFFDIO_REGISTER_MODE_WP), hands the uffd to the host with
// SCM_RIGHTS and closes its own copy, so its fd table holds no userfaultfd (what CRIU cannot dump, criu#2021).
// The host then reads and re-arms the child's written pages with PAGEMAP_SCAN on /proc/<pid>/pagemap
// (PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC, category PAGE_IS_WRITTEN): the kernel's replacement for soft-dirty.
//
//   wptrack check                 facts as key=value lines (exact page counts; tests/fork/test_wptrack.py asserts them)
//   wptrack bench MIB DIRTY ROUNDS  pre-copy pass while running, then a frozen pass copying only the written pages,
//                                 beside a frozen full copy (today's dump); one JSON line
//   wptrack hold MIB              a tracked child for a real `criu dump`: prints its pid, then reads commands
//                                 (scan | sum | quit) on stdin
//   wptrack inspect PID ADDR LEN  tracked pages (PAGE_IS_WPALLOWED), "uw" in smaps VmFlags and a checksum of a range
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <linux/types.h>
#include <linux/userfaultfd.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <stddef.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

// include/uapi/linux/fs.h (6.7+); spelled out so the tool builds against older headers too.
#define PAGE_IS_WPALLOWED (1 << 0)
#define PAGE_IS_WRITTEN (1 << 1)
#define PAGE_IS_FILE (1 << 2)
#define PAGE_IS_PRESENT (1 << 3)
#define PAGE_IS_SWAPPED (1 << 4)
#define PAGE_IS_PFNZERO (1 << 5)
#define PM_SCAN_WP_MATCHING (1 << 0)
#define PM_SCAN_CHECK_WPASYNC (1 << 1)
struct page_region {
	__u64 start, end, categories;
};
struct pm_scan_arg {
	__u64 size, flags, start, end, walk_end, vec, vec_len, max_pages, category_inverted, category_mask,
		category_anyof_mask, return_mask;
};
#define PAGEMAP_SCAN _IOWR('f', 16, struct pm_scan_arg)
#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif
#ifndef UFFD_FEATURE_WP_UNPOPULATED
#define UFFD_FEATURE_WP_UNPOPULATED (1 << 13)
#endif
#ifndef UFFD_FEATURE_WP_ASYNC
#define UFFD_FEATURE_WP_ASYNC (1 << 15)
#endif

#define PG 4096UL
#define VEC_LEN 65536

static void die(const char *what)
{
	perror(what);
	exit(2);
}

static double now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void send_fd(int sock, int fd)
{
	char byte = 0, ctl[CMSG_SPACE(sizeof(int))];
	struct iovec io = { &byte, 1 };
	struct msghdr m = { .msg_iov = &io, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl };
	struct cmsghdr *h = CMSG_FIRSTHDR(&m);
	h->cmsg_level = SOL_SOCKET;
	h->cmsg_type = SCM_RIGHTS;
	h->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(h), &fd, sizeof fd);
	if (sendmsg(sock, &m, 0) != 1)
		die("sendmsg");
}

static int recv_fd(int sock)
{
	char byte, ctl[CMSG_SPACE(sizeof(int))];
	struct iovec io = { &byte, 1 };
	struct msghdr m = { .msg_iov = &io, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl };
	int fd;
	if (recvmsg(sock, &m, 0) != 1 || !CMSG_FIRSTHDR(&m))
		die("recvmsg");
	memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&m)), sizeof fd);
	return fd;
}

static void xread(int fd, void *buf, size_t n)
{
	if (read(fd, buf, n) != (ssize_t)n)
		die("read");
}

static void xwrite(int fd, const void *buf, size_t n)
{
	if (write(fd, buf, n) != (ssize_t)n)
		die("write");
}

// Register [p, p+len) for async write-protect and return the uffd (what a CRIU parasite would run in the task).
static int register_wp(void *p, size_t len)
{
	int u = syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY);
	if (u < 0)
		die("userfaultfd");
	struct uffdio_api api = { .api = UFFD_API, .features = UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED };
	if (ioctl(u, UFFDIO_API, &api))
		die("UFFDIO_API");
	struct uffdio_register r = { .range = { (unsigned long)p, len }, .mode = UFFDIO_REGISTER_MODE_WP };
	if (ioctl(u, UFFDIO_REGISTER, &r))
		die("UFFDIO_REGISTER");
	return u;
}

// The task's side of the handover: the address and the uffd to the host, then its own fd closed, then an ack (so
// the host never looks at the task's fd table before the close).
static void hand_over(int s, void *p, int u)
{
	char ack = 1;
	xwrite(s, &p, sizeof p);
	send_fd(s, u);
	close(u);
	xwrite(s, &ack, 1);
}

static int take_over(int s, void *p)
{
	char ack;
	xread(s, p, sizeof(void *));
	int u = recv_fd(s);
	xread(s, &ack, 1);
	return u;
}

static struct page_region *vec;

// PAGEMAP_SCAN over [start, end), resumed from walk_end until the walk reaches end (the kernel may stop early,
// e.g. when it splits a huge page); returns the number of regions in vec (or -errno), *pages the pages in them.
static long scan(int pm, unsigned long start, unsigned long end, __u64 flags, __u64 mask, __u64 ret, long *pages)
{
	long total = 0, n = 0;
	struct pm_scan_arg a = { .walk_end = start };
	do {
		a = (struct pm_scan_arg){
			.size = sizeof a,
			.flags = flags,
			.start = a.walk_end,
			.end = end,
			.vec = (unsigned long)(vec + total),
			.vec_len = VEC_LEN - total,
			.category_mask = mask,
			.return_mask = ret,
		};
		__u64 from = a.start;
		long rc = ioctl(pm, PAGEMAP_SCAN, &a);
		if (rc < 0)
			return -errno;
		total += rc;
		if (a.walk_end <= from)
			return -EAGAIN; // no progress: never loop forever
		if (total == VEC_LEN && a.walk_end < end) {
			fprintf(stderr, "scan: more than %d regions\n", VEC_LEN);
			return -ENOSPC;
		}
	} while (a.walk_end < end);
	for (long i = 0; i < total; i++)
		n += (vec[i].end - vec[i].start) / PG;
	if (pages)
		*pages = n;
	return total;
}

// Written pages since the last arm, re-protected atomically in the same walk.
static long scan_rearm(int pm, unsigned long start, unsigned long end, long *pages)
{
	return scan(pm, start, end, PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC, PAGE_IS_WRITTEN, PAGE_IS_WRITTEN,
		    pages);
}

static long count(int pm, unsigned long start, unsigned long end, __u64 category)
{
	long pages = 0;
	long rc = scan(pm, start, end, 0, category, category, &pages);
	return rc < 0 ? rc : pages;
}

static int open_pagemap(pid_t pid)
{
	char path[64];
	snprintf(path, sizeof path, "/proc/%d/pagemap", pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		die(path);
	return fd;
}

// Number of userfaultfd descriptors in a process's fd table.
static int uffd_fds(pid_t pid)
{
	char cmd[128];
	snprintf(cmd, sizeof cmd, "ls -l /proc/%d/fd 2>/dev/null | grep -c 'anon_inode:\\[userfaultfd\\]'", pid);
	FILE *f = popen(cmd, "r");
	int n = -1;
	if (!f || fscanf(f, "%d", &n) != 1)
		n = -1;
	if (f)
		pclose(f);
	return n;
}

// Whether the VMA at addr has "uw" (VM_UFFD_WP) in its smaps VmFlags.
static int smaps_uw(pid_t pid, unsigned long addr)
{
	char path[64], line[512];
	snprintf(path, sizeof path, "/proc/%d/smaps", pid);
	FILE *f = fopen(path, "r");
	if (!f)
		die(path);
	int in = 0, uw = 0;
	while (fgets(line, sizeof line, f)) {
		unsigned long s, e;
		if (sscanf(line, "%lx-%lx ", &s, &e) == 2 && strchr(line, '-') < strchr(line, ' '))
			in = s <= addr && addr < e;
		else if (in && !strncmp(line, "VmFlags:", 8))
			uw = strstr(line, " uw") != NULL;
	}
	fclose(f);
	return uw;
}

static uint64_t checksum(const unsigned char *p, size_t len)
{
	uint64_t h = 1469598103934665603ULL;
	for (size_t i = 0; i < len; i += 64)
		h = (h ^ p[i]) * 1099511628211ULL;
	return h;
}

// Touch `pages` distinct pages of the region, spread over it (a stride coprime with its page count).
static void dirty(unsigned char *p, size_t len, long pages, unsigned char v)
{
	size_t n = len / PG;
	for (long i = 0; i < pages; i++)
		p[((size_t)i * 7919 % n) * PG + (i % 64)] = v;
}

/* ---- check: the facts, with exact counts ---- */

enum { C_WRITE, C_MMAP, C_FORK, C_DONTNEED, C_READ, C_QUIT };
struct reply {
	unsigned long addr;
	pid_t pid;
};

static void check_child(int s, unsigned char *p, size_t len)
{
	int u = register_wp(p, len);
	hand_over(s, p, u);
	int cmd;
	long arg;
	unsigned char *extra = NULL;
	pid_t kid = 0;
	while (read(s, &cmd, sizeof cmd) == sizeof cmd) {
		xread(s, &arg, sizeof arg);
		struct reply r = { 0, 0 };
		switch (cmd) {
		case C_WRITE:
			dirty(p, len, arg, 7);
			break;
		case C_MMAP: // a VMA made after arming
			extra = mmap(NULL, arg * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
			memset(extra, 3, arg * PG);
			r.addr = (unsigned long)extra;
			break;
		case C_FORK: // a child forked after arming writes its copy; it stays until we quit
			kid = fork();
			if (!kid) {
				prctl(PR_SET_PDEATHSIG, SIGKILL); // never outlives the check
				dirty(p, len, arg, 9);
				pause();
				_exit(0);
			}
			usleep(100000);
			r.pid = kid;
			break;
		case C_DONTNEED: // the first `arg` pages are dropped: their content changes to zeros without a write
			madvise(p, arg * PG, MADV_DONTNEED);
			break;
		case C_READ: { // read faults on those pages
			volatile unsigned char sink = 0;
			for (long i = 0; i < arg; i++)
				sink += p[i * PG];
			(void)sink;
			break;
		}
		case C_QUIT:
			if (kid)
				kill(kid, SIGKILL), waitpid(kid, NULL, 0);
			_exit(0);
		}
		xwrite(s, &r, sizeof r);
	}
	_exit(0);
}

static struct reply ask(int s, int cmd, long arg)
{
	struct reply r;
	xwrite(s, &cmd, sizeof cmd);
	xwrite(s, &arg, sizeof arg);
	if (cmd != C_QUIT)
		xread(s, &r, sizeof r);
	return r;
}

static int soft_dirty_works(void)
{
	unsigned char *p = mmap(NULL, PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	p[0] = 1;
	int cr = open("/proc/self/clear_refs", O_WRONLY);
	if (cr < 0 || write(cr, "4", 1) != 1) // 4: clear soft-dirty bits
		return -1;
	close(cr);
	uint64_t before, after;
	int pm = open("/proc/self/pagemap", O_RDONLY);
	pread(pm, &before, 8, (unsigned long)p / PG * 8);
	p[0] = 2;
	pread(pm, &after, 8, (unsigned long)p / PG * 8);
	close(pm);
	// bit 55: soft-dirty. After clear_refs it must be 0, after a write 1; with CONFIG_MEM_SOFT_DIRTY=n it never is.
	return !((before >> 55) & 1) && ((after >> 55) & 1);
}

// The workspace's seccomp filter denies userfaultfd (native/security.c). CRIU's compel attaches with
// PTRACE_O_SUSPEND_SECCOMP (compel/src/lib/infect.c): then the task's syscalls bypass its filter, so a parasite can
// create the uffd. Shown with a filter denying userfaultfd with EPERM: the call fails, then succeeds once a tracer
// has seized the task with that option. Returns the errno of each attempt (0: it worked) in *before and *after.
static void seccomp_suspend(int *before, int *after)
{
	int go[2], res[2];
	if (pipe(go) || pipe(res))
		die("pipe");
	pid_t pid = fork();
	if (!pid) {
		struct sock_filter f[] = {
			BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
			BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_userfaultfd, 0, 1),
			BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
			BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
		};
		struct sock_fprog prog = { sizeof f / sizeof f[0], f };
		if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog))
			_exit(3);
		for (int i = 0; i < 2; i++) {
			char c;
			if (i)
				xread(go[0], &c, 1);
			int u = syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY), err = u < 0 ? errno : 0;
			xwrite(res[1], &err, sizeof err);
		}
		_exit(0);
	}
	xread(res[0], before, sizeof *before);
	if (ptrace(PTRACE_SEIZE, pid, 0, PTRACE_O_SUSPEND_SECCOMP))
		die("PTRACE_SEIZE");
	xwrite(go[1], "g", 1);
	xread(res[0], after, sizeof *after);
	waitpid(pid, NULL, 0);
	close(go[0]), close(go[1]), close(res[0]), close(res[1]);
}

static int cmd_check(void)
{
	size_t len = 1024 * PG; // 4 MiB, populated
	int sp[2];
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sp))
		die("socketpair");
	unsigned char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	memset(p, 1, len);
	pid_t pid = fork();
	if (!pid) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		check_child(sp[1], p, len);
	}
	unsigned char *cp;
	int u = take_over(sp[0], &cp);
	int pm = open_pagemap(pid);
	unsigned long s = (unsigned long)cp, e = s + len;
	long n;

	printf("soft_dirty_works=%d\n", soft_dirty_works());
	int filtered, suspended;
	seccomp_suspend(&filtered, &suspended);
	printf("seccomp_filtered_uffd=%s\n", filtered ? strerrorname_np(filtered) : "ok");
	printf("seccomp_suspended_uffd=%s\n", suspended ? strerrorname_np(suspended) : "ok");
	printf("child_uffd_fds=%d\n", uffd_fds(pid));
	printf("host_uffd_fds=%d\n", uffd_fds(getpid()));
	printf("smaps_uw=%d\n", smaps_uw(pid, s));
	printf("wpallowed_pages=%ld\n", count(pm, s, e, PAGE_IS_WPALLOWED));
	scan_rearm(pm, s, e, &n);
	printf("arm_written_pages=%ld\n", n); // everything memset before registering counts as written once
	scan_rearm(pm, s, e, &n);
	printf("idle_written_pages=%ld\n", n);
	ask(sp[0], C_WRITE, 16);
	scan_rearm(pm, s, e, &n);
	printf("wrote16_written_pages=%ld\n", n);
	scan_rearm(pm, s, e, &n);
	printf("rescan_written_pages=%ld\n", n);
	ask(sp[0], C_WRITE, 300);
	ask(sp[0], C_WRITE, 300); // the same pages twice
	scan_rearm(pm, s, e, &n);
	printf("wrote300x2_written_pages=%ld\n", n);

	struct reply r = ask(sp[0], C_MMAP, 8);
	printf("new_vma_wpallowed_pages=%ld\n", count(pm, r.addr, r.addr + 8 * PG, PAGE_IS_WPALLOWED));
	printf("new_vma_present_pages=%ld\n", count(pm, r.addr, r.addr + 8 * PG, PAGE_IS_PRESENT));
	long rc = scan_rearm(pm, r.addr, r.addr + 8 * PG, &n);
	printf("new_vma_checked_scan=%s\n", rc == -EPERM ? "EPERM" : rc < 0 ? strerror(-rc) : "ok");
	// Without PM_SCAN_CHECK_WPASYNC, unregistered VMAs are skipped silently: a whole-address-space scan is safe.
	rc = scan(pm, 0, 0x7ffffffff000UL, PM_SCAN_WP_MATCHING, PAGE_IS_WRITTEN, PAGE_IS_WRITTEN, &n);
	printf("whole_space_unchecked_scan_written_pages=%ld\n", rc < 0 ? rc : n);

	r = ask(sp[0], C_FORK, 32);
	int kpm = open_pagemap(r.pid);
	printf("forked_child_wpallowed_pages=%ld\n", count(kpm, s, e, PAGE_IS_WPALLOWED));
	printf("forked_child_smaps_uw=%d\n", smaps_uw(r.pid, s));
	rc = scan_rearm(kpm, s, e, &n);
	printf("forked_child_checked_scan=%s\n", rc == -EPERM ? "EPERM" : rc < 0 ? strerror(-rc) : "ok");
	close(kpm);
	scan_rearm(pm, s, e, &n); // the forked child's writes go to its own copies (CoW): the parent sees none
	printf("parent_after_fork_written_pages=%ld\n", n);

	ask(sp[0], C_DONTNEED, 8);
	scan(pm, s, s + 8 * PG, 0, PAGE_IS_WRITTEN, PAGE_IS_WRITTEN, &n);
	printf("dontneed_written_pages=%ld\n", n);
	printf("dontneed_present_pages=%ld\n", count(pm, s, s + 8 * PG, PAGE_IS_PRESENT));
	ask(sp[0], C_READ, 8);
	scan(pm, s, s + 8 * PG, 0, PAGE_IS_WRITTEN, PAGE_IS_WRITTEN, &n);
	printf("dontneed_read_written_pages=%ld\n", n);
	printf("dontneed_read_present_pages=%ld\n", count(pm, s, s + 8 * PG, PAGE_IS_PRESENT));
	printf("dontneed_read_pfnzero_pages=%ld\n", count(pm, s, s + 8 * PG, PAGE_IS_PFNZERO));
	ask(sp[0], C_DONTNEED, 8);
	// A richer mask goes through pagemap_page_category(), which calls a dropped (pte_none) page clean on kernels
	// without the fix "fs/proc/task_mmu: fix PAGEMAP_SCAN written state for unpopulated ptes": a tracker on such a
	// kernel must scan with masks of exactly PAGE_IS_WRITTEN. 8 here: this kernel reports it written either way.
	scan(pm, s, s + 8 * PG, 0, PAGE_IS_WRITTEN, PAGE_IS_WRITTEN | PAGE_IS_PRESENT, &n);
	printf("dontneed_rich_mask_written_pages=%ld\n", n);
	scan_rearm(pm, s, e, &n);

	{ // a MAP_PRIVATE file mapping (what a CoW restore maps): WP_ASYNC registers any memory type
		char tmpl[] = "/tmp/wptrack-XXXXXX";
		int fd = mkstemp(tmpl);
		unlink(tmpl);
		if (fd < 0 || ftruncate(fd, 64 * PG))
			die("mkstemp");
		unsigned char *f = mmap(NULL, 64 * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
		close(fd);
		for (int i = 0; i < 64; i++)
			(void)*(volatile unsigned char *)(f + i * PG); // read: page cache pages, not yet copied
		int fu = register_wp(f, 64 * PG);
		int self = open("/proc/self/pagemap", O_RDONLY);
		scan_rearm(self, (unsigned long)f, (unsigned long)f + 64 * PG, &n);
		printf("file_private_arm_written_pages=%ld\n", n);
		for (int i = 0; i < 5; i++)
			f[i * 7 * PG] = 1;
		scan_rearm(self, (unsigned long)f, (unsigned long)f + 64 * PG, &n);
		printf("file_private_wrote5_written_pages=%ld\n", n);
		close(self);
		close(fu);
		munmap(f, 64 * PG);
	}

	close(u); // the last reference to the context: the kernel unregisters every VMA it covered
	printf("after_close_wpallowed_pages=%ld\n", count(pm, s, e, PAGE_IS_WPALLOWED));
	printf("after_close_smaps_uw=%d\n", smaps_uw(pid, s));
	ask(sp[0], C_QUIT, 0);
	waitpid(pid, NULL, 0);
	return 0;
}

/* ---- bench: pre-copy while running, then a frozen pass of the written pages ---- */

static void bench_child(int s, size_t len)
{
	unsigned char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	for (size_t i = 0; i < len; i += PG)
		memset(p + i, (int)(i / PG), PG);
	int u = register_wp(p, len);
	hand_over(s, p, u);
	long pages;
	unsigned char v = 100;
	while (read(s, &pages, sizeof pages) == sizeof pages) {
		dirty(p, len, pages, v++);
		xwrite(s, &pages, sizeof pages);
	}
	_exit(0);
}

// Copy the regions in vec[0..n) from the child into the same offsets of dst (process_vm_readv, IOV_MAX at a time).
static long copy_regions(pid_t pid, unsigned long base, unsigned char *dst, long n)
{
	struct iovec l[IOV_MAX], r[IOV_MAX];
	long bytes = 0;
	for (long i = 0; i < n;) {
		int k = 0;
		for (; k < IOV_MAX && i < n; k++, i++) {
			size_t sz = vec[i].end - vec[i].start;
			l[k] = (struct iovec){ dst + (vec[i].start - base), sz };
			r[k] = (struct iovec){ (void *)vec[i].start, sz };
		}
		ssize_t got = process_vm_readv(pid, l, k, r, k, 0);
		if (got < 0)
			die("process_vm_readv");
		bytes += got;
	}
	return bytes;
}

static long copy_all(pid_t pid, unsigned long base, unsigned char *dst, size_t len)
{
	vec[0] = (struct page_region){ base, base + len, 0 };
	return copy_regions(pid, base, dst, 1);
}

static void stop(pid_t pid)
{
	siginfo_t si;
	kill(pid, SIGSTOP);
	if (waitid(P_PID, pid, &si, WSTOPPED))
		die("waitid");
}

static void cont(pid_t pid)
{
	siginfo_t si;
	kill(pid, SIGCONT);
	waitid(P_PID, pid, &si, WCONTINUED);
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static double median(double *v, int n)
{
	qsort(v, n, sizeof *v, cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static int cmd_bench(size_t mib, size_t dirty_mib, int rounds)
{
	size_t len = mib << 20;
	long dirty_pages = (dirty_mib << 20) / PG;
	int sp[2];
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sp))
		die("socketpair");
	pid_t pid = fork();
	if (!pid) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		bench_child(sp[1], len);
	}
	unsigned char *cp;
	int u = take_over(sp[0], &cp);
	int pm = open_pagemap(pid);
	unsigned long s = (unsigned long)cp, e = s + len;
	unsigned char *copy = malloc(len), *check = malloc(len);
	if (!copy || !check)
		die("malloc");
	memset(copy, 0, len); // fault the buffers in so the first pass does not pay for it
	memset(check, 0, len);
	double arm[rounds], pre[rounds], frozen[rounds], stop_ms[rounds], scan_ms[rounds], copy_ms[rounds], full[rounds];
	long written = 0, wrong = 0;
	for (int i = 0; i < rounds; i++) {
		long n;
		// Pre-copy pass, source running: arm, then copy everything.
		double t = now_ms();
		if (scan_rearm(pm, s, e, &n) < 0)
			die("arm");
		arm[i] = now_ms() - t;
		t = now_ms();
		copy_all(pid, s, copy, len);
		pre[i] = now_ms() - t;
		// The workspace keeps running and dirties DIRTY MiB.
		xwrite(sp[0], &dirty_pages, sizeof dirty_pages);
		xread(sp[0], &n, sizeof n);
		// Final pass, source frozen: the written pages only.
		t = now_ms();
		stop(pid);
		double t1 = now_ms();
		long regions = scan_rearm(pm, s, e, &written);
		double t2 = now_ms();
		if (regions < 0)
			die("scan");
		copy_regions(pid, s, copy, regions);
		frozen[i] = now_ms() - t;
		stop_ms[i] = t1 - t;
		scan_ms[i] = t2 - t1;
		copy_ms[i] = frozen[i] - (t2 - t);
		copy_all(pid, s, check, len); // still frozen: the copy must equal the source exactly
		wrong += memcmp(copy, check, len) != 0;
		cont(pid);
		// Today's equivalent: freeze and copy every page.
		t = now_ms();
		stop(pid);
		copy_all(pid, s, check, len);
		cont(pid);
		full[i] = now_ms() - t;
	}
	printf("{\"mib\": %zu, \"dirty_mib\": %zu, \"rounds\": %d, \"written_pages\": %ld, \"dirty_pages\": %ld, "
	       "\"copies_wrong\": %ld, \"arm_ms\": %.3f, \"precopy_ms\": %.2f, \"frozen_pass_ms\": %.3f, "
	       "\"frozen_stop_ms\": %.3f, \"frozen_scan_ms\": %.3f, \"frozen_copy_ms\": %.3f, \"frozen_full_copy_ms\": %.2f}\n",
	       mib, dirty_mib, rounds, written, dirty_pages, wrong, median(arm, rounds), median(pre, rounds),
	       median(frozen, rounds), median(stop_ms, rounds), median(scan_ms, rounds), median(copy_ms, rounds),
	       median(full, rounds));
	close(u);
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	return wrong != 0;
}

/* ---- hold / inspect: a tracked process for a real criu dump ---- */

static int cmd_hold(size_t mib)
{
	size_t len = mib << 20;
	int sp[2];
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sp))
		die("socketpair");
	pid_t pid = fork();
	if (!pid) { // a session of its own, no tty, so `criu dump -t PID` needs no --shell-job
		setsid();
		int null = open("/dev/null", O_RDWR);
		dup2(null, 0), dup2(null, 1), dup2(null, 2);
		dup2(sp[1], 3); // nothing else of the caller's (pipes, sockets) stays open in the task CRIU dumps
		syscall(SYS_close_range, 4, ~0U, 0);
		sp[1] = 3;
		unsigned char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		for (size_t i = 0; i < len; i += PG)
			memset(p + i, (int)(i / PG * 31), PG);
		int u = register_wp(p, len);
		hand_over(sp[1], p, u);
		close(sp[1]);
		for (unsigned v = 0;; v++) { // a slow writer: one page a second
			sleep(1);
			p[(v % (len / PG)) * PG] = 0x55;
		}
	}
	close(sp[1]);
	unsigned char *cp;
	int u = take_over(sp[0], &cp);
	char eof;
	if (read(sp[0], &eof, 1) != 0) // the task has closed its end: its fd table is what CRIU will see
		die("handover");
	int pm = open_pagemap(pid);
	unsigned long s = (unsigned long)cp, e = s + len;
	long n;
	scan_rearm(pm, s, e, &n);
	printf("pid=%d addr=%lx len=%zu armed=%ld uffd_fd=%d\n", pid, s, len, n, u);
	fflush(stdout);
	char line[64];
	while (fgets(line, sizeof line, stdin)) {
		if (!strncmp(line, "scan", 4)) {
			long rc = scan_rearm(pm, s, e, &n);
			printf("scan rc=%ld written=%ld wpallowed=%ld uw=%d\n", rc, n, count(pm, s, e, PAGE_IS_WPALLOWED),
			       smaps_uw(pid, s));
		} else if (!strncmp(line, "quit", 4)) {
			break;
		}
		fflush(stdout);
	}
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	return 0;
}

static int cmd_inspect(pid_t pid, unsigned long addr, size_t len)
{
	int pm = open_pagemap(pid);
	unsigned char *buf = malloc(len);
	struct iovec l = { buf, len }, r = { (void *)addr, len };
	if (!buf || process_vm_readv(pid, &l, 1, &r, 1, 0) != (ssize_t)len)
		die("process_vm_readv");
	printf("wpallowed=%ld uw=%d uffd_fds=%d present=%ld sum=%016llx\n", count(pm, addr, addr + len, PAGE_IS_WPALLOWED),
	       smaps_uw(pid, addr), uffd_fds(pid), count(pm, addr, addr + len, PAGE_IS_PRESENT),
	       (unsigned long long)checksum(buf, len));
	return 0;
}

int main(int argc, char **argv)
{
	vec = malloc(VEC_LEN * sizeof *vec);
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc >= 2 && !strcmp(argv[1], "check"))
		return cmd_check();
	if (argc >= 5 && !strcmp(argv[1], "bench"))
		return cmd_bench(strtoul(argv[2], NULL, 0), strtoul(argv[3], NULL, 0), atoi(argv[4]));
	if (argc >= 3 && !strcmp(argv[1], "hold"))
		return cmd_hold(strtoul(argv[2], NULL, 0));
	if (argc >= 5 && !strcmp(argv[1], "inspect"))
		return cmd_inspect(atoi(argv[2]), strtoul(argv[3], NULL, 16), strtoul(argv[4], NULL, 0));
	fprintf(stderr, "usage: wptrack check | bench MIB DIRTY_MIB ROUNDS | hold MIB | inspect PID ADDR_HEX LEN\n");
	return 2;
}
