/* FP8 block dequant as a table lookup: within one scale block every fp8 byte has exactly one
 * result, so the caller computes the 256 results of each block with torch (bit for bit the
 * reference's float32(x) * s, rounded by torch's own cast) and this loop only gathers.
 *
 * y[r, c] = lut[((r / BR) * nbc + c / BC) * 256 + x[r, c]] for rows [r0, r1) of an M x N matrix, one scale
 * per BR x BC block (DeepSeek: 128 x 128; compressed-tensors: 1 x N per channel, M x N per tensor).
 *
 * The 16-bit loop reads 8 bytes at a time and stores 4 results per 64-bit write (little-endian
 * hosts): ~1.3x the one-element loop; the tail of each block goes one by one.
 */
#include <stdint.h>
#include <string.h>

#define DEQUANT_LUT(NAME, T)                                                                    \
    void NAME(const uint8_t *x, const T *lut, T *y, int64_t n, int64_t brow, int64_t bcol,      \
              int64_t r0, int64_t r1) {                                                         \
        int64_t nbc = (n + bcol - 1) / bcol;                                                    \
        for (int64_t r = r0; r < r1; r++) {                                                     \
            const T *lrow = lut + (r / brow) * nbc * 256;                                       \
            const uint8_t *xr = x + r * n;                                                      \
            T *yr = y + r * n;                                                                  \
            for (int64_t cb = 0; cb < nbc; cb++) {                                              \
                const T *l = lrow + cb * 256;                                                   \
                int64_t c = cb * bcol;                                                          \
                int64_t c1 = (cb + 1) * bcol < n ? (cb + 1) * bcol : n;                         \
                c = WIDE(xr, l, yr, c, c1);                                                     \
                for (; c < c1; c++) yr[c] = l[xr[c]];                                           \
            }                                                                                   \
        }                                                                                       \
    }

static inline int64_t wide16(const uint8_t *xr, const uint16_t *l, uint16_t *yr, int64_t c, int64_t c1) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (; c + 8 <= c1; c += 8) {
        uint64_t w, a, b;
        memcpy(&w, xr + c, 8);
        a = (uint64_t)l[w & 255] | (uint64_t)l[(w >> 8) & 255] << 16 | (uint64_t)l[(w >> 16) & 255] << 32 |
            (uint64_t)l[(w >> 24) & 255] << 48;
        b = (uint64_t)l[(w >> 32) & 255] | (uint64_t)l[(w >> 40) & 255] << 16 | (uint64_t)l[(w >> 48) & 255] << 32 |
            (uint64_t)l[(w >> 56) & 255] << 48;
        memcpy(yr + c, &a, 8);
        memcpy(yr + c + 4, &b, 8);
    }
#endif
    return c;
}

static inline int64_t wide32(const uint8_t *xr, const uint32_t *l, uint32_t *yr, int64_t c, int64_t c1) {
    (void)xr, (void)l, (void)yr, (void)c1;
    return c;
}

#define WIDE wide16
DEQUANT_LUT(dequant_lut16_scalar, uint16_t)
#undef WIDE
#define WIDE wide32
DEQUANT_LUT(dequant_lut32, uint32_t)

/* With AVX-512 VBMI (checked at run time; compiled for any x86-64 through target attributes) the 16-bit
 * gather takes 64 bytes at a time: each block's table is split into its low and high result bytes
 * (4 registers each, 256 entries), `vpermi2b` looks up 64 codes in the half their top bit selects,
 * and the two byte planes are interleaved back into 64 results. Still a pure gather of the same
 * table: bit for bit the scalar loop's results. Blocks are walked block by block (all their rows for
 * one table), so each table is split once per block, not once per row. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi")))

#define SPLIT(K)                                                                                     \
    do {                                                                                             \
        __m512i a = _mm512_loadu_si512(l + 64 * (K)), b = _mm512_loadu_si512(l + 64 * (K) + 32);      \
        lo##K = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)),                  \
                                   _mm512_cvtepi16_epi8(b), 1);                                      \
        hi##K = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srli_epi16(a, 8))), \
                                   _mm512_cvtepi16_epi8(_mm512_srli_epi16(b, 8)), 1);                \
    } while (0)

VBMI static void dequant_lut16_vbmi(const uint8_t *x, const uint16_t *lut, uint16_t *y, int64_t n, int64_t brow,
                                    int64_t bcol, int64_t r0, int64_t r1) {
    int64_t nbc = (n + bcol - 1) / bcol;
    /* after unpacking within 128-bit lanes: words 0-31 are qwords {0,1} {8,9} {2,3} {10,11} of (u0, u1) */
    const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
    const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (int64_t rb = r0 / brow; rb * brow < r1; rb++) {
        int64_t ra = rb * brow > r0 ? rb * brow : r0;
        int64_t rz = (rb + 1) * brow < r1 ? (rb + 1) * brow : r1;
        for (int64_t cb = 0; cb < nbc; cb++) {
            const uint16_t *l = lut + (rb * nbc + cb) * 256;
            int64_t c0 = cb * bcol, c1 = (cb + 1) * bcol < n ? (cb + 1) * bcol : n;
            __m512i lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3;
            lo0 = lo1 = lo2 = lo3 = hi0 = hi1 = hi2 = hi3 = _mm512_setzero_si512();
            if (c1 - c0 >= 64) {
                SPLIT(0);
                SPLIT(1);
                SPLIT(2);
                SPLIT(3);
            }
            for (int64_t r = ra; r < rz; r++) {
                const uint8_t *xr = x + r * n;
                uint16_t *yr = y + r * n;
                int64_t c = c0;
                for (; c + 64 <= c1; c += 64) {
                    __m512i v = _mm512_loadu_si512(xr + c);
                    __mmask64 top = _mm512_movepi8_mask(v); /* codes 128-255: the second half */
                    __m512i lo = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(lo0, v, lo1),
                                                        _mm512_permutex2var_epi8(lo2, v, lo3));
                    __m512i hi = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(hi0, v, hi1),
                                                        _mm512_permutex2var_epi8(hi2, v, hi3));
                    __m512i u0 = _mm512_unpacklo_epi8(lo, hi), u1 = _mm512_unpackhi_epi8(lo, hi);
                    _mm512_storeu_si512(yr + c, _mm512_permutex2var_epi64(u0, first, u1));
                    _mm512_storeu_si512(yr + c + 32, _mm512_permutex2var_epi64(u0, second, u1));
                }
                c = wide16(xr, l, yr, c, c1);
                for (; c < c1; c++) yr[c] = l[xr[c]];
            }
        }
    }
}

static int vbmi_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vbmi");
}
#else
static int vbmi_supported(void) { return 0; }
#endif

/* A kernel's SIMD switch (this file's and mxfp4.c's): `enable` 1 or 0 sets *setting (1 only where
 * `supported()`), -1 only asks (deciding 1 where the CPU allows, the first time: *setting -1 is not decided
 * yet). Returns the setting now in force. */
int simd_switch(int *setting, int enable, int (*supported)(void)) {
    if (*setting < 0 || enable >= 0) *setting = (enable != 0) && supported();
    return *setting;
}

static int simd = -1; /* -1: not decided yet */

/* Whether the 16-bit gather uses the CPU's vector instructions (simd_switch). */
int dequant_lut_simd(int enable) { return simd_switch(&simd, enable, vbmi_supported); }

void dequant_lut16(const uint8_t *x, const uint16_t *lut, uint16_t *y, int64_t n, int64_t brow, int64_t bcol,
                   int64_t r0, int64_t r1) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (simd < 0) dequant_lut_simd(1);
    if (simd) {
        dequant_lut16_vbmi(x, lut, y, n, brow, bcol, r0, r1);
        return;
    }
#endif
    dequant_lut16_scalar(x, lut, y, n, brow, bcol, r0, r1);
}

/* Many small parts in one call (the caller's Python drops the GIL for it): part i is described by
 * desc[7i..7i+6] = fp8 bytes x, result y, rows m, columns n, its first block's row of the table, and the
 * rows and columns one of its scales covers.
 * y = the table lookup of x, and both are hashed: hashes[2i] = hash(x), hashes[2i+1] = hash(y).
 * `hash` is XXH3_64bits of the xxhash library the daemon already loads. */
typedef uint64_t (*hash64_fn)(const void *, size_t);

void fill_parts16(int64_t count, const int64_t *desc, const uint16_t *lut, hash64_fn hash, uint64_t *hashes) {
    for (int64_t i = 0; i < count; i++) {
        const int64_t *d = desc + 7 * i;
        const uint8_t *x = (const uint8_t *)(intptr_t)d[0];
        uint16_t *y = (uint16_t *)(intptr_t)d[1];
        int64_t m = d[2], n = d[3];
        hashes[2 * i] = hash(x, (size_t)(m * n));
        dequant_lut16(x, lut + d[4] * 256, y, n, d[5], d[6], 0, m);
        hashes[2 * i + 1] = hash(y, (size_t)(m * n) * 2);
    }
}

/* Copy many small buffers and hash each copy: desc[3i..3i+2] = source, destination, bytes. */
void copy_hash(int64_t count, const int64_t *desc, hash64_fn hash, uint64_t *hashes) {
    for (int64_t i = 0; i < count; i++) {
        const int64_t *d = desc + 3 * i;
        memcpy((void *)(intptr_t)d[1], (const void *)(intptr_t)d[0], (size_t)d[2]);
        hashes[i] = hash((const void *)(intptr_t)d[1], (size_t)d[2]);
    }
}
