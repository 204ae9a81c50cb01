/* shmtier.scheduler.policies._lru: the LRU policy's recency ranks, evictable set and
 * min-heap over arena rows, in C.
 *
 * Who calls: shmtier.scheduler.policies.lru.LRUCachePolicy only, in the scheduler
 * process, under the manager's lock. Nothing here blocks, does I/O or releases the GIL.
 *
 * Why C (measured with bench/tiering_steps.py on the 2-vCPU VM): every engine step ranks,
 * pins, unpins and evicts a few dozen keys, after the forward pass has left the caches
 * cold. In Python each key cost a tuple, a dict entry, set updates and heap pushes, and
 * a heap rebuild (one step in a hundred) cost 85-150 us; those were a fifth of the
 * slowest 1% of steps. Re-measured against the pure-Python reference (issue 30;
 * bench/c_vs_reference.py, 2026-12-05, the shared 2-CPU x86_64 VM, Python 3.11, 10k
 * chunks, 5 repeats, 2 runs): the CPU tier's manager time per step with this core, median
 * [runs], mean 188-277 us, p50 137 us; with lru_reference.py's LRUCore, mean 1435-1810 us
 * (6.5-7.6x), p50 611-746 us (4.5-5.4x); both helpers in Python, their heap on heapq,
 * mean 5.5-5.8x. It pays; kept.
 *
 * Semantics are lru.py's module docstring, unchanged. A rank is (major, minor), compared
 * as a pair; minors below MIN_MINOR (positions of 2**48 tokens and more) compare as
 * MIN_MINOR, and equal ranks order by key bytes, as the (rank, key) tuples of the Python
 * heap did, so the victims are the same. Per row the core keeps the rank, the resident
 * key (a reference) and whether the row is evictable; the table's rank_major/rank_minor
 * (the source of truth for a warm restart) are written through. The heap is lazy: an
 * entry is (rank, row, key) and is current iff the row still holds that key (identity:
 * the entry holds a reference, so the address cannot be reused), at that rank, and is
 * evictable; others are skipped when popped and dropped when the heap is rebuilt (linear,
 * from the rows) once it holds twice the evictable rows. A twin (the same row pushed
 * twice at the same rank) is selected once.
 *
 * The core holds buffers of the table's arrays: close() releases them (the policy's
 * close, before the segment is unmapped). Callbacks and the lookups in the rows dict and
 * ``protected`` can run Python code (a key's __hash__ or __eq__): each method works on a
 * snapshot of its argument lists and refuses a call into the core from inside one of its
 * calls (``busy``).
 *
 * shmtier/scheduler/policies/lru_reference.py is this file in Python (the same heap sifts),
 * the reference it is tested against (tests/test_c_reference.py: the same operations on
 * both, results, errors, ranks, heap size and object reference counts compared);
 * scripts/test-sanitizers runs those tests on a build with AddressSanitizer and
 * UndefinedBehaviorSanitizer. A change here changes the reference alike.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MIN_REBUILD 64
#define MIN_MINOR (1 - ((int64_t)1 << 48))

typedef struct {
    int64_t major, minor;  /* minor already clamped to >= MIN_MINOR */
    Py_ssize_t row;
    PyObject *key;         /* owned */
} Entry;

typedef struct {
    PyObject_HEAD
    PyObject *rows;              /* the primary's key -> row dict (shared, not copied) */
    Py_buffer major_view, minor_view, counters_view;
    int open;
    int64_t *tmajor, *tminor;    /* the table's rank arrays */
    int64_t *counters;
    Py_ssize_t next_rank_index;
    Py_ssize_t n;                /* rows */
    int64_t *major, *minor;      /* the row's rank, minor clamped */
    PyObject **key;              /* the row's resident key (owned), NULL = none */
    uint8_t *evictable, *mark;
    Py_ssize_t num_evictable;
    Entry *heap;
    Py_ssize_t heap_len, heap_cap;
    Py_ssize_t *scratch;         /* rows updated by one call */
    Py_ssize_t scratch_cap;
    int busy;                    /* inside a method (see core_enter) */
} LRUCore;

static inline int64_t clamp_minor(int64_t minor) { return minor > MIN_MINOR ? minor : MIN_MINOR; }

/* a < b as the Python heap's (rank, key) tuples compare; keys are bytes */
static inline int entry_lt(const Entry *a, const Entry *b) {
    if (a->major != b->major) return a->major < b->major;
    if (a->minor != b->minor) return a->minor < b->minor;
    Py_ssize_t la = PyBytes_GET_SIZE(a->key), lb = PyBytes_GET_SIZE(b->key);
    int c = memcmp(PyBytes_AS_STRING(a->key), PyBytes_AS_STRING(b->key), la < lb ? la : lb);
    return c != 0 ? c < 0 : la < lb;
}

static void sift_down(Entry *heap, Py_ssize_t len, Py_ssize_t i) {
    Entry item = heap[i];
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= len) break;
        if (child + 1 < len && entry_lt(&heap[child + 1], &heap[child])) child++;
        if (!entry_lt(&heap[child], &item)) break;
        heap[i] = heap[child];
        i = child;
    }
    heap[i] = item;
}

static void sift_up(Entry *heap, Py_ssize_t i) {
    Entry item = heap[i];
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!entry_lt(&item, &heap[parent])) break;
        heap[i] = heap[parent];
        i = parent;
    }
    heap[i] = item;
}

static int heap_reserve(LRUCore *self, Py_ssize_t extra) {
    if (self->heap_len + extra <= self->heap_cap) return 0;
    Py_ssize_t cap = self->heap_cap ? self->heap_cap : 64;
    while (cap < self->heap_len + extra) cap *= 2;
    Entry *heap = PyMem_Realloc(self->heap, (size_t)cap * sizeof(Entry));
    if (heap == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->heap = heap;
    self->heap_cap = cap;
    return 0;
}

static int heap_push_row(LRUCore *self, Py_ssize_t row) {
    if (heap_reserve(self, 1) < 0) return -1;
    Entry *e = &self->heap[self->heap_len];
    e->major = self->major[row];
    e->minor = self->minor[row];
    e->row = row;
    e->key = Py_NewRef(self->key[row]);
    sift_up(self->heap, self->heap_len++);
    return 0;
}

static Entry heap_pop(LRUCore *self) {
    Entry top = self->heap[0];
    Entry last = self->heap[--self->heap_len];
    if (self->heap_len > 0) {
        self->heap[0] = last;
        sift_down(self->heap, self->heap_len, 0);
    }
    return top;
}

static inline int entry_current(LRUCore *self, const Entry *e) {
    Py_ssize_t row = e->row;
    return self->evictable[row] && self->key[row] == e->key && self->major[row] == e->major
           && self->minor[row] == e->minor;
}

static void heap_clear(LRUCore *self) {
    for (Py_ssize_t i = 0; i < self->heap_len; i++) Py_DECREF(self->heap[i].key);
    self->heap_len = 0;
}

/* The heap anew from the evictable rows (linear). */
static int heap_rebuild(LRUCore *self) {
    heap_clear(self);
    if (heap_reserve(self, self->num_evictable) < 0) return -1;
    Entry *heap = self->heap;
    Py_ssize_t len = 0;
    for (Py_ssize_t row = 0; row < self->n; row++) {
        if (!self->evictable[row]) continue;
        heap[len].major = self->major[row];
        heap[len].minor = self->minor[row];
        heap[len].row = row;
        heap[len].key = Py_NewRef(self->key[row]);
        len++;
    }
    self->heap_len = len;
    for (Py_ssize_t i = len / 2 - 1; i >= 0; i--) sift_down(heap, len, i);
    return 0;
}

static int maybe_compact(LRUCore *self) {
    if (self->heap_len >= MIN_REBUILD && self->heap_len >= 2 * self->num_evictable)
        return heap_rebuild(self);
    return 0;
}

/* The evictable rows among ``count`` rows in scratch were re-ranked: push them, or rebuild
 * when that many pushes would cost more than a linear heapify. */
static int update_heap(LRUCore *self, Py_ssize_t count) {
    if (count == 0) return 0;
    Py_ssize_t quarter = self->num_evictable / 4;
    if (count >= (quarter > MIN_REBUILD ? quarter : MIN_REBUILD)) return heap_rebuild(self);
    for (Py_ssize_t i = 0; i < count; i++)
        if (heap_push_row(self, self->scratch[i]) < 0) return -1;
    return maybe_compact(self);
}

static int scratch_reserve(LRUCore *self, Py_ssize_t count) {
    if (count <= self->scratch_cap) return 0;
    Py_ssize_t *scratch = PyMem_Realloc(self->scratch, (size_t)count * sizeof(Py_ssize_t));
    if (scratch == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->scratch = scratch;
    self->scratch_cap = count;
    return 0;
}

static int core_ready(LRUCore *self) {
    if (!self->open) {
        PyErr_SetString(PyExc_ValueError, "LRU core is closed");
        return 0;
    }
    return 1;
}

/* A method holds ``busy`` while it runs: callbacks (positions, request_rank) and the rows
 * dict's and ``protected``'s lookups (a key's __hash__ or __eq__) run Python code, and a call
 * into the core from there is refused, since the outer call keeps rows, heap entries and
 * buffer pointers across that code. */
static int core_enter(LRUCore *self) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "LRU core called from inside one of its own calls (a callback, or a "
                        "key's __hash__ or __eq__)");
        return 0;
    }
    self->busy = 1;
    return 1;
}

#define GUARDED_O(name)                                                                   \
    static PyObject *name(LRUCore *self, PyObject *arg) {                                 \
        if (!core_enter(self)) return NULL;                                               \
        PyObject *result = name##_body(self, arg);                                        \
        self->busy = 0;                                                                   \
        return result;                                                                    \
    }
#define GUARDED_FAST(name)                                                                \
    static PyObject *name(LRUCore *self, PyObject *const *args, Py_ssize_t nargs) {       \
        if (!core_enter(self)) return NULL;                                               \
        PyObject *result = name##_body(self, args, nargs);                                \
        self->busy = 0;                                                                   \
        return result;                                                                    \
    }

/* The row of ``key`` in the rows dict: -1 if absent, -2 with an exception set. */
static Py_ssize_t row_of(LRUCore *self, PyObject *key) {
    PyObject *value = PyDict_GetItemWithError(self->rows, key);
    if (value == NULL) return PyErr_Occurred() ? -2 : -1;
    Py_ssize_t row = PyLong_AsSsize_t(value);
    if (row == -1 && PyErr_Occurred()) return -2;
    if (row < 0 || row >= self->n) {
        PyErr_Format(PyExc_ValueError, "row %zd of a key is outside the table's %zd rows", row,
                     self->n);
        return -2;
    }
    return row;
}

static int check_row(LRUCore *self, Py_ssize_t row) {
    if (row < 0 || row >= self->n) {
        PyErr_Format(PyExc_IndexError, "row %zd is outside the table's %zd rows", row, self->n);
        return -1;
    }
    return 0;
}

static int check_key(PyObject *key) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "offload keys are bytes, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    return 0;
}

/* Rank ``row`` (major, minor) for ``key``, writing the table through. */
static void set_rank(LRUCore *self, Py_ssize_t row, PyObject *key, int64_t major, int64_t minor) {
    self->tmajor[row] = major;
    self->tminor[row] = minor;
    self->major[row] = major;
    self->minor[row] = clamp_minor(minor);
    if (self->key[row] != key) Py_XSETREF(self->key[row], Py_NewRef(key));
}

/* The position of ``key``: 1 and *out set, 0 if unknown, -1 on error. ``positions`` is a
 * dict (the context's own) or a callable (its get_offload_key_position). */
static int position_of(PyObject *positions, PyObject *key, int64_t *out) {
    PyObject *value;
    if (PyDict_Check(positions)) {
        value = PyDict_GetItemWithError(positions, key);
        if (value == NULL) return PyErr_Occurred() ? -1 : 0;
        Py_INCREF(value);
    } else {
        value = PyObject_CallOneArg(positions, key);
        if (value == NULL) return -1;
    }
    int found = value != Py_None;
    if (found) {
        *out = PyLong_AsLongLong(value);
        if (*out == -1 && PyErr_Occurred()) {
            found = -1;
        } else if (*out == INT64_MIN) {  /* -position, the rank minor, would overflow */
            PyErr_Format(PyExc_OverflowError,
                         "position %lld of a key has no int64 rank minor (-position)",
                         (long long)*out);
            found = -1;
        }
    }
    Py_DECREF(value);
    return found;
}

static int64_t *counter(LRUCore *self) { return &self->counters[self->next_rank_index]; }

/* --- type slots --- */

static void core_release(LRUCore *self) {
    if (self->open) {
        PyBuffer_Release(&self->major_view);
        PyBuffer_Release(&self->minor_view);
        PyBuffer_Release(&self->counters_view);
        self->open = 0;
    }
    self->tmajor = self->tminor = self->counters = NULL;
}

static void core_forget(LRUCore *self) {
    heap_clear(self);
    for (Py_ssize_t row = 0; row < self->n; row++) Py_CLEAR(self->key[row]);
    if (self->evictable) memset(self->evictable, 0, (size_t)self->n);
    self->num_evictable = 0;
}

static void core_dealloc(LRUCore *self) {
    if (self->key) core_forget(self);
    core_release(self);
    PyMem_Free(self->heap);
    PyMem_Free(self->scratch);
    PyMem_Free(self->major);
    PyMem_Free(self->minor);
    PyMem_Free(self->key);
    PyMem_Free(self->evictable);
    PyMem_Free(self->mark);
    Py_XDECREF(self->rows);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int get_int64_view(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->itemsize != 8 || view->format == NULL
        || (strcmp(view->format, "q") != 0 && strcmp(view->format, "l") != 0
            && strcmp(view->format, "<q") != 0 && strcmp(view->format, "=q") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a writable int64 buffer (format 'q'), not '%s'",
                     what, view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int core_init(LRUCore *self, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"rows", "rank_major", "rank_minor", "counters", "next_rank_index", NULL};
    PyObject *rows, *major, *minor, *counters;
    Py_ssize_t index;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OOOn", kw, &PyDict_Type, &rows, &major,
                                     &minor, &counters, &index))
        return -1;
    if (self->open || self->key != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "LRUCore is already initialised");
        return -1;
    }
    if (get_int64_view(major, &self->major_view, "rank_major") < 0) return -1;
    if (get_int64_view(minor, &self->minor_view, "rank_minor") < 0) {
        PyBuffer_Release(&self->major_view);
        return -1;
    }
    if (get_int64_view(counters, &self->counters_view, "counters") < 0) {
        PyBuffer_Release(&self->major_view);
        PyBuffer_Release(&self->minor_view);
        return -1;
    }
    self->open = 1;
    Py_ssize_t n = self->major_view.len / 8;
    if (self->minor_view.len / 8 != n || index < 0 || index >= self->counters_view.len / 8) {
        PyErr_Format(PyExc_ValueError,
                     "rank_major has %zd rows, rank_minor %zd; next_rank_index %zd of %zd counters",
                     n, self->minor_view.len / 8, index, self->counters_view.len / 8);
        core_release(self);
        return -1;
    }
    self->n = n;
    self->tmajor = self->major_view.buf;
    self->tminor = self->minor_view.buf;
    self->counters = self->counters_view.buf;
    self->next_rank_index = index;
    size_t rows_alloc = (size_t)(n > 0 ? n : 1);
    self->major = PyMem_Calloc(rows_alloc, sizeof(int64_t));
    self->minor = PyMem_Calloc(rows_alloc, sizeof(int64_t));
    self->key = PyMem_Calloc(rows_alloc, sizeof(PyObject *));
    self->evictable = PyMem_Calloc(rows_alloc, 1);
    self->mark = PyMem_Calloc(rows_alloc, 1);
    if (!self->major || !self->minor || !self->key || !self->evictable || !self->mark) {
        PyErr_NoMemory();
        core_release(self);
        return -1;
    }
    Py_INCREF(rows);
    Py_XSETREF(self->rows, rows);
    return 0;
}

/* --- methods --- */

PyDoc_STRVAR(insert_pending_doc,
"insert_pending(keys, rows, positions, request_rank)\n\n"
"Rank each newly inserted (key, row) of two equal-length lists, pending (not evictable): a key\n"
"with a position ranks (request rank, -position), the request rank from calling\n"
"``request_rank()`` once, on the first such key; a key without one gets the next rank.\n"
"``positions``: a dict key -> position or a callable(key) -> position or None.");

static PyObject *core_insert_pending_body(LRUCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "insert_pending(keys, rows, positions, request_rank)");
        return NULL;
    }
    PyObject *positions = args[2], *request_rank_fn = args[3];
    if (!core_ready(self)) return NULL;
    if (!PyList_Check(args[0]) || !PyList_Check(args[1])
        || PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1])) {
        PyErr_SetString(PyExc_TypeError, "insert_pending takes two lists of equal length");
        return NULL;
    }
    /* the lists as they are now: the callbacks could change them and free a key in hand */
    PyObject *keys = PyList_AsTuple(args[0]), *rows = PyList_AsTuple(args[1]), *result = NULL;
    Py_ssize_t count = keys == NULL ? 0 : PyTuple_GET_SIZE(keys);
    if (keys == NULL || rows == NULL) goto done;
    int have_request_rank = 0;
    int64_t request_rank = 0;
    int64_t *next_rank = counter(self);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        Py_ssize_t row = PyLong_AsSsize_t(PyTuple_GET_ITEM(rows, i));
        if (row == -1 && PyErr_Occurred()) goto done;
        if (check_key(key) < 0 || check_row(self, row) < 0) goto done;
        int64_t position;
        int found = position_of(positions, key, &position);
        if (found < 0) goto done;
        if (self->evictable[row]) {
            self->evictable[row] = 0;
            self->num_evictable--;
        }
        if (!found) {
            *next_rank += 1;
            set_rank(self, row, key, *next_rank, 0);
            continue;
        }
        if (!have_request_rank) {
            PyObject *value = PyObject_CallNoArgs(request_rank_fn);
            if (value == NULL) goto done;
            request_rank = PyLong_AsLongLong(value);
            Py_DECREF(value);
            if (request_rank == -1 && PyErr_Occurred()) goto done;
            have_request_rank = 1;
        }
        set_rank(self, row, key, request_rank, -position);
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(keys);
    Py_XDECREF(rows);
    return result;
}

GUARDED_FAST(core_insert_pending)

PyDoc_STRVAR(update_recency_doc,
"update_recency(keys, reverse)\n\n"
"Fresh ranks, in the order of the list ``keys`` (from its end if ``reverse``): the last\n"
"key ranked becomes the most recent. Keys that are not resident are skipped.");

static PyObject *core_update_recency_body(LRUCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "update_recency(keys: list, reverse: bool)");
        return NULL;
    }
    if (!core_ready(self)) return NULL;
    int reverse = PyObject_IsTrue(args[1]);
    if (reverse < 0) return NULL;
    PyObject *keys = PyList_AsTuple(args[0]);  /* a lookup could change the list */
    if (keys == NULL) return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(keys), updated = 0;
    int64_t *next_rank = counter(self);
    int failed = scratch_reserve(self, count) < 0;
    for (Py_ssize_t j = 0; !failed && j < count; j++) {
        PyObject *key = PyTuple_GET_ITEM(keys, reverse ? count - 1 - j : j);
        Py_ssize_t row = row_of(self, key);
        if (row == -2) failed = 1;
        if (row < 0 || self->key[row] == NULL) continue;
        *next_rank += 1;
        set_rank(self, row, self->key[row], *next_rank, 0);
        if (self->evictable[row]) self->scratch[updated++] = row;
    }
    Py_DECREF(keys);
    /* the rows re-ranked before a bad key too: their old heap entries are stale now */
    if (update_heap(self, updated) < 0 || failed) return NULL;
    Py_RETURN_NONE;
}

GUARDED_FAST(core_update_recency)

PyDoc_STRVAR(raise_to_request_doc,
"raise_to_request(keys, positions, request_rank)\n\n"
"Raise each resident key of the list with a known position to (request_rank, -position)\n"
"if that is newer than its rank (``positions`` as for insert_pending).");

static PyObject *core_raise_to_request_body(LRUCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "raise_to_request(keys: list, positions, request_rank: int)");
        return NULL;
    }
    if (!core_ready(self)) return NULL;
    PyObject *positions = args[1];
    int64_t request_rank = PyLong_AsLongLong(args[2]);
    if (request_rank == -1 && PyErr_Occurred()) return NULL;
    PyObject *keys = PyList_AsTuple(args[0]);  /* a callback or a lookup could change the list */
    if (keys == NULL) return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(keys), updated = 0;
    int failed = scratch_reserve(self, count) < 0;
    for (Py_ssize_t j = 0; !failed && j < count; j++) {
        PyObject *key = PyTuple_GET_ITEM(keys, j);
        Py_ssize_t row = row_of(self, key);
        if (row == -2) failed = 1;
        if (row < 0 || self->key[row] == NULL) continue;  /* about to be stored: insert ranks it */
        int64_t position;
        int found = position_of(positions, key, &position);
        if (found < 0) failed = 1;
        if (found <= 0) continue;
        int64_t minor = clamp_minor(-position);
        if (self->major[row] > request_rank
            || (self->major[row] == request_rank && self->minor[row] >= minor))
            continue;
        set_rank(self, row, self->key[row], request_rank, -position);
        if (self->evictable[row]) self->scratch[updated++] = row;
    }
    Py_DECREF(keys);
    /* the rows re-ranked before a bad key too: their old heap entries are stale now */
    if (update_heap(self, updated) < 0 || failed) return NULL;
    Py_RETURN_NONE;
}

GUARDED_FAST(core_raise_to_request)

PyDoc_STRVAR(evict_doc,
"evict(n, protected) -> list[(key, row)] | None\n\n"
"Take exactly ``n`` evictable keys not in the set ``protected``, oldest rank first, and\n"
"forget them; or take none and return None.");

static PyObject *core_evict_body(LRUCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "evict(n, protected)");
        return NULL;
    }
    if (!core_ready(self)) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[0]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    PyObject *protected = args[1];
    if (n <= 0) return PyList_New(0);
    if (n > self->num_evictable) Py_RETURN_NONE;
    Entry *selected = PyMem_Malloc((size_t)n * sizeof(Entry));
    Py_ssize_t nsel = 0, ndef = 0, def_cap = 0;
    Entry *deferred = NULL;
    PyObject *result = NULL;
    int failed = 0;
    if (selected == NULL) return PyErr_NoMemory();
    while (self->heap_len > 0 && nsel < n) {
        Entry e = heap_pop(self);
        if (!entry_current(self, &e) || self->mark[e.row]) {
            Py_DECREF(e.key);  /* stale (pinned or re-ranked since), or a twin */
            continue;
        }
        int is_protected = PySet_Contains(protected, e.key);
        if (is_protected != 0) {
            if (ndef == def_cap) {
                def_cap = def_cap ? 2 * def_cap : 16;
                Entry *grown = PyMem_Realloc(deferred, (size_t)def_cap * sizeof(Entry));
                if (grown == NULL) {
                    PyErr_NoMemory();
                    is_protected = -1;
                } else {
                    deferred = grown;
                }
            }
            if (is_protected < 0) {  /* put it back and stop */
                self->heap[self->heap_len] = e;
                sift_up(self->heap, self->heap_len++);
                failed = 1;
                break;
            }
            deferred[ndef++] = e;
            continue;
        }
        self->mark[e.row] = 1;
        selected[nsel++] = e;
    }
    /* the heap has room for everything popped from it */
    for (Py_ssize_t i = 0; i < ndef; i++) {
        self->heap[self->heap_len] = deferred[i];
        sift_up(self->heap, self->heap_len++);
    }
    if (failed || nsel < n) {
        for (Py_ssize_t i = 0; i < nsel; i++) {
            self->mark[selected[i].row] = 0;
            self->heap[self->heap_len] = selected[i];
            sift_up(self->heap, self->heap_len++);
        }
        if (!failed) result = Py_NewRef(Py_None);
        goto done;
    }
    result = PyList_New(n);
    if (result == NULL) {
        for (Py_ssize_t i = 0; i < nsel; i++) {
            self->mark[selected[i].row] = 0;
            self->heap[self->heap_len] = selected[i];
            sift_up(self->heap, self->heap_len++);
        }
        goto done;
    }
    for (Py_ssize_t i = 0; i < nsel; i++) {
        Py_ssize_t row = selected[i].row;
        PyObject *pair = Py_BuildValue("(On)", selected[i].key, row);
        if (pair == NULL) {  /* cannot happen short of memory; the victims are gone already */
            Py_CLEAR(result);
            for (; i < nsel; i++) {
                self->mark[selected[i].row] = 0;
                Py_DECREF(selected[i].key);
            }
            goto done;
        }
        PyList_SET_ITEM(result, i, pair);
        self->mark[row] = 0;
        self->evictable[row] = 0;
        self->num_evictable--;
        Py_CLEAR(self->key[row]);
        Py_DECREF(selected[i].key);
    }
    if (maybe_compact(self) < 0) Py_CLEAR(result);
done:
    PyMem_Free(selected);
    PyMem_Free(deferred);
    return result;
}

GUARDED_FAST(core_evict)

static int rows_of_keys(LRUCore *self, PyObject *keys, int missing_is_error) {
    /* fills scratch with the rows of the list ``keys``; returns their count, -1 on error */
    if (!PyList_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "keys must be a list");
        return -1;
    }
    PyObject *items = PyList_AsTuple(keys);  /* a lookup could change the list */
    if (items == NULL) return -1;
    Py_ssize_t count = PyTuple_GET_SIZE(items), found = 0;
    if (scratch_reserve(self, count) < 0) found = -1;
    for (Py_ssize_t i = 0; found >= 0 && i < count; i++) {
        PyObject *key = PyTuple_GET_ITEM(items, i);
        Py_ssize_t row = row_of(self, key);
        if (row == -2) {
            found = -1;
        } else if (row < 0 || self->key[row] == NULL) {
            if (missing_is_error) {
                PyErr_SetObject(PyExc_KeyError, key);
                found = -1;
            }
        } else {
            self->scratch[found++] = row;
        }
    }
    Py_DECREF(items);
    return (int)found;
}

PyDoc_STRVAR(mark_evictable_doc,
"mark_evictable(keys)\n\nThe resident keys of the list became evictable (KeyError for one\n"
"that is not resident; then none is marked).");

static PyObject *core_mark_evictable_body(LRUCore *self, PyObject *keys) {
    if (!core_ready(self)) return NULL;
    int count = rows_of_keys(self, keys, 1);
    if (count < 0) return NULL;
    for (int i = 0; i < count; i++) {
        Py_ssize_t row = self->scratch[i];
        if (!self->evictable[row]) {
            self->evictable[row] = 1;
            self->num_evictable++;
        }
        if (heap_push_row(self, row) < 0) return NULL;
    }
    if (maybe_compact(self) < 0) return NULL;
    Py_RETURN_NONE;
}

GUARDED_O(core_mark_evictable)

PyDoc_STRVAR(mark_non_evictable_doc,
"mark_non_evictable(keys)\n\nThe keys of the list are no longer evictable (pinned).");

static PyObject *core_mark_non_evictable_body(LRUCore *self, PyObject *keys) {
    if (!core_ready(self)) return NULL;
    int count = rows_of_keys(self, keys, 0);
    if (count < 0) return NULL;
    for (int i = 0; i < count; i++) {
        Py_ssize_t row = self->scratch[i];
        if (self->evictable[row]) {
            self->evictable[row] = 0;
            self->num_evictable--;
        }
    }
    Py_RETURN_NONE;
}

GUARDED_O(core_mark_non_evictable)

PyDoc_STRVAR(remove_doc, "remove(key)\n\nForget ``key`` (its store failed); no-op if unknown.");

static PyObject *core_remove_body(LRUCore *self, PyObject *key) {
    if (!core_ready(self)) return NULL;
    Py_ssize_t row = row_of(self, key);
    if (row == -2) return NULL;
    if (row >= 0 && self->key[row] != NULL) {
        if (self->evictable[row]) {
            self->evictable[row] = 0;
            self->num_evictable--;
        }
        Py_CLEAR(self->key[row]);
    }
    Py_RETURN_NONE;
}

GUARDED_O(core_remove)

PyDoc_STRVAR(rebuild_doc,
"rebuild(refcnt)\n\nForget everything, then adopt every key of the rows dict at the\n"
"table's rank; evictable where the int32 buffer ``refcnt`` holds 0 (warm restart).");

static PyObject *core_rebuild_body(LRUCore *self, PyObject *refcnt) {
    if (!core_ready(self)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(refcnt, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (view.itemsize != 4 || view.len / 4 != self->n) {
        PyErr_Format(PyExc_ValueError, "refcnt must be int32 over %zd rows", self->n);
        PyBuffer_Release(&view);
        return NULL;
    }
    const int32_t *counts = view.buf;
    core_forget(self);
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    int failed = 0;
    while (!failed && PyDict_Next(self->rows, &pos, &key, &value)) {
        Py_ssize_t row = PyLong_AsSsize_t(value);
        if ((row == -1 && PyErr_Occurred()) || check_row(self, row) < 0 || check_key(key) < 0) {
            failed = 1;
            break;
        }
        set_rank(self, row, key, self->tmajor[row], self->tminor[row]);
        if (counts[row] == 0 && !self->evictable[row]) {  /* a row two keys claim counts once */
            self->evictable[row] = 1;
            self->num_evictable++;
        }
    }
    PyBuffer_Release(&view);
    /* also after a bad entry: the rows adopted before it must be findable */
    if (heap_rebuild(self) < 0 || failed) return NULL;
    Py_RETURN_NONE;
}

GUARDED_O(core_rebuild)

PyDoc_STRVAR(clear_doc, "clear()\n\nForget every key (reset); the caller resets the rank counter.");

static PyObject *core_clear_body(LRUCore *self, PyObject *unused) {
    if (!core_ready(self)) return NULL;
    core_forget(self);
    Py_RETURN_NONE;
}

GUARDED_O(core_clear)

PyDoc_STRVAR(close_doc,
"close()\n\nForget every key and release the table's buffers (idempotent); later calls\n"
"raise ValueError.");

static PyObject *core_close_body(LRUCore *self, PyObject *unused) {
    if (self->key) core_forget(self);
    core_release(self);
    Py_RETURN_NONE;
}

GUARDED_O(core_close)

PyDoc_STRVAR(rank_doc, "rank(row) -> (major, minor) | None\n\nThe row's rank (minor clamped), or None.");

static PyObject *core_rank(LRUCore *self, PyObject *arg) {
    Py_ssize_t row = PyLong_AsSsize_t(arg);
    if ((row == -1 && PyErr_Occurred()) || check_row(self, row) < 0) return NULL;
    if (self->key == NULL || self->key[row] == NULL) Py_RETURN_NONE;
    return Py_BuildValue("(LL)", (long long)self->major[row], (long long)self->minor[row]);
}

static PyObject *core_get_num_evictable(LRUCore *self, void *unused) {
    return PyLong_FromSsize_t(self->num_evictable);
}

static PyObject *core_get_heap_size(LRUCore *self, void *unused) {
    return PyLong_FromSsize_t(self->heap_len);
}

static PyGetSetDef core_getset[] = {
    {"num_evictable", (getter)core_get_num_evictable, NULL, "evictable rows", NULL},
    {"heap_size", (getter)core_get_heap_size, NULL, "heap entries, stale ones included", NULL},
    {NULL},
};

static PyMethodDef core_methods[] = {
    {"insert_pending", (PyCFunction)(void (*)(void))core_insert_pending, METH_FASTCALL, insert_pending_doc},
    {"update_recency", (PyCFunction)(void (*)(void))core_update_recency, METH_FASTCALL, update_recency_doc},
    {"raise_to_request", (PyCFunction)(void (*)(void))core_raise_to_request, METH_FASTCALL,
     raise_to_request_doc},
    {"evict", (PyCFunction)(void (*)(void))core_evict, METH_FASTCALL, evict_doc},
    {"mark_evictable", (PyCFunction)core_mark_evictable, METH_O, mark_evictable_doc},
    {"mark_non_evictable", (PyCFunction)core_mark_non_evictable, METH_O, mark_non_evictable_doc},
    {"remove", (PyCFunction)core_remove, METH_O, remove_doc},
    {"rebuild", (PyCFunction)core_rebuild, METH_O, rebuild_doc},
    {"clear", (PyCFunction)core_clear, METH_NOARGS, clear_doc},
    {"close", (PyCFunction)core_close, METH_NOARGS, close_doc},
    {"rank", (PyCFunction)core_rank, METH_O, rank_doc},
    {NULL},
};

static PyTypeObject LRUCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmtier.scheduler.policies._lru.LRUCore",
    .tp_basicsize = sizeof(LRUCore),
    .tp_dealloc = (destructor)core_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "LRUCore(rows, rank_major, rank_minor, counters, next_rank_index)\n\n"
              "Ranks, evictable rows and the lazy min-heap of the LRU policy (see _lru.c).",
    .tp_methods = core_methods,
    .tp_getset = core_getset,
    .tp_init = (initproc)core_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef lru_module = {
    PyModuleDef_HEAD_INIT, "shmtier.scheduler.policies._lru",
    "The LRU policy's ranks and heap in C (see _lru.c's header).", -1, NULL,
};

PyMODINIT_FUNC PyInit__lru(void) {
    if (PyType_Ready(&LRUCoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&lru_module);
    if (m == NULL) return NULL;
    Py_INCREF(&LRUCoreType);
    if (PyModule_AddObject(m, "LRUCore", (PyObject *)&LRUCoreType) < 0) {
        Py_DECREF(&LRUCoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
