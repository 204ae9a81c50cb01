/* shmtier.shared._planes: the byte-plane split and merge of the chunk codec, and
 * CRC-32C, in C because they run on every byte a tier worker moves.
 *
 * Who calls: shmtier.shared.codec (tier worker processes, the bench, tests).
 * Every function takes buffer-protocol objects, checks their sizes, releases the
 * GIL while it works and never blocks on anything but the CPU.
 *
 * Why C (measured in bench/codec.py on the 2-vCPU Xeon VM): numpy's shift-and-cast
 * split plus zlib.crc32 over the low plane cost ~0.3 s per GB of chunk, a third of
 * the encode; one pass that splits a tile and checksums its low plane while it is
 * in cache, with the SSE4.2 crc32 instruction, reads the chunk once at memory speed.
 *
 * CRC-32C (Castagnoli, the iSCSI/ext4/btrfs checksum): reflected polynomial
 * 0x82F63B78, initial value and final xor 0xFFFFFFFF; crc32c(b"123456789") ==
 * 0xE3069283. Chained like zlib.crc32: crc32c(b, crc32c(a)) == crc32c(a + b).
 * x86-64 with SSE4.2 uses the instruction (chosen at import); elsewhere a
 * slicing-by-8 table (~1-2 GB/s).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define HAVE_X86_CRC 1
#endif

#define TILE_ELEMS (8 * 1024) /* uint16 elements per split tile: 16 KiB of chunk */

static uint32_t crc_table[8][256];

static void crc_table_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

/* Both take and return the raw (un-inverted) register. */
static uint32_t crc_sw(uint32_t c, const uint8_t *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) { c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xFF]; n--; }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = crc_table[7][w & 0xFF] ^ crc_table[6][(w >> 8) & 0xFF] ^
            crc_table[5][(w >> 16) & 0xFF] ^ crc_table[4][(w >> 24) & 0xFF] ^
            crc_table[3][(w >> 32) & 0xFF] ^ crc_table[2][(w >> 40) & 0xFF] ^
            crc_table[1][(w >> 48) & 0xFF] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xFF];
    return c;
}

#ifdef HAVE_X86_CRC
__attribute__((target("sse4.2")))
static uint32_t crc_hw(uint32_t c32, const uint8_t *p, size_t n) {
    uint64_t c = c32;
    while (n && ((uintptr_t)p & 7)) { c = _mm_crc32_u8((uint32_t)c, *p++); n--; }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        n -= 8;
    }
    while (n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    return (uint32_t)c;
}
#endif

static uint32_t (*crc_update)(uint32_t, const uint8_t *, size_t) = crc_sw;

static void split_tile(const uint8_t *raw, uint8_t *hi, uint8_t *lo, size_t n) {
    for (size_t i = 0; i < n; i++) {  /* little-endian uint16: low byte first */
        lo[i] = raw[2 * i];
        hi[i] = raw[2 * i + 1];
    }
}

static void merge_tile(const uint8_t *hi, const uint8_t *lo, uint8_t *out, size_t n) {
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = lo[i];
        out[2 * i + 1] = hi[i];
    }
}

/* Buffers: `views` of n entries, the first `n_ro` read-only. Returns 0 or -1 (error set). */
static int get_views(PyObject *const *objs, Py_buffer *views, int n, int n_ro) {
    for (int i = 0; i < n; i++) {
        int flags = PyBUF_C_CONTIGUOUS | (i < n_ro ? 0 : PyBUF_WRITABLE);
        if (PyObject_GetBuffer(objs[i], &views[i], flags) < 0) {
            for (int j = 0; j < i; j++) PyBuffer_Release(&views[j]);
            return -1;
        }
    }
    return 0;
}

static void release_views(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

PyDoc_STRVAR(crc32c_doc,
"crc32c(data, value=0, /) -> int\n\n"
"CRC-32C of the bytes-like ``data``, continuing from ``value`` (a previous result),\n"
"like zlib.crc32.");

static PyObject *crc32c_with(uint32_t (*update)(uint32_t, const uint8_t *, size_t),
                             PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "crc32c(data, value=0) takes 1 or 2 arguments");
        return NULL;
    }
    uint32_t value = 0;
    if (nargs == 2) {
        unsigned long v = PyLong_AsUnsignedLongMask(args[1]);
        if (v == (unsigned long)-1 && PyErr_Occurred()) return NULL;
        value = (uint32_t)v;
    }
    Py_buffer b;
    if (get_views(args, &b, 1, 1) < 0) return NULL;
    uint32_t c = ~value;
    Py_BEGIN_ALLOW_THREADS
    c = update(c, (const uint8_t *)b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    release_views(&b, 1);
    return PyLong_FromUnsignedLong((unsigned long)(~c));
}

static PyObject *py_crc32c(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return crc32c_with(crc_update, args, nargs);
}

PyDoc_STRVAR(crc32c_table_doc,
"crc32c_table(data, value=0, /) -> int\n\n"
"crc32c computed with the portable table, whatever the CPU (tests compare the two).");

static PyObject *py_crc32c_table(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return crc32c_with(crc_sw, args, nargs);
}

PyDoc_STRVAR(split_doc,
"split(raw, hi, lo, /) -> int\n\n"
"Write the high and low bytes of the little-endian uint16 elements of ``raw`` into\n"
"``hi`` and ``lo`` (writable, each len(raw) // 2 bytes; len(raw) even) and return\n"
"the CRC-32C of ``lo``, computed tile by tile while each tile is in cache.");

static PyObject *py_split(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "split(raw, hi, lo) takes 3 arguments");
        return NULL;
    }
    Py_buffer v[3];
    if (get_views(args, v, 3, 1) < 0) return NULL;
    size_t n = (size_t)v[0].len / 2;
    if (v[0].len % 2 || (size_t)v[1].len != n || (size_t)v[2].len != n) {
        PyErr_Format(PyExc_ValueError,
                     "split: raw has %zd bytes (must be even), hi %zd and lo %zd (must be %zu)",
                     v[0].len, v[1].len, v[2].len, n);
        release_views(v, 3);
        return NULL;
    }
    const uint8_t *raw = v[0].buf;
    uint8_t *hi = v[1].buf, *lo = v[2].buf;
    uint32_t c = 0xFFFFFFFFu;
    Py_BEGIN_ALLOW_THREADS
    for (size_t s = 0; s < n; s += TILE_ELEMS) {
        size_t k = n - s < TILE_ELEMS ? n - s : TILE_ELEMS;
        split_tile(raw + 2 * s, hi + s, lo + s, k);
        c = crc_update(c, lo + s, k);
    }
    Py_END_ALLOW_THREADS
    release_views(v, 3);
    return PyLong_FromUnsignedLong((unsigned long)(~c));
}

PyDoc_STRVAR(merge_doc,
"merge(hi, lo, out, /) -> None\n\n"
"Write ``hi[i] << 8 | lo[i]`` as little-endian uint16 elements into ``out``\n"
"(writable, 2 * len(hi) bytes; len(lo) == len(hi)).");

static PyObject *py_merge(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "merge(hi, lo, out) takes 3 arguments");
        return NULL;
    }
    Py_buffer v[3];
    if (get_views(args, v, 3, 2) < 0) return NULL;
    size_t n = (size_t)v[0].len;
    if ((size_t)v[1].len != n || (size_t)v[2].len != 2 * n) {
        PyErr_Format(PyExc_ValueError,
                     "merge: hi has %zd bytes, lo %zd (must be equal), out %zd (must be %zu)",
                     v[0].len, v[1].len, v[2].len, 2 * n);
        release_views(v, 3);
        return NULL;
    }
    const uint8_t *hi = v[0].buf, *lo = v[1].buf;
    uint8_t *out = v[2].buf;
    Py_BEGIN_ALLOW_THREADS
    merge_tile(hi, lo, out, n);
    Py_END_ALLOW_THREADS
    release_views(v, 3);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_FASTCALL, crc32c_doc},
    {"crc32c_table", (PyCFunction)(void (*)(void))py_crc32c_table, METH_FASTCALL,
     crc32c_table_doc},
    {"split", (PyCFunction)(void (*)(void))py_split, METH_FASTCALL, split_doc},
    {"merge", (PyCFunction)(void (*)(void))py_merge, METH_FASTCALL, merge_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shmtier.shared._planes",
    "Byte-plane split/merge and CRC-32C for the chunk codec (see _planes.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__planes(void) {
    crc_table_init();
    const char *impl = "table";
#ifdef HAVE_X86_CRC
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
        crc_update = crc_hw;
        impl = "sse4.2";
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddStringConstant(m, "CRC32C_IMPL", impl) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
