/* shmtier.shared._wire: the data path of the scheduler <-> tier worker rings, the encoder
 * of the common job descriptor and the decoder of results, in C because each runs a few
 * times per engine step on the scheduler thread.
 *
 * Who calls: shmtier.shared.ring (RingPort, both ends of every ring, every process) and
 * shmtier.shared.jobs (pack_job and decode_result, the scheduler). Nothing here blocks: a full ring is a
 * False, an empty one an empty list; waiting for items stays in ring.py.
 *
 * Why C (measured with bench/tiering_steps.py on the 2-vCPU VM): a step runs each of
 * these once or twice, after the engine's forward pass has left the caches cold. Cold,
 * the Python try_put (posix_ipc, struct, memoryview: five extension calls) cost 15-20
 * µs, get_many as much, msgpack's Packer 17-30 µs; one small C call costs ~6 µs.
 *
 * RingPort is the protocol of ring.py's module docstring, unchanged (depth() reads the
 * published head and tail, as ring.py's crash recovery does): the producer
 * takes a space token (sem_trywait), writes slot[head % slots] (u32 length, u32 low
 * bits of the sequence number, payload), commits head, posts an item token; the
 * consumer takes item tokens, copies the slots out, commits tail, posts space tokens.
 * Counters are little-endian u64 at ring offsets 64 (head) and 128 (tail); slots start
 * at 192. The port keeps the private copies of head and tail that ring.py's resync
 * sets. It opens its own handles on the ring's named semaphores (sem_open of a name
 * this process already opened returns the same mapping in glibc).
 *
 * pack_job encodes [SCHEMA_VERSION, KIND_JOB, job_id, op, tier, keys, rows, {}] exactly
 * as msgpack.Packer(use_bin_type=True) does (smallest int and bin formats); any value
 * outside that shape (a non-bytes key, a bool, a negative or >64-bit int) returns
 * NotImplemented and the caller uses msgpack itself. decode_result is the other way for
 * results: it reads exactly what jobs.encode_result writes and makes every check of
 * jobs.decode_result's fast path; anything else is None and jobs.py decodes it (and
 * names what is wrong). Neither ever accepts what the Python path would refuse.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>

#define RING_HEADER_SIZE 192
#define HEAD_OFFSET 64
#define TAIL_OFFSET 128
#define SLOT_HEADER_SIZE 8

static void put_le32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* The counters are written by one end and read by both: whole-word atomic accesses.
 * The byte order is the segment's (little-endian); every supported target is. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the ring area is little-endian; this target is not"
#endif

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    uint8_t *base;
    uint32_t slots, slot_size;
    uint64_t head, tail;
    sem_t *items, *spaces;
    PyObject *label;    /* str, for messages */
    PyObject *corrupt;  /* exception class raised for a slot that is not the expected item */
    PyObject *dropped;  /* callable(n): item tokens without an item were dropped */
} RingPort;

static void port_close_handles(RingPort *self) {
    if (self->items != NULL && self->items != SEM_FAILED) sem_close(self->items);
    if (self->spaces != NULL && self->spaces != SEM_FAILED) sem_close(self->spaces);
    self->items = self->spaces = NULL;
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    self->base = NULL;
}

static void port_dealloc(RingPort *self) {
    port_close_handles(self);
    Py_XDECREF(self->label);
    Py_XDECREF(self->corrupt);
    Py_XDECREF(self->dropped);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int port_init(RingPort *self, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"region", "slots", "slot_size", "items_name", "spaces_name", "label",
                         "corrupt_error", "on_dropped_tokens", NULL};
    PyObject *region, *label, *corrupt, *dropped;
    unsigned int slots, slot_size;
    const char *items_name, *spaces_name;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OIIssUOO", kw, &region, &slots, &slot_size,
                                     &items_name, &spaces_name, &label, &corrupt, &dropped))
        return -1;
    if (self->has_view || self->items != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "RingPort is already initialised");
        return -1;
    }
    if (slots == 0 || slot_size <= SLOT_HEADER_SIZE) {
        PyErr_Format(PyExc_ValueError, "ring of %u slots of %u bytes", slots, slot_size);
        return -1;
    }
    if (PyObject_GetBuffer(region, &self->view, PyBUF_WRITABLE) < 0) return -1;
    self->has_view = 1;
    if ((uint64_t)self->view.len < RING_HEADER_SIZE + (uint64_t)slots * slot_size) {
        PyErr_Format(PyExc_ValueError, "ring region of %zd bytes is smaller than %u slots of %u bytes",
                     self->view.len, slots, slot_size);
        port_close_handles(self);
        return -1;
    }
    self->base = (uint8_t *)self->view.buf;
    self->slots = slots;
    self->slot_size = slot_size;
    self->items = sem_open(items_name, 0);
    self->spaces = self->items == SEM_FAILED ? SEM_FAILED : sem_open(spaces_name, 0);
    if (self->items == SEM_FAILED || self->spaces == SEM_FAILED) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError,
                                       self->items == SEM_FAILED ? items_name : spaces_name);
        port_close_handles(self);
        return -1;
    }
    self->head = __atomic_load_n((uint64_t *)(self->base + HEAD_OFFSET), __ATOMIC_ACQUIRE);
    self->tail = __atomic_load_n((uint64_t *)(self->base + TAIL_OFFSET), __ATOMIC_ACQUIRE);
    Py_INCREF(label); Py_XSETREF(self->label, label);
    Py_INCREF(corrupt); Py_XSETREF(self->corrupt, corrupt);
    Py_INCREF(dropped); Py_XSETREF(self->dropped, dropped);
    return 0;
}

static int port_ready(RingPort *self) {
    if (self->base == NULL) {
        PyErr_SetString(PyExc_ValueError, "ring port is closed");
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(try_put_doc,
"try_put(payload) -> bool\n\n"
"Producer: append one payload; False if the ring is full. ValueError if it is longer\n"
"than a slot's payload. Never blocks.");

static PyObject *port_try_put(RingPort *self, PyObject *payload) {
    if (!port_ready(self)) return NULL;
    Py_buffer p;
    if (PyObject_GetBuffer(payload, &p, PyBUF_SIMPLE) < 0) return NULL;
    uint32_t max_payload = self->slot_size - SLOT_HEADER_SIZE;
    if ((uint64_t)p.len > max_payload) {
        PyErr_Format(PyExc_ValueError,
                     "%U: payload of %zd bytes exceeds the slot payload of %u bytes (slot_size %u)",
                     self->label, p.len, max_payload, self->slot_size);
        PyBuffer_Release(&p);
        return NULL;
    }
    if (sem_trywait(self->spaces) != 0) {
        int err = errno;
        PyBuffer_Release(&p);
        if (err == EAGAIN) Py_RETURN_FALSE;
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    uint64_t head = self->head;
    uint8_t *slot = self->base + RING_HEADER_SIZE + (head % self->slots) * (uint64_t)self->slot_size;
    put_le32(slot, (uint32_t)p.len);
    put_le32(slot + 4, (uint32_t)head);
    memcpy(slot + SLOT_HEADER_SIZE, p.buf, (size_t)p.len);
    PyBuffer_Release(&p);
    head += 1;
    self->head = head;
    __atomic_store_n((uint64_t *)(self->base + HEAD_OFFSET), head, __ATOMIC_RELEASE); /* commit */
    if (sem_post(self->items) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(take_doc,
"take(max_items, token_held=False) -> list[bytes]\n\n"
"Consumer: take up to max_items payloads, oldest first, without blocking: the item\n"
"tokens there are (plus one the caller already took from a blocking wait if\n"
"token_held). Raises corrupt_error for a slot that does not hold the expected item.");

static PyObject *port_take(RingPort *self, PyObject *args) {
    Py_ssize_t max_items;
    int token_held = 0;
    if (!PyArg_ParseTuple(args, "n|p", &max_items, &token_held)) return NULL;
    if (!port_ready(self)) return NULL;
    if (max_items < 1) {
        PyErr_Format(PyExc_ValueError, "%U: max_items must be >= 1, got %zd", self->label, max_items);
        return NULL;
    }
    Py_ssize_t k = token_held ? 1 : 0;
    while (k < max_items && sem_trywait(self->items) == 0) k++;
    if (k == 0) return PyList_New(0);
    uint64_t tail = self->tail;
    uint64_t avail = __atomic_load_n((uint64_t *)(self->base + HEAD_OFFSET), __ATOMIC_ACQUIRE) - tail;
    if ((uint64_t)k > avail) {
        /* Tokens without a visible item: an over-release by a resync that raced with
         * this end (contract violation). Drop them rather than read a slot that is
         * not there. */
        PyObject *r = PyObject_CallFunction(self->dropped, "n", (Py_ssize_t)(k - (Py_ssize_t)avail));
        if (r == NULL) return NULL;
        Py_DECREF(r);
        k = (Py_ssize_t)avail;
    }
    PyObject *out = PyList_New(k);
    if (out == NULL) return NULL;
    uint32_t max_payload = self->slot_size - SLOT_HEADER_SIZE;
    for (Py_ssize_t i = 0; i < k; i++) {
        const uint8_t *slot = self->base + RING_HEADER_SIZE + (tail % self->slots) * (uint64_t)self->slot_size;
        uint32_t n = get_le32(slot), seq = get_le32(slot + 4);
        if (seq != (uint32_t)tail || n > max_payload) {
            Py_DECREF(out);
            PyErr_Format(self->corrupt,
                         "%U: slot %llu holds item %u of %u bytes where item %u was expected "
                         "(two producers or consumers?)",
                         self->label, (unsigned long long)(tail % self->slots), seq, n,
                         (uint32_t)tail);
            return NULL;
        }
        PyObject *item = PyBytes_FromStringAndSize((const char *)slot + SLOT_HEADER_SIZE, n);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
        tail += 1;
    }
    self->tail = tail;
    __atomic_store_n((uint64_t *)(self->base + TAIL_OFFSET), tail, __ATOMIC_RELEASE); /* commit */
    for (Py_ssize_t i = 0; i < k; i++) {
        if (sem_post(self->spaces) != 0) {
            Py_DECREF(out);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    return out;
}

PyDoc_STRVAR(depth_doc,
"depth() -> int\n\n"
"Items put and not yet taken: the published head less the published tail (a snapshot;\n"
"either end, any process).");

static PyObject *port_depth(RingPort *self, PyObject *unused) {
    if (!port_ready(self)) return NULL;
    uint64_t head = __atomic_load_n((uint64_t *)(self->base + HEAD_OFFSET), __ATOMIC_ACQUIRE);
    uint64_t tail = __atomic_load_n((uint64_t *)(self->base + TAIL_OFFSET), __ATOMIC_ACQUIRE);
    return PyLong_FromUnsignedLongLong(head > tail ? head - tail : 0);
}

static PyObject *port_close(RingPort *self, PyObject *unused) {
    port_close_handles(self);
    Py_RETURN_NONE;
}

static PyObject *port_get_head(RingPort *self, void *c) { return PyLong_FromUnsignedLongLong(self->head); }
static PyObject *port_get_tail(RingPort *self, void *c) { return PyLong_FromUnsignedLongLong(self->tail); }

static int port_set_counter(uint64_t *field, PyObject *value) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete a ring counter");
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *field = v;
    return 0;
}

static int port_set_head(RingPort *self, PyObject *v, void *c) { return port_set_counter(&self->head, v); }
static int port_set_tail(RingPort *self, PyObject *v, void *c) { return port_set_counter(&self->tail, v); }

static PyGetSetDef port_getset[] = {
    {"head", (getter)port_get_head, (setter)port_set_head, "producer's private copy of head", NULL},
    {"tail", (getter)port_get_tail, (setter)port_set_tail, "consumer's private copy of tail", NULL},
    {NULL},
};

static PyMethodDef port_methods[] = {
    {"try_put", (PyCFunction)port_try_put, METH_O, try_put_doc},
    {"take", (PyCFunction)port_take, METH_VARARGS, take_doc},
    {"depth", (PyCFunction)port_depth, METH_NOARGS, depth_doc},
    {"close", (PyCFunction)port_close, METH_NOARGS,
     "Close the semaphore handles and release the region (idempotent)."},
    {NULL},
};

static PyTypeObject RingPortType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmtier.shared._wire.RingPort",
    .tp_basicsize = sizeof(RingPort),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "RingPort(region, slots, slot_size, items_name, spaces_name, label, corrupt_error, "
              "on_dropped_tokens): the non-blocking data path of one ring (see the module doc).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)port_init,
    .tp_dealloc = (destructor)port_dealloc,
    .tp_methods = port_methods,
    .tp_getset = port_getset,
};

/* --- pack_job: msgpack of the common job descriptor --- */

typedef struct {
    uint8_t *buf;
    size_t len, cap;
} Out;

static int out_reserve(Out *o, size_t more) {
    if (o->len + more <= o->cap) return 0;
    size_t cap = o->cap ? o->cap : 256;
    while (cap < o->len + more) cap *= 2;
    uint8_t *b = PyMem_Realloc(o->buf, cap);
    if (b == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->buf = b;
    o->cap = cap;
    return 0;
}

static int out_byte_be(Out *o, uint8_t tag, uint64_t v, int nbytes) {
    if (out_reserve(o, 1 + (size_t)nbytes) < 0) return -1;
    o->buf[o->len++] = tag;
    for (int i = nbytes - 1; i >= 0; i--) o->buf[o->len++] = (uint8_t)(v >> (8 * i));
    return 0;
}

static int out_array(Out *o, size_t n) {
    if (n < 16) return out_byte_be(o, (uint8_t)(0x90 | n), 0, 0);
    if (n <= 0xFFFF) return out_byte_be(o, 0xdc, n, 2);
    return out_byte_be(o, 0xdd, n, 4);
}

static int out_uint(Out *o, uint64_t v) {
    if (v < 128) return out_byte_be(o, (uint8_t)v, 0, 0);
    if (v <= 0xFF) return out_byte_be(o, 0xcc, v, 1);
    if (v <= 0xFFFF) return out_byte_be(o, 0xcd, v, 2);
    if (v <= 0xFFFFFFFFu) return out_byte_be(o, 0xce, v, 4);
    return out_byte_be(o, 0xcf, v, 8);
}

/* 1: encoded; 0: not a plain non-negative int below 2**64 (caller falls back); -1: error */
static int out_pyuint(Out *o, PyObject *x) {
    if (!PyLong_CheckExact(x)) return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred()) return -1;
        if (v < 0) return 0;
        return out_uint(o, (uint64_t)v) < 0 ? -1 : 1;
    }
    if (overflow < 0) return 0;
    unsigned long long u = PyLong_AsUnsignedLongLong(x);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return out_uint(o, u) < 0 ? -1 : 1;
}

/* 1 / 0 / -1 as out_pyuint */
static int out_pybytes(Out *o, PyObject *x) {
    if (!PyBytes_CheckExact(x)) return 0;
    Py_ssize_t n = PyBytes_GET_SIZE(x);
    int rc;
    if (n <= 0xFF) rc = out_byte_be(o, 0xc4, (uint64_t)n, 1);
    else if (n <= 0xFFFF) rc = out_byte_be(o, 0xc5, (uint64_t)n, 2);
    else if ((uint64_t)n <= 0xFFFFFFFFu) rc = out_byte_be(o, 0xc6, (uint64_t)n, 4);
    else return 0;
    if (rc < 0 || out_reserve(o, (size_t)n) < 0) return -1;
    memcpy(o->buf + o->len, PyBytes_AS_STRING(x), (size_t)n);
    o->len += (size_t)n;
    return 1;
}

/* a list or tuple of items each encoded by one; 1 / 0 / -1 */
static int out_seq(Out *o, PyObject *seq, int (*one)(Out *, PyObject *)) {
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (out_array(o, (size_t)n) < 0) return -1;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        int rc = one(o, items[i]);
        if (rc <= 0) return rc;
    }
    return 1;
}

PyDoc_STRVAR(pack_job_doc,
"pack_job(schema_version, kind, job_id, op_code, tier, keys, rows) -> bytes | NotImplemented\n\n"
"msgpack of [schema_version, kind, job_id, op_code, tier, keys, rows, {}], byte for byte\n"
"what msgpack.Packer(use_bin_type=True) writes; NotImplemented for any value outside\n"
"that shape (keys: list/tuple of bytes; the rest non-negative ints below 2**64).");

static PyObject *pack_job(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "pack_job takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    Out o = {NULL, 0, 0};
    int rc = out_array(&o, 8) < 0 ? -1 : 1;
    for (int i = 0; i < 5 && rc > 0; i++) rc = out_pyuint(&o, args[i]);
    if (rc > 0) rc = out_seq(&o, args[5], out_pybytes);
    if (rc > 0) rc = out_seq(&o, args[6], out_pyuint);
    if (rc > 0) rc = out_byte_be(&o, 0x80, 0, 0) < 0 ? -1 : 1; /* {} */
    PyObject *result = NULL;
    if (rc > 0) {
        result = PyBytes_FromStringAndSize((const char *)o.buf, (Py_ssize_t)o.len);
    } else if (rc == 0) {
        result = Py_NewRef(Py_NotImplemented);
    }
    PyMem_Free(o.buf);
    return result;
}

/* --- decode_result: the fast path of jobs.decode_result --- */

typedef struct {
    const uint8_t *p, *end;
} In;

static int in_take(In *in, size_t n, const uint8_t **at) {
    if ((size_t)(in->end - in->p) < n) return 0;
    *at = in->p;
    in->p += n;
    return 1;
}

static uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* an unsigned int (positive fixint or uint8..64); 1 ok, 0 not one */
static int in_uint(In *in, uint64_t *v) {
    const uint8_t *t, *b;
    if (!in_take(in, 1, &t)) return 0;
    if (*t < 0x80) { *v = *t; return 1; }
    int n = *t == 0xcc ? 1 : *t == 0xcd ? 2 : *t == 0xce ? 4 : *t == 0xcf ? 8 : 0;
    if (n == 0 || !in_take(in, (size_t)n, &b)) return 0;
    *v = be(b, n);
    return 1;
}

/* a length-prefixed item: fix_base/fix_mask for the fix format (0 if none), then the
 * 8/16/32-bit formats' tags; 1 ok, 0 not one */
static int in_len(In *in, uint8_t fix_base, uint8_t fix_mask, uint8_t t8, uint8_t t16, uint8_t t32,
                  size_t *len) {
    const uint8_t *t, *b;
    if (!in_take(in, 1, &t)) return 0;
    if (fix_mask && (*t & (uint8_t)~fix_mask) == fix_base) { *len = *t & fix_mask; return 1; }
    int n = t8 && *t == t8 ? 1 : *t == t16 ? 2 : *t == t32 ? 4 : 0;
    if (n == 0 || !in_take(in, (size_t)n, &b)) return 0;
    *len = (size_t)be(b, n);
    return 1;
}

static int in_float64(In *in, double *v) {
    const uint8_t *t, *b;
    if (!in_take(in, 1, &t) || *t != 0xcb || !in_take(in, 8, &b)) return 0;
    uint64_t bits = be(b, 8);
    memcpy(v, &bits, 8);
    return 1;
}

/* a bin (bin8/16/32); 1 ok, 0 not one */
static int in_bin(In *in, const uint8_t **at, size_t *len) {
    return in_len(in, 0, 0, 0xc4, 0xc5, 0xc6, len) && in_take(in, *len, at);
}

/* A list of the n uint32 LE at p (equal neighbours share one int object). NULL on error. */
static PyObject *u32_list(const uint8_t *p, size_t n) {
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (list == NULL) return NULL;
    PyObject *prev = NULL;
    uint32_t prev_v = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t v = get_le32(p + 4 * i);
        PyObject *item;
        if (prev != NULL && v == prev_v) {
            item = Py_NewRef(prev);
        } else {
            item = PyLong_FromUnsignedLong(v);
            if (item == NULL) {
                Py_DECREF(list);
                return NULL;
            }
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
        prev = item;
        prev_v = v;
    }
    return list;
}

static float get_f32(const uint8_t *p) {
    uint32_t bits = get_le32(p);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

PyDoc_STRVAR(decode_result_doc,
"decode_result(raw, schema_version, kind, outcomes, result_type) -> result | None\n\n"
"A result_type (a tuple subclass without fields of its own, e.g. a namedtuple) of the\n"
"fields (job_id, outcomes: list, logical: list[int], stored: list[int],\n"
"seconds: list[float], codec_s, error, listed, more, flags: int) of a result message that is exactly\n"
"what jobs.encode_result writes and passes every check of jobs.decode_result's fast\n"
"path; None for anything else (the caller then decodes it in Python, which names the\n"
"problem). ``outcomes`` is the tuple of outcome objects indexed by code: its length is\n"
"the number of known codes, and the decoded list holds its items.");

static PyObject *decode_result(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "decode_result takes 5 arguments (%zd given)", nargs);
        return NULL;
    }
    unsigned long long want_version = PyLong_AsUnsignedLongLong(args[1]);
    unsigned long long want_kind = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    PyObject *members = args[3];
    if (!PyTuple_CheckExact(members)) {
        PyErr_SetString(PyExc_TypeError, "decode_result: outcomes must be a tuple");
        return NULL;
    }
    size_t num_outcomes = (size_t)PyTuple_GET_SIZE(members);
    PyTypeObject *result_type = (PyTypeObject *)args[4];
    if (!PyType_Check(args[4]) || !PyType_IsSubtype(result_type, &PyTuple_Type)
        || result_type->tp_basicsize != PyTuple_Type.tp_basicsize
        || result_type->tp_itemsize != PyTuple_Type.tp_itemsize) {
        PyErr_SetString(PyExc_TypeError,
                        "decode_result: result_type must be a tuple subclass without fields");
        return NULL;
    }
    Py_buffer raw;
    if (PyObject_GetBuffer(args[0], &raw, PyBUF_SIMPLE) < 0) return NULL;
    In in = {(const uint8_t *)raw.buf, (const uint8_t *)raw.buf + raw.len};
    PyObject *outcomes = NULL, *logical = NULL, *stored = NULL, *seconds = NULL;
    PyObject *error = NULL, *keys = NULL, *result = NULL;
    const uint8_t *t, *b, *out_b, *logical_b, *stored_b, *seconds_b;
    size_t n, out_len, logical_len, stored_len, seconds_len, err_len, num_keys;
    uint64_t version, kind, job_id, flags;
    double codec_s;
    if (!in_len(&in, 0x90, 0x0f, 0, 0xdc, 0xdd, &n) || n != 12) goto fallback;
    if (!in_uint(&in, &version) || version != want_version) goto fallback;
    if (!in_uint(&in, &kind) || kind != want_kind) goto fallback;
    if (!in_uint(&in, &job_id)) goto fallback;
    if (!in_bin(&in, &out_b, &out_len)) goto fallback;
    for (size_t i = 0; i < out_len; i++)
        if (out_b[i] >= num_outcomes) goto fallback;
    if (!in_bin(&in, &logical_b, &logical_len) || logical_len != 4 * out_len) goto fallback;
    /* one per answered key, then one per listed key: checked against the keys below */
    if (!in_bin(&in, &stored_b, &stored_len) || stored_len % 4 || stored_len < 4 * out_len)
        goto fallback;
    if (!in_bin(&in, &seconds_b, &seconds_len) || seconds_len != 4 * out_len) goto fallback;
    for (size_t i = 0; i < out_len; i++) {
        float f = get_f32(seconds_b + 4 * i);
        if (!(f >= 0.0f)) goto fallback; /* negative or NaN */
    }
    if (!in_float64(&in, &codec_s) || !(codec_s >= 0.0)) goto fallback;
    if (!in_len(&in, 0xa0, 0x1f, 0xd9, 0xda, 0xdb, &err_len) || !in_take(&in, err_len, &b))
        goto fallback;
    if (!in_len(&in, 0x90, 0x0f, 0, 0xdc, 0xdd, &num_keys)) goto fallback;
    if (num_keys > (size_t)(in.end - in.p)) goto fallback; /* each key takes >= 2 bytes */
    if (stored_len != 4 * (out_len + num_keys)) goto fallback;
    const uint8_t *keys_at = in.p;
    for (size_t i = 0; i < num_keys; i++) { /* validate before building anything */
        size_t klen;
        if (!in_bin(&in, &t, &klen)) goto fallback;
    }
    if (!in_take(&in, 1, &t) || (*t != 0xc2 && *t != 0xc3)) goto fallback;
    int more = *t == 0xc3;
    if (!in_uint(&in, &flags) || flags > 0xffffffffULL) goto fallback;
    if (in.p != in.end) goto fallback; /* trailing bytes */
    error = PyUnicode_DecodeUTF8((const char *)b, (Py_ssize_t)err_len, "strict");
    if (error == NULL) {
        PyErr_Clear();
        goto fallback;
    }
    outcomes = PyList_New((Py_ssize_t)out_len);
    if (outcomes == NULL) goto done;
    for (size_t i = 0; i < out_len; i++)
        PyList_SET_ITEM(outcomes, (Py_ssize_t)i, Py_NewRef(PyTuple_GET_ITEM(members, out_b[i])));
    if ((logical = u32_list(logical_b, out_len)) == NULL) goto done;
    if ((stored = u32_list(stored_b, out_len + num_keys)) == NULL) goto done;
    seconds = PyList_New((Py_ssize_t)out_len);
    if (seconds == NULL) goto done;
    for (size_t i = 0; i < out_len; i++) {
        PyObject *f = PyFloat_FromDouble((double)get_f32(seconds_b + 4 * i));
        if (f == NULL) goto done;
        PyList_SET_ITEM(seconds, (Py_ssize_t)i, f);
    }
    keys = PyList_New((Py_ssize_t)num_keys);
    if (keys == NULL) goto done;
    In kin = {keys_at, in.end};
    for (size_t i = 0; i < num_keys; i++) {
        size_t klen;
        in_bin(&kin, &b, &klen); /* validated above */
        PyObject *key = PyBytes_FromStringAndSize((const char *)b, (Py_ssize_t)klen);
        if (key == NULL) goto done;
        PyList_SET_ITEM(keys, (Py_ssize_t)i, key);
    }
    PyObject *id = PyLong_FromUnsignedLongLong((unsigned long long)job_id);
    PyObject *codec = id == NULL ? NULL : PyFloat_FromDouble(codec_s);
    PyObject *flag_bits = codec == NULL ? NULL : PyLong_FromUnsignedLongLong(flags);
    result = flag_bits == NULL ? NULL : result_type->tp_alloc(result_type, 10);
    if (result == NULL) {
        Py_XDECREF(id);
        Py_XDECREF(codec);
        Py_XDECREF(flag_bits);
        goto done;
    }
    /* as tuple_subtype_new fills a tuple subclass; the result owns every field now */
    PyObject *fields[10] = {id, outcomes, logical, stored, seconds, codec, error, keys,
                            Py_NewRef(more ? Py_True : Py_False), flag_bits};
    for (int i = 0; i < 10; i++) PyTuple_SET_ITEM(result, i, fields[i]);
    outcomes = logical = stored = seconds = error = keys = NULL;
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(outcomes);
    Py_XDECREF(logical);
    Py_XDECREF(stored);
    Py_XDECREF(seconds);
    Py_XDECREF(error);
    Py_XDECREF(keys);
    PyBuffer_Release(&raw);
    return result;
}

static PyMethodDef module_methods[] = {
    {"pack_job", (PyCFunction)(void (*)(void))pack_job, METH_FASTCALL, pack_job_doc},
    {"decode_result", (PyCFunction)(void (*)(void))decode_result, METH_FASTCALL, decode_result_doc},
    {NULL},
};

static struct PyModuleDef wire_module = {
    PyModuleDef_HEAD_INIT, "shmtier.shared._wire",
    "The ring data path and the job encoder in C (see _wire.c's header).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__wire(void) {
    if (PyType_Ready(&RingPortType) < 0) return NULL;
    PyObject *m = PyModule_Create(&wire_module);
    if (m == NULL) return NULL;
    Py_INCREF(&RingPortType);
    if (PyModule_AddObject(m, "RingPort", (PyObject *)&RingPortType) < 0) {
        Py_DECREF(&RingPortType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
