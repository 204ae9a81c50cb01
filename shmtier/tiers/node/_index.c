/* shmtier.tiers.node._index: the node pool's lock-free lookup (a seqlock bracket around a
 * probe of the hash index), in C because the scheduler thread runs it for every key its CPU
 * tier misses (bench/README.md, "Node pool: how far a protocol change could take the step
 * p99": a CPU-tier miss answered from the pool should cost about what a CPU-tier hit does).
 *
 * Who calls: shmtier/tiers/node/pool.py (NodePool.lookup, lookup_many), in the scheduler
 * process, without the pool's lock. Keeps the GIL (a few hundred nanoseconds of work:
 * giving the GIL away would hand it to any other thread of the process and wait to get it
 * back) and never blocks; while a mutation runs it tries again for a bounded time
 * (``budget_ns``) and yields its CPU once (sched_yield), as the Python reference does with
 * a count of tries.
 *
 * The reference is shmtier/tiers/node/index.py (``_finder``) with the seqlock loop of
 * NodePool.lookup; tests/test_node_index_c.py drives both over the same mappings, torn
 * states included. The layout constants below are checked against layout.py at import
 * (pool.py), so a change of the layout cannot leave this file behind.
 *
 * Memory order: the sequence word is read with acquire loads and the probe's reads are
 * relaxed atomic loads (another process may write them meanwhile: what they return is a
 * guess until the sequence word is found unchanged); the key bytes are compared with
 * memcmp over a record whose bounds were checked (a torn compare only makes a wrong guess,
 * which the unchanged-sequence check then rejects or, unchanged, cannot have happened).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* layout.py: a row record is ROW_BYTES bytes; u32 words R_STATE, R_KLEN, R_KHASH; the key
 * at byte R_KEY; ROW_READY the state of a row the index serves; the sequence word is u64
 * word H_SEQ of the header page */
#define ROW_BYTES 160
#define R_STATE 0
#define R_KLEN 1
#define R_KHASH 2
#define R_KEY 48
#define ROW_READY 2
#define H_SEQ 128
#define MAX_KEY (ROW_BYTES - R_KEY)

typedef struct {
    Py_buffer header, slots, records;
    Py_ssize_t rows;
    uint32_t mask;
} Views;

static int get_views(PyObject *const *args, Views *v) {
    PyObject *objs[3] = {args[0], args[1], args[2]};
    Py_buffer *bufs[3] = {&v->header, &v->slots, &v->records};
    for (int i = 0; i < 3; i++) {
        if (PyObject_GetBuffer(objs[i], bufs[i], PyBUF_SIMPLE) < 0) {
            for (int j = 0; j < i; j++) PyBuffer_Release(bufs[j]);
            return -1;
        }
    }
    const char *problem = NULL;
    if (v->header.len < (H_SEQ + 1) * 8 || ((uintptr_t)v->header.buf & 7))
        problem = "header: expected an 8-byte aligned buffer of the header page";
    else if ((v->slots.len & 3) || ((uintptr_t)v->slots.buf & 3) || v->slots.len < 4)
        problem = "slots: expected a 4-byte aligned buffer of int32 slots";
    else if (((uintptr_t)v->records.buf & 3))
        problem = "records: expected a 4-byte aligned buffer of row records";
    if (problem) {
        PyErr_SetString(PyExc_ValueError, problem);
        for (int j = 0; j < 3; j++) PyBuffer_Release(bufs[j]);
        return -1;
    }
    return 0;
}

static void release_views(Views *v) {
    PyBuffer_Release(&v->header);
    PyBuffer_Release(&v->slots);
    PyBuffer_Release(&v->records);
}

/* The row whose READY record holds key (len n, hash h), or -1; at most mask + 1 probes,
 * rows out of range skipped (a torn read). */
static long find(const Views *v, const uint8_t *key, uint32_t n, uint32_t h) {
    const int32_t *slots = (const int32_t *)v->slots.buf;
    const uint8_t *records = (const uint8_t *)v->records.buf;
    Py_ssize_t rows = v->rows;
    uint32_t mask = v->mask, slot = h & mask, probes = mask;
    int32_t row = __atomic_load_n(&slots[slot], __ATOMIC_RELAXED);
    while (row >= 0) {
        if (row < rows) {
            const uint32_t *rec = (const uint32_t *)(records + (size_t)row * ROW_BYTES);
            if (__atomic_load_n(&rec[R_KHASH], __ATOMIC_RELAXED) == h
                    && __atomic_load_n(&rec[R_KLEN], __ATOMIC_RELAXED) == n
                    && __atomic_load_n(&rec[R_STATE], __ATOMIC_RELAXED) == ROW_READY
                    && memcmp(records + (size_t)row * ROW_BYTES + R_KEY, key, n) == 0)
                return row;
        }
        if (!probes) return -1;
        probes--;
        slot = (slot + 1) & mask;
        row = __atomic_load_n(&slots[slot], __ATOMIC_RELAXED);
    }
    return -1;
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static inline void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* 1: READY now; 0: not found under an unchanged sequence word, or no quiet read within
 * ``budget_ns`` (a false MISS while others mutate, as the reference answers after its
 * tries). The budget is time, not tries: a try here takes tens of nanoseconds, so a count
 * that suits the Python reference would give up while a writer is still inside its few
 * stores. Past half the budget it yields its CPU once (a writer preempted on this CPU gets
 * to finish). */
static int lookup_one(const Views *v, const uint8_t *key, uint32_t n, uint32_t h,
                      long budget_ns) {
    const uint64_t *seqp = (const uint64_t *)v->header.buf + H_SEQ;
    uint64_t started = 0;
    int yielded = 0;
    for (;;) {
        uint64_t seq = __atomic_load_n(seqp, __ATOMIC_ACQUIRE);
        if (!(seq & 1)) {
            long row = find(v, key, n, h);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (__atomic_load_n(seqp, __ATOMIC_RELAXED) == seq) return row >= 0;
        }
        /* a mutation ran or runs: the clock starts at the first such try */
        uint64_t now = now_ns();
        if (!started) {
            started = now;
        } else if (now - started >= (uint64_t)budget_ns) {
            return 0;
        } else if (!yielded && now - started >= (uint64_t)budget_ns / 2) {
            yielded = 1;
            sched_yield();
            continue;
        }
        spin_pause();
    }
}

/* Shared argument checks: (header, slots, records, rows, key(s), ...). */
static int parse_common(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                        const char *usage, Views *v, long *budget_ns) {
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    Py_ssize_t rows = PyLong_AsSsize_t(args[3]);
    if (rows == -1 && PyErr_Occurred()) return -1;
    *budget_ns = PyLong_AsLong(args[want - 1]);
    if (*budget_ns == -1 && PyErr_Occurred()) return -1;
    if (rows < 0 || *budget_ns < 0) {
        PyErr_SetString(PyExc_ValueError, "rows and budget_ns must be >= 0");
        return -1;
    }
    if (get_views(args, v) < 0) return -1;
    Py_ssize_t nslots = v->slots.len / 4;
    if (nslots & (nslots - 1)) {
        release_views(v);
        PyErr_SetString(PyExc_ValueError, "slots: expected a power of two of int32 slots");
        return -1;
    }
    if (rows > v->records.len / ROW_BYTES) {
        release_views(v);
        PyErr_Format(PyExc_ValueError, "records: %zd rows do not fit in %zd bytes", rows,
                     v->records.len);
        return -1;
    }
    v->rows = rows;
    v->mask = (uint32_t)(nslots - 1);
    return 0;
}

static int key_of(PyObject *obj, const uint8_t **key, uint32_t *n) {
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "key: expected bytes, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    Py_ssize_t len = PyBytes_GET_SIZE(obj);
    *key = (const uint8_t *)PyBytes_AS_STRING(obj);
    /* a longer key is in no record: not found (never compared past a record) */
    *n = len > MAX_KEY ? UINT32_MAX : (uint32_t)len;
    return 0;
}

static int hash_of(PyObject *obj, uint32_t *h) {
    unsigned long value = PyLong_AsUnsignedLongMask(obj);
    if (value == (unsigned long)-1 && PyErr_Occurred()) return -1;
    *h = (uint32_t)value;
    return 0;
}

PyDoc_STRVAR(lookup_doc,
"lookup(header, slots, records, rows, key, hash, budget_ns, /) -> bool\n\n"
"Whether ``key`` (bytes) is READY in the pool whose header page, int32 index slots and\n"
"``rows`` row records are the given buffers: a probe from ``hash & (len(slots) - 1)``\n"
"bracketed by the sequence word, tried again for up to ``budget_ns`` while mutations run\n"
"(False then). NodePool.lookup's answer.");

static PyObject *py_lookup(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Views v;
    long budget_ns;
    if (parse_common(args, nargs, 7, "lookup(header, slots, records, rows, key, hash, budget_ns)",
                     &v, &budget_ns) < 0)
        return NULL;
    const uint8_t *key;
    uint32_t n, h;
    int found = 0;
    if (key_of(args[4], &key, &n) < 0 || hash_of(args[5], &h) < 0) {
        release_views(&v);
        return NULL;
    }
    if (n != UINT32_MAX) found = lookup_one(&v, key, n, h, budget_ns);
    release_views(&v);
    return PyBool_FromLong(found);
}

PyDoc_STRVAR(lookup_many_doc,
"lookup_many(header, slots, records, rows, keys, hashes, budget_ns, /) -> list[bool]\n\n"
"``lookup`` of each of ``keys`` (a list of bytes) with its hash from ``hashes`` (a list of\n"
"the same length): first all under one sequence bracket, and if a mutation ran meanwhile\n"
"each key's own lookup again. NodePool.lookup_many's answers.");

static PyObject *py_lookup_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Views v;
    long budget_ns;
    if (parse_common(args, nargs, 7,
                     "lookup_many(header, slots, records, rows, keys, hashes, budget_ns)",
                     &v, &budget_ns) < 0)
        return NULL;
    PyObject *keys = args[4], *hashes = args[5], *out = NULL;
    if (!PyList_Check(keys) || !PyList_Check(hashes)
            || PyList_GET_SIZE(keys) != PyList_GET_SIZE(hashes)) {
        PyErr_SetString(PyExc_TypeError, "keys and hashes: expected two lists of one length");
        goto done;
    }
    Py_ssize_t count = PyList_GET_SIZE(keys);
    out = PyList_New(count);
    if (out == NULL) goto done;
    const uint64_t *seqp = (const uint64_t *)v.header.buf + H_SEQ;
    uint64_t seq = __atomic_load_n(seqp, __ATOMIC_ACQUIRE);
    int bracketed = !(seq & 1);
    for (Py_ssize_t i = 0; i < count; i++) {
        const uint8_t *key;
        uint32_t n, h;
        if (key_of(PyList_GET_ITEM(keys, i), &key, &n) < 0
                || hash_of(PyList_GET_ITEM(hashes, i), &h) < 0) {
            Py_CLEAR(out);
            goto done;
        }
        int found = 0;
        if (n != UINT32_MAX) {
            if (bracketed) {
                found = find(&v, key, n, h) >= 0;
            } else {
                found = lookup_one(&v, key, n, h, budget_ns);
            }
        }
        PyList_SET_ITEM(out, i, PyBool_FromLong(found));
    }
    if (bracketed) {
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(seqp, __ATOMIC_RELAXED) != seq) {  /* a mutation ran: each again */
            for (Py_ssize_t i = 0; i < count; i++) {
                const uint8_t *key = NULL;
                uint32_t n = UINT32_MAX, h = 0;
                if (key_of(PyList_GET_ITEM(keys, i), &key, &n) < 0   /* (checked above) */
                        || hash_of(PyList_GET_ITEM(hashes, i), &h) < 0) {
                    Py_CLEAR(out);
                    goto done;
                }
                int found = n != UINT32_MAX && lookup_one(&v, key, n, h, budget_ns);
                PyObject *old = PyList_GET_ITEM(out, i);
                PyList_SET_ITEM(out, i, PyBool_FromLong(found));
                Py_DECREF(old);
            }
        }
    }
done:
    release_views(&v);
    return out;
}

static PyMethodDef methods[] = {
    {"lookup", (PyCFunction)(void (*)(void))py_lookup, METH_FASTCALL, lookup_doc},
    {"lookup_many", (PyCFunction)(void (*)(void))py_lookup_many, METH_FASTCALL, lookup_many_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_index",
    "The node pool's lock-free lookup in C (see shmtier/tiers/node/_index.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__index(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "ROW_BYTES", ROW_BYTES) < 0
            || PyModule_AddIntConstant(m, "R_STATE", R_STATE) < 0
            || PyModule_AddIntConstant(m, "R_KLEN", R_KLEN) < 0
            || PyModule_AddIntConstant(m, "R_KHASH", R_KHASH) < 0
            || PyModule_AddIntConstant(m, "R_KEY", R_KEY) < 0
            || PyModule_AddIntConstant(m, "ROW_READY", ROW_READY) < 0
            || PyModule_AddIntConstant(m, "H_SEQ", H_SEQ) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
