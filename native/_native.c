/*
 * bunshin_async._native: the Linux system calls Python 3.11's standard library lacks (mount(2), umount2(2),
 * openat2(2)), plus the prctl flags the fork fallback needs (namespaces and the root are set up by bunshin-init,
 * native/init.c).  Each function raises OSError with errno set, like the os module; callers translate it into
 * BunshinError where they call it.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE 1 /* as Python 3.10's pyconfig.h defines it: an identical redefinition is no warning */
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef PR_SET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#define PR_GET_MEMORY_MERGE 68
#endif

static PyObject *native_mount(PyObject *self, PyObject *args)
{
	const char *source, *target, *fstype, *data;
	unsigned long flags;
	if (!PyArg_ParseTuple(args, "zszkz", &source, &target, &fstype, &flags, &data))
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS rc = mount(source, target, fstype, flags, data);
	Py_END_ALLOW_THREADS if (rc < 0) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, target);
	Py_RETURN_NONE;
}

static PyObject *native_umount2(PyObject *self, PyObject *args)
{
	const char *target;
	int flags = 0;
	if (!PyArg_ParseTuple(args, "s|i", &target, &flags))
		return NULL;
	int rc;
	Py_BEGIN_ALLOW_THREADS rc = umount2(target, flags);
	Py_END_ALLOW_THREADS if (rc < 0) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, target);
	Py_RETURN_NONE;
}

static PyObject *native_set_memory_merge(PyObject *self, PyObject *args)
{
	int on;
	if (!PyArg_ParseTuple(args, "p", &on))
		return NULL;
	if (prctl(PR_SET_MEMORY_MERGE, on, 0, 0, 0) < 0)
		return PyErr_SetFromErrno(PyExc_OSError);
	Py_RETURN_NONE;
}

static PyObject *native_get_memory_merge(PyObject *self, PyObject *noargs)
{
	int rc = prctl(PR_GET_MEMORY_MERGE, 0, 0, 0, 0);
	if (rc < 0)
		return PyErr_SetFromErrno(PyExc_OSError);
	return PyBool_FromLong(rc);
}

/* openat2(2) (Linux 5.6; Python's os module has no wrapper): a lookup the caller confines with RESOLVE_* flags,
 * e.g. RESOLVE_IN_ROOT below a directory a workspace controls, so that none of its symlinks leads out of it. */
static PyObject *native_openat2(PyObject *self, PyObject *args)
{
	int dirfd, flags;
	PyObject *path; /* str, bytes or os.PathLike, as the os module takes them (a name need not be UTF-8) */
	unsigned long long resolve, mode = 0;
	if (!PyArg_ParseTuple(args, "iO&iK|K", &dirfd, PyUnicode_FSConverter, &path, &flags, &resolve, &mode))
		return NULL;
	struct open_how how = {.flags = (unsigned long long)(unsigned int)flags, .mode = mode, .resolve = resolve};
	const char *name = PyBytes_AsString(path); /* the stable ABI has no macro form */
	long fd;
	Py_BEGIN_ALLOW_THREADS fd = syscall(SYS_openat2, dirfd, name, &how, sizeof(how));
	Py_END_ALLOW_THREADS if (fd < 0)
	{
		PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
		Py_DECREF(path);
		return NULL;
	}
	Py_DECREF(path);
	return PyLong_FromLong(fd);
}

static PyMethodDef methods[] = {
	{"mount", native_mount, METH_VARARGS, "mount(source, target, fstype, flags, data): mount(2)."},
	{"umount2", native_umount2, METH_VARARGS, "umount2(target, flags=0): umount2(2)."},
	{"set_memory_merge", native_set_memory_merge, METH_VARARGS,
	 "set_memory_merge(on): prctl(PR_SET_MEMORY_MERGE); inherited across fork and exec (Linux 6.4+)."},
	{"get_memory_merge", native_get_memory_merge, METH_NOARGS, "get_memory_merge() -> bool."},
	{"openat2", native_openat2, METH_VARARGS,
	 "openat2(dirfd, path, flags, resolve, mode=0) -> fd: openat2(2); flags as os.open's, resolve RESOLVE_*."},
	{NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "bunshin_async._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void)
{
	PyObject *m = PyModule_Create(&module);
	if (!m)
		return NULL;
	PyModule_AddIntConstant(m, "CLONE_NEWNS", CLONE_NEWNS);
	PyModule_AddIntConstant(m, "CLONE_NEWPID", CLONE_NEWPID);
	PyModule_AddIntConstant(m, "CLONE_NEWNET", CLONE_NEWNET);
	PyModule_AddIntConstant(m, "CLONE_NEWIPC", CLONE_NEWIPC);
	PyModule_AddIntConstant(m, "CLONE_NEWUTS", CLONE_NEWUTS);
	PyModule_AddIntConstant(m, "CLONE_NEWUSER", CLONE_NEWUSER);
	PyModule_AddIntConstant(m, "MS_RDONLY", MS_RDONLY);
	PyModule_AddIntConstant(m, "MS_BIND", MS_BIND);
	PyModule_AddIntConstant(m, "MS_REC", MS_REC);
	PyModule_AddIntConstant(m, "MS_PRIVATE", MS_PRIVATE);
	PyModule_AddIntConstant(m, "MNT_DETACH", MNT_DETACH);
	PyModule_AddIntConstant(m, "RESOLVE_NO_XDEV", RESOLVE_NO_XDEV);
	PyModule_AddIntConstant(m, "RESOLVE_NO_MAGICLINKS", RESOLVE_NO_MAGICLINKS);
	PyModule_AddIntConstant(m, "RESOLVE_NO_SYMLINKS", RESOLVE_NO_SYMLINKS);
	PyModule_AddIntConstant(m, "RESOLVE_BENEATH", RESOLVE_BENEATH);
	PyModule_AddIntConstant(m, "RESOLVE_IN_ROOT", RESOLVE_IN_ROOT);
	return m;
}
