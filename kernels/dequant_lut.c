/* FP8 block dequant as a table lookup: within one scale block every fp8 byte has exactly one
 * result, so the caller computes the 256 results of each block with torch (bit for bit the
 * reference's float32(x) * s, rounded by torch's own cast) and this loop only gathers.
 *
 * y[r, c] = lut[((r / B) * nbc + c / B) * 256 + x[r, c]] for rows [r0, r1) of an M x N matrix.
 */
#include <stdint.h>

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
                int64_t c1 = (cb + 1) * block < n ? (cb + 1) * block : n;                       \
                for (int64_t c = cb * block; c < c1; c++) yr[c] = l[xr[c]];                     \
            }                                                                                   \
        }                                                                                       \
    }

DEQUANT_LUT(dequant_lut16, uint16_t)
DEQUANT_LUT(dequant_lut32, uint32_t)
