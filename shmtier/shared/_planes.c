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
 * x86-64 with SSE4.2 uses the instruction (chosen at import), and buffers of FOLD_MIN
 * bytes or more fold with carry-less products where the CPU has AVX-512 VPCLMULQDQ
 * (crc_fold_into below; CRC32C_IMPL names the path); elsewhere a slicing-by-8 table
 * (~1-2 GB/s).
 *
 * Three streams (bench/README.md, codec part): one crc32 instruction has a latency of
 * 3 cycles and a throughput of 1 per cycle, so a single dependent chain uses a third
 * of the unit. Buffers of at least 3 * CRC3_SHORT bytes are cut into groups of three
 * adjacent blocks of a fixed length L, checksummed by three independent chains in one
 * loop and combined with the zero-extension operator of L bytes (crc3_* below); the
 * tail shorter than a group runs on one chain.
 *
 * copy_crc32c (the p2p client: a received chunk into its arena row) copies while it
 * checksums, in one pass with non-temporal stores. Measured on 1.4 MiB
 * (bench/README.md, p2p_tier.py section): into a row not in cache, memcpy then crc32c
 * ~180 µs, three crc32 streams fused ~75 µs, folding ~58 µs; crc32c alone from memory
 * ~126 µs on three streams, ~62 µs folding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
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
/* One chain over p[0:n]; with dst (not NULL) also copies p[0:n] to dst as it goes.
 * Inlined into its callers, where dst is a constant NULL or not, so the copy costs
 * nothing where it is not asked for. */
__attribute__((target("sse4.2"), always_inline))
static inline uint32_t crc_hw_into(uint32_t c32, const uint8_t *p, size_t n, uint8_t *dst) {
    uint64_t c = c32;
    while (n && ((uintptr_t)p & 7)) {
        if (dst) *dst++ = *p;
        c = _mm_crc32_u8((uint32_t)c, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        if (dst) { memcpy(dst, &w, 8); dst += 8; }
        c = _mm_crc32_u64(c, w);
        p += 8;
        n -= 8;
    }
    while (n--) {
        if (dst) *dst++ = *p;
        c = _mm_crc32_u8((uint32_t)c, *p++);
    }
    return (uint32_t)c;
}

__attribute__((target("sse4.2")))
static uint32_t crc_hw(uint32_t c, const uint8_t *p, size_t n) {
    return crc_hw_into(c, p, n, NULL);
}
#endif

/* Combining streams. Without the initial and final inversions, the register update
 * R(c, M) is linear over GF(2) in c and M together, so for a message A || B with
 * |B| = L:  R(c, A || B) = R(R(c, A), B) = Z_L(R(c, A)) ^ R(0, B),  where
 * Z_L(x) = R(x, L zero bytes). Z_L is a linear map of 32 bits, known once L is fixed:
 * it is tabulated at import from its 32 basis images as 4 tables of 256 (one per byte
 * of x), so applying it costs 4 lookups. For a group of three blocks of L bytes with
 * chains c0 = R(c, A), c1 = R(0, B), c2 = R(0, C):
 *   R(c, A || B || C) = Z_L(Z_L(c0) ^ c1) ^ c2. */
#define CRC3_LONG 4096 /* block length of the large groups (12 KiB a group) */
#define CRC3_SHORT 256 /* block length for what is left of a large buffer, and the
                        * smallest buffer that uses three streams is 3 * CRC3_SHORT */

typedef struct { uint32_t t[4][256]; } crc3_zeros_op;

static crc3_zeros_op crc3_long_op, crc3_short_op;

/* Z_len(x) by definition, one zero byte at a time (import only). */
static uint32_t crc3_zeros_slow(uint32_t x, size_t len) {
    while (len--) x = (x >> 8) ^ crc_table[0][x & 0xFF];
    return x;
}

/* Needs crc_table_init first. */
static void crc3_zeros_init(crc3_zeros_op *op, size_t len) {
    uint32_t basis[32];
    for (int b = 0; b < 32; b++) basis[b] = crc3_zeros_slow(1u << b, len);
    for (int j = 0; j < 4; j++)
        for (uint32_t v = 0; v < 256; v++) {
            uint32_t x = 0;
            for (int k = 0; k < 8; k++)
                if ((v >> k) & 1) x ^= basis[8 * j + k];
            op->t[j][v] = x;
        }
}

static inline uint32_t crc3_zeros(const crc3_zeros_op *op, uint32_t x) {
    return op->t[0][x & 0xFF] ^ op->t[1][(x >> 8) & 0xFF] ^ op->t[2][(x >> 16) & 0xFF] ^
           op->t[3][x >> 24];
}

#ifdef HAVE_X86_CRC
/* Groups of three blocks of `len` bytes (a multiple of 64) from *p while at least one
 * is left; advances *p and *n past them (and *dst, when dst is not NULL: then every byte
 * read is also stored at the same offset from *dst, the copy of copy_crc32c). Takes and
 * returns the raw register. */
__attribute__((target("sse4.2"), always_inline))
static inline uint32_t crc3_groups(uint32_t c, const uint8_t **p, size_t *n, size_t len,
                                   const crc3_zeros_op *op, uint8_t **dst) {
    const uint8_t *q = *p;
    uint8_t *d = dst ? *dst : NULL;
    size_t left = *n;
    while (left >= 3 * len) {
        uint64_t c0 = c, c1 = 0, c2 = 0;
        /* The next group's three blocks start far apart (a new page each, for the long
         * blocks), where the hardware prefetchers start cold: asking for their first
         * two lines now speeds up buffers read from memory (bench/README.md, codec
         * part). A prefetch is a hint that cannot fault, past the buffer's end too (the
         * address is formed as an integer, not as a pointer out of the object). */
        uintptr_t next = (uintptr_t)q + 3 * len;
        for (size_t i = 0; i < 2 * 64; i += 64) {
            __builtin_prefetch((const void *)(next + i));
            __builtin_prefetch((const void *)(next + len + i));
            __builtin_prefetch((const void *)(next + 2 * len + i));
        }
        for (const uint8_t *end = q + len; q < end; q += 64, d = dst ? d + 64 : d) {
            /* a cache line a stream */
            for (int i = 0; i < 64; i += 8) {
                uint64_t w0, w1, w2;
                memcpy(&w0, q + i, 8);
                memcpy(&w1, q + len + i, 8);
                memcpy(&w2, q + 2 * len + i, 8);
                if (dst) { /* non-temporal: no read of the destination's lines */
                    _mm_stream_si64((long long *)(d + i), (long long)w0);
                    _mm_stream_si64((long long *)(d + len + i), (long long)w1);
                    _mm_stream_si64((long long *)(d + 2 * len + i), (long long)w2);
                }
                c0 = _mm_crc32_u64(c0, w0);
                c1 = _mm_crc32_u64(c1, w1);
                c2 = _mm_crc32_u64(c2, w2);
            }
        }
        c = crc3_zeros(op, crc3_zeros(op, (uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
        q += 2 * len;
        if (dst) d += 2 * len;
        left -= 3 * len;
    }
    *p = q;
    *n = left;
    if (dst) *dst = d;
    return c;
}

/* crc_hw's contract, three streams where the buffer is long enough. */
__attribute__((target("sse4.2")))
static uint32_t crc_hw3(uint32_t c, const uint8_t *p, size_t n) {
    if (n < 3 * CRC3_SHORT) return crc_hw(c, p, n);
    while ((uintptr_t)p & 7) { c = _mm_crc32_u8(c, *p++); n--; }
    c = crc3_groups(c, &p, &n, CRC3_LONG, &crc3_long_op, NULL);
    c = crc3_groups(c, &p, &n, CRC3_SHORT, &crc3_short_op, NULL);
    return crc_hw(c, p, n);
}

/* crc_hw3 over src, copying src[0:n] to dst in the same pass (copy_crc32c). The groups
 * store with non-temporal stores (movnti), aligned on dst: the destination (an arena row,
 * read next by a DMA or a later pass) is not read for ownership, which makes the fused
 * pass faster than memcpy alone on a destination not in cache (bench/README.md,
 * p2p_tier.py section). Small buffers and the tail take ordinary stores. */
__attribute__((target("sse4.2")))
static uint32_t copy_crc_hw3(uint32_t c, const uint8_t *p, size_t n, uint8_t *dst) {
    if (n < 3 * CRC3_SHORT) return crc_hw_into(c, p, n, dst);
    while ((uintptr_t)dst & 7) { *dst++ = *p; c = _mm_crc32_u8(c, *p++); n--; }
    c = crc3_groups(c, &p, &n, CRC3_LONG, &crc3_long_op, &dst);
    c = crc3_groups(c, &p, &n, CRC3_SHORT, &crc3_short_op, &dst);
    _mm_sfence(); /* the non-temporal stores are ordered before what follows */
    return crc_hw_into(c, p, n, dst);
}

/* copy_crc32c with carry-less multiplication (AVX-512 VPCLMULQDQ), where the CPU has it:
 * the crc32 instruction runs at most 8 bytes a cycle, folding 256 bytes a round with
 * four 512-bit accumulators is bound by memory instead.
 *
 * Folding (reflected CRC, Intel's "Fast CRC computation using PCLMULQDQ"): 16 bytes
 * loaded little-endian hold a polynomial B of degree < 128, first bit highest, as
 * H x^64 + L (H: the first 8 bytes, the lane's low qword). Moving B forward by D bytes
 * multiplies it by x^(8D) mod P: H x^(64+8D) + L x^(8D). A carry-less product of the
 * reflected H with fold_const(x^e mod P) = reflect32(x^e mod P) << 1 stands for
 * H x^(e+32), so the constants are x^(8D+32) (H) and x^(8D-32) (L) mod P; the product
 * (< 97 bits) is again a 16-byte block of the message, D bytes later. The running CRC
 * enters by xor into the first 4 bytes (R(c, M) = R(0, M ^ c)); what is left at the end,
 * one 16-byte block, is reduced with the crc32 instruction from 0. */
typedef struct { uint64_t h, l; } fold_pair;
static fold_pair fold256, fold64, fold16;

static uint32_t xpow_mod(size_t e) { /* x^e mod P, P = 0x1EDC6F41 (normal form) */
    uint64_t r = 1;
    while (e--) {
        r <<= 1;
        if (r & (1ull << 32)) r ^= 0x11EDC6F41ull;
    }
    return (uint32_t)r;
}

static uint64_t fold_const(uint32_t k) {
    uint32_t r = 0;
    for (int i = 0; i < 32; i++)
        if (k & (1u << i)) r |= 1u << (31 - i);
    return (uint64_t)r << 1;
}

static void fold_init(fold_pair *f, size_t bytes) {
    f->h = fold_const(xpow_mod(8 * bytes + 32));
    f->l = fold_const(xpow_mod(8 * bytes - 32));
}

#define FOLD_MIN 1024 /* shorter buffers: the three streams */

__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))
static inline __m512i fold512(__m512i x, __m512i k, __m512i next) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_clmulepi64_epi128(x, k, 0x11), next, 0x96);
}

__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))
static inline __m128i fold128(__m128i x, __m128i k, __m128i next) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00),
                                       _mm_clmulepi64_si128(x, k, 0x11)), next);
}

/* The folding pass over p[0:n]; with dst (not NULL: a constant after inlining) also a
 * copy to dst, non-temporal and aligned on dst; without, aligned on p. */
__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2"), always_inline))
static inline uint32_t crc_fold_into(uint32_t c, const uint8_t *p, size_t n, uint8_t *dst) {
    if (dst) {
        while ((uintptr_t)dst & 63) { *dst++ = *p; c = _mm_crc32_u8(c, *p++); n--; }
    } else {
        while ((uintptr_t)p & 63) { c = _mm_crc32_u8(c, *p++); n--; }
    }
    __m512i x[4];
    for (int j = 0; j < 4; j++) {
        x[j] = _mm512_loadu_si512((const void *)(p + 64 * j));
        if (dst) _mm512_stream_si512((void *)(dst + 64 * j), x[j]);
    }
    x[0] = _mm512_xor_si512(x[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)c)));
    p += 256, n -= 256;
    if (dst) dst += 256;
    const __m512i k256 = _mm512_set4_epi64((long long)fold256.l, (long long)fold256.h,
                                           (long long)fold256.l, (long long)fold256.h);
    while (n >= 256) {
        for (int j = 0; j < 4; j++) {
            __m512i y = _mm512_loadu_si512((const void *)(p + 64 * j));
            if (dst) _mm512_stream_si512((void *)(dst + 64 * j), y);
            x[j] = fold512(x[j], k256, y);
        }
        p += 256, n -= 256;
        if (dst) dst += 256;
    }
    if (dst) _mm_sfence();
    const __m512i k64 = _mm512_set4_epi64((long long)fold64.l, (long long)fold64.h,
                                          (long long)fold64.l, (long long)fold64.h);
    __m512i z = fold512(fold512(fold512(x[0], k64, x[1]), k64, x[2]), k64, x[3]);
    const __m128i k16 = _mm_set_epi64x((long long)fold16.l, (long long)fold16.h);
    __m128i a = _mm512_castsi512_si128(z);
    a = fold128(a, k16, _mm512_extracti32x4_epi32(z, 1));
    a = fold128(a, k16, _mm512_extracti32x4_epi32(z, 2));
    a = fold128(a, k16, _mm512_extracti32x4_epi32(z, 3));
    uint64_t r = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(a));
    r = _mm_crc32_u64(r, (uint64_t)_mm_extract_epi64(a, 1));
    return crc_hw_into((uint32_t)r, p, n, dst);
}

/* crc_hw3's contract, folding where the buffer is long enough. */
__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))
static uint32_t crc_fold(uint32_t c, const uint8_t *p, size_t n) {
    if (n < FOLD_MIN) return crc_hw3(c, p, n);
    return crc_fold_into(c, p, n, NULL);
}

/* copy_crc_hw3's contract, folding where the buffer is long enough. */
__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))
static uint32_t copy_crc_fold(uint32_t c, const uint8_t *p, size_t n, uint8_t *dst) {
    if (n < FOLD_MIN) return copy_crc_hw3(c, p, n, dst);
    return crc_fold_into(c, p, n, dst);
}
#endif

/* The portable copy_crc32c: a tile copied, then checksummed while it is in cache. */
static uint32_t copy_crc_sw(uint32_t c, const uint8_t *p, size_t n, uint8_t *dst) {
    for (size_t s = 0; s < n; s += 2 * TILE_ELEMS) {
        size_t k = n - s < 2 * TILE_ELEMS ? n - s : 2 * TILE_ELEMS;
        memcpy(dst + s, p + s, k);
        c = crc_sw(c, dst + s, k);
    }
    return c;
}

static uint32_t (*crc_update)(uint32_t, const uint8_t *, size_t) = crc_sw;
static uint32_t (*crc_update_serial)(uint32_t, const uint8_t *, size_t) = crc_sw;
static uint32_t (*crc_update_streams)(uint32_t, const uint8_t *, size_t) = crc_sw;
static uint32_t (*copy_crc_update)(uint32_t, const uint8_t *, size_t, uint8_t *) = copy_crc_sw;
static uint32_t (*copy_crc_update_streams)(uint32_t, const uint8_t *, size_t, uint8_t *) = copy_crc_sw;

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

/* Below this many bytes crc32c keeps the GIL: a key's CRC (the node pool's index hash,
 * once per lookup on the scheduler thread) takes tens of ns, and giving the GIL away
 * hands it to any other thread of the process, so the caller waits to get it back
 * (docs/node-pool.md, "Lookups"). Chunks (KiB and more) still release it. */
#define CRC_GIL_RELEASE_MIN 4096

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
    if (b.len >= CRC_GIL_RELEASE_MIN) {
        Py_BEGIN_ALLOW_THREADS
        c = update(c, (const uint8_t *)b.buf, (size_t)b.len);
        Py_END_ALLOW_THREADS
    } else {
        c = update(c, (const uint8_t *)b.buf, (size_t)b.len);
    }
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

PyDoc_STRVAR(crc32c_streams_doc,
"crc32c_streams(data, value=0, /) -> int\n\n"
"crc32c on three crc32 streams (where the CPU has SSE4.2; else the table), whatever\n"
"else it has (tests compare the paths).");

static PyObject *py_crc32c_streams(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return crc32c_with(crc_update_streams, args, nargs);
}

PyDoc_STRVAR(crc32c_serial_doc,
"crc32c_serial(data, value=0, /) -> int\n\n"
"crc32c on a single stream (the instruction where crc32c uses it, else the table):\n"
"the bench's baseline for the three streams; tests compare the two.");

static PyObject *py_crc32c_serial(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return crc32c_with(crc_update_serial, args, nargs);
}

PyDoc_STRVAR(copy_crc32c_doc,
"copy_crc32c(dst, src, value=0, /) -> int\n\n"
"Copy the bytes-like ``src`` into ``dst`` (writable, contiguous, exactly len(src) bytes,\n"
"not overlapping src) and return crc32c(src, value), in one pass over the bytes: each\n"
"block is checksummed as it is copied (carry-less folding where the CPU has AVX-512\n"
"VPCLMULQDQ, else three crc32 streams: CRC32C_IMPL), with non-temporal stores,\n"
"so the checksum costs little over the copy.");

static PyObject *copy_crc32c_with(uint32_t (*update)(uint32_t, const uint8_t *, size_t, uint8_t *),
                                  PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "copy_crc32c(dst, src, value=0) takes 2 or 3 arguments");
        return NULL;
    }
    uint32_t value = 0;
    if (nargs == 3) {
        unsigned long v = PyLong_AsUnsignedLongMask(args[2]);
        if (v == (unsigned long)-1 && PyErr_Occurred()) return NULL;
        value = (uint32_t)v;
    }
    Py_buffer v[2];
    if (PyObject_GetBuffer(args[0], &v[0], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyErr_Format(PyObject_CheckBuffer(args[0]) ? PyExc_BufferError : PyExc_TypeError,
                     "copy_crc32c: dst must be a writable contiguous buffer, got %.100s",
                     Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &v[1], PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&v[0]);
        return NULL;
    }
    uint8_t *dst = v[0].buf;
    const uint8_t *src = v[1].buf;
    size_t n = (size_t)v[1].len;
    if (v[0].len != v[1].len) {
        PyErr_Format(PyExc_ValueError,
                     "copy_crc32c: dst has %zd bytes, src %zd (must be equal)", v[0].len, v[1].len);
        release_views(v, 2);
        return NULL;
    }
    if (n && (uintptr_t)dst < (uintptr_t)src + n && (uintptr_t)src < (uintptr_t)dst + n) {
        PyErr_SetString(PyExc_ValueError, "copy_crc32c: dst and src overlap");
        release_views(v, 2);
        return NULL;
    }
    uint32_t c = ~value;
    Py_BEGIN_ALLOW_THREADS
    c = update(c, src, n, dst);
    Py_END_ALLOW_THREADS
    release_views(v, 2);
    return PyLong_FromUnsignedLong((unsigned long)(~c));
}

static PyObject *py_copy_crc32c(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return copy_crc32c_with(copy_crc_update, args, nargs);
}

PyDoc_STRVAR(copy_crc32c_table_doc,
"copy_crc32c_table(dst, src, value=0, /) -> int\n\n"
"copy_crc32c with the portable table, whatever the CPU (tests compare the two).");

static PyObject *py_copy_crc32c_table(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return copy_crc32c_with(copy_crc_sw, args, nargs);
}

PyDoc_STRVAR(copy_crc32c_streams_doc,
"copy_crc32c_streams(dst, src, value=0, /) -> int\n\n"
"copy_crc32c on three crc32 streams (where the CPU has SSE4.2; else the table),\n"
"whatever else the CPU has (tests compare the paths).");

static PyObject *py_copy_crc32c_streams(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return copy_crc32c_with(copy_crc_update_streams, args, nargs);
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
    {"crc32c_streams", (PyCFunction)(void (*)(void))py_crc32c_streams, METH_FASTCALL,
     crc32c_streams_doc},
    {"crc32c_serial", (PyCFunction)(void (*)(void))py_crc32c_serial, METH_FASTCALL,
     crc32c_serial_doc},
    {"copy_crc32c", (PyCFunction)(void (*)(void))py_copy_crc32c, METH_FASTCALL,
     copy_crc32c_doc},
    {"copy_crc32c_table", (PyCFunction)(void (*)(void))py_copy_crc32c_table, METH_FASTCALL,
     copy_crc32c_table_doc},
    {"copy_crc32c_streams", (PyCFunction)(void (*)(void))py_copy_crc32c_streams, METH_FASTCALL,
     copy_crc32c_streams_doc},
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
    crc3_zeros_init(&crc3_long_op, CRC3_LONG);
    crc3_zeros_init(&crc3_short_op, CRC3_SHORT);
    const char *impl = "table";
#ifdef HAVE_X86_CRC
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
        crc_update = crc_update_streams = crc_hw3;
        crc_update_serial = crc_hw;
        copy_crc_update = copy_crc_update_streams = copy_crc_hw3;
        impl = "sse4.2";
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
            __builtin_cpu_supports("pclmul")) {
            fold_init(&fold256, 256);
            fold_init(&fold64, 64);
            fold_init(&fold16, 16);
            crc_update = crc_fold;
            copy_crc_update = copy_crc_fold;
            impl = "vpclmulqdq";
        }
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* block lengths of the three-stream path (crc32c_streams; crc32c where CRC32C_IMPL
     * is "sse4.2", and below FOLD_MIN bytes where it is "vpclmulqdq") */
    PyObject *blocks = Py_BuildValue("(ii)", CRC3_LONG, CRC3_SHORT);
    if (blocks == NULL || PyModule_AddStringConstant(m, "CRC32C_IMPL", impl) < 0 ||
        PyModule_AddObjectRef(m, "CRC32C_BLOCKS", blocks) < 0) {
        Py_XDECREF(blocks);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(blocks);
    return m;
}
