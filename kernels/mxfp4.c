/* MXFP4 (gpt-oss's `*_blocks` / `*_scales`) dequant as a table lookup, built into the same library as
 * dequant_lut.c by native.py.
 *
 * One expert: blocks uint8 [R, G, 16] (two e2m1 codes per byte, low nibble first: 32 codes per group),
 * scales uint8 [R, G] (e8m0). The result is [G*32, R] (transformers' convert_moe_packed_tensors
 * transposes the last two dims): y[g*32 + 2i + h, r] = table[scales[r, g] * 16 + nibble h of blocks[r, g, i]].
 * The caller computes the [256, 16] table with transformers' own torch ops (bit for bit its decode); this
 * code only gathers.
 *
 * Reads go along r's bytes, writes along r's results: R is walked in tiles of TILE_R columns, and within
 * a tile each group's 32 result rows get a run of TILE_R contiguous bf16 each (256 bytes), so every
 * cache line written is filled while it is hot. With SSSE3 (asked at run time) 8 columns are decoded at
 * once: `pshufb` looks up 16 codes in the low and high byte planes of their scale's table row, and an
 * 8x8 transpose of 16-bit lanes turns 8 columns of 32 results into 32 rows of 8; with AVX2, 16 columns
 * (two such 8x8 transposes, one per 128-bit half). The same gather, so the same bits as the scalar loop.
 * The AVX2 loop stages a group's 32 x TILE_R results in L1 and then writes each row's run at once; a call
 * whose result is at least `mxfp4_stream_min` bytes writes those runs with non-temporal stores (whole
 * lines, no read for ownership: ~1.5x on a result far larger than the caches, which nobody reads soon).
 */
#include <stdint.h>
#include <string.h>

#define TILE_R 128

#define GROUPS_AT_ONCE 64
static int64_t stream_min = (int64_t)64 << 20; /* results of at least this many bytes: non-temporal stores */
static int mx_simd = -1;                       /* whether the gather uses SSSE3 (mxfp4_simd); -1: not decided yet */

/* The result size from which a call streams its stores: `bytes` >= 0 sets it, < 0 only asks. */
int64_t mxfp4_stream_min(int64_t bytes) {
    if (bytes >= 0) stream_min = bytes;
    return stream_min;
}

/* Columns [c0, c1) of groups [g0, g1) of one expert; y is row g0*32 of its [G*32, R] result. */
static void mxfp4_tile_scalar(const uint8_t *x, const uint8_t *s, const uint16_t *table, uint16_t *y, int64_t R,
                              int64_t G, int64_t g0, int64_t g1, int64_t c0, int64_t c1) {
    for (int64_t g = g0; g < g1; g++) {
        uint16_t *yg = y + (g - g0) * 32 * R;
        for (int64_t r = c0; r < c1; r++) {
            const uint16_t *t = table + (int64_t)s[r * G + g] * 16;
            const uint8_t *xb = x + (r * G + g) * 16;
            for (int i = 0; i < 16; i++) {
                uint8_t b = xb[i];
                yg[(2 * i) * R + r] = t[b & 15];
                yg[(2 * i + 1) * R + r] = t[b >> 4];
            }
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SSSE3 __attribute__((target("ssse3")))
#define AVX2 __attribute__((target("avx2")))

/* The transpose and the decode below are written once for both widths, as macros that define a function:
 * SSSE3 on __m128i (8 columns) and AVX2 on __m256i (16 columns, the same steps in each 128-bit half, which is
 * how the AVX2 forms of these instructions work). ATTR is the target, T the vector type, P the intrinsics'
 * prefix (_mm_ / _mm256_) and SI their whole-register suffix (si128 / si256). */

/* 8x8 transpose of 16-bit lanes (per 128-bit half): v[j] holds column j's 8 values; afterwards v[k] holds row k's. */
#define DEFINE_TRANSPOSE8X8(ATTR, NAME, T, P)                                        \
    ATTR static inline void NAME(T v[8]) {                                          \
        T a0 = P##unpacklo_epi16(v[0], v[1]), a1 = P##unpackhi_epi16(v[0], v[1]);   \
        T a2 = P##unpacklo_epi16(v[2], v[3]), a3 = P##unpackhi_epi16(v[2], v[3]);   \
        T a4 = P##unpacklo_epi16(v[4], v[5]), a5 = P##unpackhi_epi16(v[4], v[5]);   \
        T a6 = P##unpacklo_epi16(v[6], v[7]), a7 = P##unpackhi_epi16(v[6], v[7]);   \
        T b0 = P##unpacklo_epi32(a0, a2), b1 = P##unpackhi_epi32(a0, a2);           \
        T b2 = P##unpacklo_epi32(a1, a3), b3 = P##unpackhi_epi32(a1, a3);           \
        T b4 = P##unpacklo_epi32(a4, a6), b5 = P##unpackhi_epi32(a4, a6);           \
        T b6 = P##unpacklo_epi32(a5, a7), b7 = P##unpackhi_epi32(a5, a7);           \
        v[0] = P##unpacklo_epi64(b0, b4);                                           \
        v[1] = P##unpackhi_epi64(b0, b4);                                           \
        v[2] = P##unpacklo_epi64(b1, b5);                                           \
        v[3] = P##unpackhi_epi64(b1, b5);                                           \
        v[4] = P##unpacklo_epi64(b2, b6);                                           \
        v[5] = P##unpackhi_epi64(b2, b6);                                           \
        v[6] = P##unpacklo_epi64(b3, b7);                                           \
        v[7] = P##unpackhi_epi64(b3, b7);                                           \
    }

/* One column's 32 results (per 128-bit half) from its 16 bytes of codes and its scale's table row as two planes
 * (16 low bytes, 16 high bytes): `pshufb` looks each code up in both planes; v[q][j] gets results 8q..8q+7. */
#define DEFINE_DECODE32(ATTR, NAME, T, P, SI)                                                   \
    ATTR static inline void NAME(T lo_plane, T hi_plane, T bytes, T v[4][8], int j) {          \
        const T low4 = P##set1_epi8(0x0F);                                                     \
        T nl = P##and_##SI(bytes, low4), nh = P##and_##SI(P##srli_epi16(bytes, 4), low4);      \
        T c01 = P##unpacklo_epi8(nl, nh), c23 = P##unpackhi_epi8(nl, nh); /* result order */  \
        T l01 = P##shuffle_epi8(lo_plane, c01), h01 = P##shuffle_epi8(hi_plane, c01);          \
        T l23 = P##shuffle_epi8(lo_plane, c23), h23 = P##shuffle_epi8(hi_plane, c23);          \
        v[0][j] = P##unpacklo_epi8(l01, h01);                                                  \
        v[1][j] = P##unpackhi_epi8(l01, h01);                                                  \
        v[2][j] = P##unpacklo_epi8(l23, h23);                                                  \
        v[3][j] = P##unpackhi_epi8(l23, h23);                                                  \
    }

DEFINE_TRANSPOSE8X8(SSSE3, transpose8x8, __m128i, _mm_)
DEFINE_TRANSPOSE8X8(AVX2, transpose8x8x2, __m256i, _mm256_)
DEFINE_DECODE32(SSSE3, decode32, __m128i, _mm_, si128)
DEFINE_DECODE32(AVX2, decode32x2, __m256i, _mm256_, si256)

AVX2 static inline __m256i load2(const uint8_t *lo, const uint8_t *hi) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)lo)),
                                   _mm_loadu_si128((const __m128i *)hi), 1);
}

/* The SSSE3 step on 16 columns at once: column r+j in the low half of a register, r+8+j in the high
 * half, so after the per-half transposes each register holds one result row's 16 consecutive columns. */
AVX2 static int64_t mxfp4_cols_avx2(const uint8_t *x, const uint8_t *s, const uint8_t *planes, uint16_t *yg,
                                    int64_t R, int64_t G, int64_t g, int64_t c0, int64_t c1, int stream) {
    uint16_t st[32 * TILE_R] __attribute__((aligned(64))); /* row k's results at st[k * TILE_R + (r - c0)] */
    int64_t r = c0;
    for (; r + 16 <= c1; r += 16) {
        __m256i v[4][8];
        for (int j = 0; j < 8; j++) {
            int64_t a = (r + j) * G + g, b = (r + 8 + j) * G + g;
            const uint8_t *pa = planes + (int64_t)s[a] * 32, *pb = planes + (int64_t)s[b] * 32;
            __m256i lo_plane = load2(pa, pb), hi_plane = load2(pa + 16, pb + 16);
            decode32x2(lo_plane, hi_plane, load2(x + a * 16, x + b * 16), v, j);
        }
        for (int q = 0; q < 4; q++) {
            transpose8x8x2(v[q]);
            for (int k = 0; k < 8; k++)
                _mm256_store_si256((__m256i *)(st + (8 * q + k) * TILE_R + (r - c0)), v[q][k]);
        }
    }
    for (int k = 0; k < 32; k++) {
        const uint16_t *from = st + k * TILE_R;
        uint16_t *row = yg + k * R;
        if (stream && ((uintptr_t)(row + c0) & 31) == 0)
            for (int64_t c = c0; c < r; c += 16)
                _mm256_stream_si256((__m256i *)(row + c), _mm256_load_si256((const __m256i *)(from + (c - c0))));
        else
            for (int64_t c = c0; c < r; c += 16)
                _mm256_storeu_si256((__m256i *)(row + c), _mm256_load_si256((const __m256i *)(from + (c - c0))));
    }
    return r;
}

static int avx2 = 0;

SSSE3 static void mxfp4_tile_ssse3(const uint8_t *x, const uint8_t *s, const uint8_t *planes, uint16_t *y,
                                   int64_t R, int64_t G, int64_t g0, int64_t g1, int64_t c0, int64_t c1,
                                   int stream) {
    for (int64_t g = g0; g < g1; g++) {
        uint16_t *yg = y + (g - g0) * 32 * R;
        int64_t r = avx2 ? mxfp4_cols_avx2(x, s, planes, yg, R, G, g, c0, c1, stream) : c0;
        for (; r + 8 <= c1; r += 8) {
            __m128i v[4][8]; /* v[q][j]: results 8q..8q+7 of column r+j */
            for (int j = 0; j < 8; j++) {
                int64_t at = (r + j) * G + g;
                const uint8_t *p = planes + (int64_t)s[at] * 32; /* 16 low bytes, then 16 high bytes */
                __m128i lo_plane = _mm_loadu_si128((const __m128i *)p);
                __m128i hi_plane = _mm_loadu_si128((const __m128i *)(p + 16));
                decode32(lo_plane, hi_plane, _mm_loadu_si128((const __m128i *)(x + at * 16)), v, j);
            }
            for (int q = 0; q < 4; q++) {
                transpose8x8(v[q]);
                for (int k = 0; k < 8; k++) _mm_storeu_si128((__m128i *)(yg + (8 * q + k) * R + r), v[q][k]);
            }
        }
        if (r < c1) {
            /* the table, rebuilt from its planes, for the last < 8 columns */
            for (; r < c1; r++) {
                const uint8_t *p = planes + (int64_t)s[r * G + g] * 32;
                const uint8_t *xb = x + (r * G + g) * 16;
                for (int i = 0; i < 16; i++) {
                    uint8_t b = xb[i], l = b & 15, h = b >> 4;
                    yg[(2 * i) * R + r] = (uint16_t)(p[l] | p[16 + l] << 8);
                    yg[(2 * i + 1) * R + r] = (uint16_t)(p[h] | p[16 + h] << 8);
                }
            }
        }
    }
}

static int ssse3_supported(void) {
    __builtin_cpu_init();
    avx2 = __builtin_cpu_supports("avx2");
    return __builtin_cpu_supports("ssse3");
}
#else
static int ssse3_supported(void) { return 0; }
#endif

int simd_switch(int *setting, int enable, int (*supported)(void)); /* dequant_lut.c's, in the same library */

/* Whether the gather uses SSSE3 (and AVX2 where the CPU has it): simd_switch on SSSE3. */
int mxfp4_simd(int enable) { return simd_switch(&mx_simd, enable, ssse3_supported); }

/* Groups [g0, g1) of `experts` consecutive experts, each blocks [R, G, 16] / scales [R, G], into
 * y[experts, (g1-g0)*32, R]. `table` is uint16 [256, 16]. */
void mxfp4_dequant16(const uint8_t *x, const uint8_t *s, const uint16_t *table, uint16_t *y, int64_t experts,
                     int64_t R, int64_t G, int64_t g0, int64_t g1) {
    if (mx_simd < 0) mxfp4_simd(1);
#if defined(__x86_64__) && defined(__GNUC__)
    uint8_t planes[256 * 32]; /* per scale byte: the table row's 16 low bytes, then its 16 high bytes */
    if (mx_simd)
        for (int i = 0; i < 256; i++)
            for (int c = 0; c < 16; c++) {
                planes[i * 32 + c] = (uint8_t)(table[i * 16 + c] & 0xFF);
                planes[i * 32 + 16 + c] = (uint8_t)(table[i * 16 + c] >> 8);
            }
#endif
    int stream = (experts * (g1 - g0) * 32 * R * 2 >= stream_min);
    for (int64_t e = 0; e < experts; e++) {
        const uint8_t *xe = x + e * R * G * 16;
        const uint8_t *se = s + e * R * G;
        uint16_t *ye = y + e * (g1 - g0) * 32 * R;
        /* GROUPS_AT_ONCE groups (2048 result rows) at a time, tile by tile across R: the rows being written
         * stay the same few hundred pages while the blocks are read row by row (walking all groups per tile
         * would spread each tile's writes over one page per result row; one group at a time, its reads) */
        for (int64_t ga = g0; ga < g1; ga += GROUPS_AT_ONCE) {
            int64_t gz = ga + GROUPS_AT_ONCE < g1 ? ga + GROUPS_AT_ONCE : g1;
            uint16_t *yg = ye + (ga - g0) * 32 * R;
            for (int64_t c0 = 0; c0 < R; c0 += TILE_R) {
                int64_t c1 = c0 + TILE_R < R ? c0 + TILE_R : R;
#if defined(__x86_64__) && defined(__GNUC__)
                if (mx_simd) {
                    mxfp4_tile_ssse3(xe, se, planes, yg, R, G, ga, gz, c0, c1, stream);
                    continue;
                }
#endif
                mxfp4_tile_scalar(xe, se, table, yg, R, G, ga, gz, c0, c1);
            }
        }
    }
#if defined(__x86_64__) && defined(__GNUC__)
    if (mx_simd && stream) _mm_sfence(); /* the streamed stores are visible before the caller says done */
#endif
    (void)stream;
}
