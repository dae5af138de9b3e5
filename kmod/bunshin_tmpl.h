/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * bunshin_tmpl: user interface of the template-memory device (kmod/README.md describes it in full).
 *
 * open("/dev/bunshin_tmpl") then ioctl(BUNSHIN_TMPL_CREATE) pins the anonymous pages of a range of a frozen
 * template process and returns a template fd; mmap(MAP_PRIVATE) of that fd in a copy maps those pages read-only,
 * and a write faults into a private page of the copy. Shared by the module, the test program and CRIU.
 */
#ifndef BUNSHIN_TMPL_H
#define BUNSHIN_TMPL_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define BUNSHIN_TMPL_DEVICE "/dev/bunshin_tmpl"
#define BUNSHIN_TMPL_ABI_VERSION 1

/* Insert every page table entry at mmap time (cost grows with the range) instead of on first touch. */
#define BUNSHIN_TMPL_F_PREFILL 0x1u
#define BUNSHIN_TMPL_F_ALL BUNSHIN_TMPL_F_PREFILL

struct bunshin_tmpl_create {
	__s32 pid;     /* in: the template process, in the caller's pid namespace */
	__u32 flags;   /* in: BUNSHIN_TMPL_F_* */
	__u64 addr;    /* in: start of the range in the template, page-aligned */
	__u64 len;     /* in: length in bytes, page-aligned, > 0 */
	__u64 npages;  /* out: pages held (len / page size): pinned, or referenced for a copy's template mapping */
};

struct bunshin_tmpl_info {
	__u32 abi;     /* out: BUNSHIN_TMPL_ABI_VERSION */
	__u32 flags;   /* out: the flags the template was created with */
	__u64 len;     /* out: length of the template in bytes */
	__u64 mapped;  /* out: mappings of this template now alive (VMAs, across all processes) */
};

#define BUNSHIN_TMPL_IOC_MAGIC 0xB5
/* On the device fd: returns a new template fd (O_RDONLY | O_CLOEXEC) or -1 with errno. */
#define BUNSHIN_TMPL_CREATE _IOWR(BUNSHIN_TMPL_IOC_MAGIC, 1, struct bunshin_tmpl_create)
/* On a template fd. */
#define BUNSHIN_TMPL_INFO _IOR(BUNSHIN_TMPL_IOC_MAGIC, 2, struct bunshin_tmpl_info)

#endif /* BUNSHIN_TMPL_H */
