/*
 * bunshin-init: the shim and the pid-1 init of a Bunshin workspace.
 *
 * The host runs this binary (the "shim").  With --userns it first clones pid 1 into a user namespace of its own that
 * owns all the others (clone_userns).  It unshares the mount, pid, ipc, uts and network namespaces, forks the
 * workspace's pid 1 and moves it into the workspace's cgroups, which mounts the overlayfs root and the pseudo filesystems,
 * pivots into the root, starts the in-workspace agent (bunshin-agent, native/agent.c: a static executable, so it needs
 * nothing from the image) and reaps orphans until the agent exits.
 *
 * Status protocol on stdout (a pipe to the host), one line each:
 *   "P <host pid of the workspace's pid 1>"   written by the shim right after the fork
 *   "J"                                       written by the shim once pid 1 and the agent are in their cgroups
 *   "R"                                       written by pid 1 once the agent listens
 *   "E <step>: <error>"                       written by either on failure; the process then exits 1
 * pid 1 then replaces its stdout with /dev/null: CRIU refuses to dump a tree holding a descriptor from the host
 * ("Can't lookup mount for fd=0 path=/dev/null") and a session from outside its pid namespace, so pid 1 calls
 * setsid() and keeps no inherited descriptor.
 *
 * The host stops a workspace with SIGKILL to its pid 1 (the kernel then kills the whole pid namespace).  If the host
 * dies, PR_SET_PDEATHSIG chains the kill: host -> shim -> pid 1.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <grp.h>
#include <stdint.h>
#include <unistd.h>

#include "security.h"

extern char **environ;

#define MAX_CGROUPS 8
#define MAX_ENV 64

struct config {
	const char *lower, *upper, *work, *root, *hostname, *agent, *workdir, *self_exe;
	const char *cgroups[MAX_CGROUPS];
	int ncgroups;
	unsigned long uid_base, gid_base, id_count; /* --userns UID:GID:COUNT (0 count: no user namespace) */
	char *env[MAX_ENV + 1];
	int nenv;
	struct security sec; /* native/security.c */
};

static int status_fd = STDOUT_FILENO; /* where failures are reported: the status pipe, or stderr (--restore-wrap) */

static void fail(const char *step, int err)
{
	dprintf(status_fd, "E %s: %s\n", step, strerror(err));
	_exit(1);
}

static void failf(const char *fmt, ...)
{
	char buf[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	dprintf(status_fd, "E %s\n", buf);
	_exit(1);
}

static void attach(int procs_fd, pid_t pid)
{
	if (dprintf(procs_fd, "%d\n", pid) < 0)
		fail("attach to cgroup", errno);
}

/* Move pid 1, and the agent if pid 1 already forked it, into the workspace's cgroups. The first cgroup-v1 attach of
 * a burst waits for an RCU grace period (~10 ms here, cgroup_threadgroup_rwsem), so the shim does it while pid 1
 * builds the root and the agent imports: nothing in the workspace runs a command before the host has both "R" and
 * "J". An attach takes the rwsem for writing and fork() for reading, so a child forked before the attach is already
 * on pid 1's children list and one forked after inherits the cgroup. The shim shares pid 1's mount namespace, whose
 * root pid 1 pivots, so every path it needs was opened before the fork (procs_fds, proc_fd). */
static void attach_tree(const int *procs_fds, int n, int proc_fd, pid_t pid1)
{
	for (int i = 0; i < n; i++)
		attach(procs_fds[i], pid1);
	char path[64], buf[256];
	snprintf(path, sizeof(path), "%d/task/%d/children", pid1, pid1);
	int fd = openat(proc_fd, path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		fail(path, errno);
	ssize_t len = read(fd, buf, sizeof(buf) - 1); /* pid 1 has one child here, the agent, or none */
	close(fd);
	if (len == (ssize_t)sizeof(buf) - 1) /* a cut list could end in a cut pid: another process */
		failf("%s: more children than expected", path);
	buf[len > 0 ? len : 0] = 0;
	for (char *tok = strtok(buf, " \n"); tok; tok = strtok(NULL, " \n"))
		for (int i = 0; i < n; i++)
			attach(procs_fds[i], (pid_t)atoi(tok));
	for (int i = 0; i < n; i++)
		close(procs_fds[i]);
	close(proc_fd);
}

static void mount_or_fail(const char *src, const char *dst, const char *type, unsigned long flags, const char *data)
{
	if (mount(src, dst, type, flags, data) < 0) {
		char step[300];
		snprintf(step, sizeof(step), "mount %s on %s", type ? type : src, dst);
		fail(step, errno);
	}
}

static void mkdir_p(const char *path, mode_t mode)
{
	char buf[4096];
	if ((size_t)snprintf(buf, sizeof(buf), "%s", path) >= sizeof(buf))
		fail(path, ENAMETOOLONG);
	for (char *p = buf + 1; *p; p++) {
		if (*p == '/') {
			*p = 0;
			mkdir(buf, mode);
			*p = '/';
		}
	}
	if (mkdir(buf, mode) < 0 && errno != EEXIST)
		fail(path, errno);
}

/* Everything below runs as pid 1 of the new pid namespace, with the new mount namespace still rooted at the host's. */
static void mount_root(const struct config *c)
{
	char opts[8192];
	/* index=on,nfs_export=on: CRIU dumps inotify/fanotify watches by file handle, which overlayfs only
	 * provides with both (Documentation/filesystems/overlayfs.rst, "NFS export"). */
	int n = snprintf(opts, sizeof(opts), "lowerdir=%s,upperdir=%s,workdir=%s,index=on,nfs_export=on", c->lower,
			 c->upper, c->work);
	if (n < 0 || n >= 4096) /* mount(2) copies one page of options: a longer string would lose its end */
		fail("overlay options longer than a page", E2BIG);
	mount_or_fail("overlay", c->root, "overlay", 0, opts);
}

static void setup_root(const struct config *c)
{
	/* Nothing we mount may propagate back to the host. */
	if (!c->id_count) { /* else clone_userns did it */
		mount_or_fail(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
		mount_root(c);
		if (chdir(c->root) < 0)
			fail("chdir root", errno);
	}

	mkdir_p("proc", 0555);
	mount_or_fail("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	mkdir_p("sys", 0555);
	mount_or_fail("sysfs", "sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	/* /dev is a directory of the agent layer (_image._make_dev), not a tmpfs: CRIU would tar a tmpfs at every
	 * dump and restore. A private devpts instance: terminals opened inside never reach the host's /dev/pts. */
	mkdir_p("dev/pts", 0755);
	mount_or_fail("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620");
	const char *err = security_mounts(&c->sec);
	if (err)
		fail(err, errno);

	/* pivot_root(".", ".") stacks the old root under the new one; detaching it leaves no host path reachable
	 * (pivot_root(2), NOTES). */
	if (syscall(SYS_pivot_root, ".", ".") < 0)
		fail("pivot_root", errno);
	if (umount2(".", MNT_DETACH) < 0)
		fail("detach old root", errno);
	if (chdir("/") < 0)
		fail("chdir /", errno);
	mkdir_p(c->workdir, 0755);
}

static void loopback_up(void)
{
	int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (s < 0)
		fail("socket", errno);
	struct ifreq ifr = {0};
	strcpy(ifr.ifr_name, "lo");
	if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
		fail("SIOCGIFFLAGS lo", errno);
	ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
	if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
		fail("SIOCSIFFLAGS lo", errno);
	close(s);
}

/* A workspace's net namespace gets a TCP established-connection hash of its own, of CHILD_EHASH buckets, instead of
 * sharing the host's (sized by RAM: 262,144 here). CRIU collects sockets at every dump with inet_diag, which walks
 * the whole table of the namespace for IPv4 and again for IPv6: ~2 ms each with the host's, ~0.7 ms with this one
 * (most of it the listening hash, which stays the host's).
 * The size is net.ipv4.tcp_child_ehash_entries of the net namespace the creating task is in (read at creation,
 * tcp_set_hashinfo in net/ipv4/tcp_ipv4.c), so the caller is moved into an intermediate namespace whose setting
 * is changed, leaving the host's alone; the namespace made next from there gets the small table, and the
 * intermediate one goes with its last task. Inside, net.ipv4.tcp_max_tw_buckets is CHILD_EHASH / 2 and
 * tcp_max_syn_backlog 128. Best effort: without the sysctl (kernels before 6.1) the table is the host's, as before.
 * Returns a descriptor of the caller's net namespace (to go back with setns), or -1. */
#define CHILD_EHASH "16384"
static int enter_small_hash_netns(void)
{
	int orig = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
	if (orig < 0)
		return -1;
	if (unshare(CLONE_NEWNET) < 0) {
		close(orig);
		return -1;
	}
	int fd = open("/proc/sys/net/ipv4/tcp_child_ehash_entries", O_WRONLY | O_CLOEXEC);
	if (fd >= 0) {
		if (write(fd, CHILD_EHASH, strlen(CHILD_EHASH)) < 0) { /* best effort, see above */
		}
		close(fd);
	}
	return orig;
}

static void leave_netns(int orig)
{
	if (orig < 0)
		return;
	if (setns(orig, CLONE_NEWNET) < 0)
		fail("setns back to the host's net namespace", errno);
	close(orig);
}

static void setup_net(const char *hostname)
{
	if (sethostname(hostname, strlen(hostname)) < 0)
		fail("sethostname", errno);
	loopback_up();
}

/* Close every descriptor but keep: the status pipe stays on 1 until the agent is ready. */
static void close_inherited(int keep)
{
	DIR *d = opendir("/proc/self/fd");
	if (!d)
		fail("opendir /proc/self/fd", errno);
	int dfd = dirfd(d);
	struct dirent *e;
	while ((e = readdir(d))) {
		int fd = atoi(e->d_name);
		if (e->d_name[0] == '.' || fd == dfd || fd == keep)
			continue;
		close(fd);
	}
	closedir(d);
	int null = open("/dev/null", O_RDWR);
	if (null < 0)
		fail("open /dev/null", errno);
	for (int fd = 0; fd <= 2; fd++)
		if (fd != keep)
			dup2(null, fd);
	if (null > 2)
		close(null);
}

/* pid 1 before its re-exec: build the root, then become the workspace's own copy of this binary, so that pid 1's
 * executable (and every other mapping in the tree) lies inside the workspace, as CRIU requires. */
static void setup_pid1(const struct config *c)
{
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	setup_root(c);
	setup_net(c->hostname);
	if (setsid() < 0)
		fail("setsid", errno);
	close_inherited(STDOUT_FILENO);
	/* pid 1 dies only when the workspace does: keep the OOM killer on the workspace's own processes. */
	int oom = open("/proc/self/oom_score_adj", O_WRONLY);
	if (oom >= 0) {
		dprintf(oom, "-1000\n");
		close(oom);
	}
	const char *err = security_apply(&c->sec);
	if (err)
		fail(err, errno);
	char *argv[] = {"bunshin-init", "--pid1", (char *)c->agent, NULL};
	execve(c->self_exe, argv, (char **)c->env);
	fail(c->self_exe, errno);
}

/* pid 1 after the re-exec: start the agent, report readiness, reap orphans until the agent exits. */
static int run_pid1(const struct config *c)
{
	int ready[2];
	if (pipe2(ready, O_CLOEXEC) < 0)
		fail("pipe", errno);
	pid_t agent = fork();
	if (agent < 0)
		fail("fork agent", errno);
	if (agent == 0) {
		dup2(ready[1], 3); /* dup2 clears O_CLOEXEC on the copy */
		int null = open("/dev/null", O_RDWR);
		dup2(null, STDOUT_FILENO);
		if (null > 3)
			close(null);
		char *argv[] = {(char *)c->agent, NULL};
		execve(c->agent, argv, (char **)c->env);
		dprintf(3, "E exec %s: %s\n", c->agent, strerror(errno));
		_exit(127);
	}
	close(ready[1]);
	char buf[256];
	ssize_t n = read(ready[0], buf, sizeof(buf) - 1);
	close(ready[0]);
	if (n <= 0)
		failf("agent exited before it was ready");
	buf[n] = 0;
	if (buf[0] != 'R') {
		dprintf(STDOUT_FILENO, "%s", buf);
		_exit(1);
	}
	dprintf(STDOUT_FILENO, "R\n");
	int null = open("/dev/null", O_WRONLY);
	dup2(null, STDOUT_FILENO);
	close(null);

	/* Reap everything; the workspace lives as long as its agent. */
	for (;;) {
		int status;
		pid_t pid = wait(&status);
		if (pid < 0 && errno == EINTR)
			continue;
		if (pid < 0 || pid == agent)
			return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
	}
}

static void write_proc(int proc_fd, pid_t pid, const char *file, const char *text)
{
	char path[64];
	snprintf(path, sizeof(path), "%d/%s", pid, file);
	int fd = openat(proc_fd, path, O_WRONLY | O_CLOEXEC);
	if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text))
		fail(path, errno);
	close(fd);
}

/* --userns: pid 1 in a new user namespace that owns its mount, pid, ipc, uts and net namespaces (clone(2) with all
 * the flags makes the user namespace first and the others owned by it). The shim, still the host's root, mounts the
 * overlay root first in a mount namespace of its own, which pid 1's is a copy of: overlayfs then works with the
 * host's credentials (trusted.overlay.* attributes, whiteouts) and pid 1 needs no right over the lower dirs. The
 * shim writes pid 1's uid_map and gid_map (a writer with CAP_SETUID/CAP_SETGID over the parent namespace needs no
 * "setgroups deny", user_namespaces(7)), then lets it go on; pid 1 becomes root of its namespace (the mapped host
 * uid) and builds the root as without one. CRIU dumps and restores the user namespace with its maps. */
static pid_t clone_userns(const struct config *c, int proc_fd)
{
	int sync[2];
	if (unshare(CLONE_NEWNS) < 0)
		fail("unshare", errno);
	mount_or_fail(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
	mount_root(c);
	if (pipe2(sync, O_CLOEXEC) < 0)
		fail("pipe", errno);
	/* pid 1 inherits it: a process in the new namespace may not lower its own (that takes CAP_SYS_RESOURCE of the
	 * host), nor may the shim write it once pid 1 is in the namespace (its /proc files are no longer the shim's) */
	char oom[16] = "0\n";
	int oom_fd = open("/proc/self/oom_score_adj", O_RDWR | O_CLOEXEC);
	if (oom_fd >= 0) {
		ssize_t n = read(oom_fd, oom, sizeof(oom) - 1);
		oom[n > 0 ? n : 0] = 0;
		if (pwrite(oom_fd, "-1000\n", 6, 0) < 0) { /* best effort, as without a user namespace */
			close(oom_fd);
			oom_fd = -1;
		}
	}
	int host_net = enter_small_hash_netns();
	pid_t pid = (pid_t)syscall(SYS_clone, CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS |
						       CLONE_NEWNET | SIGCHLD,
				   NULL, NULL, NULL, 0);
	if (pid < 0)
		fail("clone", errno);
	if (pid > 0)
		leave_netns(host_net);
	if (pid == 0) {
		char go;
		if (host_net >= 0)
			close(host_net);
		close(sync[1]);
		if (read(sync[0], &go, 1) != 1)
			_exit(1);
		close(sync[0]);
		/* Still the host's uid 0 (its fsuid, so the host's directories on the way are searched as by the
		 * shim), with every capability over the new namespaces. The shim's overlay is locked in this copy of
		 * its mount namespace, and pivot_root refuses a locked new root (fs/namespace.c); a bind of it is not. */
		mount_or_fail(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
		mount_or_fail(c->root, c->root, NULL, MS_BIND, NULL);
		if (chdir(c->root) < 0)
			fail("chdir root", errno);
		if (setresgid(0, 0, 0) < 0 || setgroups(0, NULL) < 0 || setresuid(0, 0, 0) < 0)
			fail("become root of the user namespace", errno);
		setup_pid1(c); /* sets PR_SET_PDEATHSIG again: a credential change cleared it */
	}
	close(sync[0]);
	char map[64];
	snprintf(map, sizeof(map), "0 %lu %lu\n", c->uid_base, c->id_count);
	write_proc(proc_fd, pid, "uid_map", map);
	snprintf(map, sizeof(map), "0 %lu %lu\n", c->gid_base, c->id_count);
	write_proc(proc_fd, pid, "gid_map", map);
	if (oom_fd >= 0) {
		if (pwrite(oom_fd, oom, strlen(oom), 0) < 0)
			fail("oom_score_adj", errno);
		close(oom_fd);
	}
	if (write(sync[1], "g", 1) != 1)
		fail("start pid 1", errno);
	close(sync[1]);
	return pid;
}

static pid_t child_pid;

static void forward_kill(int sig)
{
	(void)sig;
	if (child_pid > 0)
		kill(child_pid, SIGKILL);
}

static void usage(void)
{
	failf("usage: bunshin-init --lower DIRS --upper DIR --work DIR --root DIR --hostname NAME "
	      "--agent PATH --workdir PATH --self PATH [--cgroup PROCS_FILE]... [--env K=V]... "
	      "[--caps HEX] [--seccomp 0|1] [--masks 0|1] [--nofile N] [--userns UID:GID:COUNT]");
}

#define NET_FD 9 /* _fork.NET_FD: CRIU inherits the fresh net namespace on this descriptor */

/* The wrapper CRIU restores a workspace through (_fork._wrapper): a private mount namespace that exists only for the
 * restore (no host mount to clean up if anything dies), joined to the new workspace's cgroups, its overlay root
 * mounted, with --mnt-roots a tmpfs for CRIU's mount roots; with --net also a fresh net namespace with loopback up, handed to CRIU on NET_FD. Then it execs CRIU (same
 * pid: still the host's child). One exec where unshare(1), sh, mount(8) and ip(8) took ~5 ms a restore. */
/* CRIU's mount roots directory (criu/patches/0037, CRIU_MNT_ROOTS) on a tmpfs mounted on ``dir`` in this private
 * mount namespace: a restore killed or failed leaves it there, and it goes with the namespace; CRIU's default, /tmp,
 * kept one per such restore on the host, nobody's to remove. ``dir`` (made here if missing) must be a root-owned
 * directory, no symlink: the mount goes on what was checked (its descriptor). The tmpfs is 0711: the restored root,
 * mapped in its user namespace, walks through it to mount its yard (make_yard). */
static void mount_roots_tmpfs(const char *dir)
{
	if (mkdir(dir, 0755) < 0 && errno != EEXIST)
		fail(dir, errno);
	int fd = open(dir, O_PATH | O_NOFOLLOW | O_DIRECTORY | O_CLOEXEC);
	struct stat st;
	if (fd < 0 || fstat(fd, &st) < 0)
		fail(dir, errno);
	if (!S_ISDIR(st.st_mode))
		fail(dir, ENOTDIR);
	if (st.st_uid != 0)
		fail(dir, EPERM);
	char at[64];
	snprintf(at, sizeof(at), "/proc/self/fd/%d", fd);
	mount_or_fail("tmpfs", at, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0711");
	close(fd);
	if (setenv("CRIU_MNT_ROOTS", dir, 1) < 0)
		fail("CRIU_MNT_ROOTS", errno);
}

static int restore_wrap(int argc, char **argv)
{
	const char *overlay = NULL, *root = NULL, *mnt_roots = NULL, *cgroups[MAX_CGROUPS];
	int ncgroups = 0, net = 0, i;

	status_fd = STDERR_FILENO;
	for (i = 2; i < argc; i++) {
		if (!strcmp(argv[i], "--")) {
			i++;
			break;
		}
		if (!strcmp(argv[i], "--net"))
			net = 1;
		else if (i + 1 < argc && !strcmp(argv[i], "--overlay"))
			overlay = argv[++i];
		else if (i + 1 < argc && !strcmp(argv[i], "--root"))
			root = argv[++i];
		else if (i + 1 < argc && !strcmp(argv[i], "--mnt-roots"))
			mnt_roots = argv[++i];
		else if (i + 1 < argc && !strcmp(argv[i], "--cgroup") && ncgroups < MAX_CGROUPS)
			cgroups[ncgroups++] = argv[++i];
		else
			break;
	}
	if (!overlay || !root || i >= argc || strcmp(argv[i - 1], "--"))
		failf("usage: bunshin-init --restore-wrap [--net] [--cgroup PROCS_FILE]... [--mnt-roots DIR] --overlay OPTS "
		      "--root DIR -- CMD [ARG]...");
	/* With --net the namespace made next is the copy's; without, CRIU makes it from this one (in the restored user
	 * namespace, criu/patches/0011, or from the images). Either way it gets a table of its own
	 * (enter_small_hash_netns). */
	int host_net = enter_small_hash_netns();
	if (host_net >= 0) {
		close(host_net); /* CRIU needs nothing of the host's net namespace but a loopback (kerndat probes) */
		if (!net)
			loopback_up();
	}
	if (unshare(CLONE_NEWNS | (net ? CLONE_NEWNET : 0)) < 0)
		fail("unshare", errno);
	mount_or_fail(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
	for (int k = 0; k < ncgroups; k++) {
		int fd = open(cgroups[k], O_WRONLY | O_CLOEXEC);
		if (fd < 0)
			fail(cgroups[k], errno);
		attach(fd, getpid());
		close(fd);
	}
	if (strlen(overlay) >= 4096) /* mount(2) copies one page of options */
		fail("overlay options longer than a page", E2BIG);
	mount_or_fail("overlay", root, "overlay", 0, overlay);
	if (mnt_roots)
		mount_roots_tmpfs(mnt_roots);
	if (net) {
		loopback_up();
		int fd = open("/proc/self/ns/net", O_RDONLY);
		if (fd < 0 || (fd != NET_FD && dup2(fd, NET_FD) < 0))
			fail("net namespace descriptor", errno);
		if (fd != NET_FD)
			close(fd);
	}
	execv(argv[i], argv + i);
	fail(argv[i], errno);
	return 1;
}

/* The wrapper a host helper working for a run runs through (CRIU's dump, _fork._dump): it joins the cgroups named
 * (a CPU-accounting cgroup under the run's parent, so the run's counter includes the helper) and execs the command
 * (same pid: still the host's child). Nothing else of the host's context changes. */
static int join_wrap(int argc, char **argv)
{
	int i;

	status_fd = STDERR_FILENO;
	for (i = 2; i + 1 < argc && !strcmp(argv[i], "--cgroup"); i += 2) {
		int fd = open(argv[i + 1], O_WRONLY | O_CLOEXEC);
		if (fd < 0)
			fail(argv[i + 1], errno);
		attach(fd, getpid());
		close(fd);
	}
	if (i + 1 >= argc || strcmp(argv[i], "--"))
		failf("usage: bunshin-init --join [--cgroup PROCS_FILE]... -- CMD [ARG]...");
	execv(argv[i + 1], argv + i + 1);
	fail(argv[i + 1], errno);
	return 1;
}

#define LAST_PID "/proc/sys/kernel/ns_last_pid"

/* clone3(2)'s argument up to set_tid (CLONE_ARGS_SIZE_VER1, Linux 5.5), spelled out: glibc 2.36 has no wrapper and
 * <linux/sched.h> clashes with <sched.h>. */
struct clone_args_v1 {
	uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid, set_tid_size;
};

/* --last-pid FD: the last pid handed out in the pid namespace of the process FD (a pidfd) refers to, printed as
 * "L <pid>" once a "g" arrives on stdin (the host starts this before it freezes the workspace and asks once it is
 * frozen, so that the exec is not part of the pause; EOF: exit quietly). For the host's _host/_pidns.py: a dump keeps
 * the value for the restore, criu/patches/0021. kernel.ns_last_pid
 * answers for the pid namespace of the task that reads it (kernel/pid_namespace.c, pid_ns_ctl_handler:
 * task_active_pid_ns(current)), not for the procfs it is opened on, so a task inside that namespace must read it.
 * This process joins the namespace for its children (setns) and makes one child there with clone3's set_tid at a pid
 * nobody holds: a pid asked for that way is allocated exactly (kernel/pid.c, alloc_pid: idr_alloc) and leaves the
 * namespace's cursor alone, where a plain fork would move it. The child lives for one pread and is not dumpable; the
 * host runs this while the workspace is frozen, so nothing in it runs meanwhile anyway.
 *
 * --last-pid FD EXPECT NEW: the same, and if the value read is EXPECT the child writes NEW, printing "L <pid> W" (the
 * host's _host/_pidcursor.py puts the cursor back after a speculative read the rollout did not use, and forward when
 * it did). Compare and set in one child, a pread and a pwrite apart: only a process of the workspace forking in that
 * window is missed (it keeps its pid; the kernel never hands out a pid in use, whatever the cursor says). Writing
 * needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE over the namespace's user namespace (pid_ns_ctl_handler): the child
 * has the host's. */
static long number(const char *s, long lo, long hi, const char *what)
{
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (*s == 0 || *end || errno || v < lo || v > hi)
		failf("bad %s %s", what, s);
	return v;
}

static int last_pid(int argc, char **argv)
{
	char buf[128];
	long fd, max = 0, expect = -1, want = -1;

	if (argc != 3 && argc != 5)
		failf("usage: bunshin-init --last-pid PIDFD [EXPECT NEW]");
	fd = number(argv[2], 0, 1 << 20, "descriptor");
	prctl(PR_SET_DUMPABLE, 0);
	int maxfd = open("/proc/sys/kernel/pid_max", O_RDONLY | O_CLOEXEC);
	ssize_t n = maxfd < 0 ? -1 : read(maxfd, buf, sizeof(buf) - 1);
	if (n <= 0)
		fail("pid_max", errno);
	buf[n] = 0;
	max = strtol(buf, NULL, 10);
	close(maxfd);
	if (argc == 5) {
		expect = number(argv[3], 0, max - 1, "expected last pid");
		want = number(argv[4], 0, max - 1, "last pid");
	}
	int sysctl = open(LAST_PID, (argc == 5 ? O_RDWR : O_RDONLY) | O_CLOEXEC);
	if (sysctl < 0)
		fail(LAST_PID, errno);
	if (setns((int)fd, CLONE_NEWPID) < 0)
		fail("setns", errno);
	int out[2];
	if (pipe2(out, O_CLOEXEC) < 0)
		fail("pipe", errno);
	char go = 0;
	while ((n = read(STDIN_FILENO, &go, 1)) < 0 && errno == EINTR)
		;
	if (n != 1 || go != 'g')
		return 0;
	/* Candidates from the top down, halving: the namespace's pid_max may be lower than the host's (EINVAL), a
	 * candidate held by one of its processes (EEXIST) is skipped. RESERVED_PIDS (300) is where the kernel wraps. */
	long child = -1;
	for (pid_t tid = (pid_t)max - 1; tid > 300 && child < 0; tid /= 2) {
		struct clone_args_v1 ca = {.exit_signal = SIGCHLD, .set_tid = (uintptr_t)&tid, .set_tid_size = 1};
		child = syscall(SYS_clone3, &ca, sizeof(ca));
		if (child < 0 && errno != EEXIST && errno != EINVAL)
			fail("clone3", errno);
	}
	if (child < 0)
		failf("no free pid in the namespace to read it from");
	if (child == 0) {
		close(out[0]);
		n = pread(sysctl, buf, sizeof(buf) - 1, 0);
		if (n <= 0) {
			dprintf(out[1], "E read " LAST_PID ": %s", strerror(errno));
			_exit(1);
		}
		buf[n] = 0;
		long now = strtol(buf, NULL, 10);
		if (want >= 0 && now == expect) {
			char num[32];
			int len = snprintf(num, sizeof(num), "%ld", want);
			if (pwrite(sysctl, num, (size_t)len, 0) != len) {
				dprintf(out[1], "E write " LAST_PID ": %s", strerror(errno));
				_exit(1);
			}
			dprintf(out[1], "%ld W", now);
		} else {
			dprintf(out[1], "%ld", now);
		}
		_exit(0);
	}
	close(out[1]);
	n = read(out[0], buf, sizeof(buf) - 1);
	buf[n > 0 ? n : 0] = 0;
	int status;
	while (waitpid(child, &status, 0) < 0)
		if (errno != EINTR)
			fail("waitpid", errno);
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
		failf("%s", buf[0] == 'E' ? buf + 2 : "the reader in the namespace died");
	if (n <= 0)
		failf("the reader in the namespace said nothing");
	char *end;
	long value = strtol(buf, &end, 10);
	dprintf(STDOUT_FILENO, "L %ld%s\n", value, strcmp(end, " W") ? "" : " W");
	return 0;
}

/* A host helper that must not outlive the host process (CRIU's wrappers, _criu.SwrkCriu): the host names itself
 * in PARENT_ENV, and this process takes SIGKILL when its parent dies. A CRIU orphaned mid-dump would go on with the
 * tree frozen and seized, or restore a copy nobody owns. The signal comes when the *thread* that forked this process
 * exits (prctl(2)): the host forks from its event loop's thread, which outlives the call. It is kept across the exec
 * of CRIU (not set-user-ID, no file capabilities) and cleared by a fork, so CRIU's own helpers do not inherit it. If
 * the parent died before the prctl this process was reparented already: getppid() then names another process. */
#define PARENT_ENV "BUNSHIN_PARENT_PID"

static void die_with_parent(void)
{
	const char *want = getenv(PARENT_ENV);
	char *end;

	if (!want)
		return;
	long pid = strtol(want, &end, 10);
	if (*want == 0 || *end || pid <= 0)
		failf("bad " PARENT_ENV " %s", want);
	if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
		fail("PR_SET_PDEATHSIG", errno);
	if (getppid() != (pid_t)pid)
		_exit(1); /* the host is gone: nothing to report to */
	unsetenv(PARENT_ENV);
}

int main(int argc, char **argv)
{
	struct config c = {0};
	pid_t parent = getppid();

	if (argc >= 2 && (!strcmp(argv[1], "--restore-wrap") || !strcmp(argv[1], "--join")))
		status_fd = STDERR_FILENO;
	die_with_parent();
	if (argc >= 2 && !strcmp(argv[1], "--restore-wrap"))
		return restore_wrap(argc, argv);
	if (argc >= 2 && !strcmp(argv[1], "--join"))
		return join_wrap(argc, argv);
	if (argc >= 2 && !strcmp(argv[1], "--last-pid"))
		return last_pid(argc, argv);
	if (argc == 3 && !strcmp(argv[1], "--pid1")) {
		c.agent = argv[2];
		for (char **e = environ; *e && c.nenv < MAX_ENV; e++)
			c.env[c.nenv++] = *e;
		return run_pid1(&c);
	}
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	if (getppid() != parent)
		_exit(1);
	for (int i = 1; i + 1 < argc; i += 2) {
		const char *k = argv[i], *v = argv[i + 1];
		if (!strcmp(k, "--lower"))
			c.lower = v;
		else if (!strcmp(k, "--upper"))
			c.upper = v;
		else if (!strcmp(k, "--work"))
			c.work = v;
		else if (!strcmp(k, "--root"))
			c.root = v;
		else if (!strcmp(k, "--hostname"))
			c.hostname = v;
		else if (!strcmp(k, "--agent"))
			c.agent = v;
		else if (!strcmp(k, "--workdir"))
			c.workdir = v;
		else if (!strcmp(k, "--self"))
			c.self_exe = v;
		else if (!strcmp(k, "--cgroup") && c.ncgroups < MAX_CGROUPS)
			c.cgroups[c.ncgroups++] = v;
		else if (!strcmp(k, "--env") && c.nenv < MAX_ENV)
			c.env[c.nenv++] = (char *)v;
		else if (!strcmp(k, "--userns")) {
			if (sscanf(v, "%lu:%lu:%lu", &c.uid_base, &c.gid_base, &c.id_count) != 3 || !c.uid_base ||
			    !c.gid_base || !c.id_count)
				usage();
		}
		else if (security_arg(&c.sec, k, v) != 1)
			usage();
	}
	if (!c.lower || !c.upper || !c.work || !c.root || !c.hostname || !c.agent ||
	    !c.workdir || !c.self_exe)
		usage();

	int procs_fds[MAX_CGROUPS];
	for (int i = 0; i < c.ncgroups; i++) {
		procs_fds[i] = open(c.cgroups[i], O_WRONLY | O_CLOEXEC);
		if (procs_fds[i] < 0)
			fail(c.cgroups[i], errno);
	}
	int proc_fd = open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (proc_fd < 0)
		fail("/proc", errno);
	if (c.id_count) {
		child_pid = clone_userns(&c, proc_fd);
	} else {
		int host_net = enter_small_hash_netns();
		if (unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET) < 0)
			fail("unshare", errno);
		if (host_net >= 0)
			close(host_net); /* the shim stays in the workspace's namespace: the intermediate one goes now */
		child_pid = fork();
		if (child_pid < 0)
			fail("fork", errno);
		if (child_pid == 0)
			setup_pid1(&c);
	}

	struct sigaction sa = {.sa_handler = forward_kill};
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGHUP, &sa, NULL);
	dprintf(STDOUT_FILENO, "P %d\n", child_pid);
	attach_tree(procs_fds, c.ncgroups, proc_fd, child_pid);
	dprintf(STDOUT_FILENO, "J\n");
	int null = open("/dev/null", O_WRONLY);
	dup2(null, STDOUT_FILENO);
	close(null);
	for (;;) {
		int status;
		pid_t pid = waitpid(child_pid, &status, 0);
		if (pid < 0 && errno == EINTR)
			continue;
		if (pid < 0)
			return 1;
		return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
	}
}
