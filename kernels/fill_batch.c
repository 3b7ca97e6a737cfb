/* A loader task's parts in one call, without the GIL: for each part, read its checkpoint bytes from the shard
 * (pread, from the page cache), dequantize them by the table lookup of dequant_lut.c (or keep them as they are),
 * hash the source and the result while each piece is in cache, and write the result into its segment (pwrite
 * into the tmpfs file: fresh pages are taken without being zeroed first; or straight to an address where the
 * folder has no write(), hugetlbfs). An FP8 part's scales are read, hashed and checked here too, and its table
 * made here: each block's 256 results are float32(code) * float32(scale) rounded to bf16 to nearest even, as
 * torch's cast rounds (NaN codes get the bits torch writes, passed in). Python only plans: one descriptor row
 * per part, one call per task; at many cores the GIL is then no shared lock the threads take turns on.
 *
 * desc[FIELDS * i ...] of part i:
 *   0 kind (KIND_COPY: stored bytes; KIND_LUT16: fp8 -> bf16 by a table; KIND_SCALES: only the part's scales read,
 *     hashed, checked and widened to float32 at the address in 6, for the GPU)
 *   1 source fd, 2 source offset (of the part's first byte in the file); fd -1: the bytes at the address in 2
 *   3 rows m, 4 columns n (KIND_COPY: m bytes, n = 1)
 *   5 destination fd (-1: write at the address in 6), 6 destination offset in that file (or the address)
 *   7 scale fd, 8 scale offset, 9 rows and 10 columns a scale covers, 11 scale dtype (SCALE_F32, SCALE_BF16,
 *     SCALE_F16), ceil(m / rows) * ceil(n / columns) scales
 *   12 (out) what failed: 0 nothing, ERR_READ, ERR_SHORT (the file ended early), ERR_WRITE, ERR_SCALE (a scale
 *     that is not finite and positive, or ERR_SHORT / ERR_READ of the scale: 13 says which); 13 (out) errno, or the
 *     bad scale's index, or SCALE_FILE for a scale read that failed
 * hashes[3i ...]: XXH3-64 of the source bytes, of the result, of the scale bytes (the daemon's checksums).
 * env: XXH3 createState, freeState, 64bits_reset, 64bits_update, 64bits_digest, 64bits (one shot); the address of
 * the float32 value of each fp8 code (256); the bf16 bits for the NaN codes 0x7f and 0xff.
 * A failure stops the call at that part; the caller raises an error that names its file and tensor.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

enum { FIELDS = 14, KIND_COPY = 0, KIND_LUT16 = 1, KIND_SCALES = 2, ERR_READ = 1, ERR_SHORT = 2, ERR_WRITE = 3, ERR_SCALE = 4 };
enum { SCALE_F32 = 0, SCALE_BF16 = 1, SCALE_F16 = 2, SCALE_FILE = -1 };

typedef void *(*xxh_create_fn)(void);
typedef int (*xxh_free_fn)(void *);
typedef int (*xxh_reset_fn)(void *);
typedef int (*xxh_update_fn)(void *, const void *, size_t);
typedef uint64_t (*xxh_digest_fn)(const void *);
typedef uint64_t (*xxh_once_fn)(const void *, size_t);

void dequant_lut16(const uint8_t *x, const uint16_t *lut, uint16_t *y, int64_t n, int64_t brow, int64_t bcol,
                   int64_t r0, int64_t r1);

static int read_all(int fd, uint8_t *buf, size_t nbytes, int64_t at, int64_t *d) {
    while (nbytes) {
        ssize_t got = pread(fd, buf, nbytes, at);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            d[12] = got < 0 ? ERR_READ : ERR_SHORT;
            d[13] = got < 0 ? errno : 0;
            return -1;
        }
        buf += got, nbytes -= (size_t)got, at += got;
    }
    return 0;
}

static int write_all(int fd, const uint8_t *buf, size_t nbytes, int64_t at, int64_t *d) {
    while (nbytes) {
        ssize_t done = pwrite(fd, buf, nbytes, at);
        if (done < 0 && errno == EINTR) continue;
        if (done <= 0) {
            d[12] = ERR_WRITE;
            d[13] = done < 0 ? errno : ENOSPC;
            return -1;
        }
        buf += done, nbytes -= (size_t)done, at += done;
    }
    return 0;
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (!man) {
        bits = sign;
    } else { /* subnormal: normalised, exactly */
        int shifts = 0;
        while (!(man & 0x400)) man <<= 1, shifts++;
        bits = sign | ((uint32_t)(113 - shifts) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t to_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16); /* to nearest even: torch's rounding */
}

/* How many scales part d has: one per block of rows x columns (desc 9, 10), partial edge blocks included. */
static int64_t scale_count(const int64_t *d) { return ((d[3] + d[9] - 1) / d[9]) * ((d[4] + d[10] - 1) / d[10]); }

/* Read, hash and check part d's scales (ceil(m / rows) * ceil(n / columns) of them) into `raw`, widened to float32
 * into `vals`; returns how many, or -1 where one failed (desc[12], desc[13] say what). */
static int64_t read_scales(int64_t *d, const int64_t *env, uint8_t *raw, float *vals, uint64_t *scale_hash) {
    int64_t count = scale_count(d), item = d[11] == SCALE_F32 ? 4 : 2;
    if (read_all((int)d[7], raw, (size_t)(count * item), d[8], d)) {
        d[13] = SCALE_FILE;
        return -1;
    }
    *scale_hash = ((xxh_once_fn)(intptr_t)env[5])(raw, (size_t)(count * item));
    for (int64_t k = 0; k < count; k++) {
        float s;
        if (d[11] == SCALE_F32) {
            memcpy(&s, raw + 4 * k, 4);
        } else {
            uint16_t h;
            memcpy(&h, raw + 2 * k, 2);
            if (d[11] == SCALE_BF16) {
                uint32_t bits = (uint32_t)h << 16;
                memcpy(&s, &bits, 4);
            } else {
                s = half_to_float(h);
            }
        }
        if (!(s > 0.0f) || !(s < INFINITY)) { /* NaN fails both, -inf and 0 the first */
            d[12] = ERR_SCALE, d[13] = k;
            return -1;
        }
        vals[k] = s;
    }
    return count;
}

/* Part d's table in `lut`: 256 results per scale; `raw` holds 8 bytes per scale. */
static int make_table(int64_t *d, const int64_t *env, uint8_t *raw, uint16_t *lut, uint64_t *scale_hash) {
    const float *codes = (const float *)(intptr_t)env[6];
    uint16_t nan_pos = (uint16_t)env[7], nan_neg = (uint16_t)env[8];
    float *vals = (float *)(raw + 4 * scale_count(d));
    int64_t count = read_scales(d, env, raw, vals, scale_hash);
    if (count < 0) return -1;
    for (int64_t k = 0; k < count; k++) {
        uint16_t *row = lut + 256 * k;
        for (int c = 0; c < 256; c++) row[c] = to_bf16(codes[c] * vals[k]);
        row[0x7f] = nan_pos, row[0xff] = nan_neg;
    }
    return 0;
}

/* Part d piece by piece: `chunk` result bytes at a time (whole rows; one row when a row is larger), through
 * `in` (source pieces) and `out` (result pieces), each at least max(chunk, one row's result) bytes; `raw` and `lut`
 * hold the scales and the table (ceil(m / rows) * ceil(n / columns) times 8 and 512 bytes). */
static int fill_one(int64_t *d, const int64_t *env, uint8_t *in, uint8_t *out, uint8_t *raw, uint16_t *lut,
                    int64_t chunk, uint64_t *hashes) {
    int64_t kind = d[0], src_fd = d[1], src_at = d[2], m = d[3], n = d[4], dst_fd = d[5], dst_at = d[6];
    int64_t item = kind == KIND_LUT16 ? 2 : 1; /* result bytes per source byte */
    int64_t rows = n > 0 ? chunk / (n * item) : m; /* no columns: nothing to read, one empty piece */
    void *hs = NULL, *ho = NULL;
    int rc = -1;
    hashes[0] = hashes[1] = hashes[2] = 0;
    if (kind == KIND_SCALES) /* only the scales, as float32 at the destination address */
        return read_scales(d, env, raw, (float *)(intptr_t)dst_at, hashes + 2) < 0 ? -1 : 0;
    if (kind == KIND_LUT16 && make_table(d, env, raw, lut, hashes + 2)) return -1;
    hs = ((xxh_create_fn)(intptr_t)env[0])(), ho = ((xxh_create_fn)(intptr_t)env[0])();
    xxh_reset_fn reset = (xxh_reset_fn)(intptr_t)env[2];
    xxh_update_fn update = (xxh_update_fn)(intptr_t)env[3];
    if (!hs || !ho) {
        d[12] = ERR_READ, d[13] = ENOMEM;
        goto done;
    }
    reset(hs), reset(ho);
    if (rows < 1) rows = 1;
    for (int64_t r0 = 0; r0 < m; r0 += rows) {
        int64_t r1 = r0 + rows < m ? r0 + rows : m;
        size_t in_bytes = (size_t)((r1 - r0) * n), out_bytes = in_bytes * (size_t)item;
        uint8_t *y = dst_fd < 0 ? (uint8_t *)(intptr_t)(dst_at + r0 * n * item) : out;
        uint8_t *x = kind == KIND_COPY ? y : in; /* stored bytes are read straight into place */
        if (src_fd < 0) {
            x = (uint8_t *)(intptr_t)(src_at + r0 * n); /* already in memory: hashed (and written) from there */
            if (kind == KIND_COPY) y = x;
            if (kind == KIND_COPY && dst_fd < 0) memcpy((uint8_t *)(intptr_t)(dst_at + r0 * n), x, in_bytes);
        } else if (read_all((int)src_fd, x, in_bytes, src_at + r0 * n, d)) {
            goto done;
        }
        update(hs, x, in_bytes);
        if (kind == KIND_LUT16) /* rows [r0, r1) of the part: the buffers stand for its rows from r0 on */
            dequant_lut16(x - r0 * n, lut, (uint16_t *)y - r0 * n, n, d[9], d[10], r0, r1);
        if (kind != KIND_COPY) update(ho, y, out_bytes); /* a copy's result is its source: hashed once */
        if (dst_fd >= 0 && write_all((int)dst_fd, y, out_bytes, dst_at + r0 * n * item, d)) goto done;
    }
    rc = 0;
done:
    if (rc == 0) {
        xxh_digest_fn digest = (xxh_digest_fn)(intptr_t)env[4];
        hashes[0] = digest(hs);
        hashes[1] = kind == KIND_COPY ? hashes[0] : digest(ho);
    }
    if (hs) ((xxh_free_fn)(intptr_t)env[1])(hs);
    if (ho) ((xxh_free_fn)(intptr_t)env[1])(ho);
    return rc;
}

/* Every part of a task in order; returns how many were filled (count unless one failed: see its desc[12]). */
int64_t fill_batch(int64_t count, int64_t *desc, const int64_t *env, uint8_t *in, uint8_t *out, uint8_t *raw,
                   uint16_t *lut, int64_t chunk, uint64_t *hashes) {
    for (int64_t i = 0; i < count; i++) {
        int64_t *d = desc + FIELDS * i;
        d[12] = d[13] = 0;
        if (fill_one(d, env, in, out, raw, lut, chunk, hashes + 3 * i)) return i;
    }
    return count;
}
