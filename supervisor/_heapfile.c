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
#define _GNU_SOURCE
#include <Python.h>

#include <dirent.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U
#endif

#define PAGE 4096UL
#define FILE_NAME "tether-template-heap"
#define MAX_REGIONS 4096
#define MAX_EXCLUDED 1024
/* around the thread pointer: the thread's descriptor (the kernel writes its rseq area there at
 * any return to user space) and the static TLS blocks below it (errno among them) */
#define TLS_MARGIN (16 * PAGE)
/* The file goes on this far past its last byte, as a hole: a private mapping that the
 * allocator grows in place (mremap) past the end of its file would raise SIGBUS where it is
 * read; inside a hole it reads zeros, as grown anonymous memory does. No memory is used. */
#define TAIL_HOLE (1UL << 36)

struct region {
    uintptr_t start, end;
    const char *ref; /* the same bytes in the view (give_back) */
};

struct range {
    uintptr_t lo, hi;
};

/* Written once, by snapshot, after the last replacement; inherited by every fork; read-only
 * afterwards. The view is the file mapped again, privately and read-only: what a copy is
 * compared with (its pages are the file's; it is never written). */
static int nregions = -1; /* -1: no snapshot in this process's history */
static const char *view = NULL;
static size_t view_size = 0;
static ino_t file_ino = 0;

struct excluded {
    struct range r[MAX_EXCLUDED];
    int n;
};

static int
exclude(struct excluded *ex, uintptr_t lo, uintptr_t hi)
{
    if (ex->n == MAX_EXCLUDED) {
        return -1;
    }
    ex->r[ex->n].lo = lo & ~(PAGE - 1);
    ex->r[ex->n].hi = (hi + PAGE - 1) & ~(PAGE - 1);
    ex->n++;
    return 0;
}

/* Every loaded object's writable segment, its zero-filled data included: a library's static
 * data can share a mapping with an arena (the kernel merges neighbours), and static data is
 * where a signal handler writes (the interpreter's, at any time). */
static int
exclude_object(struct dl_phdr_info *info, size_t size, void *data)
{
    struct excluded *ex = data;
    for (int k = 0; k < info->dlpi_phnum; k++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[k];
        if (ph->p_type == PT_LOAD && (ph->p_flags & PF_W)) {
            uintptr_t lo = info->dlpi_addr + ph->p_vaddr;
            if (exclude(ex, lo, lo + ph->p_memsz) < 0) {
                return 1;
            }
        }
    }
    return 0;
}

/* [a, b) less the excluded ranges, appended to out as separate regions */
static int
add_region(struct region *out, int n, uintptr_t a, uintptr_t b, const struct excluded *ex)
{
    for (int i = 0; i < ex->n; i++) {
        if (ex->r[i].hi <= a || ex->r[i].lo >= b) {
            continue;
        }
        if (ex->r[i].lo > a) {
            n = add_region(out, n, a, ex->r[i].lo, ex);
        }
        if (ex->r[i].hi < b) {
            n = add_region(out, n, ex->r[i].hi, b, ex);
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

/* The next run of pages that hold anything (present, or swapped out) in pagemap entries
 * [j, n): its first page (n if none); *end is set to the page after it. */
static size_t
next_run(const uint64_t *entries, size_t j, size_t n, size_t *end)
{
    while (j < n && !(entries[j] >> 62)) {
        j++;
    }
    size_t k = j;
    while (k < n && (entries[k] >> 62)) {
        k++;
    }
    *end = k;
    return j;
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
os_error(int err, const char *what)
{
    errno = err;
    return PyErr_SetFromErrnoWithFilename(PyExc_OSError, what);
}

static PyObject *
snapshot(PyObject *self, PyObject *args)
{
    unsigned long min_size;
    if (!PyArg_ParseTuple(args, "k", &min_size)) {
        return NULL;
    }
    if (nregions >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "this process's heap was made a file already");
        return NULL;
    }
    int threads = count_threads();
    if (threads != 1) {
        PyErr_Format(PyExc_RuntimeError, "%d threads run here: another could write while "
                     "its memory is copied", threads);
        return NULL;
    }
    /* What must stay anonymous: this thread's Python frames (the interpreter writes them
     * while this very call runs), its descriptor and TLS, every loaded object's static data.
     * The C stack has a name. */
    static struct excluded ex;
    ex.n = 0;
    PyThreadState *ts = PyThreadState_Get();
    for (_PyStackChunk *c = ts->datastack_chunk; c != NULL; c = c->previous) {
        if (exclude(&ex, (uintptr_t)c, (uintptr_t)c + c->size) < 0) {
            PyErr_SetString(PyExc_RuntimeError, "too many ranges to leave anonymous");
            return NULL;
        }
    }
    uintptr_t tp = (uintptr_t)pthread_self() & ~(PAGE - 1);
    if (exclude(&ex, tp - TLS_MARGIN, tp + TLS_MARGIN) < 0
        || dl_iterate_phdr(exclude_object, &ex) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "too many ranges to leave anonymous");
        return NULL;
    }

    /* The map is read, the file made and the pagemap read before anything is copied:
     * allocation is still allowed until the pagemap is read. */
    static struct region found[MAX_REGIONS];
    int nf = 0;
    FILE *maps = fopen("/proc/self/maps", "re");
    if (maps == NULL) {
        return os_error(errno, "/proc/self/maps");
    }
    char line[4096];
    while (fgets(line, sizeof line, maps) != NULL) {
        unsigned long a, b;
        char perms[8];
        char name[256] = "";
        if (sscanf(line, "%lx-%lx %7s %*s %*s %*s %255s", &a, &b, perms, name) < 3) {
            continue;
        }
        /* private, writable, not executable: the heap and the anonymous mappings big enough
         * to be allocator arenas (CPython's are 1 MiB) */
        if (strcmp(perms, "rw-p") != 0) {
            continue;
        }
        int heap = strcmp(name, "[heap]") == 0;
        if (!heap && (name[0] != '\0' || b - a < min_size)) {
            continue;
        }
        nf = add_region(found, nf, a, b, &ex);
        if (nf == MAX_REGIONS) {
            break;
        }
    }
    fclose(maps);
    size_t total = 0, pages = 0;
    for (int i = 0; i < nf; i++) {
        total += found[i].end - found[i].start;
    }
    pages = total / PAGE;
    if (total == 0) {
        nregions = 0;
        return Py_BuildValue("(in)", 0, (Py_ssize_t)0);
    }
    int fd = memfd_create(FILE_NAME, MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_NOEXEC_SEAL);
    if (fd < 0 && errno == EINVAL) { /* a kernel before 6.3 */
        fd = memfd_create(FILE_NAME, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    }
    if (fd < 0) {
        return os_error(errno, "memfd_create");
    }
    struct stat st;
    if (ftruncate(fd, (off_t)(total + TAIL_HOLE)) < 0 || fstat(fd, &st) < 0) {
        int err = errno;
        close(fd);
        return os_error(err, "the heap file");
    }
    /* Which pages hold anything: only those are copied, the rest stay holes (read as zeros,
     * as untouched anonymous memory does, and using no memory). */
    uint64_t *present = malloc(pages * sizeof(uint64_t));
    int pm = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    if (present == NULL || pm < 0) {
        int err = present == NULL ? ENOMEM : errno;
        free(present);
        if (pm >= 0) {
            close(pm);
        }
        close(fd);
        return os_error(err, "/proc/self/pagemap");
    }
    size_t at = 0;
    int err = 0;
    for (int i = 0; i < nf && err == 0; i++) {
        size_t n = (found[i].end - found[i].start) / PAGE, done = 0;
        while (done < n) {
            ssize_t got = pread(pm, present + at + done, (n - done) * 8,
                                (off_t)((found[i].start / PAGE + done) * 8));
            if (got < 8) {
                err = got < 0 ? errno : EIO;
                break;
            }
            done += (size_t)got / 8;
        }
        at += n;
    }
    close(pm);

    /* From here to the last replacement: system calls only, no allocation, no write to
     * memory but this frame's locals and errno (both left anonymous above). */
    size_t off = 0;
    at = 0;
    for (int i = 0; i < nf && err == 0; i++) {
        size_t n = (found[i].end - found[i].start) / PAGE, k;
        /* the pages between runs hold nothing: they stay holes */
        for (size_t j = next_run(present + at, 0, n, &k); j < n && err == 0;
             j = next_run(present + at, k, n, &k)) {
            size_t len = (k - j) * PAGE, done = 0;
            const char *src = (const char *)(found[i].start + j * PAGE);
            while (done < len) {
                ssize_t w = pwrite(fd, src + done, len - done, (off_t)(off + j * PAGE + done));
                if (w <= 0) {
                    err = w < 0 ? errno : EIO;
                    break;
                }
                done += (size_t)w;
            }
        }
        off += n * PAGE;
        at += n;
    }
    /* Nobody writes the file again; its size is fixed. */
    if (err == 0 && fcntl(fd, F_ADD_SEALS,
                          F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) < 0) {
        err = errno;
    }
    if (err != 0) { /* nothing replaced yet: the process goes on as it was */
        free(present);
        close(fd);
        return os_error(err, "the heap file");
    }
    off = 0;
    for (int i = 0; i < nf; i++) {
        size_t len = found[i].end - found[i].start;
        void *p = mmap((void *)found[i].start, len, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_FIXED, fd, (off_t)off);
        if (p == MAP_FAILED) {
            /* The range may be unmapped already: this process cannot go on, and a template
             * that dies is restarted (supervisors start cold meanwhile). */
            static const char msg[] = "tether: cannot map the heap file back; aborting\n";
            (void)!write(2, msg, sizeof msg - 1);
            abort();
        }
        off += len;
    }
    /* End of the window. Every page that holds anything is mapped here as well, so that a
     * supervisor's read-only pages are shared with this process (and counted so), not its
     * alone; holes are left alone (a read would give them a page each). */
    at = 0;
    for (int i = 0; i < nf; i++) {
        size_t n = (found[i].end - found[i].start) / PAGE, k;
        for (size_t j = next_run(present + at, 0, n, &k); j < n;
             j = next_run(present + at, k, n, &k)) {
            (void)madvise((void *)(found[i].start + j * PAGE), (k - j) * PAGE,
                          MADV_POPULATE_READ);
        }
        at += n;
    }
    free(present);
    nregions = nf;
    /* What a supervisor's copies are compared with: read-only and private, which a sealed
     * file allows on every kernel (a shared mapping of it needs Linux 6.7). Without it this
     * process and its forks still share the file's pages until they write; they only cannot
     * give copies back. */
    const char *ref = mmap(NULL, total, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (ref != MAP_FAILED) {
        view = ref;
        view_size = total;
        file_ino = st.st_ino;
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
        unsigned long a, b, off, ino;
        char perms[8];
        char name[256] = "";
        if (sscanf(line, "%lx-%lx %7s %lx %*s %lu %255s", &a, &b, perms, &off, &ino, name) < 6) {
            continue;
        }
        /* this very file (its inode), written here (the view is read-only), within it */
        if (strcmp(perms, "rw-p") != 0 || (ino_t)ino != file_ino
            || strcmp(name, "/memfd:" FILE_NAME) != 0 || off + (b - a) > view_size) {
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
    unsigned char held[512];
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
            /* which of the file's pages exist: a hole has none to share (a read of it
             * would make one) */
            if (mincore((void *)(ranges[r].ref + (a - ranges[r].start)), n * PAGE, held) < 0) {
                break;
            }
            uintptr_t run = 0; /* start of a run of pages to give back */
            for (size_t i = 0; i <= n; i++) {
                uintptr_t p = a + i * PAGE;
                int give = 0;
                if (i < n) {
                    uint64_t e = entries[i];
                    /* present, anonymous (a copy, not the file's page), this process's only */
                    if ((e >> 63 & 1) && !(e >> 61 & 1) && (e >> 56 & 1) && (held[i] & 1)) {
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
    /* the comparisons mapped the view's pages here: unmap them (the file keeps them; the view
     * is never written, so nothing of its own goes) */
    (void)madvise((void *)view, view_size, MADV_DONTNEED);
    return Py_BuildValue("(ll)", given, copies);
}

static PyObject *
mapped(PyObject *self, PyObject *noargs)
{
    /* (mappings made a file, the bytes a copy can be compared with: 0 without a view) */
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
