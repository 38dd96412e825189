/* The template's heap as a file, and a supervisor giving back the copies it no longer needs.
 *
 * Why this is C: ``snapshot`` copies the template's anonymous memory into a memfd and maps the
 * memfd privately over that very memory. Between the copy of a range and its replacement
 * nothing may write to the range, or the write is lost: in Python, the interpreter's own
 * bookkeeping (reference counts, allocations) between two calls would be. Here the whole step
 * runs with the GIL held, on the template's only thread, calling nothing but system calls.
 * ``give_back`` likewise compares a page and discards it with no write in between.
 *
 * supervisor/heapfile.py has the theory of operation; this file only does the two steps.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

#define PAGE 4096UL
#define FILE_NAME "tether-template-heap"
#define MAX_REGIONS 512
#define MAX_EXCLUDED 64
/* around the thread pointer: the thread's descriptor (the kernel writes its rseq area there at
 * any return to user space) and the static TLS blocks below it (errno among them) */
#define TLS_MARGIN (16 * PAGE)

struct region {
    uintptr_t start, end;
    const char *ref; /* the same bytes in the view (give_back) */
};

struct range {
    uintptr_t lo, hi;
};

/* Written once, by snapshot, after the last replacement; inherited by every fork; read-only
 * afterwards. The view is the whole file, mapped shared and read-only: what a copy is
 * compared with. */
static int nregions = -1; /* -1: no snapshot in this process's history */
static const char *view = NULL;
static size_t view_size = 0;

/* [a, b) less the excluded ranges, appended to out as separate regions */
static int
add_region(struct region *out, int n, uintptr_t a, uintptr_t b,
           const struct range *ex, int nex)
{
    for (int i = 0; i < nex; i++) {
        if (ex[i].hi <= a || ex[i].lo >= b) {
            continue;
        }
        if (ex[i].lo > a) {
            n = add_region(out, n, a, ex[i].lo, ex, nex);
        }
        if (ex[i].hi < b) {
            n = add_region(out, n, ex[i].hi, b, ex, nex);
        }
        return n;
    }
    if (b > a && n < MAX_REGIONS) {
        out[n].start = a;
        out[n].end = b;
        n++;
    }
    return n;
}

static int
count_threads(void)
{
    DIR *d = opendir("/proc/self/task");
    if (d == NULL) {
        return -1;
    }
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] != '.') {
            n++;
        }
    }
    closedir(d);
    return n;
}

static PyObject *
snapshot(PyObject *self, PyObject *args)
{
    unsigned long min_size;
    if (!PyArg_ParseTuple(args, "k", &min_size)) {
        return NULL;
    }
    if (view != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "this process's heap is a file already");
        return NULL;
    }
    int threads = count_threads();
    if (threads != 1) {
        PyErr_Format(PyExc_RuntimeError, "%d threads run here: another could write while "
                     "its memory is copied", threads);
        return NULL;
    }
    /* What must stay anonymous: this thread's Python frames (the interpreter writes them
     * while this very call runs) and its descriptor and TLS. The C stack has a name. */
    struct range ex[MAX_EXCLUDED];
    int nex = 0;
    PyThreadState *ts = PyThreadState_Get();
    for (_PyStackChunk *c = ts->datastack_chunk; c != NULL; c = c->previous) {
        if (nex == MAX_EXCLUDED - 1) {
            PyErr_SetString(PyExc_RuntimeError, "too many frame chunks");
            return NULL;
        }
        ex[nex].lo = (uintptr_t)c & ~(PAGE - 1);
        ex[nex].hi = ((uintptr_t)c + c->size + PAGE - 1) & ~(PAGE - 1);
        nex++;
    }
    uintptr_t tp = (uintptr_t)pthread_self() & ~(PAGE - 1);
    ex[nex].lo = tp - TLS_MARGIN;
    ex[nex].hi = tp + TLS_MARGIN;
    nex++;

    /* The map is read, and the file made, before anything is copied: allocation is still
     * allowed here. */
    static struct region found[MAX_REGIONS];
    int nf = 0;
    FILE *maps = fopen("/proc/self/maps", "re");
    if (maps == NULL) {
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, "/proc/self/maps");
    }
    char line[4096];
    /* The interpreter's zero-filled data (its .bss, an anonymous mapping) holds the flags its
     * signal handler sets at any time: found by a variable of its own that lives there. */
    uintptr_t bss = (uintptr_t)&PyOS_InputHook;
    while (fgets(line, sizeof line, maps) != NULL) {
        unsigned long a, b;
        char perms[8];
        char name[256] = "";
        if (sscanf(line, "%lx-%lx %7s %*s %*s %*s %255s", &a, &b, perms, name) < 3) {
            continue;
        }
        /* private, writable, not executable: the heap and the anonymous mappings big enough
         * to be allocator arenas (CPython's are 1 MiB) */
        if (strcmp(perms, "rw-p") != 0 || (a <= bss && bss < b)) {
            continue;
        }
        int heap = strcmp(name, "[heap]") == 0;
        if (!heap && (name[0] != '\0' || b - a < min_size)) {
            continue;
        }
        nf = add_region(found, nf, a, b, ex, nex);
        if (nf == MAX_REGIONS) {
            break;
        }
    }
    fclose(maps);
    size_t total = 0;
    for (int i = 0; i < nf; i++) {
        total += found[i].end - found[i].start;
    }
    if (total == 0) {
        return Py_BuildValue("(in)", 0, (Py_ssize_t)0);
    }
    int fd = memfd_create(FILE_NAME, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (ftruncate(fd, (off_t)total) < 0) {
        int err = errno;
        close(fd);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }

    /* From the first copy to the last replacement: system calls only, no allocation, no
     * write to memory but this frame's locals and errno (both left anonymous above). */
    size_t off = 0;
    int err = 0;
    for (int i = 0; i < nf && err == 0; i++) {
        size_t len = found[i].end - found[i].start, done = 0;
        while (done < len) {
            ssize_t w = pwrite(fd, (const char *)found[i].start + done, len - done,
                               (off_t)(off + done));
            if (w <= 0) {
                err = w < 0 ? errno : EIO;
                break;
            }
            done += (size_t)w;
        }
        off += len;
    }
    /* Nobody writes the file again (a shared writable mapping is refused from now on, and the
     * view below is mapped read-only for good); its size is fixed. */
    if (err == 0 && fcntl(fd, F_ADD_SEALS,
                          F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) < 0) {
        err = errno;
    }
    if (err != 0) { /* nothing replaced yet: the process goes on as it was */
        close(fd);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    off = 0;
    for (int i = 0; i < nf; i++) {
        size_t len = found[i].end - found[i].start;
        void *p = mmap((void *)found[i].start, len, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_FIXED, fd, (off_t)off);
        if (p == MAP_FAILED) {
            /* The range is unmapped, or half replaced: this process cannot go on, and a
             * template that dies is restarted (supervisors start cold meanwhile). */
            static const char msg[] = "tether: cannot map the heap file back; aborting\n";
            (void)!write(2, msg, sizeof msg - 1);
            abort();
        }
        off += len;
    }
    /* End of the window. Every page mapped here as well, so that a supervisor's read-only
     * pages are shared with this process (and counted so), not its alone. */
    for (int i = 0; i < nf; i++) {
        (void)madvise((void *)found[i].start, found[i].end - found[i].start,
                      MADV_POPULATE_READ);
    }
    /* What a supervisor's copies are compared with. Without it this process and its forks
     * still share the file's pages until they write; they only cannot give copies back. */
    const char *ref = mmap(NULL, total, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    nregions = nf;
    if (ref != MAP_FAILED) {
        view = ref;
        view_size = total;
    }
    return Py_BuildValue("(in)", nf, (Py_ssize_t)total);
}

/* The ranges mapped from the heap file now, with where each sits in the view. Read from the
 * kernel, not remembered: the allocator may have unmapped an arena since, and something else
 * may be mapped there now, anonymous memory that must never be compared with the file. */
static int
file_ranges(struct region *out)
{
    FILE *maps = fopen("/proc/self/maps", "re");
    if (maps == NULL) {
        return -1;
    }
    int n = 0;
    char line[4096];
    while (n < MAX_REGIONS && fgets(line, sizeof line, maps) != NULL) {
        unsigned long a, b, off;
        char perms[8];
        char name[256] = "";
        if (sscanf(line, "%lx-%lx %7s %lx %*s %*s %255s", &a, &b, perms, &off, name) < 5) {
            continue;
        }
        if (strcmp(perms, "rw-p") != 0 || strcmp(name, "/memfd:" FILE_NAME) != 0
            || off + (b - a) > view_size) {
            continue;
        }
        out[n].start = a;
        out[n].end = b;
        out[n].ref = view + off;
        n++;
    }
    fclose(maps);
    return n;
}

static PyObject *
give_back(PyObject *self, PyObject *noargs)
{
    if (view == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no heap file in this process");
        return NULL;
    }
    /* Another thread could write to a page between its comparison and its discarding; a
     * thread of ours only starts from Python, which cannot run while this call does. */
    if (count_threads() != 1) {
        Py_RETURN_NONE;
    }
    static struct region ranges[MAX_REGIONS];
    int nranges = file_ranges(ranges);
    if (nranges < 0) {
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, "/proc/self/maps");
    }
    int pm = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    if (pm < 0) {
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, "/proc/self/pagemap");
    }
    /* From here on nothing allocates: a page compared equal is written by nobody before it
     * is discarded. */
    long given = 0, copies = 0;
    uint64_t entries[512];
    for (int r = 0; r < nranges; r++) {
        uintptr_t a = ranges[r].start;
        while (a < ranges[r].end) {
            size_t n = (ranges[r].end - a) / PAGE;
            if (n > 512) {
                n = 512;
            }
            ssize_t got = pread(pm, entries, n * 8, (off_t)(a / PAGE * 8));
            if (got < 8) {
                break;
            }
            n = (size_t)got / 8;
            uintptr_t run = 0; /* start of a run of pages to give back */
            for (size_t i = 0; i <= n; i++) {
                uintptr_t p = a + i * PAGE;
                int give = 0;
                if (i < n) {
                    uint64_t e = entries[i];
                    /* present, anonymous (a copy, not the file's page), this process's only */
                    if ((e >> 63 & 1) && !(e >> 61 & 1) && (e >> 56 & 1)) {
                        copies++;
                        give = memcmp((const void *)p, ranges[r].ref + (p - ranges[r].start),
                                      PAGE) == 0;
                    }
                }
                if (give && run == 0) {
                    run = p;
                } else if (!give && run != 0) {
                    /* the copy goes; the next access maps the file's page again */
                    if (madvise((void *)run, p - run, MADV_DONTNEED) == 0) {
                        given += (long)((p - run) / PAGE);
                    }
                    run = 0;
                }
            }
            a += n * PAGE;
        }
    }
    close(pm);
    /* the comparisons mapped the view's pages here: unmap them (the file keeps them) */
    (void)madvise((void *)view, view_size, MADV_DONTNEED);
    return Py_BuildValue("(ll)", given, copies);
}

static PyObject *
mapped(PyObject *self, PyObject *noargs)
{
    return Py_BuildValue("(in)", nregions < 0 ? 0 : nregions, (Py_ssize_t)view_size);
}

static PyMethodDef methods[] = {
    {"snapshot", snapshot, METH_VARARGS,
     "snapshot(min_size) -> (regions, bytes): this process's heap and anonymous mappings of at "
     "least min_size bytes become a private mapping of a sealed memfd holding their bytes."},
    {"give_back", give_back, METH_NOARGS,
     "give_back() -> (pages given back, private copies seen), or None while another thread "
     "runs: every private copy of the file's pages that still equals the file is discarded."},
    {"mapped", mapped, METH_NOARGS,
     "mapped() -> (regions, bytes) of the heap file this process inherited or made."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_heapfile", NULL, -1, methods,
};

PyMODINIT_FUNC
PyInit__heapfile(void)
{
    return PyModule_Create(&module);
}
