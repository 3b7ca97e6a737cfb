/* FP8 block dequant as a table lookup: within one scale block every fp8 byte has exactly one
 * result, so the caller computes the 256 results of each block with torch (bit for bit the
 * reference's float32(x) * s, rounded by torch's own cast) and this loop only gathers.
 *
 * y[r, c] = lut[((r / B) * nbc + c / B) * 256 + x[r, c]] for rows [r0, r1) of an M x N matrix.
 *
 * The 16-bit loop reads 8 bytes at a time and stores 4 results per 64-bit write (little-endian
 * hosts): ~1.3x the one-element loop; the tail of each block goes one by one.
 */
#include <stdint.h>
#include <string.h>

#define DEQUANT_LUT(NAME, T)                                                                    \
    void NAME(const uint8_t *x, const T *lut, T *y, int64_t n, int64_t block, int64_t r0,       \
              int64_t r1) {                                                                     \
        int64_t nbc = (n + block - 1) / block;                                                  \
        for (int64_t r = r0; r < r1; r++) {                                                     \
            const T *lrow = lut + (r / block) * nbc * 256;                                      \
            const uint8_t *xr = x + r * n;                                                      \
            T *yr = y + r * n;                                                                  \
            for (int64_t cb = 0; cb < nbc; cb++) {                                              \
                const T *l = lrow + cb * 256;                                                   \
                int64_t c = cb * block;                                                         \
                int64_t c1 = (cb + 1) * block < n ? (cb + 1) * block : n;                       \
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
DEQUANT_LUT(dequant_lut16, uint16_t)
#undef WIDE
#define WIDE wide32
DEQUANT_LUT(dequant_lut32, uint32_t)

/* Many small parts in one call (the caller's Python drops the GIL for it): part i is described by
 * desc[5i..5i+4] = fp8 bytes x, result y, rows m, columns n, its first block's row of the table.
 * y = the table lookup of x, and both are hashed: hashes[2i] = hash(x), hashes[2i+1] = hash(y).
 * `hash` is XXH3_64bits of the xxhash library the daemon already loads. */
typedef uint64_t (*hash64_fn)(const void *, size_t);

void fill_parts16(int64_t count, const int64_t *desc, const uint16_t *lut, int64_t block, hash64_fn hash,
                  uint64_t *hashes) {
    for (int64_t i = 0; i < count; i++) {
        const int64_t *d = desc + 5 * i;
        const uint8_t *x = (const uint8_t *)(intptr_t)d[0];
        uint16_t *y = (uint16_t *)(intptr_t)d[1];
        int64_t m = d[2], n = d[3];
        hashes[2 * i] = hash(x, (size_t)(m * n));
        dequant_lut16(x, lut + d[4] * 256, y, n, block, 0, m);
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
