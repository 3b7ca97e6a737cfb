/* A loader task's parts in one call, without the GIL: for each part, read its checkpoint bytes from the shard
 * (pread, from the page cache), dequantize them by the table lookup of dequant_lut.c (or keep them as they are),
 * hash the source and the result while each piece is in cache, and write the result into its segment (pwrite
 * into the tmpfs file: fresh pages are taken without being zeroed first; or straight to an address where the
 * folder has no write(), hugetlbfs). Python only plans: one descriptor row per part, one call per task.
 *
 * desc[FIELDS * i ...] of part i:
 *   0 kind (KIND_COPY: stored bytes; KIND_LUT16: fp8 -> a 16-bit table lookup)
 *   1 source fd, 2 source offset (of the part's first byte in the file); fd -1: the bytes at the address in 2
 *   3 rows m, 4 columns n (KIND_COPY: m bytes, n = 1)
 *   5 destination fd (-1: write at the address in 6), 6 destination offset in that file (or the address)
 *   7 address of the part's first table row (256 results per scale block), 8 rows and 9 columns a scale covers
 *   10 (out) what failed: 0 nothing, ERR_READ, ERR_SHORT (the file ended early), ERR_WRITE; 11 (out) errno
 * hashes[2i], hashes[2i + 1]: XXH3-64 of the source bytes and of the result (the daemon's checksums).
 * A failure stops the call at that part; the caller raises an error that names its file and tensor.
 */
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

enum { FIELDS = 12, KIND_COPY = 0, KIND_LUT16 = 1, ERR_READ = 1, ERR_SHORT = 2, ERR_WRITE = 3 };

/* XXH3's streaming functions, taken from the xxhash library the daemon already loads (its checksums' hash). */
typedef void *(*xxh_create_fn)(void);
typedef int (*xxh_free_fn)(void *);
typedef int (*xxh_reset_fn)(void *);
typedef int (*xxh_update_fn)(void *, const void *, size_t);
typedef uint64_t (*xxh_digest_fn)(const void *);

void dequant_lut16(const uint8_t *x, const uint16_t *lut, uint16_t *y, int64_t n, int64_t brow, int64_t bcol,
                   int64_t r0, int64_t r1);

static int read_all(int fd, uint8_t *buf, size_t nbytes, int64_t at, int64_t *d) {
    while (nbytes) {
        ssize_t got = pread(fd, buf, nbytes, at);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            d[10] = got < 0 ? ERR_READ : ERR_SHORT;
            d[11] = got < 0 ? errno : 0;
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
            d[10] = ERR_WRITE;
            d[11] = done < 0 ? errno : ENOSPC;
            return -1;
        }
        buf += done, nbytes -= (size_t)done, at += done;
    }
    return 0;
}

/* Part i piece by piece: `chunk` result bytes at a time (whole rows; one row when a row is larger), through
 * `in` (source pieces) and `out` (result pieces), each at least max(chunk, one row's result) bytes. */
static int fill_one(int64_t *d, const int64_t *xxh, uint8_t *in, uint8_t *out, int64_t chunk, uint64_t *hashes) {
    xxh_create_fn create = (xxh_create_fn)(intptr_t)xxh[0];
    xxh_free_fn release = (xxh_free_fn)(intptr_t)xxh[1];
    xxh_reset_fn reset = (xxh_reset_fn)(intptr_t)xxh[2];
    xxh_update_fn update = (xxh_update_fn)(intptr_t)xxh[3];
    xxh_digest_fn digest = (xxh_digest_fn)(intptr_t)xxh[4];
    int64_t kind = d[0], src_fd = d[1], src_at = d[2], m = d[3], n = d[4], dst_fd = d[5], dst_at = d[6];
    int64_t item = kind == KIND_LUT16 ? 2 : 1; /* result bytes per source byte */
    int64_t rows = chunk / (n * item);
    void *hs = create(), *ho = create();
    int rc = -1;
    if (!hs || !ho) {
        d[10] = ERR_READ, d[11] = ENOMEM;
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
        if (kind == KIND_LUT16)
            /* rows [r0, r1) of the part: the buffers stand for its rows from r0 on */
            dequant_lut16(x - r0 * n, (const uint16_t *)(intptr_t)d[7], (uint16_t *)y - r0 * n, n, d[8], d[9], r0,
                          r1);
        if (kind != KIND_COPY) update(ho, y, out_bytes); /* a copy's result is its source: hashed once */
        if (dst_fd >= 0 && write_all((int)dst_fd, y, out_bytes, dst_at + r0 * n * item, d)) goto done;
    }
    hashes[0] = digest(hs);
    hashes[1] = kind == KIND_COPY ? hashes[0] : digest(ho);
    rc = 0;
done:
    if (hs) release(hs);
    if (ho) release(ho);
    return rc;
}

/* Every part of a task in order; returns how many were filled (count unless one failed: see its desc[10]). */
int64_t fill_batch(int64_t count, int64_t *desc, const int64_t *xxh, uint8_t *in, uint8_t *out, int64_t chunk,
                   uint64_t *hashes) {
    for (int64_t i = 0; i < count; i++) {
        int64_t *d = desc + FIELDS * i;
        d[10] = d[11] = 0;
        if (fill_one(d, xxh, in, out, chunk, hashes + 2 * i)) return i;
    }
    return count;
}
