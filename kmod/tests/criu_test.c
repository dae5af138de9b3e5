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
 * first overwrites the first 256 KiB of its buffer. Copies restored by CRIU answer the same way.
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
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <dirent.h>
#include <time.h>
#include <unistd.h>

#include "guest.h"

#define OUT "/tmp/wl"
#define IMG "/tmp/img"
#define CRIU "/criu/criu"
#define DEV "/dev/bunshin_tmpl"
#define NCOPIES 3
#define CHILD_MIB 1
#define DIRTY (256UL << 10)

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
			memset(buf, 0xab, DIRTY);
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
	while (now_ms() - t0 < 20000) {
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

/* Dumps the tree of pid: into IMG_FULL with every page, leaving it running, or into IMG_TMPL with CRIU_TMPL_DUMP
 * (no pages of private anonymous memory), leaving it stopped (the template) unless running. *ms: criu's own time
 * (its log). */
static int dump_as(pid_t pid, int tmpl, int running, double *ms)
{
	const char *dir = tmpl ? IMG_TMPL : IMG_FULL;
	char spid[16], cmd[128], path[96], *d = (char *)dir;
	char *args[] = { CRIU, "dump", "-t", spid, "-D", d, tmpl && !running ? "--leave-stopped" : "--leave-running", "-o",
			 "dump.log", "-v4", NULL };
	char *env[] = { "CRIU_TMPL_DUMP=1", NULL };
	double pin;
	int rc;

	snprintf(spid, sizeof(spid), "%d", pid);
	snprintf(cmd, sizeof(cmd), "rm -rf %s && mkdir -p %s", dir, dir);
	if (system(cmd))
		return -1;
	rc = run_criu(args, tmpl ? env : NULL, "/tmp/criu-dump.out");
	snprintf(path, sizeof(path), "%s/dump.log", dir);
	*ms = log_ms(path, &pin);
	if (rc) {
		show_log(path);
		show_log("/tmp/criu-dump.out");
		fail("criu dump (%s) exited %d", tmpl ? "CRIU_TMPL_DUMP" : "plain", rc);
	}
	return rc;
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

enum mode { M_TMPL, M_COW, M_PLAIN };

/* Restores one copy of the images in dir (detached); returns its root's pid (-1: criu failed, and *rc says how),
 * the time it took (wall, and criu's own by its log) and the part spent pinning templates. Failures are the
 * caller's to report. */
static pid_t restore_at(const char *dir, enum mode m, pid_t tpl, int n, double *ms, double *log_t, double *pin,
			int *rcp)
{
	char pidfile[64], log[64], root_env[48], line[32] = "", path[96], *d = (char *)dir;
	char *args[] = { CRIU, "restore", "-D", d, "-d", "--pidfile", pidfile, "-o", log, "-v4", NULL };
	char *tmpl_env[] = { "CRIU_TMPL_DEV=" DEV, root_env, NULL };
	char *cow_env[] = { "CRIU_COW_RESTORE=1", NULL };
	double t0;
	int rc, fd;
	ssize_t r;

	snprintf(pidfile, sizeof(pidfile), "/tmp/copy-%d.pid", n);
	snprintf(log, sizeof(log), "restore-%d.log", n);
	snprintf(root_env, sizeof(root_env), "CRIU_TMPL_ROOT=%d", tpl);
	unlink(pidfile);
	t0 = now_ms();
	rc = run_criu(args, m == M_TMPL ? tmpl_env : m == M_COW ? cow_env : NULL, "/tmp/criu-restore.out");
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
		fail("criu restore (%s) of copy %d from %s exited %d", m == M_TMPL ? "template" : m == M_COW ? "cow" : "plain",
		     n, dir, rc);
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
	 * Copies 0 and 1 through the module from the template dump, copy 2 through the module from the full dump
	 * (its anonymous pages skipped), copy 3 a plain restore of the full dump (the patch changes nothing then).
	 */
	for (int i = 0; i <= NCOPIES; i++) {
		const char *dir = i < NCOPIES - 1 ? IMG_TMPL : IMG_FULL;
		pid_t k;

		copies[i] = restore(dir, i < NCOPIES ? M_TMPL : M_PLAIN, tpl, i, &restore_ms[i], &restore_log_ms[i],
				    &pin_ms[i]);
		if (copies[i] <= 0)
			goto out;
		k = child_of(copies[i]);
		vmas[i][0] = tmpl_vmas(copies[i]);
		vmas[i][1] = tmpl_vmas(k);
		fds += tmpl_fds(copies[i]) + tmpl_fds(k);
		c[i][0] = ask_digest(copies[i], 1, SIGUSR1);
		c[i][1] = ask_digest(k, 2, SIGUSR1);
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
	printf("], \"copy_tmpl_fds\": %d, \"digests_ok\": %s, \"isolation_ok\": %s, \"plain_ok\": %s, \"failures\": [%s]}\n",
	       fds, digests_ok ? "true" : "false", isolation_ok ? "true" : "false", plain_ok ? "true" : "false", failures);
	kill_tree(tpl);
	return nfail ? 1 : 0;
out:
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

static int bench(int nsizes, char **sizes)
{
	double med[8][3], lmed[8][3], pmed[8], dfull[8], dtmpl[8];
	long long bfull[8], btmpl[8];
	size_t mib[8];
	int ns = nsizes > 8 ? 8 : nsizes, done = 0;

	if (setup())
		fail("PR_SET_CHILD_SUBREAPER: %s", strerror(errno));
	for (int s = 0; s < ns; s++) {
		double ms[3][REPS], lg[3][REPS], pin[3][REPS];
		pid_t tpl;

		mib[s] = strtoul(sizes[s], NULL, 10);
		unlink(OUT "/d1");
		unlink(OUT "/d2");
		tpl = start_workload(mib[s]);
		if (tpl <= 0 || wait_file(OUT "/d1", 120000) || wait_file(OUT "/d2", 60000)) {
			fail("%zu MiB: the workload did not start", mib[s]);
			kill_tree(tpl);
			break;
		}
		/* REPS dumps of each kind (the last template dump leaves the tree stopped: the template) */
		{
			double df[REPS], dt[REPS];
			int bad = 0;

			for (int r = 0; r < REPS && !bad; r++)
				bad = dump_as(tpl, 0, 1, &df[r]) || dump_as(tpl, 1, r < REPS - 1, &dt[r]);
			if (bad) {
				kill_tree(tpl);
				break;
			}
			qsort(df, REPS, sizeof(double), cmp_d);
			qsort(dt, REPS, sizeof(double), cmp_d);
			dfull[s] = df[REPS / 2];
			dtmpl[s] = dt[REPS / 2];
		}
		bfull[s] = pages_bytes(IMG_FULL);
		btmpl[s] = pages_bytes(IMG_TMPL);
		/* interleaved, so that the three modes see the same guest state: the template restore from the template
		 * dump, the CoW and plain restores from the full one */
		for (int r = 0; r < REPS && !nfail; r++)
			for (int m = 0; m < 3 && !nfail; m++) {
				pid_t c = restore(m == M_TMPL ? IMG_TMPL : IMG_FULL, m, tpl, r * 3 + m, &ms[m][r], &lg[m][r],
						  &pin[m][r]);

				if (c <= 0)
					break;
				/* the copy is whole: it answers with a digest */
				if (!ask_digest(c, 1, SIGUSR1))
					fail("%zu MiB: a restored copy gave no digest", mib[s]);
				kill_tree(c);
			}
		kill_tree(tpl);
		if (nfail)
			break;
		for (int m = 0; m < 3; m++) {
			qsort(ms[m], REPS, sizeof(double), cmp_d);
			qsort(lg[m], REPS, sizeof(double), cmp_d);
			med[s][m] = ms[m][REPS / 2];
			lmed[s][m] = lg[m][REPS / 2];
		}
		qsort(pin[0], REPS, sizeof(double), cmp_d);
		pmed[s] = pin[0][REPS / 2];
		fprintf(stderr,
			"%zu MiB: dump ms (medians) full %.1f, template %.1f; restore ms (median of %d; criu's log / wall) template "
			"%.1f / %.1f (pin %.1f), cow %.1f / %.1f, plain %.1f / %.1f\n",
			mib[s], dfull[s], dtmpl[s], REPS, lmed[s][0], med[s][0], pmed[s], lmed[s][1], med[s][1], lmed[s][2],
			med[s][2]);
		done++;
	}
	printf("{\"mode\": \"criu-bench\", \"reps\": %d, \"sizes\": [", REPS);
	for (int s = 0; s < done; s++)
		printf("%s{\"mib\": %zu, \"dump_full_ms\": %.2f, \"dump_tmpl_ms\": %.2f, \"full_pages_bytes\": %lld, "
		       "\"tmpl_pages_bytes\": %lld, \"tmpl_restore_ms\": %.2f, \"cow_restore_ms\": %.2f, "
		       "\"plain_restore_ms\": %.2f, \"tmpl_restore_wall_ms\": %.2f, \"cow_restore_wall_ms\": %.2f, "
		       "\"plain_restore_wall_ms\": %.2f, \"tmpl_pin_ms\": %.2f, \"tmpl_vs_cow\": %.3f, "
		       "\"tmpl_vs_plain\": %.3f, \"tmpl_unpinned_vs_cow\": %.3f, \"dump_tmpl_vs_full\": %.3f}",
		       s ? ", " : "", mib[s], dfull[s], dtmpl[s], bfull[s], btmpl[s], lmed[s][0], lmed[s][1], lmed[s][2],
		       med[s][0], med[s][1], med[s][2], pmed[s], lmed[s][0] / lmed[s][1], lmed[s][0] / lmed[s][2],
		       (lmed[s][0] - pmed[s]) / lmed[s][1], dtmpl[s] / dfull[s]);
	printf("]");
	if (done > 1) {
		int l = done - 1;

		printf(", \"sizes_ratio\": %.3f, \"tmpl_restore_largest_over_smallest\": %.3f, "
		       "\"cow_restore_largest_over_smallest\": %.3f, \"plain_restore_largest_over_smallest\": %.3f, "
		       "\"dump_tmpl_largest_over_smallest\": %.3f, \"dump_full_largest_over_smallest\": %.3f",
		       (double)mib[l] / mib[0], lmed[l][0] / lmed[0][0], lmed[l][1] / lmed[0][1], lmed[l][2] / lmed[0][2],
		       dtmpl[l] / dtmpl[0], dfull[l] / dfull[0]);
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
