// SPDX-License-Identifier: GPL-2.0
/*
 * tmpl_test: exercises /dev/bunshin_tmpl inside the qemu guest (kmod/run-vm.sh runs it as init's job).
 *
 *   tmpl_test check [MiB]      a frozen template of MiB (default 32), 4 copies: digests, isolation, accounting,
 *                              lifetime (the template killed, the pins outlive it), the interface's errors
 *   tmpl_test bench MiB...     map time per template size: lazy map, prefilled map, first read of every page,
 *                              and a page-image-like restore (copying the pages) as the baseline
 *
 * Prints one JSON object on the last line of stdout; exits 0 only when every check passed. Built static
 * (the guest has busybox and nothing else).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/capability.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../bunshin_tmpl.h"
#include "guest.h"

#define PAGE 4096UL
#define NCOPIES 4
#define CGROOT "/sys/fs/cgroup"

static void fill(uint64_t *p, size_t len)
{
	for (size_t i = 0; i < len / 8; i++)
		p[i] = mix(i);
}

/* FNV-1a over 64-bit words, position-dependent through the multiply chain. */
static uint64_t digest(const uint64_t *p, size_t len)
{
	uint64_t h = 0xcbf29ce484222325ULL;

	for (size_t i = 0; i < len / 8; i++) {
		h ^= p[i];
		h *= 0x100000001b3ULL;
	}
	return h;
}

/* What a copy writes: one word per written page, its id and the page index (distinct per copy). */
static inline uint64_t stamp(int copy, size_t page)
{
	return 0xC0FE000000000000ULL | ((uint64_t)copy << 40) | page;
}

static int dev_fd(void)
{
	int fd = open(BUNSHIN_TMPL_DEVICE, O_RDWR | O_CLOEXEC);

	if (fd < 0) {
		fprintf(stderr, "open %s: %s\n", BUNSHIN_TMPL_DEVICE, strerror(errno));
		exit(2);
	}
	return fd;
}

static int tmpl_create(int dev, pid_t pid, uint64_t addr, uint64_t len, uint32_t flags, uint64_t *npages)
{
	struct bunshin_tmpl_create req = { .pid = pid, .flags = flags, .addr = addr, .len = len };
	int fd = ioctl(dev, BUNSHIN_TMPL_CREATE, &req);

	if (fd >= 0 && npages)
		*npages = req.npages;
	return fd;
}

static long tmpl_mapped(int tfd)
{
	struct bunshin_tmpl_info info;

	if (ioctl(tfd, BUNSHIN_TMPL_INFO, &info) < 0)
		return -1;
	return (long)info.mapped;
}

/* In a child: tells the parent where its memory is, then stops itself (frozen, as a template is) until killed. */
static void __attribute__((noreturn)) report_and_stop(int fd, uint64_t addr)
{
	if (write(fd, &addr, sizeof(addr)) != sizeof(addr))
		_exit(3);
	raise(SIGSTOP);
	pause();
	_exit(0);
}

/* A template process: maps `len` of anonymous memory, fills it, reports the address and stops itself (frozen, as
 * a snapshot's template tree is). The caller reaps it. */
static pid_t spawn_template(size_t len, uint64_t *addr)
{
	int pfd[2];
	pid_t pid;

	if (pipe(pfd))
		exit(2);
	pid = fork();
	if (pid < 0)
		exit(2);
	if (pid == 0) {
		uint64_t *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		uint64_t a = (uint64_t)(uintptr_t)p;

		if (p == MAP_FAILED)
			_exit(3);
		fill(p, len);
		report_and_stop(pfd[1], a);
	}
	close(pfd[1]);
	if (read(pfd[0], addr, sizeof(*addr)) != sizeof(*addr)) {
		fprintf(stderr, "template did not start\n");
		exit(2);
	}
	close(pfd[0]);
	int st;
	if (waitpid(pid, &st, WUNTRACED) != pid || !WIFSTOPPED(st)) {
		fprintf(stderr, "template did not stop\n");
		exit(2);
	}
	return pid;
}

static void reap(pid_t pid)
{
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
}

/* The template's memory as the template sees it (it is stopped: process_vm_readv reads its own pages). */
static uint64_t digest_remote(pid_t pid, uint64_t addr, size_t len)
{
	uint64_t *buf = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	struct iovec l = { buf, len }, r = { (void *)(uintptr_t)addr, len };
	uint64_t h = 0;

	if (buf == MAP_FAILED)
		return 0;
	if (process_vm_readv(pid, &l, 1, &r, 1, 0) == (ssize_t)len)
		h = digest(buf, len);
	munmap(buf, len);
	return h;
}

/* Rss and Pss (kB) of the VMA that starts at addr, from /proc/self/smaps. */
static int vma_rss_pss(void *addr, long *rss, long *pss)
{
	char want[32], line[256];
	int in = 0;
	FILE *f = fopen("/proc/self/smaps", "r");

	*rss = *pss = -1;
	if (!f)
		return -1;
	snprintf(want, sizeof(want), "%lx-", (unsigned long)(uintptr_t)addr);
	while (fgets(line, sizeof(line), f)) {
		if (strchr(line, '-') && strncmp(line, want, strlen(want)) == 0) {
			in = 1;
			continue;
		}
		if (!in)
			continue;
		if (sscanf(line, "Rss: %ld kB", rss) == 1)
			continue;
		if (sscanf(line, "Pss: %ld kB", pss) == 1)
			break;
	}
	fclose(f);
	return *rss < 0 || *pss < 0 ? -1 : 0;
}

static long read_long(const char *path)
{
	char buf[64] = "";
	int fd = open(path, O_RDONLY);
	ssize_t n;

	if (fd < 0)
		return -1;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	return n > 0 ? atol(buf) : -1;
}

static int write_str(const char *path, const char *s)
{
	int fd = open(path, O_WRONLY);
	ssize_t n;

	if (fd < 0)
		return -1;
	n = write(fd, s, strlen(s));
	close(fd);
	return n == (ssize_t)strlen(s) ? 0 : -1;
}

/* Per-copy report, written by the copy into a shared page. */
struct copy_report {
	uint64_t digest_before;
	uint64_t digest_after;   /* after its own writes, after every copy wrote */
	uint64_t expect_after;
	long rss_before_kb, pss_before_kb, rss_after_kb;
	long cg_before, cg_after; /* memory.current of the copy's own cgroup, bytes */
	long written_pages;
	int child_ok;            /* the copy's own fork() child saw its memory; the child's write stayed its own */
	int done;
};

/* A copy: maps the template, checks it, writes every `stride`th page, waits until every copy wrote, checks that it
 * sees exactly its own writes. Runs in its own memory cgroup (charged for what it writes). */
static void run_copy(int id, int tfd, size_t len, size_t stride, struct copy_report *rep, int go_fd, int ready_fd)
{
	char cg[128], pidbuf[32];
	uint64_t *p;
	size_t npages = len / PAGE;
	char c;

	snprintf(cg, sizeof(cg), CGROOT "/copy%d/cgroup.procs", id);
	snprintf(pidbuf, sizeof(pidbuf), "%d", getpid());
	if (write_str(cg, pidbuf))
		_exit(10);
	snprintf(cg, sizeof(cg), CGROOT "/copy%d/memory.current", id);

	p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, tfd, 0);
	if (p == MAP_FAILED)
		_exit(11);
	rep->cg_before = read_long(cg);
	rep->digest_before = digest(p, len);
	vma_rss_pss(p, &rep->rss_before_kb, &rep->pss_before_kb);
	for (size_t i = id % stride; i < npages; i += stride) {
		p[i * (PAGE / 8)] = stamp(id, i);
		rep->written_pages++;
	}
	rep->cg_after = read_long(cg);
	if (write(ready_fd, "r", 1) != 1 || read(go_fd, &c, 1) != 1) /* every copy has written */
		_exit(12);
	rep->digest_after = digest(p, len);
	vma_rss_pss(p, &rep->rss_after_kb, &(long){ 0 });
	/* What this copy must see: the template's pattern with exactly its own stamps. */
	uint64_t *want = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (want == MAP_FAILED)
		_exit(13);
	fill(want, len);
	for (size_t i = id % stride; i < npages; i += stride)
		want[i * (PAGE / 8)] = stamp(id, i);
	rep->expect_after = digest(want, len);
	/* The copy's own fork(): its child sees the copy's memory and its writes stay its own. */
	pid_t child = fork();
	if (child == 0) {
		if (digest(p, len) != rep->expect_after)
			_exit(1);
		p[1] = stamp(id + 100, 1);
		_exit(0);
	}
	int st;
	rep->child_ok = child > 0 && waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st) == 0 &&
			p[1] == mix(1) && digest(p, len) == rep->expect_after;
	rep->done = 1;
	_exit(0);
}

/* An operation that must fail with `err`; closes or unmaps what it made if it wrongly succeeded. */
static int fails_with(const char *what, int ret, int err)
{
	if (ret >= 0) {
		fail("%s: succeeded, expected errno %d", what, err);
		return 0;
	}
	if (errno != err) {
		fail("%s: errno %d, expected %d", what, errno, err);
		return 0;
	}
	return 1;
}

static int create_rc(int dev, pid_t pid, uint64_t addr, uint64_t len, uint32_t flags)
{
	int fd = tmpl_create(dev, pid, addr, len, flags, NULL);

	if (fd >= 0)
		close(fd);
	return fd;
}

static int map_rc(int tfd, size_t len, int flags, off_t off)
{
	void *m = mmap(NULL, len, PROT_READ, flags, tfd, off);

	if (m == MAP_FAILED)
		return -1;
	munmap(m, len);
	return 0;
}

/* TMPL_CREATE from a child that dropped CAP_SYS_PTRACE from its effective set: -1 with its errno. */
static int without_ptrace_cap(int dev, pid_t pid, uint64_t addr)
{
	int st, pfd[2];
	pid_t child;
	int err = 0;

	if (pipe(pfd))
		return -1;
	child = fork();
	if (child == 0) {
		struct __user_cap_header_struct hdr = { _LINUX_CAPABILITY_VERSION_3, 0 };
		struct __user_cap_data_struct data[2];
		int rc, e;

		if (syscall(SYS_capget, &hdr, data))
			_exit(1);
		data[CAP_SYS_PTRACE / 32].effective &= ~(1u << (CAP_SYS_PTRACE % 32));
		if (syscall(SYS_capset, &hdr, data))
			_exit(1);
		rc = create_rc(dev, pid, addr, PAGE, 0);
		e = rc < 0 ? errno : 0;
		if (write(pfd[1], &e, sizeof(e)) != sizeof(e))
			_exit(1);
		_exit(0);
	}
	close(pfd[1]);
	if (read(pfd[0], &err, sizeof(err)) != sizeof(err))
		err = -1;
	close(pfd[0]);
	waitpid(child, &st, 0);
	if (err == 0)
		return 0;
	errno = err < 0 ? EIO : err;
	return -1;
}

static const char *jbool(int v)
{
	return v ? "true" : "false";
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
	qsort(v, n, sizeof(*v), cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* VmPTE (kB of page tables) of this process; read without stdio so that reading it allocates nothing. */
static long pte_kb(void)
{
	char buf[4096];
	int fd = open("/proc/self/status", O_RDONLY);
	ssize_t n = fd >= 0 ? read(fd, buf, sizeof(buf) - 1) : -1;
	const char *at;

	if (fd >= 0)
		close(fd);
	if (n <= 0)
		return -1;
	buf[n] = 0;
	at = strstr(buf, "VmPTE:");
	return at ? strtol(at + 6, NULL, 10) : -1;
}

/*
 * A copy's map of a template of `mib` MiB (`flags` as TMPL_CREATE's), `reps` times, each unmapped again: the median
 * mmap time (ms; reported, not checked: tens of microseconds in a guest are noise) and the page tables the first
 * mmap built (*pte_grown_kb, checked): a lazy map builds none whatever the size, a prefilled one a PTE page per 2 MiB.
 */
static double map_time(int dev, size_t mib, int reps, unsigned flags, long *pte_grown_kb)
{
	size_t len = mib << 20;
	uint64_t addr;
	pid_t tpl = spawn_template(len, &addr);
	int tfd = tmpl_create(dev, tpl, addr, len, flags, NULL);
	double t[16];

	*pte_grown_kb = -1;
	if (tfd < 0 || reps > 16) {
		fail("map_time: TMPL_CREATE of %zu MiB: %s", mib, strerror(errno));
		reap(tpl);
		return -1;
	}
	for (int r = 0; r < reps; r++) {
		long before = pte_kb();
		double t0 = now_ms();
		void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, tfd, 0);

		t[r] = now_ms() - t0;
		if (p == MAP_FAILED)
			return fail("map_time: mmap"), -1;
		if (r == 0)
			*pte_grown_kb = pte_kb() - before;
		munmap(p, len);
	}
	close(tfd);
	reap(tpl);
	return median(t, reps);
}

/*
 * A fork of a fork: a child maps template src (its memory as expect[] holds it), reads every 4th page (special
 * PTEs: the template's pages), writes a stamp into every 8th page starting at gen (its own pages), stops, and the
 * stopped child is made a template itself. expect[] is updated to the child's memory; returns the new template's
 * fd (-1 on failure, reported), the stopped child in *child (the caller reaps it).
 */
static int nested_template(int dev, int src, size_t len, int gen, uint64_t *expect, pid_t *child, double *create_ms)
{
	int pfd[2], st, fd;
	uint64_t a = 0;
	size_t npg = len / PAGE;

	if (pipe(pfd))
		return -1;
	*child = fork();
	if (*child == 0) {
		volatile uint64_t *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, src, 0);
		uint64_t sum = 0;

		if (m == MAP_FAILED)
			_exit(3);
		for (size_t i = 0; i < npg; i += 4)
			sum += m[i * (PAGE / 8) + 2];
		for (size_t i = gen; i < npg; i += 8)
			m[i * (PAGE / 8) + 1] = stamp(gen, i);
		report_and_stop(pfd[1], (uint64_t)(uintptr_t)m + (sum & 0)); /* the reads happen */
	}
	close(pfd[1]);
	if (*child < 0 || read(pfd[0], &a, sizeof(a)) != sizeof(a) || waitpid(*child, &st, WUNTRACED) != *child ||
	    !WIFSTOPPED(st)) {
		close(pfd[0]);
		fail("generation %d: the copy did not start", gen);
		return -1;
	}
	close(pfd[0]);
	for (size_t i = gen; i < npg; i += 8)
		expect[i * (PAGE / 8) + 1] = stamp(gen, i);
	double t0 = now_ms();
	fd = tmpl_create(dev, *child, a, len, 0, NULL);
	*create_ms = now_ms() - t0;
	if (fd < 0)
		fail("generation %d: a template of a copy's template mapping: %s", gen, strerror(errno));
	return fd;
}

/* The digest of a fresh private mapping of template fd (what a new copy of it reads), written to once after. */
static uint64_t mapped_digest(int fd, size_t len, int scribble)
{
	uint64_t *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
	uint64_t h;

	if (m == MAP_FAILED)
		return 0;
	h = digest(m, len);
	if (scribble)
		memset(m, 0x5a, 2 * PAGE); /* a copy's write: its own pages, seen by nobody else */
	munmap(m, len);
	return h;
}

static int check(size_t mib)
{
	size_t len = mib << 20, stride = 8;
	uint64_t addr, npages = 0, expect;
	int dev = dev_fd(), tfd, go[2], ready[2], errors_ok = 1;
	pid_t tpl, copies[NCOPIES];
	struct copy_report *reps;
	char path[128];

	tpl = spawn_template(len, &addr);
	{
		uint64_t *want = malloc(len);

		if (!want)
			return 2;
		fill(want, len);
		expect = digest(want, len);
		free(want);
	}

	/* The interface's errors: each fails cleanly with its documented errno. */
	{
		int ffd = open("/init", O_RDONLY);
		void *fm = ffd >= 0 ? mmap(NULL, PAGE, PROT_READ, MAP_PRIVATE, ffd, 0) : MAP_FAILED;
		uint64_t fa = (uint64_t)(uintptr_t)fm;

		errors_ok &= fails_with("unaligned addr", create_rc(dev, tpl, addr + 1, PAGE, 0), EINVAL);
		errors_ok &= fails_with("unaligned len", create_rc(dev, tpl, addr, PAGE + 1, 0), EINVAL);
		errors_ok &= fails_with("zero len", create_rc(dev, tpl, addr, 0, 0), EINVAL);
		errors_ok &= fails_with("unknown flag", create_rc(dev, tpl, addr, PAGE, 0x80), EINVAL);
		errors_ok &= fails_with("no such pid", create_rc(dev, 999999, addr, PAGE, 0), ESRCH);
		errors_ok &= fails_with("past the mapping", create_rc(dev, tpl, addr, len + PAGE, 0), EFAULT);
		errors_ok &= fails_with("too large", create_rc(dev, tpl, addr, 17ULL << 30, 0), E2BIG);
		void *none = mmap(NULL, PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		void *shared = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);

		if (none == MAP_FAILED || shared == MAP_FAILED)
			fail("could not map the unreadable and shared cases");
		errors_ok &= fails_with("unreadable range", create_rc(dev, getpid(), (uint64_t)(uintptr_t)none, PAGE, 0),
					EACCES);
		errors_ok &= fails_with("shared anonymous range",
					create_rc(dev, getpid(), (uint64_t)(uintptr_t)shared, PAGE, 0), EINVAL);
		munmap(none, PAGE);
		munmap(shared, PAGE);
		errors_ok &= fails_with("without CAP_SYS_PTRACE", without_ptrace_cap(dev, tpl, addr), EPERM);
		if (fm == MAP_FAILED)
			fail("could not map /init for the file-mapping case");
		else
			errors_ok &= fails_with("file mapping", create_rc(dev, getpid(), fa, PAGE, 0), EINVAL);
		errors_ok &= fails_with("unknown ioctl", ioctl(dev, _IO(BUNSHIN_TMPL_IOC_MAGIC, 9)), ENOTTY);
		if (fm != MAP_FAILED)
			munmap(fm, PAGE);
		if (ffd >= 0)
			close(ffd);
	}

	double t0 = now_ms();
	tfd = tmpl_create(dev, tpl, addr, len, 0, &npages);
	double create_ms = now_ms() - t0;
	if (tfd < 0) {
		fail("TMPL_CREATE: %s", strerror(errno));
		reap(tpl);
		printf("{\"mode\": \"check\", \"failures\": [%s]}\n", failures);
		return 1;
	}
	if (npages != len / PAGE)
		fail("npages %llu, expected %zu", (unsigned long long)npages, len / PAGE);
	errors_ok &= fails_with("MAP_SHARED", map_rc(tfd, PAGE, MAP_SHARED, 0), EINVAL);
	errors_ok &= fails_with("map past the end", map_rc(tfd, 2 * PAGE, MAP_PRIVATE, len - PAGE), EINVAL);
	errors_ok &= fails_with("map at an offset past the end", map_rc(tfd, PAGE, MAP_PRIVATE, len), EINVAL);
	errors_ok &= fails_with("create on a template fd", ioctl(tfd, BUNSHIN_TMPL_CREATE, &(struct bunshin_tmpl_create){
		.pid = tpl, .addr = addr, .len = PAGE }), ENOTTY);
	/* An offset mapping reads the template's pages from that offset on. */
	{
		uint64_t *m = mmap(NULL, PAGE, PROT_READ, MAP_PRIVATE, tfd, 3 * PAGE);

		if (m == MAP_FAILED || m[0] != mix(3 * PAGE / 8) || m[PAGE / 8 - 1] != mix(4 * PAGE / 8 - 1))
			fail("offset mapping reads the wrong page");
		if (m != MAP_FAILED)
			munmap(m, PAGE);
	}

	/* Four copies, each in its own memory cgroup, side by side. */
	reps = mmap(NULL, sizeof(*reps) * NCOPIES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (reps == MAP_FAILED || pipe(go) || pipe(ready))
		return 2;
	memset(reps, 0, sizeof(*reps) * NCOPIES);
	if (write_str(CGROOT "/cgroup.subtree_control", "+memory"))
		fail("cannot enable the memory controller");
	for (int i = 0; i < NCOPIES; i++) {
		snprintf(path, sizeof(path), CGROOT "/copy%d", i);
		mkdir(path, 0755);
		copies[i] = fork();
		if (copies[i] == 0) {
			close(go[1]);
			close(ready[0]);
			run_copy(i, tfd, len, stride, &reps[i], go[0], ready[1]);
		}
	}
	close(go[0]);
	close(ready[1]);
	for (int i = 0; i < NCOPIES; i++) {
		char c;

		if (read(ready[0], &c, 1) != 1)
			fail("a copy exited before writing");
	}
	long mapped_live = tmpl_mapped(tfd);
	/* While the copies hold their private pages, the template still holds its own pattern. */
	uint64_t tpl_digest_during = digest_remote(tpl, addr, len);
	for (int i = 0; i < NCOPIES; i++)
		if (write(go[1], "g", 1) != 1)
			fail("copy %d gone", i);
	close(go[1]);
	close(ready[0]);
	for (int i = 0; i < NCOPIES; i++) {
		int st;

		waitpid(copies[i], &st, 0);
		if (!WIFEXITED(st) || WEXITSTATUS(st))
			fail("copy %d exited with status %d", i, st);
	}
	long mapped_after_copies = tmpl_mapped(tfd);

	int digests_ok = 1, isolation_ok = 1, accounting_ok = 1;
	long written_kb = 0;
	for (int i = 0; i < NCOPIES; i++) {
		struct copy_report *r = &reps[i];
		long wkb = r->written_pages * (long)(PAGE / 1024);
		long charged = r->cg_after - r->cg_before;

		written_kb = wkb;
		if (!r->done || r->digest_before != expect) {
			fail("copy %d: digest before writes differs from the template's", i);
			digests_ok = 0;
		}
		if (!r->child_ok) {
			fail("copy %d: its own fork() child saw other memory or leaked a write back", i);
			isolation_ok = 0;
		}
		if (!r->done || r->digest_after != r->expect_after) {
			fail("copy %d: sees another copy's writes or lost its own", i);
			isolation_ok = 0;
		}
		/* Before writes the mapping holds no page of its own: special PTEs count in neither Rss nor Pss. */
		if (r->rss_before_kb != 0 || r->pss_before_kb != 0) {
			fail("copy %d: Rss %ld kB, Pss %ld kB before writes", i, r->rss_before_kb, r->pss_before_kb);
			accounting_ok = 0;
		}
		if (r->rss_after_kb != wkb) {
			fail("copy %d: Rss %ld kB after writing %ld kB", i, r->rss_after_kb, wkb);
			accounting_ok = 0;
		}
		/* The private pages are charged to the copy's own cgroup. memory.current moves in per-cpu batches
		 * (mm/memcontrol.c, MEMCG_CHARGE_BATCH pages), and page tables add a little: a MiB of slack. */
		if (r->cg_before < 0 || charged < wkb * 1024 - (1L << 20) || charged > wkb * 1024 + (1L << 20)) {
			fail("copy %d: its cgroup was charged %ld bytes for %ld kB written", i, charged, wkb);
			accounting_ok = 0;
		}
	}
	if (tpl_digest_during != expect) {
		fail("the template changed while the copies wrote");
		isolation_ok = 0;
	}

	/* The other fault paths, in this process: a write before any read (do_cow_fault: the kernel copies the page
	 * the handler returns into a page of the copy), MADV_DONTNEED of a written page (the template's content again),
	 * a prefilled template (every PTE at mmap time), mremap moving a mapping. */
	int paths_ok = 1;
	{
		uint64_t *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, tfd, 0);
		size_t npg = len / PAGE, nw = 0;
		long rss, pss;

		if (m == MAP_FAILED)
			return 2;
		for (size_t i = 0; i < npg; i += 16, nw++)
			m[i * (PAGE / 8) + 1] = stamp(7, i); /* the first touch of that page is this write */
		for (size_t i = 0; i < npg; i += 16)
			if (m[i * (PAGE / 8)] != mix(i * (PAGE / 8)) || m[i * (PAGE / 8) + 1] != stamp(7, i) ||
			    m[i * (PAGE / 8) + 2] != mix(i * (PAGE / 8) + 2)) {
				fail("write-first page %zu: not a copy of the template page plus the write", i);
				paths_ok = 0;
				break;
			}
		if (vma_rss_pss(m, &rss, &pss) || rss != (long)(nw * PAGE / 1024)) {
			fail("write-first: Rss %ld kB for %zu pages written", rss, nw);
			paths_ok = 0;
		}
		madvise(m, PAGE, MADV_DONTNEED);
		if (m[1] != mix(1)) {
			fail("after MADV_DONTNEED a written page does not read the template's content");
			paths_ok = 0;
		}
		void *moved = mremap(m, len, len, MREMAP_MAYMOVE | MREMAP_FIXED,
				     (char *)mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
		if (moved == MAP_FAILED || ((uint64_t *)moved)[16 * (PAGE / 8) + 1] != stamp(7, 16) ||
		    ((uint64_t *)moved)[PAGE / 8 + 5] != mix(PAGE / 8 + 5)) {
			fail("mremap moved a mapping and lost its content");
			paths_ok = 0;
		}
		munmap(moved == MAP_FAILED ? m : moved, len);

		/* A template range never touched: the pins hold the zero page; copies read zeros and a write-first
		 * or read-then-write gives a zeroed private page plus the write. */
		uint64_t *fresh = mmap(NULL, 4 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		int zfd = fresh == MAP_FAILED ? -1 : tmpl_create(dev, getpid(), (uint64_t)(uintptr_t)fresh, 4 * PAGE, 0,
								  NULL);
		uint64_t *zm = zfd < 0 ? MAP_FAILED : mmap(NULL, 4 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE, zfd, 0);
		if (zm == MAP_FAILED) {
			fail("template of an untouched range: %s", strerror(errno));
			paths_ok = 0;
		} else {
			zm[1] = 5;                  /* write first */
			uint64_t z = zm[PAGE / 8];  /* read, */
			zm[PAGE / 8 + 1] = 6;       /* then write */
			if (zm[0] || zm[1] != 5 || z || zm[PAGE / 8] || zm[PAGE / 8 + 1] != 6 || zm[2 * PAGE / 8] ||
			    fresh[1] || fresh[PAGE / 8 + 1]) {
				fail("untouched template range: copies do not read zeros or writes leaked");
				paths_ok = 0;
			}
			munmap(zm, 4 * PAGE);
		}
		if (zfd >= 0)
			close(zfd);
		if (fresh != MAP_FAILED)
			munmap(fresh, 4 * PAGE);

		int pfd = tmpl_create(dev, tpl, addr, len, BUNSHIN_TMPL_F_PREFILL, NULL);
		uint64_t *pm = pfd < 0 ? MAP_FAILED : mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, pfd, 0);
		if (pm == MAP_FAILED || vma_rss_pss(pm, &rss, &pss) || rss != 0 || digest(pm, len) != expect) {
			fail("prefilled template: mapping, Rss or digest wrong");
			paths_ok = 0;
		}
		if (pm != MAP_FAILED) {
			pm[3] = 1;
			if (digest_remote(tpl, addr, len) != expect) {
				fail("a write to a prefilled mapping reached the template");
				paths_ok = 0;
			}
			munmap(pm, len);
		}
		if (pfd >= 0)
			close(pfd);
	}

	/* Forks of forks: a copy that read and wrote pages of its template is a template itself (its written pages
	 * and its template's pages), twice over; each generation reads exactly its copy's memory, a copy of it writing
	 * changes no other, and a generation outlives the copy it was made of and the templates before it. */
	int nested_ok = 1, nfd[2] = { -1, -1 };
	double nested_create_ms[2] = { 0, 0 };
	uint64_t nested_digest[2] = { 0, 0 }, nested_expect[2] = { 0, 0 };
	{
		uint64_t *want = malloc(len);
		pid_t kid[2] = { 0, 0 };

		if (!want)
			return 2;
		fill(want, len);
		for (int g = 0; g < 2; g++) {
			nfd[g] = nested_template(dev, g ? nfd[0] : tfd, len, g + 1, want, &kid[g], &nested_create_ms[g]);
			nested_expect[g] = digest(want, len);
			if (nfd[g] < 0) {
				nested_ok = 0;
				break;
			}
			nested_digest[g] = mapped_digest(nfd[g], len, 1);
			if (nested_digest[g] != nested_expect[g] || mapped_digest(nfd[g], len, 0) != nested_expect[g]) {
				fail("generation %d reads %016llx, its copy held %016llx", g + 1,
				     (unsigned long long)nested_digest[g], (unsigned long long)nested_expect[g]);
				nested_ok = 0;
			}
		}
		for (int g = 0; g < 2; g++)
			if (kid[g] > 0)
				reap(kid[g]);
		/* the copies they were made of are gone: both generations still read what those copies held */
		for (int g = 0; g < 2 && nested_ok; g++)
			if (mapped_digest(nfd[g], len, 0) != nested_expect[g]) {
				fail("generation %d changed after its copy exited", g + 1);
				nested_ok = 0;
			}
		if (nested_ok && nested_expect[0] == expect) {
			fail("the generations' copies wrote nothing");
			nested_ok = 0;
		}
		if (mapped_digest(tfd, len, 0) != expect || digest_remote(tpl, addr, len) != expect) {
			fail("a fork of a fork changed the first template");
			nested_ok = 0;
		}
		/* the last generation alone: the first one's fd closed (its pages are held by reference) */
		if (nfd[0] >= 0)
			close(nfd[0]);
		if (nfd[1] >= 0 && mapped_digest(nfd[1], len, 0) != nested_expect[1]) {
			fail("generation 2 changed after generation 1 was closed");
			nested_ok = 0;
		}
		if (nfd[1] >= 0)
			close(nfd[1]);
		free(want);
	}

	/* Lifetime: the template process dies; the pins keep its pages for later copies. */
	reap(tpl);
	int lifetime_ok = 1;
	uint64_t *again = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, tfd, 0);
	if (again == MAP_FAILED || digest(again, len) != expect) {
		fail("a mapping made after the template exited differs");
		lifetime_ok = 0;
	}
	if (again != MAP_FAILED) {
		/* A partial unmap splits nothing off but shrinks the VMA; unmapping the middle splits it in two
		 * (->open counts the new half). */
		munmap((char *)again + 2 * PAGE, PAGE);
		if (tmpl_mapped(tfd) != 2) {
			fail("after splitting a mapping: %ld mappings counted, expected 2", tmpl_mapped(tfd));
			lifetime_ok = 0;
		}
		if (again[(4 * PAGE) / 8] != mix(4 * PAGE / 8) || again[0] != mix(0)) {
			fail("a split mapping reads the wrong pages");
			lifetime_ok = 0;
		}
		munmap(again, len);
	}
	long mapped_end = tmpl_mapped(tfd);
	if (mapped_live != NCOPIES || mapped_after_copies != 0 || mapped_end != 0) {
		fail("mappings counted: %ld live, %ld after the copies exited, %ld at the end", mapped_live,
		     mapped_after_copies, mapped_end);
		lifetime_ok = 0;
	}
	/* Only the template file is left holding the module (tmpl_fops.owner): it may not be unloaded yet. */
	close(dev);
	if (syscall(SYS_delete_module, "bunshin_tmpl", O_NONBLOCK) == 0 || errno != EWOULDBLOCK) {
		fail("the module unloaded (or failed with errno %d) while a template was open", errno);
		lifetime_ok = 0;
	}
	close(tfd);
	for (int i = 0; i < NCOPIES; i++) {
		snprintf(path, sizeof(path), CGROOT "/copy%d", i);
		rmdir(path);
	}

	/* A copy's map does no per-page work: no page tables for a lazy map of any size (a prefilled one, the control,
	 * builds them). */
	long pte64, pte256, prefill_pte256;
	dev = dev_fd();
	double map64 = map_time(dev, 64, 9, 0, &pte64), map256 = map_time(dev, 256, 9, 0, &pte256);
	map_time(dev, 256, 1, BUNSHIN_TMPL_F_PREFILL, &prefill_pte256);
	close(dev);

	printf("{\"mode\": \"check\", \"map_ms_64mib\": %.4f, \"map_ms_256mib\": %.4f, \"map_pte_kb_64mib\": %ld, "
	       "\"map_pte_kb_256mib\": %ld, \"prefill_map_pte_kb_256mib\": %ld, \"mib\": %zu, \"copies\": %d, \"expect_digest\": \"%016llx\", "
	       "\"copy_digests\": [\"%016llx\", \"%016llx\", \"%016llx\", \"%016llx\"], "
	       "\"digests_ok\": %s, \"isolation_ok\": %s, \"accounting_ok\": %s, \"lifetime_ok\": %s, "
	       "\"errors_ok\": %s, \"paths_ok\": %s, \"nested_ok\": %s, \"nested_digests\": [\"%016llx\", \"%016llx\"], "
	       "\"nested_expect\": [\"%016llx\", \"%016llx\"], \"nested_create_ms\": [%.3f, %.3f], \"create_ms\": %.3f, \"copy_rss_before_kb\": %ld, \"copy_pss_before_kb\": %ld, "
	       "\"copy_written_kb\": %ld, \"copy_rss_after_kb\": %ld, \"copy_cgroup_charged_bytes\": %ld, "
	       "\"failures\": [%s]}\n",
	       map64, map256, pte64, pte256, prefill_pte256, mib, NCOPIES, (unsigned long long)expect, (unsigned long long)reps[0].digest_before,
	       (unsigned long long)reps[1].digest_before, (unsigned long long)reps[2].digest_before,
	       (unsigned long long)reps[3].digest_before, jbool(digests_ok), jbool(isolation_ok),
	       jbool(accounting_ok), jbool(lifetime_ok), jbool(errors_ok), jbool(paths_ok), jbool(nested_ok),
	       (unsigned long long)nested_digest[0], (unsigned long long)nested_digest[1],
	       (unsigned long long)nested_expect[0], (unsigned long long)nested_expect[1], nested_create_ms[0],
	       nested_create_ms[1], create_ms, reps[0].rss_before_kb,
	       reps[0].pss_before_kb, written_kb, reps[0].rss_after_kb, reps[0].cg_after - reps[0].cg_before,
	       failures);
	return nfail ? 1 : 0;
}

#define REPS 5

struct bench_row {
	size_t mib;
	double create_ms, map_ms, prefill_map_ms, touch_ms, dump_ms, cow_map_ms, copy_restore_ms;
};

/* One template size: the module's costs (pin once, then per copy: map, prefilled map, first read of every page)
 * beside a page-image fork's (dump the pages to a tmpfs image, then per copy map the image MAP_PRIVATE as
 * criu-cow does, or read it into anonymous memory as a stock restore does). Medians of REPS runs. */
static int bench_one(int dev, size_t mib, struct bench_row *row)
{
	size_t len = mib << 20;
	uint64_t addr;
	pid_t tpl = spawn_template(len, &addr);
	double create[REPS], map[REPS], pmap[REPS], touch[REPS], dump[REPS], cmap[REPS], crest[REPS];
	volatile uint64_t sink = 0;
	int tfd = -1, pfd = -1;

	for (int r = 0; r < REPS; r++) {
		double t0 = now_ms();
		int fd = tmpl_create(dev, tpl, addr, len, 0, NULL);

		create[r] = now_ms() - t0;
		if (fd < 0)
			return fail("bench TMPL_CREATE %zu MiB: %s", mib, strerror(errno)), -1;
		if (tfd >= 0)
			close(tfd);
		tfd = fd;
	}
	fprintf(stderr, "bench %zu MiB: template pinned %d times\n", mib, REPS);
	pfd = tmpl_create(dev, tpl, addr, len, BUNSHIN_TMPL_F_PREFILL, NULL);
	if (pfd < 0)
		return fail("bench TMPL_CREATE prefill: %s", strerror(errno)), -1;
	for (int r = 0; r < REPS; r++) {
		double t0 = now_ms();
		uint64_t *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, tfd, 0);

		map[r] = now_ms() - t0;
		if (p == MAP_FAILED)
			return fail("bench map"), -1;
		t0 = now_ms();
		for (size_t i = 0; i < len / 8; i += PAGE / 8)
			sink += p[i];
		touch[r] = now_ms() - t0;
		munmap(p, len);
		t0 = now_ms();
		p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, pfd, 0);
		pmap[r] = now_ms() - t0;
		if (p == MAP_FAILED)
			return fail("bench prefilled map"), -1;
		munmap(p, len);
	}
	fprintf(stderr, "bench %zu MiB: maps done\n", mib);
	/* The page-image baseline: the dump copies the template's pages into an image on tmpfs. */
	char *buf = malloc(1 << 20);
	for (int r = 0; r < REPS; r++) {
		double t0 = now_ms();
		int img = open("/tmp/pages.img", O_RDWR | O_CREAT | O_TRUNC, 0600);

		for (size_t off = 0; off < len; off += 1 << 20) {
			struct iovec l = { buf, 1 << 20 }, rv = { (void *)(uintptr_t)(addr + off), 1 << 20 };

			if (process_vm_readv(tpl, &l, 1, &rv, 1, 0) != 1 << 20 || write(img, buf, 1 << 20) != 1 << 20)
				return fail("bench dump"), -1;
		}
		dump[r] = now_ms() - t0;
		t0 = now_ms();
		uint64_t *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, img, 0);
		cmap[r] = now_ms() - t0;
		if (p == MAP_FAILED)
			return fail("bench image map"), -1;
		munmap(p, len);
		t0 = now_ms();
		p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
		if (p == MAP_FAILED || pread(img, p, len, 0) != (ssize_t)len)
			return fail("bench copy restore"), -1;
		crest[r] = now_ms() - t0;
		munmap(p, len);
		close(img);
		unlink("/tmp/pages.img");
	}
	free(buf);
	close(tfd);
	close(pfd);
	reap(tpl);
	fprintf(stderr, "bench %zu MiB: done\n", mib);
	row->mib = mib;
	row->create_ms = median(create, REPS);
	row->map_ms = median(map, REPS);
	row->prefill_map_ms = median(pmap, REPS);
	row->touch_ms = median(touch, REPS);
	row->dump_ms = median(dump, REPS);
	row->cow_map_ms = median(cmap, REPS);
	row->copy_restore_ms = median(crest, REPS);
	(void)sink;
	return 0;
}

static double ratio(double a, double b)
{
	return b > 0 ? a / b : 0;
}

static int bench(int argc, char **argv)
{
	struct bench_row rows[8];
	int n = 0, dev = dev_fd();

	for (int i = 0; i < argc && n < 8; i++, n++)
		if (bench_one(dev, strtoul(argv[i], NULL, 10), &rows[n]))
			break;
	close(dev);
	printf("{\"mode\": \"bench\", \"reps\": %d, \"sizes\": [", REPS);
	for (int i = 0; i < n; i++) {
		struct bench_row *r = &rows[i];

		printf("%s{\"mib\": %zu, \"kmod_create_ms\": %.3f, \"kmod_map_ms\": %.3f, \"kmod_prefill_map_ms\": %.3f, "
		       "\"kmod_first_read_ms\": %.3f, \"image_dump_ms\": %.3f, \"image_cow_map_ms\": %.3f, "
		       "\"image_copy_restore_ms\": %.3f}",
		       i ? ", " : "", r->mib, r->create_ms, r->map_ms, r->prefill_map_ms, r->touch_ms, r->dump_ms,
		       r->cow_map_ms, r->copy_restore_ms);
	}
	printf("]");
	if (n >= 2) {
		struct bench_row *a = &rows[0], *b = &rows[n - 1];

		/* Ratios of the largest size to the smallest, and of the page image to the module: the guest is
		 * emulated, so only ratios mean something. A fork = what the snapshot pays once + what each copy
		 * pays: kmod = pin + map; criu-cow-like = dump + map of the image. */
		printf(", \"ratio_sizes\": %.3f, \"ratio_kmod_map\": %.3f, \"ratio_kmod_prefill_map\": %.3f, "
		       "\"ratio_kmod_create\": %.3f, \"ratio_image_dump\": %.3f, \"ratio_image_copy_restore\": %.3f, "
		       "\"kmod_fork_ms_small\": %.3f, \"kmod_fork_ms_large\": %.3f, "
		       "\"image_cow_fork_ms_small\": %.3f, \"image_cow_fork_ms_large\": %.3f, "
		       "\"image_cow_over_kmod_small\": %.3f, \"image_cow_over_kmod_large\": %.3f",
		       ratio(b->mib, a->mib), ratio(b->map_ms, a->map_ms), ratio(b->prefill_map_ms, a->prefill_map_ms),
		       ratio(b->create_ms, a->create_ms), ratio(b->dump_ms, a->dump_ms),
		       ratio(b->copy_restore_ms, a->copy_restore_ms), a->create_ms + a->map_ms,
		       b->create_ms + b->map_ms, a->dump_ms + a->cow_map_ms, b->dump_ms + b->cow_map_ms,
		       ratio(a->dump_ms + a->cow_map_ms, a->create_ms + a->map_ms),
		       ratio(b->dump_ms + b->cow_map_ms, b->create_ms + b->map_ms));
	}
	printf(", \"failures\": [%s]}\n", failures);
	return nfail || n < argc ? 1 : 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc >= 2 && strcmp(argv[1], "check") == 0)
		return check(argc >= 3 ? strtoul(argv[2], NULL, 10) : 32);
	if (argc >= 3 && strcmp(argv[1], "bench") == 0)
		return bench(argc - 2, argv + 2);
	fprintf(stderr, "usage: tmpl_test check [MiB] | tmpl_test bench MiB...\n");
	return 2;
}
