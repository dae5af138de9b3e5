// SPDX-License-Identifier: GPL-2.0
/*
 * bunshin_tmpl: fork a process's anonymous memory without copying it.
 *
 * A template is a pinned, read-only view of a range of anonymous memory of a frozen process (the template
 * process). A copy maps the template fd MAP_PRIVATE: the mapping starts with the template's own pages mapped
 * read-only, and a write to one of them gives the copy a private page, charged to the copy's memory cgroup, as a
 * fork's copy-on-write would. Mapping costs page-table metadata, not memory. kmod/README.md documents the
 * interface, its errors, lifetimes and costs.
 *
 * Kernel facts this relies on (mm/memory.c, mm/gup.c):
 * - vmf_insert_mixed() in a VM_MIXEDMAP VMA on an architecture with pte_special (x86-64) installs a *special*
 *   PTE: no struct page is looked at, so no rmap, no refcount, no RSS. vm_normal_page() returns NULL for it, so
 *   a write to it in a private (COW) mapping goes do_wp_page() -> wp_page_copy() with no old page: the kernel
 *   allocates an anonymous page, charges it to the faulting mm's memcg, copies from the old user address and maps
 *   the copy writable. The template's page is never mapped writable anywhere but in the template itself.
 * - A write fault on a PTE that is not present yet goes do_cow_fault(): the kernel preallocates vmf->cow_page
 *   (charged to the copy), calls ->fault for the source page and copies it (our handler returns the template
 *   page as the copy source only: it is never mapped into the copy).
 * - pin_user_pages_remote(FOLL_LONGTERM) without FOLL_WRITE unshares a page that is not exclusive to the
 *   template (a page it still shares with its parent since fork), so the pinned page is the template's own and
 *   stays the page at that address while the template does not write (the template must stay frozen).
 * - The pins keep the pages alive after the template process exits or unmaps them; a VMA holds a reference to
 *   the template file (vma->vm_file), so the pins outlive every mapping.
 * - A copy's written pages are ordinary anonymous pages in its template mapping (present, not special PTEs), its
 *   unwritten ones special PTEs or none: a template of a frozen copy's mapping (a fork of a fork) takes the
 *   former from its page table and the latter from the copy's template, both by reference (tmpl_take()).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/anon_inodes.h>
#include <linux/atomic.h>
#include <linux/capability.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/mmap_lock.h>
#include <linux/module.h>
#include <linux/pfn_t.h>
#include <linux/pid.h>
#include <linux/sched/mm.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/version.h>

#include "bunshin_tmpl.h"

static unsigned long max_pages = 1UL << 22; /* 16 GiB of 4 KiB pages */
module_param(max_pages, ulong, 0644);
MODULE_PARM_DESC(max_pages, "largest template in pages (default 4194304: 16 GiB)");

/* Pages pinned per pin_user_pages_remote() call: bounds the time between signal checks and reschedules. */
#define PIN_CHUNK 512UL

struct tmpl {
	struct page **pages;
	unsigned long *byref; /* bit i: pages[i] is held by a page reference (a nested template), not a pin */
	unsigned long npages;
	unsigned long nbyref;
	u32 flags;
	atomic_t mapped; /* live VMAs (diagnostics: BUNSHIN_TMPL_INFO) */
};

static atomic_long_t pinned_total = ATOMIC_LONG_INIT(0); /* pages held, pinned or by reference */

static void tmpl_free(struct tmpl *t, unsigned long nheld)
{
	unsigned long i;

	if (nheld) {
		if (!t->nbyref) {
			unpin_user_pages(t->pages, nheld);
		} else {
			for (i = 0; i < nheld; i++) {
				if (test_bit(i, t->byref))
					put_page(t->pages[i]);
				else
					unpin_user_page(t->pages[i]);
			}
		}
		atomic_long_sub(nheld, &pinned_total);
	}
	kvfree(t->byref);
	kvfree(t->pages);
	kfree(t);
}

static const struct vm_operations_struct tmpl_vm_ops;

/* A copy's mapping of a template (this module's VMA): a nested template takes its pages from it. */
static inline bool is_tmpl_vma(struct vm_area_struct *vma)
{
	return vma->vm_ops == &tmpl_vm_ops;
}

static inline void tmpl_vm_flags_set(struct vm_area_struct *vma, unsigned long flags)
{
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 3, 0)
	vm_flags_set(vma, flags);
#else
	vma->vm_flags |= flags;
#endif
}

static inline long tmpl_pin(struct mm_struct *mm, unsigned long start, unsigned long n, struct page **pages)
{
	/* FOLL_LONGTERM: the pins last as long as the template (mm/gup.c migrates the pages out of movable zones
	 * and CMA first). No FOLL_WRITE: a write pin would break copy-on-write the template shares with others. */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 5, 0)
	return pin_user_pages_remote(mm, start, n, FOLL_LONGTERM, pages, NULL);
#else
	return pin_user_pages_remote(mm, start, n, FOLL_LONGTERM, pages, NULL, NULL);
#endif
}

/* Every byte of [start, end) must be private anonymous memory (no file, no shared, no I/O or PFN mapping), or a
 * copy's private mapping of a template (a nested template: the copy's memory is its written pages over its
 * template's). */
static int tmpl_check_range(struct mm_struct *mm, unsigned long start, unsigned long end)
{
	unsigned long addr = start;

	while (addr < end) {
		struct vm_area_struct *vma = find_vma(mm, addr);

		if (!vma || vma->vm_start > addr)
			return -EFAULT; /* a hole */
		if (is_tmpl_vma(vma)) {
			if (vma->vm_flags & (VM_SHARED | VM_MAYSHARE))
				return -EINVAL;
		} else if (!vma_is_anonymous(vma) || (vma->vm_flags & (VM_SHARED | VM_MAYSHARE | VM_IO | VM_PFNMAP |
									  VM_MIXEDMAP | VM_HUGETLB))) {
			return -EINVAL;
		}
		if (!(vma->vm_flags & VM_READ))
			return -EACCES;
		addr = vma->vm_end;
	}
	return 0;
}

/* apply_to_existing_page_range() callback, under the PTE lock, for one PTE of a copy's template mapping (it is
 * not called for an empty one): a present, non-special PTE is a page the copy wrote (an ordinary anonymous page,
 * see the top of this file), taken by reference; a special one is its template's page. A page the copy wrote that
 * is swapped out or migrating gives -EAGAIN: the caller faults it in. */
static int take_pte(pte_t *ptep, unsigned long addr, void *data)
{
	struct page **out = data;
	pte_t pte = ptep_get(ptep);
	struct page *page;

	if (!pte_present(pte))
		return -EAGAIN;
	if (pte_special(pte))
		return 0;
	page = pte_page(pte);
	if (!PageAnon(page))
		return -EFAULT;
	get_page(page); /* under the PTE lock: the page cannot be freed under us */
	*out = page;
	return 0;
}

static inline long tmpl_get_one(struct mm_struct *mm, unsigned long addr, struct page **page)
{
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 5, 0)
	return get_user_pages_remote(mm, addr, 1, 0, page, NULL);
#else
	return get_user_pages_remote(mm, addr, 1, 0, page, NULL, NULL);
#endif
}

/*
 * A nested template: the pages of n pages at addr of a copy's template mapping vma, held by reference (bits set
 * in t->byref): the copy's own written pages where it wrote, its template's pages elsewhere. The copy is frozen,
 * so neither changes; its written pages are anonymous pages nobody maps writable any more (a copy of the copy
 * writing one gets a page of its own). One page-table walk per page: apply_to_existing_page_range() walks a range
 * correctly only on kernels with its 2025 fix (before it, an empty PTE ended the walk of its page table). Returns
 * n, or a negative errno with nothing held.
 */
static long tmpl_take(struct mm_struct *mm, struct vm_area_struct *vma, unsigned long addr, unsigned long n,
		      struct tmpl *t, unsigned long idx)
{
	struct tmpl *parent = vma->vm_file->private_data;
	unsigned long pg = vma->vm_pgoff + ((addr - vma->vm_start) >> PAGE_SHIFT), i;
	struct page **pages = t->pages + idx;
	long ret = 0;

	if (pg >= parent->npages || n > parent->npages - pg)
		return -EFAULT;
	for (i = 0; i < n && !ret; i++) {
		unsigned long a = addr + (i << PAGE_SHIFT);

		pages[i] = NULL;
		ret = apply_to_existing_page_range(mm, a, PAGE_SIZE, take_pte, &pages[i]);
		if (ret == -EAGAIN) { /* a written page not in memory: fault it in, by reference like the others */
			ret = tmpl_get_one(mm, a, &pages[i]);
			ret = ret == 1 ? 0 : ret < 0 ? ret : -EFAULT;
			if (ret)
				pages[i] = NULL;
		}
		if (!ret && !pages[i]) {
			pages[i] = parent->pages[pg + i];
			get_page(pages[i]); /* pinned by the parent template, which may go before this one */
		}
	}
	if (ret) {
		while (i--)
			if (pages[i])
				put_page(pages[i]);
		return ret;
	}
	for (i = 0; i < n; i++)
		set_bit(idx + i, t->byref);
	t->nbyref += n;
	return n;
}

static vm_fault_t tmpl_fault(struct vm_fault *vmf)
{
	struct tmpl *t = vmf->vma->vm_file->private_data;
	struct page *page;

	if (vmf->pgoff >= t->npages)
		return VM_FAULT_SIGBUS;
	page = t->pages[vmf->pgoff];
	if ((vmf->flags & FAULT_FLAG_WRITE) && vmf->cow_page) {
		/* do_cow_fault(): the kernel copies this page into vmf->cow_page (already charged to the copy) and
		 * maps that; the template page is only the source. __do_fault() locks it, do_cow_fault() unlocks and
		 * drops this reference. */
		get_page(page);
		vmf->page = page;
		return 0;
	}
	return vmf_insert_mixed(vmf->vma, vmf->address, __pfn_to_pfn_t(page_to_pfn(page), 0));
}

static void tmpl_vm_open(struct vm_area_struct *vma)
{
	struct tmpl *t = vma->vm_file->private_data;

	atomic_inc(&t->mapped); /* a split or a fork's copy of the VMA */
}

static void tmpl_vm_close(struct vm_area_struct *vma)
{
	struct tmpl *t = vma->vm_file->private_data;

	atomic_dec(&t->mapped);
}

static const struct vm_operations_struct tmpl_vm_ops = {
	.open = tmpl_vm_open,
	.close = tmpl_vm_close,
	.fault = tmpl_fault,
};

static int tmpl_mmap(struct file *file, struct vm_area_struct *vma)
{
	struct tmpl *t = file->private_data;
	unsigned long n = vma_pages(vma), i;

	/* A shared mapping would let a write reach the template's page (wp_pfn_shared()): private only. */
	if (vma->vm_flags & (VM_SHARED | VM_MAYSHARE))
		return -EINVAL;
	if (vma->vm_pgoff >= t->npages || n > t->npages - vma->vm_pgoff)
		return -EINVAL;
	/* VM_DONTEXPAND: mremap() may not grow it past the template. VM_MIXEDMAP also excludes it from mlock,
	 * khugepaged, NUMA balancing and merging (VM_SPECIAL). */
	tmpl_vm_flags_set(vma, VM_MIXEDMAP | VM_DONTEXPAND);
	vma->vm_ops = &tmpl_vm_ops;

	if (t->flags & BUNSHIN_TMPL_F_PREFILL) {
		for (i = 0; i < n; i++) {
			struct page *page = t->pages[vma->vm_pgoff + i];
			vm_fault_t ret = vmf_insert_mixed(vma, vma->vm_start + (i << PAGE_SHIFT),
							  __pfn_to_pfn_t(page_to_pfn(page), 0));

			/* On an error from ->mmap the kernel zaps what was inserted and frees the VMA without
			 * calling ->close (mm/mmap.c, mmap_region()): count the mapping only on success. */
			if (ret & VM_FAULT_ERROR)
				return (ret & VM_FAULT_OOM) ? -ENOMEM : -EFAULT;
			if (fatal_signal_pending(current))
				return -EINTR;
			if ((i & (PIN_CHUNK - 1)) == PIN_CHUNK - 1)
				cond_resched();
		}
	}
	atomic_inc(&t->mapped);
	return 0;
}

static int tmpl_release(struct inode *inode, struct file *file)
{
	struct tmpl *t = file->private_data;

	tmpl_free(t, t->npages);
	return 0;
}

static long tmpl_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct tmpl *t = file->private_data;
	struct bunshin_tmpl_info info = {};

	if (cmd != BUNSHIN_TMPL_INFO)
		return -ENOTTY;
	info.abi = BUNSHIN_TMPL_ABI_VERSION;
	info.flags = t->flags;
	info.len = (u64)t->npages << PAGE_SHIFT;
	info.mapped = atomic_read(&t->mapped);
	return copy_to_user((void __user *)arg, &info, sizeof(info)) ? -EFAULT : 0;
}

static const struct file_operations tmpl_fops = {
	.owner = THIS_MODULE,
	.mmap = tmpl_mmap,
	.release = tmpl_release,
	.unlocked_ioctl = tmpl_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
};

static long tmpl_create(struct bunshin_tmpl_create __user *uarg)
{
	struct bunshin_tmpl_create req;
	struct task_struct *task;
	struct mm_struct *mm;
	struct file *file;
	struct pid *pid;
	struct tmpl *t;
	unsigned long n, done = 0;
	long ret;
	int fd;

	/* Reading another process's memory: the same right as ptrace on any process (the device is 0600 too). */
	if (!capable(CAP_SYS_PTRACE))
		return -EPERM;
	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (req.flags & ~BUNSHIN_TMPL_F_ALL)
		return -EINVAL;
	if (!req.len || !PAGE_ALIGNED(req.addr) || !PAGE_ALIGNED(req.len) || req.addr + req.len < req.addr ||
	    req.addr + req.len > TASK_SIZE_MAX)
		return -EINVAL;
	n = req.len >> PAGE_SHIFT;
	if (n > max_pages)
		return -E2BIG;

	if (req.pid <= 0)
		return -ESRCH;
	pid = find_get_pid(req.pid); /* in the caller's pid namespace */
	task = get_pid_task(pid, PIDTYPE_PID);
	put_pid(pid);
	if (!task)
		return -ESRCH;
	mm = get_task_mm(task);
	put_task_struct(task);
	if (!mm)
		return -ESRCH; /* a kernel thread or an exiting process */

	ret = -ENOMEM;
	t = kzalloc(sizeof(*t), GFP_KERNEL);
	if (!t)
		goto out_mm;
	t->pages = kvmalloc_array(n, sizeof(*t->pages), GFP_KERNEL);
	t->byref = kvcalloc(BITS_TO_LONGS(n), sizeof(long), GFP_KERNEL);
	if (!t->pages || !t->byref)
		goto out_free;
	t->npages = n;
	t->flags = req.flags;
	atomic_set(&t->mapped, 0);

	ret = mmap_read_lock_killable(mm);
	if (ret)
		goto out_free;
	ret = tmpl_check_range(mm, req.addr, req.addr + req.len);
	while (!ret && done < n) {
		unsigned long addr = req.addr + (done << PAGE_SHIFT);
		struct vm_area_struct *vma = find_vma(mm, addr); /* tmpl_check_range() saw it cover addr */
		unsigned long chunk = min3(n - done, PIN_CHUNK, (vma->vm_end - addr) >> PAGE_SHIFT);
		long got = is_tmpl_vma(vma) ? tmpl_take(mm, vma, addr, chunk, t, done)
					    : tmpl_pin(mm, addr, chunk, t->pages + done);

		if (got <= 0) {
			ret = got ? got : -EFAULT;
			break;
		}
		done += got;
		atomic_long_add(got, &pinned_total);
		if (fatal_signal_pending(current)) {
			ret = -EINTR;
			break;
		}
		if (need_resched()) {
			mmap_read_unlock(mm);
			cond_resched();
			ret = mmap_read_lock_killable(mm);
			if (ret) /* the lock is not held: skip the unlock below */
				goto out_unpinned;
			/* The range may have changed while unlocked: the VMAs must still be private anonymous. */
			ret = tmpl_check_range(mm, req.addr + (done << PAGE_SHIFT), req.addr + req.len);
		}
	}
	mmap_read_unlock(mm);
out_unpinned:
	if (ret)
		goto out_free;
	mmput(mm);
	mm = NULL;

	/* The reply is written before the fd is installed, so a failure leaves nothing behind. */
	ret = -EFAULT;
	if (put_user((u64)n, &uarg->npages))
		goto out_free;
	fd = get_unused_fd_flags(O_CLOEXEC);
	if (fd < 0) {
		ret = fd;
		goto out_free;
	}
	/* anon_inode_getfile() takes a reference on THIS_MODULE (tmpl_fops.owner): rmmod waits for the last
	 * template file, hence for the last mapping (each VMA holds the file). */
	file = anon_inode_getfile("[bunshin_tmpl]", &tmpl_fops, t, O_RDONLY);
	if (IS_ERR(file)) {
		put_unused_fd(fd);
		ret = PTR_ERR(file);
		goto out_free;
	}
	fd_install(fd, file);
	return fd;

out_free:
	tmpl_free(t, done);
out_mm:
	if (mm)
		mmput(mm);
	return ret;
}

static long dev_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	if (cmd == BUNSHIN_TMPL_CREATE)
		return tmpl_create((struct bunshin_tmpl_create __user *)arg);
	return -ENOTTY;
}

static const struct file_operations dev_fops = {
	.owner = THIS_MODULE,
	.unlocked_ioctl = dev_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
	.llseek = noop_llseek,
};

static struct miscdevice tmpl_dev = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "bunshin_tmpl",
	.fops = &dev_fops,
	.mode = 0600,
};

static int __init tmpl_init(void)
{
	int ret = misc_register(&tmpl_dev);

	if (!ret)
		pr_info("ready (abi %d)\n", BUNSHIN_TMPL_ABI_VERSION);
	return ret;
}

static void __exit tmpl_exit(void)
{
	misc_deregister(&tmpl_dev);
	/* Every template file held a module reference, so none is left: nothing may still be pinned. */
	WARN_ON(atomic_long_read(&pinned_total));
	pr_info("unloaded\n");
}

module_init(tmpl_init);
module_exit(tmpl_exit);
MODULE_LICENSE("GPL");
MODULE_AUTHOR("Bunshin");
MODULE_DESCRIPTION("Copy-on-write views of a frozen process's anonymous memory (template fork)");
