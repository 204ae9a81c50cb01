/* shmtier.scheduler._rows: the CPU primary tier's per-key row bookkeeping, in C.
 *
 * Who calls: shmtier.scheduler.primary.CPUOffloadingManager only, in the scheduler
 * process, under the manager's lock. Nothing here blocks, does I/O or releases the GIL.
 *
 * Why C (measured with bench/tiering_steps.py on the 2-vCPU VM): every engine step
 * classifies, claims, pins, unpins and releases a few dozen keys, after the forward pass
 * has left the caches cold; in Python each key was a handful of dict, memoryview and list
 * operations, and the slowest steps (a new request's long prefix) spent a sixth of their
 * time in those loops. Re-measured against the pure-Python reference (issue 30;
 * bench/c_vs_reference.py, 2026-12-05, the shared 2-CPU x86_64 VM, Python 3.11, 10k
 * chunks, LRU, 5 repeats, 2 runs): the CPU tier's manager time per step with this file's
 * RowIndex and first_accesses, median [runs], mean 188-277 us, p50 137 us; with
 * rows_reference.py's, mean 410-599 us (2.2x), p50 301-308 us (2.2x). It pays; kept.
 *
 * RowIndex keeps nothing of its own: it works on the primary's ``key -> row`` dict (shared,
 * not copied) and on the chunk table's arrays in the segment (keys, key_len, refcnt,
 * tiers), whose meaning is chunk_table.py's module docstring. claim, pin and unpin check
 * all of their input first, so a refused call changes nothing; release and mark_stored
 * stop at the bad item. close() releases the table's buffers (the primary's shutdown,
 * before the segment is unmapped). The rows dict's lookups can run Python code (a key's
 * __hash__ or __eq__): each method works on a snapshot of its argument lists and refuses a
 * call into the index from inside one of its calls (``busy``).
 *
 * shmtier/scheduler/rows_reference.py is this file in Python, the reference it is tested
 * against (tests/test_c_reference.py: the same operations on both, results, errors, table
 * bytes and object reference counts compared); scripts/test-sanitizers runs those tests
 * on a build with AddressSanitizer and UndefinedBehaviorSanitizer. A change here changes
 * the reference alike.
 *
 * first_accesses() is the record of a request's first accesses (primary.py's
 * _RequestCacheAccess): the keys not seen before, each added to the seen set and to the
 * list of its KV-cache group.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    PyObject *rows;  /* dict key -> row */
    Py_buffer keys_view, key_len_view, refcnt_view, tiers_view;
    int open;
    uint8_t *keys, *key_len;
    int32_t *refcnt;
    uint64_t *tiers;
    Py_ssize_t n, key_width;
    int32_t *times;  /* scratch: occurrences per row within one call (all zero between calls) */
    int busy;        /* inside a method (see index_enter) */
} RowIndex;

static int index_ready(RowIndex *self) {
    if (!self->open) {
        PyErr_SetString(PyExc_ValueError, "row index is closed");
        return 0;
    }
    return 1;
}

/* A row value of the rows dict: the row, or -2 with an exception set. */
static Py_ssize_t row_value(RowIndex *self, PyObject *value) {
    Py_ssize_t row = PyLong_AsSsize_t(value);
    if (row == -1 && PyErr_Occurred()) return -2;
    if (row < 0 || row >= self->n) {
        PyErr_Format(PyExc_ValueError, "row %zd of a key is outside the table's %zd rows", row,
                     self->n);
        return -2;
    }
    return row;
}

/* A method holds ``busy`` while it runs: the rows dict's lookups can run Python code (a
 * key's __hash__ or __eq__), and a call into the index from there is refused, since the
 * outer call keeps rows, counts and buffer pointers across that code. */
static int index_enter(RowIndex *self) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "row index called from inside one of its own calls (a key's __hash__ "
                        "or __eq__)");
        return 0;
    }
    self->busy = 1;
    return 1;
}

#define GUARDED_O(name)                                                                   \
    static PyObject *name(RowIndex *self, PyObject *arg) {                                \
        if (!index_enter(self)) return NULL;                                              \
        PyObject *result = name##_body(self, arg);                                        \
        self->busy = 0;                                                                   \
        return result;                                                                    \
    }
#define GUARDED_FAST(name)                                                                \
    static PyObject *name(RowIndex *self, PyObject *const *args, Py_ssize_t nargs) {      \
        if (!index_enter(self)) return NULL;                                              \
        PyObject *result = name##_body(self, args, nargs);                                \
        self->busy = 0;                                                                   \
        return result;                                                                    \
    }

/* The keys a method iterates: an exact list's items as a new tuple (Python code run by a
 * lookup could change the caller's list and free the key in hand), else what
 * PySequence_Fast gives (a tuple as it is, another iterable as a list only this call holds). */
static PyObject *keys_snapshot(PyObject *keys) {
    return PyList_CheckExact(keys) ? PyList_AsTuple(keys)
                                   : PySequence_Fast(keys, "keys must be iterable");
}

/* The row of ``key``: -1 if absent, -2 with an exception set. */
static Py_ssize_t row_of(RowIndex *self, PyObject *key) {
    PyObject *value = PyDict_GetItemWithError(self->rows, key);
    if (value == NULL) return PyErr_Occurred() ? -2 : -1;
    return row_value(self, value);
}

/* KeyError(message with the key's hex). */
static void key_error(const char *before, PyObject *key, const char *after) {
    PyObject *hex = PyObject_CallMethod(key, "hex", NULL);
    if (hex == NULL) return;
    PyObject *message = PyUnicode_FromFormat("%s%S%s", before, hex, after);
    Py_DECREF(hex);
    if (message == NULL) return;
    PyErr_SetObject(PyExc_KeyError, message);
    Py_DECREF(message);
}

/* --- type slots --- */

static void index_release(RowIndex *self) {
    if (self->open) {
        PyBuffer_Release(&self->keys_view);
        PyBuffer_Release(&self->key_len_view);
        PyBuffer_Release(&self->refcnt_view);
        PyBuffer_Release(&self->tiers_view);
        self->open = 0;
    }
    self->keys = self->key_len = NULL;
    self->refcnt = NULL;
    self->tiers = NULL;
}

static void index_dealloc(RowIndex *self) {
    index_release(self);
    PyMem_Free(self->times);
    Py_XDECREF(self->rows);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int get_view(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s must be a writable buffer of %zd-byte items, not %zd",
                     what, itemsize, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int index_init(RowIndex *self, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"rows", "keys", "key_len", "refcnt", "tiers", "key_width", NULL};
    PyObject *rows, *keys, *key_len, *refcnt, *tiers;
    Py_ssize_t key_width;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OOOOn", kw, &PyDict_Type, &rows, &keys,
                                     &key_len, &refcnt, &tiers, &key_width))
        return -1;
    if (self->open || self->rows != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "RowIndex is already initialised");
        return -1;
    }
    if (get_view(keys, &self->keys_view, 1, "keys") < 0) return -1;
    if (get_view(key_len, &self->key_len_view, 1, "key_len") < 0) {
        PyBuffer_Release(&self->keys_view);
        return -1;
    }
    if (get_view(refcnt, &self->refcnt_view, 4, "refcnt") < 0) {
        PyBuffer_Release(&self->keys_view);
        PyBuffer_Release(&self->key_len_view);
        return -1;
    }
    if (get_view(tiers, &self->tiers_view, 8, "tiers") < 0) {
        PyBuffer_Release(&self->keys_view);
        PyBuffer_Release(&self->key_len_view);
        PyBuffer_Release(&self->refcnt_view);
        return -1;
    }
    self->open = 1;
    Py_ssize_t n = self->key_len_view.len;
    if (key_width < 1 || key_width > 255 || self->keys_view.len != n * key_width
        || self->refcnt_view.len != 4 * n || self->tiers_view.len != 8 * n) {
        PyErr_Format(PyExc_ValueError,
                     "table arrays disagree: %zd rows of key_len, %zd key bytes for key width "
                     "%zd, %zd refcnt bytes, %zd tiers bytes",
                     n, self->keys_view.len, key_width, self->refcnt_view.len, self->tiers_view.len);
        index_release(self);
        return -1;
    }
    self->times = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(int32_t));
    if (self->times == NULL) {
        PyErr_NoMemory();
        index_release(self);
        return -1;
    }
    self->n = n;
    self->key_width = key_width;
    self->keys = self->keys_view.buf;
    self->key_len = self->key_len_view.buf;
    self->refcnt = self->refcnt_view.buf;
    self->tiers = self->tiers_view.buf;
    Py_INCREF(rows);
    self->rows = rows;
    return 0;
}

/* --- methods --- */

PyDoc_STRVAR(classify_doc,
"classify(keys) -> (absent, ready)\n\n"
"The keys that are not resident, and those resident and readable (ref count >= 0), in order;\n"
"keys whose store is pending are in neither.");

static PyObject *index_classify_body(RowIndex *self, PyObject *keys) {
    if (!index_ready(self)) return NULL;
    PyObject *seq = keys_snapshot(keys);
    if (seq == NULL) return NULL;
    PyObject *absent = PyList_New(0), *ready = PyList_New(0), *result = NULL;
    if (absent == NULL || ready == NULL) goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t row = row_of(self, key);
        if (row == -2) goto done;
        PyObject *to = row < 0 ? absent : self->refcnt[row] >= 0 ? ready : NULL;
        if (to != NULL && PyList_Append(to, key) < 0) goto done;
    }
    result = PyTuple_Pack(2, absent, ready);
done:
    Py_XDECREF(absent);
    Py_XDECREF(ready);
    Py_DECREF(seq);
    return result;
}

GUARDED_O(index_classify)

PyDoc_STRVAR(ready_keys_doc,
"ready_keys(keys) -> list\n\nThe resident, readable keys (ref count >= 0), in order.");

static PyObject *index_ready_keys_body(RowIndex *self, PyObject *keys) {
    if (!index_ready(self)) return NULL;
    PyObject *seq = keys_snapshot(keys);
    if (seq == NULL) return NULL;
    PyObject *ready = PyList_New(0);
    for (Py_ssize_t i = 0; ready != NULL && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t row = row_of(self, key);
        if (row == -2 || (row >= 0 && self->refcnt[row] >= 0 && PyList_Append(ready, key) < 0))
            Py_CLEAR(ready);
    }
    Py_DECREF(seq);
    return ready;
}

GUARDED_O(index_ready_keys)

PyDoc_STRVAR(claim_doc,
"claim(keys, rows)\n\n"
"Give each key of the list its row of the list (neither resident nor held): write the key\n"
"into the table, its ref count -1 (store pending), and map it in the rows dict. A key longer\n"
"than the key width is a ValueError, before anything is written.");

static PyObject *index_claim_body(RowIndex *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[0]) || !PyList_Check(args[1])
        || PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1])) {
        PyErr_SetString(PyExc_TypeError, "claim(keys, rows) takes two lists of equal length");
        return NULL;
    }
    if (!index_ready(self)) return NULL;
    /* the lists as they are now: PyDict_SetItem can run a dict key's __eq__ */
    PyObject *keys = PyList_AsTuple(args[0]), *rows = PyList_AsTuple(args[1]), *result = NULL;
    Py_ssize_t count = keys == NULL ? 0 : PyTuple_GET_SIZE(keys);
    if (keys == NULL || rows == NULL) goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        if (!PyBytes_Check(key)) {
            PyErr_Format(PyExc_TypeError, "offload keys are bytes, not %.100s", Py_TYPE(key)->tp_name);
            goto done;
        }
        if (PyBytes_GET_SIZE(key) > self->key_width) {
            PyErr_Format(PyExc_ValueError, "offload key of %zd bytes does not fit the key width of %zd",
                         PyBytes_GET_SIZE(key), self->key_width);
            goto done;
        }
        Py_ssize_t row = PyLong_AsSsize_t(PyTuple_GET_ITEM(rows, i));
        if (row == -1 && PyErr_Occurred()) goto done;
        if (row < 0 || row >= self->n) {
            PyErr_Format(PyExc_IndexError, "row %zd is outside the table's %zd rows", row, self->n);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i), *row_obj = PyTuple_GET_ITEM(rows, i);
        Py_ssize_t row = PyLong_AsSsize_t(row_obj), len = PyBytes_GET_SIZE(key);
        memcpy(self->keys + row * self->key_width, PyBytes_AS_STRING(key), (size_t)len);
        self->key_len[row] = (uint8_t)len;
        self->refcnt[row] = -1;
        if (PyDict_SetItem(self->rows, key, row_obj) < 0) goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(keys);
    Py_XDECREF(rows);
    return result;
}

GUARDED_FAST(index_claim)

PyDoc_STRVAR(release_doc,
"release(victims, free_list)\n\n"
"Forget each (key, row) of the list: unmap the key, clear the row's key and tier bits, and\n"
"append the row to the list ``free_list``.");

static PyObject *index_release_rows_body(RowIndex *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "release(victims: list, free_list: list)");
        return NULL;
    }
    if (!index_ready(self)) return NULL;
    PyObject *free_list = args[1], *result = NULL;
    PyObject *victims = PyList_AsTuple(args[0]);  /* PyDict_DelItem can run Python code */
    if (victims == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(victims); i++) {
        PyObject *pair = PyTuple_GET_ITEM(victims, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "victims are (key, row) pairs");
            goto done;
        }
        PyObject *key = PyTuple_GET_ITEM(pair, 0), *row_obj = PyTuple_GET_ITEM(pair, 1);
        Py_ssize_t row = PyLong_AsSsize_t(row_obj);
        if (row == -1 && PyErr_Occurred()) goto done;
        if (row < 0 || row >= self->n) {
            PyErr_Format(PyExc_IndexError, "row %zd is outside the table's %zd rows", row, self->n);
            goto done;
        }
        if (PyDict_DelItem(self->rows, key) < 0) goto done;
        self->key_len[row] = 0;
        self->tiers[row] = 0;
        if (PyList_Append(free_list, row_obj) < 0) goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(victims);
    return result;
}

GUARDED_FAST(index_release_rows)

PyDoc_STRVAR(pin_doc,
"pin(keys) -> (rows, newly_pinned)\n\n"
"Add a reader to every key (all must be resident and readable; else KeyError naming the\n"
"first that is not, and nothing changes). Returns the rows in key order and the keys whose\n"
"ref count left 0 (no longer evictable).");

static PyObject *index_pin_body(RowIndex *self, PyObject *keys) {
    if (!index_ready(self)) return NULL;
    PyObject *seq = keys_snapshot(keys);
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject *ids = PyList_New(count), *pinned = NULL, *result = NULL;
    if (ids == NULL) goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *value = PyDict_GetItemWithError(self->rows, key);
        if (value == NULL) {
            if (!PyErr_Occurred())
                key_error("cannot load key ", key, ": it is not in the CPU tier");
            goto done;
        }
        Py_ssize_t row = row_value(self, value);
        if (row < 0) goto done;
        if (self->refcnt[row] < 0) {
            key_error("cannot load key ", key, ": its store has not completed");
            goto done;
        }
        Py_INCREF(value);
        PyList_SET_ITEM(ids, i, value);
    }
    pinned = PyList_New(0);
    if (pinned == NULL) goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t row = PyLong_AsSsize_t(PyList_GET_ITEM(ids, i));
        if (self->refcnt[row]++ == 0 && PyList_Append(pinned, PySequence_Fast_GET_ITEM(seq, i)) < 0)
            goto done;  /* out of memory, pins taken: cannot roll back cleanly */
    }
    result = PyTuple_Pack(2, ids, pinned);
done:
    Py_XDECREF(ids);
    Py_XDECREF(pinned);
    Py_DECREF(seq);
    return result;
}

GUARDED_O(index_pin)

PyDoc_STRVAR(unpin_doc,
"unpin(keys) -> newly_unpinned\n\n"
"Drop a reader from every key (each must hold a pin per time it is listed; else KeyError\n"
"naming the first that does not, and nothing changes). Returns the keys whose ref count\n"
"went to 0 (evictable again).");

static PyObject *index_unpin_body(RowIndex *self, PyObject *keys) {
    if (!index_ready(self)) return NULL;
    PyObject *seq = keys_snapshot(keys);
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), counted = 0;
    PyObject *unpinned = NULL;
    Py_ssize_t *rows = PyMem_Malloc((size_t)(count > 0 ? count : 1) * sizeof(Py_ssize_t));
    if (rows == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t row = row_of(self, key);
        if (row == -2) goto done;
        if (row < 0 || self->refcnt[row] <= 0) {
            key_error("complete_load for key ", key, " that is not pinned");
            goto done;
        }
        rows[i] = row;
    }
    for (; counted < count; counted++) self->times[rows[counted]]++;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t row = rows[i];
        if (self->times[row] > self->refcnt[row]) {  /* listed more often than it is pinned */
            PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
            PyObject *hex = PyObject_CallMethod(key, "hex", NULL);
            if (hex != NULL) {
                PyObject *message = PyUnicode_FromFormat(
                    "complete_load lists key %S %d times; it holds %d pins", hex,
                    (int)self->times[row], (int)self->refcnt[row]);
                if (message != NULL) {
                    PyErr_SetObject(PyExc_KeyError, message);
                    Py_DECREF(message);
                }
                Py_DECREF(hex);
            }
            goto done;
        }
    }
    unpinned = PyList_New(0);
    for (Py_ssize_t i = 0; unpinned != NULL && i < count; i++) {
        if (--self->refcnt[rows[i]] == 0
            && PyList_Append(unpinned, PySequence_Fast_GET_ITEM(seq, i)) < 0)
            Py_CLEAR(unpinned);  /* out of memory, pins dropped: cannot roll back cleanly */
    }
done:
    if (rows != NULL)
        for (Py_ssize_t i = 0; i < counted; i++) self->times[rows[i]] = 0;
    PyMem_Free(rows);
    Py_DECREF(seq);
    return unpinned;
}

GUARDED_O(index_unpin)

PyDoc_STRVAR(mark_stored_doc,
"mark_stored(keys) -> done\n\n"
"The keys whose store was pending (ref count -1) become ready and evictable (0); returns\n"
"them in order. Other keys (absent, ready) are ignored.");

static PyObject *index_mark_stored_body(RowIndex *self, PyObject *keys) {
    if (!index_ready(self)) return NULL;
    PyObject *seq = keys_snapshot(keys);
    if (seq == NULL) return NULL;
    PyObject *done = PyList_New(0);
    for (Py_ssize_t i = 0; done != NULL && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t row = row_of(self, key);
        if (row == -2) {
            Py_CLEAR(done);
        } else if (row >= 0 && self->refcnt[row] < 0) {
            self->refcnt[row] = 0;
            if (PyList_Append(done, key) < 0) Py_CLEAR(done);
        }
    }
    Py_DECREF(seq);
    return done;
}

GUARDED_O(index_mark_stored)

PyDoc_STRVAR(close_doc, "close()\n\nRelease the table's buffers (idempotent); later calls raise ValueError.");

static PyObject *index_close(RowIndex *self, PyObject *unused) {
    if (self->busy) {  /* the running call still uses the buffers */
        PyErr_SetString(PyExc_RuntimeError,
                        "row index closed from inside one of its own calls (a key's __hash__ "
                        "or __eq__)");
        return NULL;
    }
    index_release(self);
    Py_RETURN_NONE;
}

static PyMethodDef index_methods[] = {
    {"classify", (PyCFunction)index_classify, METH_O, classify_doc},
    {"ready_keys", (PyCFunction)index_ready_keys, METH_O, ready_keys_doc},
    {"claim", (PyCFunction)(void (*)(void))index_claim, METH_FASTCALL, claim_doc},
    {"release", (PyCFunction)(void (*)(void))index_release_rows, METH_FASTCALL, release_doc},
    {"pin", (PyCFunction)index_pin, METH_O, pin_doc},
    {"unpin", (PyCFunction)index_unpin, METH_O, unpin_doc},
    {"mark_stored", (PyCFunction)index_mark_stored, METH_O, mark_stored_doc},
    {"close", (PyCFunction)index_close, METH_NOARGS, close_doc},
    {NULL},
};

static PyTypeObject RowIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmtier.scheduler._rows.RowIndex",
    .tp_basicsize = sizeof(RowIndex),
    .tp_dealloc = (destructor)index_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "RowIndex(rows, keys, key_len, refcnt, tiers, key_width)\n\n"
              "The CPU tier's per-key row operations over its rows dict and chunk table "
              "(see _rows.c).",
    .tp_methods = index_methods,
    .tp_init = (initproc)index_init,
    .tp_new = PyType_GenericNew,
};

/* --- request access record --- */

PyDoc_STRVAR(first_accesses_doc,
"first_accesses(keys, seen, groups, suffix_len) -> new_keys\n\n"
"The keys of the iterable not in the set ``seen``, once each, in order; each is added to\n"
"``seen`` and appended to ``groups[g]`` (a dict of lists), g the KV-cache group index:\n"
"the key's last ``suffix_len`` (1..8) bytes as a big-endian unsigned int (contract's\n"
"get_offload_group_idx). Small group indexes are CPython's cached ints: no allocation.");

static PyObject *first_accesses(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PySet_Check(args[1]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "first_accesses(keys, seen: set, groups: dict, suffix_len: int)");
        return NULL;
    }
    PyObject *seen = args[1], *groups = args[2];
    Py_ssize_t suffix_len = PyLong_AsSsize_t(args[3]);
    if (suffix_len == -1 && PyErr_Occurred()) return NULL;
    if (suffix_len < 1 || suffix_len > 8) {
        PyErr_Format(PyExc_ValueError, "suffix_len must be 1..8, not %zd", suffix_len);
        return NULL;
    }
    PyObject *it = PyObject_GetIter(args[0]);
    if (it == NULL) return NULL;
    PyObject *new_keys = PyList_New(0), *key;
    while (new_keys != NULL && (key = PyIter_Next(it)) != NULL) {
        int known = PySet_Contains(seen, key);
        if (known == 0) {
            if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) < suffix_len) {
                PyErr_Format(PyExc_TypeError, "offload keys are bytes of at least %zd, not %R",
                             suffix_len, key);
                known = -1;
            }
        }
        if (known == 0) {
            const unsigned char *tail = (const unsigned char *)PyBytes_AS_STRING(key)
                                        + PyBytes_GET_SIZE(key) - suffix_len;
            unsigned long long index = 0;
            for (Py_ssize_t b = 0; b < suffix_len; b++) index = (index << 8) | tail[b];
            PyObject *group_idx = PyLong_FromUnsignedLongLong(index);
            /* held, not borrowed: PySet_Add can run Python code that changes ``groups`` */
            PyObject *group = group_idx == NULL ? NULL
                              : Py_XNewRef(PyDict_GetItemWithError(groups, group_idx));
            if (group_idx != NULL && group == NULL && !PyErr_Occurred()) {
                group = PyList_New(0);
                if (group != NULL && PyDict_SetItem(groups, group_idx, group) < 0) Py_CLEAR(group);
            }
            Py_XDECREF(group_idx);
            if (group == NULL || PySet_Add(seen, key) < 0 || PyList_Append(group, key) < 0
                || PyList_Append(new_keys, key) < 0)
                known = -1;
            Py_XDECREF(group);
        }
        Py_DECREF(key);
        if (known < 0) Py_CLEAR(new_keys);
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) Py_CLEAR(new_keys);
    return new_keys;
}

static PyMethodDef module_methods[] = {
    {"first_accesses", (PyCFunction)(void (*)(void))first_accesses, METH_FASTCALL, first_accesses_doc},
    {NULL},
};

static struct PyModuleDef rows_module = {
    PyModuleDef_HEAD_INIT, "shmtier.scheduler._rows",
    "The CPU primary tier's per-key row bookkeeping in C (see _rows.c's header).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__rows(void) {
    if (PyType_Ready(&RowIndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&rows_module);
    if (m == NULL) return NULL;
    Py_INCREF(&RowIndexType);
    if (PyModule_AddObject(m, "RowIndex", (PyObject *)&RowIndexType) < 0) {
        Py_DECREF(&RowIndexType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
