// SPDX-License-Identifier: GPL-2.0
/*
 * criu_test: the project's CRIU (criu/patches/0012-template-restore.patch) forking a frozen template tree through
 * /dev/bunshin_tmpl, inside the qemu guest (kmod/run-vm.sh's criu jobs run it).
 *
 *   criu_test criu [MiB]          a two-task workload (its own pid namespace) holding MiB (default 16) of patterned
 *                                 memory is dumped plain (--leave-running) and as a template (CRIU_TMPL_DUMP,
 *                                 --leave-stopped); a plain restore must refuse the template dump; 3 copies restored
 *                                 through the module (2 from the template dump, 1 from the plain one) and one plain
 *                                 copy: their mappings, digests, isolation, and the template unchanged
 *   criu_test criu-bench MiB...   per size: both dumps' times, and restore times through the module beside CRIU's
 *                                 CoW restore (CRIU_COW_RESTORE=1, the page image mapped) and a plain restore
 *
 * The workload: task 1 (pid 1 of a new pid namespace) maps MiB and fills it with a pattern, task 2 (its child)
 * 1 MiB; each then waits for signals: SIGUSR1 writes its digest to OUT/d<role> (a temporary file renamed), SIGUSR2
 * first overwrites the first 256 KiB of its buffer (with 0xab, then 0xac, ...). Copies restored by CRIU answer the
 * same way.
 *
 * Prints one JSON object on the last line of stdout; exits 0 only when every check passed. Built static.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <dirent.h>
#include <time.h>
#include <unistd.h>

#include "../bunshin_tmpl.h"
#include "guest.h"

#define OUT "/tmp/wl"
#define IMG "/tmp/img"
#define CRIU "/criu/criu"
#define DEV "/dev/bunshin_tmpl"
#define NCOPIES 3
#define CHILD_MIB 1
#define DIRTY (256UL << 10)

static size_t dirty = DIRTY; /* what SIGUSR2 overwrites (the bench's nested fork dirties more) */

/* ---- the workload ---------------------------------------------------------------------------------------- */

static uint64_t digest(const uint64_t *w, size_t n)
{
	uint64_t h = 0xcbf29ce484222325ULL;

	for (size_t i = 0; i < n; i++)
		h = (h ^ w[i]) * 0x100000001b3ULL;
	return h;
}

static void write_digest(int role, const uint64_t *buf, size_t n)
{
	char tmp[64], path[64], line[64];
	int fd, len;

	snprintf(tmp, sizeof(tmp), OUT "/.d%d", role);
	snprintf(path, sizeof(path), OUT "/d%d", role);
	len = snprintf(line, sizeof(line), "%016llx\n", (unsigned long long)digest(buf, n));
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return;
	if (write(fd, line, len) != len) {
		close(fd);
		return;
	}
	close(fd);
	rename(tmp, path);
}

static void nop(int sig)
{
	(void)sig;
}

/* One task of the workload: fill, report, then serve signals forever. */
static void serve(int role, size_t mib)
{
	size_t n = (mib << 20) / 8;
	uint64_t *buf = mmap(NULL, mib << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	unsigned char gen = 0; /* SIGUSR2 writes 0xab + gen++: every write changes the digest, in a copy too */
	sigset_t set;

	if (buf == MAP_FAILED)
		_exit(3);
	for (size_t i = 0; i < n; i++)
		buf[i] = mix(i * 2 + role);
	sigemptyset(&set);
	sigaddset(&set, SIGUSR1);
	sigaddset(&set, SIGUSR2);
	write_digest(role, buf, n);
	for (;;) {
		int sig = sigwaitinfo(&set, NULL);

		if (sig == SIGUSR2)
			memset(buf, 0xab + gen++, dirty < (mib << 20) ? dirty : (mib << 20));
		if (sig == SIGUSR1 || sig == SIGUSR2)
			write_digest(role, buf, n);
	}
}

/* Starts the workload: returns the pid (here) of task 1, pid 1 of its own pid namespace. */
static pid_t start_workload(size_t mib)
{
	int p[2];
	pid_t mid, init = -1;

	if (pipe(p))
		return -1;
	mid = fork();
	if (mid == 0) {
		struct sigaction sa = { .sa_handler = nop };
		sigset_t set;
		pid_t pid;
		int fd;

		close(p[0]);
		if (unshare(CLONE_NEWPID))
			_exit(2);
		pid = fork();
		if (pid) {
			if (write(p[1], &pid, sizeof(pid)) != sizeof(pid))
				_exit(2);
			_exit(pid < 0 ? 2 : 0);
		}
		/* task 1: no tty, no inherited descriptors but /dev/null */
		close(p[1]);
		setsid();
		fd = open("/dev/null", O_RDWR);
		dup2(fd, 0);
		dup2(fd, 1);
		dup2(fd, 2);
		if (fd > 2)
			close(fd);
		/* an init ignores signals it has no handler for; block them and take them with sigwaitinfo */
		sigaction(SIGUSR1, &sa, NULL);
		sigaction(SIGUSR2, &sa, NULL);
		sigemptyset(&set);
		sigaddset(&set, SIGUSR1);
		sigaddset(&set, SIGUSR2);
		sigprocmask(SIG_BLOCK, &set, NULL);
		if (fork() == 0)
			serve(2, CHILD_MIB);
		serve(1, mib);
	}
	close(p[1]);
	if (mid < 0 || read(p[0], &init, sizeof(init)) != sizeof(init))
		init = -1;
	close(p[0]);
	if (mid > 0)
		waitpid(mid, NULL, 0);
	return init;
}

/* ---- the driver ------------------------------------------------------------------------------------------ */

/* The digest task `role` of the tree rooted at pid writes on sig; 0 on a timeout. */
static uint64_t ask_digest(pid_t pid, int role, int sig)
{
	char path[64], line[64] = "";
	double t0 = now_ms();

	snprintf(path, sizeof(path), OUT "/d%d", role);
	unlink(path);
	if (kill(pid, sig))
		return 0;
	while (now_ms() - t0 < 120000) { /* a digest of 800 MiB under TCG takes seconds */
		int fd = open(path, O_RDONLY);

		if (fd >= 0) {
			ssize_t r = read(fd, line, sizeof(line) - 1);

			close(fd);
			if (r > 0) {
				line[r] = 0;
				return strtoull(line, NULL, 16);
			}
		}
		usleep(2000);
	}
	return 0;
}

/* Waits for the workload's first digests (it writes them once filled). */
static int wait_file(const char *path, double ms)
{
	double t0 = now_ms();

	while (now_ms() - t0 < ms) {
		if (access(path, F_OK) == 0)
			return 0;
		usleep(5000);
	}
	return -1;
}

/* The first child of pid (task 2 of a workload tree), or -1. */
static pid_t child_of(pid_t pid)
{
	char path[64];
	FILE *f;
	long c = -1;

	snprintf(path, sizeof(path), "/proc/%d/task/%d/children", pid, pid);
	f = fopen(path, "r");
	if (!f)
		return -1;
	if (fscanf(f, "%ld", &c) != 1)
		c = -1;
	fclose(f);
	return c;
}

/* Mappings of /dev/bunshin_tmpl in pid (its maps). */
static int tmpl_vmas(pid_t pid)
{
	char path[64], line[512];
	FILE *f;
	int n = 0;

	snprintf(path, sizeof(path), "/proc/%d/maps", pid);
	f = fopen(path, "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (strstr(line, "bunshin_tmpl"))
			n++;
	fclose(f);
	return n;
}

/* Descriptors of pid that refer to the module (a template or the device): a copy must hold none. */
static int tmpl_fds(pid_t pid)
{
	char path[64], link[340], target[256];
	struct dirent *de;
	int n = 0;
	DIR *d;

	snprintf(path, sizeof(path), "/proc/%d/fd", pid);
	d = opendir(path);
	if (!d)
		return -1;
	while ((de = readdir(d))) {
		ssize_t r;

		if (de->d_name[0] == '.')
			continue;
		snprintf(link, sizeof(link), "%s/%s", path, de->d_name);
		r = readlink(link, target, sizeof(target) - 1);
		if (r > 0) {
			target[r] = 0;
			n += strstr(target, "bunshin") != NULL;
		}
	}
	closedir(d);
	return n;
}

/* A copy's two tasks (pid 1 of its namespace and its child): their template mappings and digests; the module
 * descriptors they hold add to *fds. */
static void probe_copy(pid_t root, int vmas[2], uint64_t digests[2], int *fds)
{
	pid_t k = child_of(root);

	vmas[0] = tmpl_vmas(root);
	vmas[1] = tmpl_vmas(k);
	*fds += tmpl_fds(root) + tmpl_fds(k);
	digests[0] = ask_digest(root, 1, SIGUSR1);
	digests[1] = ask_digest(k, 2, SIGUSR1);
}

/* Runs criu with args and extra environment (NULL-terminated); returns its exit status, or -1. */
static int run_criu(char *const args[], char *const extra[], const char *log)
{
	char *envp[16];
	int n = 0, st;
	pid_t pid;

	envp[n++] = "PATH=/bin";
	for (int i = 0; extra && extra[i] && n < 15; i++)
		envp[n++] = extra[i];
	envp[n] = NULL;
	pid = fork();
	if (pid == 0) {
		int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);

		if (fd >= 0) {
			dup2(fd, 1);
			dup2(fd, 2);
		}
		execve(CRIU, args, envp);
		_exit(127);
	}
	if (pid < 0 || waitpid(pid, &st, 0) != pid)
		return -1;
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void show_log(const char *path)
{
	char line[512];
	FILE *f = fopen(path, "r");

	if (!f)
		return;
	while (fgets(line, sizeof(line), f))
		if (strstr(line, "Error") || strstr(line, "Warn"))
			fprintf(stderr, "  %s: %s", path, line);
	fclose(f);
}

/* How long criu ran by its own log (the last line's time stamp): without its exec and dynamic linking, which take
 * seconds under TCG and do not depend on the images. *pin: the time from the line before "Template restore: N
 * templates" to it, the BUNSHIN_TMPL_CREATE calls (0 without them). */
static double log_ms(const char *path, double *pin)
{
	char line[512];
	double last = -1, t;
	FILE *f = fopen(path, "r");

	*pin = 0;
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "(%lf)", &t) == 1) {
			if (strstr(line, "Template restore: ") && strstr(line, " templates ("))
				*pin = (t - last) * 1e3;
			last = t;
		}
	fclose(f);
	return last * 1e3;
}

#define IMG_TMPL "/tmp/img-tmpl"
#define IMG_FULL "/tmp/img-full"
#define IMG_NESTED "/tmp/img-nested"
#define IMG_BAD "/tmp/img-bad"
#define NNESTED 2

enum dump_kind { D_PLAIN, D_TMPL, D_COW_INCR };

/* Dumps the tree of pid into dir: every page (D_PLAIN), or with CRIU_TMPL_DUMP (D_TMPL: no pages of private
 * anonymous memory), leaving it stopped (the template) unless running, or a CoW copy of IMG_FULL incrementally on
 * it (D_COW_INCR, criu/patches/0002, as BunshinFork's criu-cow forks of forks are: pages the copy never wrote are
 * referenced, not written). *ms: criu's own time (its log). quiet: a failure is the caller's to report. */
static int dump_into(const char *dir, pid_t pid, enum dump_kind tmpl, int running, double *ms, int quiet)
{
	char spid[16], cmd[128], path[96], *d = (char *)dir;
	char *args[] = { CRIU, "dump", "-t", spid, "-D", d, tmpl == D_TMPL && !running ? "--leave-stopped" : "--leave-running",
			 "-o", "dump.log", "-v4", tmpl == D_COW_INCR ? "--prev-images-dir" : NULL, "../img-full", NULL };
	char *tmpl_env[] = { "CRIU_TMPL_DUMP=1", NULL }, *cow_env[] = { "CRIU_COW_ANON_PREFIX=" IMG_FULL "/", NULL };
	char **env = tmpl == D_TMPL ? tmpl_env : tmpl == D_COW_INCR ? cow_env : NULL;
	double pin;
	int rc;

	snprintf(spid, sizeof(spid), "%d", pid);
	snprintf(cmd, sizeof(cmd), "rm -rf %s && mkdir -p %s", dir, dir);
	if (system(cmd))
		return -1;
	rc = run_criu(args, env, "/tmp/criu-dump.out");
	snprintf(path, sizeof(path), "%s/dump.log", dir);
	*ms = log_ms(path, &pin);
	if (rc && !quiet) {
		show_log(path);
		show_log("/tmp/criu-dump.out");
		fail("criu dump (%s) exited %d", tmpl == D_TMPL ? "CRIU_TMPL_DUMP" : tmpl ? "incremental" : "plain", rc);
	}
	return rc;
}

/* The check's two dumps: into IMG_FULL with every page, or into IMG_TMPL as a template. */
static int dump_as(pid_t pid, int tmpl, int running, double *ms)
{
	return dump_into(tmpl ? IMG_TMPL : IMG_FULL, pid, tmpl ? D_TMPL : D_PLAIN, running, ms, 0);
}

static int dump(pid_t pid, int tmpl, double *ms)
{
	return dump_as(pid, tmpl, 0, ms);
}

/* Bytes of page images (pages-*.img) in dir. */
static long long pages_bytes(const char *dir)
{
	char cmd[160], line[64] = "";
	long long n = 0;
	FILE *p;

	snprintf(cmd, sizeof(cmd), "cat %s/pages-*.img 2>/dev/null | wc -c", dir);
	p = popen(cmd, "r");
	if (p && fgets(line, sizeof(line), p))
		n = atoll(line);
	if (p)
		pclose(p);
	return n;
}

enum mode { M_TMPL, M_COW, M_PLAIN, M_GIVEN };
#define GIVEN "/tmp/tmpl-fds"
static const char *mode_name[] = { "template", "cow", "plain", "template, made once" };

/*
 * Templates made once per snapshot (criu/patches/0012, CRIU_TMPL_FDS): one BUNSHIN_TMPL_CREATE per private,
 * readable, non-executable anonymous VMA (or template mapping) of every task of the tree at root, the fds left
 * open (inherited by criu) and listed in GIVEN as "<vpid> <start> <end> <fd>". Returns the number made (-1 on
 * failure), *ms the time it took; close_given() closes them.
 */
static int given_fds[256], ngiven;

static int make_given(pid_t root, double *ms)
{
	pid_t tasks[2] = { root, child_of(root) };
	int dev = open(DEV, O_RDWR | O_CLOEXEC);
	FILE *out = fopen(GIVEN, "w");
	double t0 = now_ms();

	ngiven = 0;
	if (dev < 0 || !out) {
		fail("make_given: %s", strerror(errno));
		goto err;
	}
	for (int t = 0; t < 2; t++) {
		char path[64], line[512];
		FILE *maps;
		int vpid = t + 1; /* the workload's tasks: pid 1 of its namespace and its child, 2 */

		snprintf(path, sizeof(path), "/proc/%d/maps", tasks[t]);
		maps = fopen(path, "r");
		while (maps && fgets(line, sizeof(line), maps)) {
			unsigned long long s, e;
			char perms[8], name[256] = "";
			struct bunshin_tmpl_create req;
			int fd;

			if (sscanf(line, "%llx-%llx %7s %*s %*s %*s %255s", &s, &e, perms, name) < 3)
				continue;
			if (perms[0] != 'r' || perms[2] == 'x' || perms[3] != 'p' ||
			    (name[0] && strcmp(name, "[heap]") && strcmp(name, "anon_inode:[bunshin_tmpl]")))
				continue;
			req = (struct bunshin_tmpl_create){ .pid = tasks[t], .addr = s, .len = e - s };
			fd = ioctl(dev, BUNSHIN_TMPL_CREATE, &req);
			if (fd < 0 || ngiven == (int)(sizeof(given_fds) / sizeof(given_fds[0]))) {
				fail("make_given: TMPL_CREATE of %d's %llx-%llx: %s", tasks[t], s, e, strerror(errno));
				fclose(maps);
				goto err;
			}
			fcntl(fd, F_SETFD, 0); /* criu inherits it */
			given_fds[ngiven++] = fd;
			fprintf(out, "%d %llx %llx %d\n", vpid, s, e, fd);
		}
		if (maps)
			fclose(maps);
	}
	fclose(out);
	close(dev);
	*ms = now_ms() - t0;
	return ngiven;
err:
	if (out)
		fclose(out);
	if (dev >= 0)
		close(dev);
	return -1;
}

static void close_given(void)
{
	while (ngiven > 0)
		close(given_fds[--ngiven]);
	unlink(GIVEN);
}

/* Restores one copy of the images in dir (detached); returns its root's pid (-1: criu failed, and *rc says how),
 * the time it took (wall, and criu's own by its log) and the part spent pinning templates. Failures are the
 * caller's to report. */
static pid_t restore_at(const char *dir, enum mode m, pid_t tpl, int n, double *ms, double *log_t, double *pin,
			int *rcp)
{
	char pidfile[64], log[64], root_env[48], line[32] = "", path[96], *d = (char *)dir;
	char *args[] = { CRIU, "restore", "-D", d, "-d", "--pidfile", pidfile, "-o", log, "-v4", NULL };
	char *tmpl_env[] = { "CRIU_TMPL_DEV=" DEV, root_env, m == M_GIVEN ? "CRIU_TMPL_FDS=" GIVEN : NULL, NULL };
	char *cow_env[] = { "CRIU_COW_RESTORE=1", NULL };
	double t0;
	int rc, fd;
	ssize_t r;

	snprintf(pidfile, sizeof(pidfile), "/tmp/copy-%d.pid", n);
	snprintf(log, sizeof(log), "restore-%d.log", n);
	snprintf(root_env, sizeof(root_env), "CRIU_TMPL_ROOT=%d", tpl);
	unlink(pidfile);
	t0 = now_ms();
	rc = run_criu(args, m == M_TMPL || m == M_GIVEN ? tmpl_env : m == M_COW ? cow_env : NULL, "/tmp/criu-restore.out");
	*ms = now_ms() - t0;
	snprintf(path, sizeof(path), "%s/%s", dir, log);
	*log_t = log_ms(path, pin);
	*rcp = rc;
	if (rc)
		return -1;
	fd = open(pidfile, O_RDONLY);
	r = fd < 0 ? -1 : read(fd, line, sizeof(line) - 1);
	if (fd >= 0)
		close(fd);
	if (r <= 0) {
		*rcp = -2;
		return -1;
	}
	line[r] = 0;
	return atoi(line);
}

static pid_t restore(const char *dir, enum mode m, pid_t tpl, int n, double *ms, double *log_t, double *pin)
{
	int rc;
	pid_t pid = restore_at(dir, m, tpl, n, ms, log_t, pin, &rc);

	if (pid < 0) {
		char path[96];

		snprintf(path, sizeof(path), "%s/restore-%d.log", dir, n);
		show_log(path);
		show_log("/tmp/criu-restore.out");
		fail("criu restore (%s) of copy %d from %s exited %d", mode_name[m], n, dir, rc);
	}
	return pid;
}

/* Whether file holds text. */
static int file_has(const char *file, const char *text)
{
	char line[1024];
	FILE *f = fopen(file, "r");
	int found = 0;

	while (f && !found && fgets(line, sizeof(line), f))
		found = strstr(line, text) != NULL;
	if (f)
		fclose(f);
	return found;
}

/* Kills a workload tree (SIGKILL to its pid namespace's init) and reaps it (we are the subreaper). */
static void kill_tree(pid_t pid)
{
	if (pid <= 0)
		return;
	kill(pid, SIGCONT);
	kill(pid, SIGKILL);
	while (waitpid(-1, NULL, WNOHANG) > 0)
		;
	for (int i = 0; i < 2000 && kill(pid, 0) == 0; i++) {
		usleep(1000);
		while (waitpid(-1, NULL, WNOHANG) > 0)
			;
	}
}

static int setup(void)
{
	mkdir(OUT, 0755);
	mkdir("/dev/shm", 01777);
	if (access("/dev/shm/criu", F_OK)) {
		mkdir("/dev/shm/criu", 0700);
	}
	/* orphaned workload and copy trees reparent here, so they can be reaped */
	return prctl(PR_SET_CHILD_SUBREAPER, 1);
}

static int check(size_t mib)
{
	uint64_t t1, t2, c[NCOPIES + 1][2], after_write = 0, others[NCOPIES + 1] = { 0 }, tpl_after = 0;
	pid_t tpl, copies[NCOPIES + 1] = { 0 };
	int vmas[NCOPIES + 1][2] = { { 0 } }, digests_ok = 1, isolation_ok = 1, plain_ok = 1;
	double restore_ms[NCOPIES + 1] = { 0 }, restore_log_ms[NCOPIES + 1] = { 0 }, pin_ms[NCOPIES + 1] = { 0 };
	double dump_full_ms = 0, dump_tmpl_ms = 0;
	long long full_bytes = 0, tmpl_bytes = 0;
	int mark_ok = 0, refused_ok = 0, wrong_root_ok = 0, fds = 0;
	/* the fork of a fork: copy 0 (written) dumped as a template, NNESTED copies of it */
	uint64_t n[NNESTED][2] = { { 0 } }, n_written = 0, n_other = 0, n_tpl_after = 0;
	pid_t ncopies[NNESTED] = { 0 };
	int nvmas[NNESTED][2] = { { 0 } }, nested_ok = 1, copy_plain_refused = 0, given_refused = 0, given_used = 0;
	double given_ms = 0;
	double nested_dump_ms = 0, nested_restore_ms[NNESTED] = { 0 }, nested_log_ms[NNESTED] = { 0 }, npin[NNESTED];
	long long nested_bytes = 0;
	char line[512];
	FILE *f;

	if (setup())
		fail("PR_SET_CHILD_SUBREAPER: %s", strerror(errno));
	/* what the guest kernel lacks for CRIU, for the record (a missing feature is no failure by itself) */
	{
		char *args[] = { CRIU, "check", NULL };

		run_criu(args, NULL, "/tmp/criu-check.out");
	}
	f = fopen("/tmp/criu-check.out", "r");
	while (f && fgets(line, sizeof(line), f))
		fprintf(stderr, "criu check: %s", line);
	if (f)
		fclose(f);

	unlink(OUT "/d1");
	unlink(OUT "/d2");
	tpl = start_workload(mib);
	if (tpl <= 0 || wait_file(OUT "/d1", 60000) || wait_file(OUT "/d2", 60000)) {
		fail("the workload did not start");
		goto out;
	}
	t1 = ask_digest(tpl, 1, SIGUSR1);
	t2 = ask_digest(child_of(tpl), 2, SIGUSR1);
	if (!t1 || !t2) {
		fail("the workload gave no digest");
		goto out;
	}
	/* the full dump first (the tree keeps running), then the template dump, which leaves the tree stopped */
	if (dump(tpl, 0, &dump_full_ms) || dump(tpl, 1, &dump_tmpl_ms))
		goto out;
	full_bytes = pages_bytes(IMG_FULL);
	tmpl_bytes = pages_bytes(IMG_TMPL);
	mark_ok = access(IMG_TMPL "/bunshin-tmpl-dump", F_OK) == 0 && access(IMG_FULL "/bunshin-tmpl-dump", F_OK);
	if (!mark_ok)
		fail("the template dump's mark is missing, or the full dump has one");

	/* Images without the anonymous pages restore only through the module: a plain restore refuses them. */
	{
		double ms, lg, pin;
		int rc;
		pid_t p = restore_at(IMG_TMPL, M_PLAIN, tpl, 9, &ms, &lg, &pin, &rc);

		refused_ok = p < 0 && rc > 0 && file_has(IMG_TMPL "/restore-9.log", "restore them with CRIU_TMPL_DEV");
		if (!refused_ok) {
			fail("a plain restore of the template dump did not refuse it (exit %d)", rc);
			kill_tree(p);
		}
	}

	/* Another tree (a workload of another size) as CRIU_TMPL_ROOT: its memory layout differs, the restore refuses. */
	{
		double ms, lg, pin;
		int rc;
		pid_t other, p = -1;

		unlink(OUT "/d1");
		unlink(OUT "/d2");
		other = start_workload(mib + 1);
		if (other <= 0 || wait_file(OUT "/d1", 60000) || wait_file(OUT "/d2", 60000))
			fail("the second workload did not start");
		else {
			p = restore_at(IMG_TMPL, M_TMPL, other, 8, &ms, &lg, &pin, &rc);
			wrong_root_ok = p < 0 && rc > 0 &&
					file_has(IMG_TMPL "/restore-8.log", "CRIU_TMPL_ROOT names another tree");
			if (!wrong_root_ok)
				fail("a template restore from another tree did not refuse it (exit %d)", rc);
		}
		kill_tree(p);
		kill_tree(other);
	}

	/*
	 * Templates made once for the snapshot (CRIU_TMPL_FDS): a listed fd of another length is refused; copy 1 then
	 * maps the listed ones instead of pinning its own.
	 */
	{
		double ms, lg, pin;
		int rc;
		pid_t p = -1;
		FILE *bad;

		if (make_given(tpl, &given_ms) <= 0)
			fail("no template made for the snapshot");
		else if (!(bad = fopen(GIVEN, "w")))
			fail("cannot write " GIVEN);
		else {
			fprintf(bad, "1 1000 3000 %d\n", given_fds[0]);
			fclose(bad);
			p = restore_at(IMG_TMPL, M_GIVEN, tpl, 7, &ms, &lg, &pin, &rc);
			given_refused = p < 0 && rc > 0 && file_has(IMG_TMPL "/restore-7.log", "is not a template of");
			if (!given_refused)
				fail("a restore given a template fd of another length did not refuse it (exit %d)", rc);
			kill_tree(p);
		}
		close_given();
		if (make_given(tpl, &given_ms) <= 0)
			fail("no template made for the snapshot");
	}

	/*
	 * Copies 0 and 1 through the module from the template dump (copy 1 with the templates made once), copy 2
	 * through the module from the full dump (its anonymous pages skipped), copy 3 a plain restore of the full dump
	 * (the patch changes nothing then).
	 */
	for (int i = 0; i <= NCOPIES; i++) {
		const char *dir = i < NCOPIES - 1 ? IMG_TMPL : IMG_FULL;

		copies[i] = restore(dir, i == 1 ? M_GIVEN : i < NCOPIES ? M_TMPL : M_PLAIN, tpl, i, &restore_ms[i],
				    &restore_log_ms[i], &pin_ms[i]);
		if (i == 1) {
			given_used = copies[i] > 0 && file_has(IMG_TMPL "/restore-1.log", "made for the snapshot") &&
				     !file_has(IMG_TMPL "/restore-1.log", " 0 made for the snapshot");
			if (!given_used)
				fail("copy 1 did not map the templates made for the snapshot");
			close_given(); /* the copy's mappings hold them now */
		}
		if (copies[i] <= 0)
			goto out;
		probe_copy(copies[i], vmas[i], c[i], &fds);
		if (c[i][0] != t1 || c[i][1] != t2) {
			digests_ok = 0;
			fail("copy %d: digests %016llx %016llx, the template's %016llx %016llx", i,
			     (unsigned long long)c[i][0], (unsigned long long)c[i][1], (unsigned long long)t1,
			     (unsigned long long)t2);
		}
		if (i < NCOPIES && (vmas[i][0] < 1 || vmas[i][1] < 1))
			fail("copy %d maps no template (%d, %d mappings of " DEV ")", i, vmas[i][0], vmas[i][1]);
		if (i == NCOPIES && (vmas[i][0] || vmas[i][1])) {
			plain_ok = 0;
			fail("a restore without CRIU_TMPL_DEV mapped the template");
		}
	}

	if (fds)
		fail("the copies hold %d descriptors of the module", fds);

	/* copy 0 writes; the other copies and the template keep the template's bytes */
	after_write = ask_digest(copies[0], 1, SIGUSR2);
	if (!after_write || after_write == t1) {
		isolation_ok = 0;
		fail("copy 0's write did not change its digest (%016llx)", (unsigned long long)after_write);
	}
	for (int i = 1; i <= NCOPIES; i++) {
		others[i] = ask_digest(copies[i], 1, SIGUSR1);
		if (others[i] != t1) {
			isolation_ok = 0;
			fail("copy %d changed after copy 0 wrote (%016llx)", i, (unsigned long long)others[i]);
		}
	}

	/*
	 * A fork of a fork. A plain dump of a template copy is refused (its template mappings have no pages to read),
	 * clearly; a template dump of copy 0 (which wrote) writes none of its anonymous memory, leaves it stopped as
	 * the nested template, and its copies map the module again: they read copy 0's memory (its written pages
	 * over the first template's), a write in one changes neither the other nor copy 0.
	 */
	{
		double ms;

		copy_plain_refused = dump_into(IMG_BAD, copies[1], D_PLAIN, 1, &ms, 1) != 0 &&
				     file_has(IMG_BAD "/dump.log", "a fork of a template copy is a template dump");
		if (!copy_plain_refused) {
			nested_ok = 0;
			fail("a plain dump of a template copy was not refused clearly");
		}
	}
	if (dump_into(IMG_NESTED, copies[0], D_TMPL, 0, &nested_dump_ms, 0)) {
		nested_ok = 0;
	} else {
		nested_bytes = pages_bytes(IMG_NESTED);
		for (int i = 0; i < NNESTED && nested_ok; i++) {
			ncopies[i] = restore(IMG_NESTED, M_TMPL, copies[0], 20 + i, &nested_restore_ms[i], &nested_log_ms[i],
					     &npin[i]);
			if (ncopies[i] <= 0) {
				nested_ok = 0;
				break;
			}
			probe_copy(ncopies[i], nvmas[i], n[i], &fds);
			if (n[i][0] != after_write || n[i][1] != t2 || nvmas[i][0] < 1 || nvmas[i][1] < 1) {
				nested_ok = 0;
				fail("nested copy %d: digests %016llx %016llx (%d, %d template mappings), copy 0's %016llx "
				     "%016llx",
				     i, (unsigned long long)n[i][0], (unsigned long long)n[i][1], nvmas[i][0], nvmas[i][1],
				     (unsigned long long)after_write, (unsigned long long)t2);
			}
		}
		if (nested_ok) {
			n_written = ask_digest(ncopies[0], 1, SIGUSR2);
			n_other = ask_digest(ncopies[1], 1, SIGUSR1);
			if (!n_written || n_written == after_write || n_other != after_write) {
				nested_ok = 0;
				fail("nested copy 0 wrote %016llx; nested copy 1 reads %016llx (expected %016llx)",
				     (unsigned long long)n_written, (unsigned long long)n_other,
				     (unsigned long long)after_write);
			}
		}
		for (int i = 0; i < NNESTED; i++)
			kill_tree(ncopies[i]);
		/* the nested copies are gone: thaw copy 0, the nested template, and ask it */
		kill(copies[0], SIGCONT);
		kill(child_of(copies[0]), SIGCONT);
		n_tpl_after = ask_digest(copies[0], 1, SIGUSR1);
		if (n_tpl_after != after_write) {
			nested_ok = 0;
			fail("the nested template (copy 0) changed (%016llx, was %016llx)", (unsigned long long)n_tpl_after,
			     (unsigned long long)after_write);
		}
	}

	for (int i = 0; i <= NCOPIES; i++) {
		kill_tree(copies[i]);
		copies[i] = 0;
	}
	/* the copies are gone: thaw the template and ask it */
	kill(tpl, SIGCONT);
	tpl_after = ask_digest(tpl, 1, SIGUSR1);
	if (tpl_after != t1) {
		isolation_ok = 0;
		fail("the template changed (%016llx, was %016llx)", (unsigned long long)tpl_after,
		     (unsigned long long)t1);
	}

	printf("{\"mode\": \"criu\", \"mib\": %zu, \"copies\": %d, \"template_digests\": [\"%016llx\", \"%016llx\"], "
	       "\"copy_digests\": [",
	       mib, NCOPIES, (unsigned long long)t1, (unsigned long long)t2);
	for (int i = 0; i < NCOPIES; i++)
		printf("%s[\"%016llx\", \"%016llx\"]", i ? ", " : "", (unsigned long long)c[i][0],
		       (unsigned long long)c[i][1]);
	printf("], \"copy_tmpl_vmas\": [");
	for (int i = 0; i < NCOPIES; i++)
		printf("%s[%d, %d]", i ? ", " : "", vmas[i][0], vmas[i][1]);
	printf("], \"plain_digests\": [\"%016llx\", \"%016llx\"], \"plain_tmpl_vmas\": [%d, %d], "
	       "\"written_digest\": \"%016llx\", \"others_after_write\": [",
	       (unsigned long long)c[NCOPIES][0], (unsigned long long)c[NCOPIES][1], vmas[NCOPIES][0],
	       vmas[NCOPIES][1], (unsigned long long)after_write);
	for (int i = 1; i <= NCOPIES; i++)
		printf("%s\"%016llx\"", i > 1 ? ", " : "", (unsigned long long)others[i]);
	printf("], \"template_after\": \"%016llx\", \"dump_full_ms\": %.1f, \"dump_tmpl_ms\": %.1f, "
	       "\"full_pages_bytes\": %lld, \"tmpl_pages_bytes\": %lld, \"mark_ok\": %s, \"refused_ok\": %s, "
	       "\"wrong_root_ok\": %s, \"restore_ms\": [",
	       (unsigned long long)tpl_after, dump_full_ms, dump_tmpl_ms, full_bytes, tmpl_bytes, mark_ok ? "true" : "false",
	       refused_ok ? "true" : "false", wrong_root_ok ? "true" : "false");
	for (int i = 0; i <= NCOPIES; i++)
		printf("%s%.1f", i ? ", " : "", restore_ms[i]);
	printf("], \"restore_log_ms\": [");
	for (int i = 0; i <= NCOPIES; i++)
		printf("%s%.1f", i ? ", " : "", restore_log_ms[i]);
	printf("], \"tmpl_pin_ms\": [");
	for (int i = 0; i < NCOPIES; i++)
		printf("%s%.1f", i ? ", " : "", pin_ms[i]);
	printf("], \"nested\": {\"copies\": %d, \"digests\": [", NNESTED);
	for (int i = 0; i < NNESTED; i++)
		printf("%s[\"%016llx\", \"%016llx\"]", i ? ", " : "", (unsigned long long)n[i][0], (unsigned long long)n[i][1]);
	printf("], \"tmpl_vmas\": [");
	for (int i = 0; i < NNESTED; i++)
		printf("%s[%d, %d]", i ? ", " : "", nvmas[i][0], nvmas[i][1]);
	printf("], \"expect\": [\"%016llx\", \"%016llx\"], \"written_digest\": \"%016llx\", \"other_after_write\": "
	       "\"%016llx\", \"template_after\": \"%016llx\", \"plain_dump_refused\": %s, \"dump_ms\": %.1f, "
	       "\"pages_bytes\": %lld, \"restore_log_ms\": [%.1f, %.1f], \"ok\": %s}",
	       (unsigned long long)after_write, (unsigned long long)t2, (unsigned long long)n_written,
	       (unsigned long long)n_other, (unsigned long long)n_tpl_after, copy_plain_refused ? "true" : "false",
	       nested_dump_ms, nested_bytes, nested_log_ms[0], nested_log_ms[1], nested_ok ? "true" : "false");
	printf(", \"given\": {\"made_ms\": %.1f, \"used\": %s, \"wrong_length_refused\": %s}", given_ms,
	       given_used ? "true" : "false", given_refused ? "true" : "false");
	printf(", \"copy_tmpl_fds\": %d, \"digests_ok\": %s, \"isolation_ok\": %s, \"plain_ok\": %s, \"failures\": [%s]}\n",
	       fds, digests_ok ? "true" : "false", isolation_ok ? "true" : "false", plain_ok ? "true" : "false", failures);
	kill_tree(tpl);
	return nfail ? 1 : 0;
out:
	for (int i = 0; i < NNESTED; i++)
		kill_tree(ncopies[i]);
	for (int i = 0; i <= NCOPIES; i++)
		kill_tree(copies[i]);
	kill_tree(tpl);
	printf("{\"mode\": \"criu\", \"failures\": [%s]}\n", failures);
	return 1;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

#define REPS 5
#define NREPS 3
#define FAN 8
#define FAN_REPS 2
#define NESTED_DIRTY (8UL << 20)
#define IMG_NESTED_COW "/tmp/img-nested-cow"

static double med_of(double *v, int n)
{
	qsort(v, n, sizeof(double), cmp_d);
	return v[n / 2];
}

/* The tree at pid answers with task 1's digest on sig; a missing answer is a failure. */
static uint64_t must_digest(pid_t pid, int sig, size_t mib)
{
	uint64_t d = ask_digest(pid, 1, sig);

	if (!d)
		fail("%zu MiB: a copy gave no digest", mib);
	return d;
}

struct bench_size {
	size_t mib;
	double dfull, dtmpl, given_pin, restore[4], restore_wall[4], pin;
	double fan[2], fan_wall[2];			       /* FAN copies, kept alive: M_GIVEN, M_COW */
	double ndump[2], nrestore[2], npin;		       /* nested: template (given), cow incremental */
	long long bfull, btmpl, nbytes[2];
};

/*
 * One size: REPS dumps of each kind; the templates made once (CRIU_TMPL_FDS); REPS restores of each mode,
 * interleaved; FAN copies kept alive at once, FAN_REPS times, made once through the module and once by CoW
 * restore; NREPS forks of a fork, a copy that wrote NESTED_DIRTY forked again, by template dump and restore
 * through the module beside an incremental dump of a CoW copy and its CoW restore. Criu's own times (its log).
 */
static int bench_size(size_t mib, struct bench_size *r)
{
	double ms[4][REPS], wall[4][REPS], pin[4][REPS], df[REPS], dt[REPS];
	double fan[2][FAN_REPS], fwall[2][FAN_REPS], nd[2][NREPS], nr[2][NREPS], np[NREPS];
	pid_t tpl, c[FAN];
	double w, lg, pn;

	memset(r, 0, sizeof(*r));
	r->mib = mib;
	unlink(OUT "/d1");
	unlink(OUT "/d2");
	tpl = start_workload(mib);
	if (tpl <= 0 || wait_file(OUT "/d1", 300000) || wait_file(OUT "/d2", 60000)) {
		fail("%zu MiB: the workload did not start", mib);
		kill_tree(tpl);
		return -1;
	}
	/* the last template dump leaves the tree stopped: the template */
	for (int i = 0; i < REPS; i++)
		if (dump_as(tpl, 0, 1, &df[i]) || dump_as(tpl, 1, i < REPS - 1, &dt[i]))
			goto err;
	r->dfull = med_of(df, REPS);
	r->dtmpl = med_of(dt, REPS);
	r->bfull = pages_bytes(IMG_FULL);
	r->btmpl = pages_bytes(IMG_TMPL);
	if (make_given(tpl, &r->given_pin) <= 0)
		goto err;

	/* interleaved, so that the modes see the same guest state */
	for (int i = 0; i < REPS; i++)
		for (int m = 0; m < 4; m++) {
			pid_t k = restore(m == M_COW || m == M_PLAIN ? IMG_FULL : IMG_TMPL, m, tpl, i * 4 + m, &wall[m][i],
					  &ms[m][i], &pin[m][i]);

			if (k <= 0)
				goto err;
			must_digest(k, SIGUSR1, mib);
			kill_tree(k);
		}
	for (int m = 0; m < 4; m++) {
		r->restore[m] = med_of(ms[m], REPS);
		r->restore_wall[m] = med_of(wall[m], REPS);
	}
	r->pin = med_of(pin[M_TMPL], REPS);

	/* fan-out: FAN copies alive at once */
	for (int i = 0; i < FAN_REPS; i++)
		for (int f = 0; f < 2; f++) {
			fan[f][i] = fwall[f][i] = 0;
			for (int j = 0; j < FAN; j++) {
				c[j] = restore(f ? IMG_FULL : IMG_TMPL, f ? M_COW : M_GIVEN, tpl, 100 + j, &w, &lg, &pn);
				if (c[j] <= 0) {
					while (j--)
						kill_tree(c[j]);
					goto err;
				}
				fan[f][i] += lg;
				fwall[f][i] += w;
			}
			for (int j = 0; j < FAN; j++) {
				must_digest(c[j], SIGUSR1, mib);
				kill_tree(c[j]);
			}
		}
	for (int f = 0; f < 2; f++) {
		r->fan[f] = med_of(fan[f], FAN_REPS);
		r->fan_wall[f] = med_of(fwall[f], FAN_REPS);
	}
	close_given();

	/* a fork of a fork: the copy writes NESTED_DIRTY (SIGUSR2), then is forked */
	for (int i = 0; i < NREPS; i++) {
		for (int f = 0; f < 2; f++) {
			pid_t copy = restore(f ? IMG_FULL : IMG_TMPL, f ? M_COW : M_TMPL, tpl, 200 + i * 2 + f, &w, &lg, &pn);
			uint64_t want;
			pid_t k;

			if (copy <= 0)
				goto err;
			want = must_digest(copy, SIGUSR2, mib);
			if (dump_into(f ? IMG_NESTED_COW : IMG_NESTED, copy, f ? D_COW_INCR : D_TMPL, f, &nd[f][i], 0)) {
				kill_tree(copy);
				goto err;
			}
			r->nbytes[f] = pages_bytes(f ? IMG_NESTED_COW : IMG_NESTED);
			if (!f && make_given(copy, &np[i]) <= 0) {
				kill_tree(copy);
				goto err;
			}
			k = restore(f ? IMG_NESTED_COW : IMG_NESTED, f ? M_COW : M_GIVEN, copy, 300 + i * 2 + f, &w,
				    &nr[f][i], &pn);
			if (!f)
				close_given();
			if (k > 0 && must_digest(k, SIGUSR1, mib) != want)
				fail("%zu MiB: a fork of a fork (%s) reads other memory than its copy", mib, f ? "cow" : "template");
			kill_tree(k);
			kill_tree(copy);
			if (k <= 0)
				goto err;
		}
	}
	for (int f = 0; f < 2; f++) {
		r->ndump[f] = med_of(nd[f], NREPS);
		r->nrestore[f] = med_of(nr[f], NREPS);
	}
	r->npin = med_of(np, NREPS);
	kill_tree(tpl);
	fprintf(stderr,
		"%zu MiB (criu's log, medians): first fork: template dump %.1f + restore with templates made once %.1f "
		"(made once: %.1f; pinning per restore %.1f, of it pin %.1f) | plain dump %.1f + cow restore %.1f "
		"(plain restore %.1f); %d-way: %.1f vs cow %.1f; nested: template %.1f + %.1f (pin %.1f) vs cow %.1f + "
		"%.1f\n",
		mib, r->dtmpl, r->restore[M_GIVEN], r->given_pin, r->restore[M_TMPL], r->pin, r->dfull, r->restore[M_COW],
		r->restore[M_PLAIN], FAN, r->fan[0], r->fan[1], r->ndump[0], r->nrestore[0], r->npin, r->ndump[1],
		r->nrestore[1]);
	return nfail ? -1 : 0;
err:
	close_given();
	kill_tree(tpl);
	return -1;
}

static int bench(int nsizes, char **sizes)
{
	struct bench_size r[8];
	int ns = nsizes > 8 ? 8 : nsizes, done = 0;

	if (setup())
		fail("PR_SET_CHILD_SUBREAPER: %s", strerror(errno));
	dirty = NESTED_DIRTY;
	for (int s = 0; s < ns && !nfail; s++)
		if (bench_size(strtoul(sizes[s], NULL, 10), &r[s]) == 0)
			done++;
	printf("{\"mode\": \"criu-bench\", \"reps\": %d, \"fan\": %d, \"nested_reps\": %d, \"nested_dirty_mib\": %lu, "
	       "\"sizes\": [",
	       REPS, FAN, NREPS, NESTED_DIRTY >> 20);
	for (int s = 0; s < done; s++) {
		struct bench_size *x = &r[s];

		printf("%s{\"mib\": %zu, \"dump_full_ms\": %.2f, \"dump_tmpl_ms\": %.2f, \"full_pages_bytes\": %lld, "
		       "\"tmpl_pages_bytes\": %lld, \"tmpl_restore_ms\": %.2f, \"cow_restore_ms\": %.2f, "
		       "\"plain_restore_ms\": %.2f, \"given_restore_ms\": %.2f, \"tmpl_restore_wall_ms\": %.2f, "
		       "\"cow_restore_wall_ms\": %.2f, \"plain_restore_wall_ms\": %.2f, \"given_restore_wall_ms\": %.2f, "
		       "\"tmpl_pin_ms\": %.2f, \"given_made_ms\": %.2f, \"tmpl_vs_cow\": %.3f, \"given_vs_cow\": %.3f, "
		       "\"tmpl_vs_plain\": %.3f, \"dump_tmpl_vs_full\": %.3f, "
		       "\"first_fork_tmpl_ms\": %.2f, \"first_fork_cow_ms\": %.2f, \"first_fork_tmpl_vs_cow\": %.3f, "
		       "\"fan_given_ms\": %.2f, \"fan_cow_ms\": %.2f, \"fan_given_wall_ms\": %.2f, \"fan_cow_wall_ms\": %.2f, "
		       "\"fan_given_vs_cow\": %.3f, \"nested_tmpl_dump_ms\": %.2f, \"nested_tmpl_restore_ms\": %.2f, "
		       "\"nested_tmpl_made_ms\": %.2f, \"nested_cow_dump_ms\": %.2f, \"nested_cow_restore_ms\": %.2f, "
		       "\"nested_tmpl_pages_bytes\": %lld, \"nested_cow_pages_bytes\": %lld, \"nested_tmpl_ms\": %.2f, "
		       "\"nested_cow_ms\": %.2f, \"nested_tmpl_vs_cow\": %.3f}",
		       s ? ", " : "", x->mib, x->dfull, x->dtmpl, x->bfull, x->btmpl, x->restore[M_TMPL], x->restore[M_COW],
		       x->restore[M_PLAIN], x->restore[M_GIVEN], x->restore_wall[M_TMPL], x->restore_wall[M_COW],
		       x->restore_wall[M_PLAIN], x->restore_wall[M_GIVEN], x->pin, x->given_pin,
		       x->restore[M_TMPL] / x->restore[M_COW], x->restore[M_GIVEN] / x->restore[M_COW],
		       x->restore[M_TMPL] / x->restore[M_PLAIN], x->dtmpl / x->dfull, x->dtmpl + x->restore[M_GIVEN],
		       x->dfull + x->restore[M_COW], (x->dtmpl + x->restore[M_GIVEN]) / (x->dfull + x->restore[M_COW]),
		       x->fan[0], x->fan[1], x->fan_wall[0], x->fan_wall[1], x->fan[0] / x->fan[1], x->ndump[0],
		       x->nrestore[0], x->npin, x->ndump[1], x->nrestore[1], x->nbytes[0], x->nbytes[1],
		       x->ndump[0] + x->nrestore[0], x->ndump[1] + x->nrestore[1],
		       (x->ndump[0] + x->nrestore[0]) / (x->ndump[1] + x->nrestore[1]));
	}
	printf("]");
	if (done > 1) {
		struct bench_size *a = &r[0], *z = &r[done - 1];

		printf(", \"sizes_ratio\": %.3f, \"largest_over_smallest\": {\"first_fork_tmpl\": %.3f, "
		       "\"first_fork_cow\": %.3f, \"given_restore\": %.3f, \"tmpl_restore\": %.3f, \"cow_restore\": %.3f, "
		       "\"plain_restore\": %.3f, \"dump_tmpl\": %.3f, \"dump_full\": %.3f, \"fan_given\": %.3f, "
		       "\"fan_cow\": %.3f, \"nested_tmpl\": %.3f, \"nested_cow\": %.3f, \"given_made\": %.3f}",
		       (double)z->mib / a->mib, (z->dtmpl + z->restore[M_GIVEN]) / (a->dtmpl + a->restore[M_GIVEN]),
		       (z->dfull + z->restore[M_COW]) / (a->dfull + a->restore[M_COW]), z->restore[M_GIVEN] / a->restore[M_GIVEN],
		       z->restore[M_TMPL] / a->restore[M_TMPL], z->restore[M_COW] / a->restore[M_COW],
		       z->restore[M_PLAIN] / a->restore[M_PLAIN], z->dtmpl / a->dtmpl, z->dfull / a->dfull, z->fan[0] / a->fan[0],
		       z->fan[1] / a->fan[1], (z->ndump[0] + z->nrestore[0]) / (a->ndump[0] + a->nrestore[0]),
		       (z->ndump[1] + z->nrestore[1]) / (a->ndump[1] + a->nrestore[1]), z->given_pin / a->given_pin);
	}
	printf(", \"failures\": [%s]}\n", failures);
	return nfail ? 1 : 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc >= 2 && !strcmp(argv[1], "criu"))
		return check(argc > 2 ? strtoul(argv[2], NULL, 10) : 16);
	if (argc >= 3 && !strcmp(argv[1], "criu-bench"))
		return bench(argc - 2, argv + 2);
	fprintf(stderr, "usage: criu_test criu [MiB] | criu_test criu-bench MiB...\n");
	return 2;
}
