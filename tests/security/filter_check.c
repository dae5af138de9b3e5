/* Runs native/security.c's seccomp program in a classic-BPF interpreter for every syscall number and checks each
 * verdict against the lists it was built from (test_filter.py compiles and runs it). Prints "ok N" or the
 * mismatches and exits 1. */
#include "../../native/security.c"

#include <stdio.h>

static unsigned run(const struct prog *p, const struct seccomp_data *d)
{
	unsigned a = 0;
	for (unsigned pc = 0; pc < p->len; pc++) {
		struct sock_filter f = p->insns[pc];
		switch (f.code) {
		case BPF_LD | BPF_W | BPF_ABS:
			memcpy(&a, (const char *)d + f.k, sizeof(a));
			break;
		case BPF_JMP | BPF_JEQ | BPF_K:
			pc += a == f.k ? f.jt : f.jf;
			break;
		case BPF_JMP | BPF_JGE | BPF_K:
			pc += a >= f.k ? f.jt : f.jf;
			break;
		case BPF_JMP | BPF_JGT | BPF_K:
			pc += a > f.k ? f.jt : f.jf;
			break;
		case BPF_JMP | BPF_JSET | BPF_K:
			pc += a & f.k ? f.jt : f.jf;
			break;
		case BPF_RET | BPF_K:
			return f.k;
		default:
			return 0xdead;
		}
	}
	return 0xdead;
}

static int listed(uint64_t caps, int nr)
{
	for (size_t i = 0; i < sizeof(allowed) / sizeof(allowed[0]); i++)
		if (allowed[i] == nr)
			return 1;
	for (size_t g = 0; g < sizeof(gated) / sizeof(gated[0]); g++)
		if (has(caps, gated[g].cap))
			for (const int *x = gated[g].nrs; *x; x++)
				if (*x == nr)
					return 1;
	return 0;
}

static int check(int ok, const char *what, uint64_t caps)
{
	if (!ok)
		printf("wrong verdict: %s (caps %llx)\n", what, (unsigned long long)caps);
	return ok ? 0 : 1;
}

int main(int argc, char **argv)
{
	int bad = 0;
	for (int i = 1; i < argc; i++) {
		uint64_t caps = strtoull(argv[i], NULL, 16);
		static struct prog p;
		p.len = 0;
		build(&p, caps);
		bad += check(p.len < MAX_INSNS, "program length", caps);
		struct seccomp_data d = {.arch = AUDIT_ARCH_X86_64};
		for (int nr = 0; nr < 1024; nr++) {
			if (nr == __NR_clone || nr == __NR_clone3 || nr == __NR_socket || nr == __NR_personality)
				continue;
			d.nr = nr;
			if ((run(&p, &d) == SECCOMP_RET_ALLOW) != listed(caps, nr)) {
				printf("nr %d: ", nr);
				bad += check(0, "allow-list", caps);
			}
		}
		int admin = has(caps, CAP_SYS_ADMIN);
		d.nr = __NR_clone;
		d.args[0] = 0x10000000; /* CLONE_NEWUSER */
		bad += check((run(&p, &d) == SECCOMP_RET_ALLOW) == admin, "clone(CLONE_NEWUSER)", caps);
		d.args[0] = 0x01200011; /* what fork() passes */
		bad += check(run(&p, &d) == SECCOMP_RET_ALLOW, "clone(fork flags)", caps);
		d.nr = __NR_clone3;
		bad += check(run(&p, &d) == (admin ? SECCOMP_RET_ALLOW : (SECCOMP_RET_ERRNO | ENOSYS)), "clone3", caps);
		d.nr = __NR_socket;
		d.args[0] = AF_VSOCK;
		bad += check(run(&p, &d) == EPERM_, "socket(AF_VSOCK)", caps);
		d.args[0] = AF_INET;
		bad += check(run(&p, &d) == SECCOMP_RET_ALLOW, "socket(AF_INET)", caps);
		d.nr = __NR_personality;
		d.args[0] = 0x0008;
		bad += check(run(&p, &d) == SECCOMP_RET_ALLOW, "personality(PER_LINUX32)", caps);
		d.args[0] = 0x0400000; /* READ_IMPLIES_EXEC */
		bad += check(run(&p, &d) == EPERM_, "personality(READ_IMPLIES_EXEC)", caps);
		d.nr = 0;
		d.arch = AUDIT_ARCH_I386;
		bad += check(run(&p, &d) == EPERM_, "i386 syscall", caps);
		d.arch = AUDIT_ARCH_X86_64;
		d.nr = 0x40000000;
		bad += check(run(&p, &d) == EPERM_, "x32 syscall", caps);
		printf("caps %llx: %u instructions\n", (unsigned long long)caps, p.len);
	}
	printf(bad ? "failed %d\n" : "ok\n", bad);
	return bad ? 1 : 0;
}
