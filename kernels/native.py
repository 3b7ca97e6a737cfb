"""The CPU dequant as a compiled table lookup, built on first use with the system C compiler.

Within a 128x128 scale block each of the 256 fp8 byte values has exactly one result, so torch
computes those 256 results per block (the reference's own float32 product and cast, hence bit
for bit the reference, NaN patterns included) and a small C loop gathers them, on as many threads
as torch uses. No compiler, or a failed build, leaves `available()` False and the vectorized torch
path in `cpu.py` in charge.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

log = logging.getLogger("expertd.kernels")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dequant_lut.c")
MXFP4_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mxfp4.c")
FILL_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fill_batch.c")
SOURCES = (SOURCE, MXFP4_SOURCE, FILL_SOURCE)  # compiled together into one cached library
_lock = threading.Lock()
_lib = None
_tried = False
_pool: ThreadPoolExecutor | None = None


def _cache_dir() -> str:
    base = os.environ.get("EXPERTD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "expertd")
    os.makedirs(base, exist_ok=True)
    return base


def _build() -> ctypes.CDLL | None:
    h = hashlib.sha256()
    for source in SOURCES:
        with open(source, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    digest = h.hexdigest()[:16]
    target = os.path.join(_cache_dir(), f"dequant_lut-{digest}.so")
    if not os.path.exists(target):
        compiler = os.environ.get("CC", "cc")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
        os.close(fd)
        try:
            subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-o", tmp, *SOURCES], check=True, capture_output=True,
                           timeout=120)
            os.replace(tmp, target)  # atomic: concurrent builders never load half a file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(target)
    for fn in (lib.dequant_lut16, lib.dequant_lut32):
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5
        fn.restype = None
    lib.fill_parts16.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.fill_parts16.restype = None
    lib.copy_hash.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.copy_hash.restype = None
    lib.dequant_lut_simd.argtypes = [ctypes.c_int]
    lib.dequant_lut_simd.restype = ctypes.c_int
    lib.dequant_lut_simd(0 if os.environ.get("EXPERTD_NATIVE_SIMD", "1") == "0" else 1)
    lib.mxfp4_dequant16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5
    lib.mxfp4_dequant16.restype = None
    lib.mxfp4_simd.argtypes = [ctypes.c_int]
    lib.mxfp4_simd.restype = ctypes.c_int
    lib.mxfp4_simd(0 if os.environ.get("EXPERTD_NATIVE_SIMD", "1") == "0" else 1)
    lib.mxfp4_stream_min.argtypes = [ctypes.c_int64]
    lib.mxfp4_stream_min.restype = ctypes.c_int64
    lib.fill_batch.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 6 + [ctypes.c_int64, ctypes.c_void_p]
    lib.fill_batch.restype = ctypes.c_int64
    return lib


def simd(enable: bool | None = None) -> bool:
    """Whether the 16-bit gather runs on AVX-512 VBMI (64 codes per instruction; the CPU is asked at run
    time). `enable` switches it (on only where the CPU has it; EXPERTD_NATIVE_SIMD=0 starts it off);
    the results are the same bits either way."""
    if not available():
        return False
    return bool(_lib.dequant_lut_simd(-1 if enable is None else int(enable)))


def _xxh3_address() -> int | None:
    """The address of XXH3_64bits in the xxhash module's own library (the checksums' hash), if it exports it."""
    try:
        import xxhash._xxhash as compiled

        lib = ctypes.CDLL(compiled.__file__)
        fn = getattr(lib, "XXH3_64bits_dispatch", None) or lib.XXH3_64bits  # the widest vectors the CPU has
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_char_p, ctypes.c_size_t], ctypes.c_uint64
    probe = b"expertd"
    if fn(probe, len(probe)) != xxhash.xxh3_64_intdigest(probe):  # not the hash the index records
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value


_xxh3: list = []


def _hash_address() -> int | None:
    if not _xxh3:
        _xxh3.append(_xxh3_address())
    return _xxh3[0]


_XXH3_STREAM = ("XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset", "XXH3_64bits_update",
                 "XXH3_64bits_digest")
_env: list = []


def _fill_env() -> torch.Tensor | None:
    """What fill_batch.c calls and reads, as an int64 table in its order: XXH3's streaming functions and its one-shot
    function (from the xxhash module's own library, the index's hash), the float32 value of every fp8 code, and the
    bf16 bits the reference writes for the NaN codes 0x7f and 0xff. None where the library lacks a function."""
    if not _env:
        table = None
        try:
            import xxhash._xxhash as compiled

            from .reference import nan_bits

            lib = ctypes.CDLL(compiled.__file__)
            fns = [getattr(lib, name) for name in _XXH3_STREAM]
            if hasattr(lib, "XXH3_64bits_update_dispatch"):  # the same hash on the CPU's widest vectors: ~2x here
                fns[3] = lib.XXH3_64bits_update_dispatch
            once = _hash_address()
            if once is not None:
                table = torch.tensor([*(ctypes.cast(fn, ctypes.c_void_p).value for fn in fns), once, _CODES.data_ptr(),
                                      *(bits & 0xFFFF for bits in nan_bits(torch.bfloat16))], dtype=torch.int64)
        except (ImportError, OSError, AttributeError):
            table = None
        _env.append(table)
    return _env[0]


# fill_batch's descriptor: FILL_FIELDS int64 per part (fill_batch.c says what each is)
FILL_FIELDS, FILL_COPY, FILL_LUT16, FILL_SCALES = 14, 0, 1, 2
FILL_ERR_READ, FILL_ERR_SHORT, FILL_ERR_WRITE, FILL_ERR_SCALE = 1, 2, 3, 4
FILL_SCALE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # scale dtype -> its code
FILL_SCALE_FILE = -1  # desc[13] of an ERR_READ / ERR_SHORT that happened reading the scales


def can_fill_batch() -> bool:
    """Whether `fill_batch` runs here: the compiled library and the xxhash library's functions to call from it."""
    return available() and _hash_address() is not None and _fill_env() is not None


def fill_batch(desc, into: int, out: int, raw: int, lut: int, chunk: int, hashes) -> int:
    """Read, dequantize or copy, hash and write a task's parts in one call with the GIL dropped (fill_batch.c):
    `desc` an int64 buffer (array "q") of FILL_FIELDS per part; the addresses of buffers `into` (sources) and `out`
    (results) of at least max(chunk, the longest row's result) bytes each, `raw` and `lut` of at least 8 and 512
    bytes per scale of the part with most scales; `hashes` a uint64 buffer (array "Q") of 3 per part (source,
    result, scales). Plain buffers, no tensors: a task's Python is what many threads take turns on. Returns how
    many parts were filled: all, else the failed part's desc row says what failed."""
    return _lib.fill_batch(len(desc) // FILL_FIELDS, desc.buffer_info()[0], _fill_env().data_ptr(), into, out, raw,
                           lut, chunk, hashes.buffer_info()[0])


def copy_hash(desc: torch.Tensor, hashes: torch.Tensor) -> bool:
    """Copy small buffers and hash each copy with the GIL dropped: `desc` int64 [k, 3] (source address,
    destination address, bytes), `hashes` uint64-sized int64 [k]. False where there is no XXH3_64bits."""
    hash_fn = _hash_address()
    if hash_fn is None:
        return False
    _lib.copy_hash(desc.shape[0], desc.data_ptr(), hash_fn, hashes.data_ptr())
    return True


def fill_parts(desc: torch.Tensor, lut_ptr: int, hashes: torch.Tensor) -> bool:
    """Small parts at once, with the GIL dropped: `desc` int64 [k, 7] (fp8 address, result address, rows,
    columns, first table row, rows and columns a scale covers), `hashes` uint64-sized int64 [k, 2] (source,
    result). False where the xxhash library does not export XXH3_64bits: the caller then goes part by part."""
    hash_fn = _hash_address()
    if hash_fn is None:
        return False
    _lib.fill_parts16(desc.shape[0], desc.data_ptr(), lut_ptr, hash_fn, hashes.data_ptr())
    return True


def available() -> bool:
    """Whether the compiled loop can be used (builds it once; EXPERTD_NATIVE=0 turns it off)."""
    global _lib, _tried
    if _tried:
        return _lib is not None
    if os.environ.get("EXPERTD_NATIVE", "1") == "0":
        return False
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("native CPU dequant unavailable (%s); using the torch path", exc)
    return _lib is not None


_CODES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every fp8 value, exactly


def block_luts(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[blocks, 256]: each block's 256 results, the reference's own float32 product and cast."""
    return (scales.reshape(-1, 1).float() * _CODES).to(dtype).contiguous()


def gather(x_ptr: int, lut_ptr: int, out_ptr: int, n: int, block: tuple[int, int], r0: int, r1: int,
           itemsize: int = 2) -> None:
    """Rows [r0, r1) of out[M, n] from fp8 bytes x[M, n] and a [blocks, 256] table of (rows, columns) `block`s,
    by address (a loader's small parts: no tensor is made per part). The caller keeps the three buffers alive
    and correctly sized."""
    fn = _lib.dequant_lut32 if itemsize == 4 else _lib.dequant_lut16
    fn(x_ptr, lut_ptr, out_ptr, n, block[0], block[1], r0, r1)


class BlockTable:
    """Many small FP8 weights' scales as one table of block results (`block_luts`), each weight then dequantized
    from its first row by address: `dequant_lut` batched, for weights too small to pay a call and a table each
    (DeepSeek-V3's experts at small dims). Made by the format's batched entry point (`ScaledFp8.batch`)."""

    def __init__(self, scales: torch.Tensor, dtype: torch.dtype):
        if not available():
            raise RuntimeError("the compiled CPU dequant is not available (BlockTable needs it)")
        self.lut = block_luts(scales, dtype)
        self.at, self.row = self.lut.data_ptr(), 256 * self.lut.element_size()

    def parts(self, desc: torch.Tensor, hashes: torch.Tensor) -> bool:
        """Whole weights at once, each hashed before and after, with the GIL dropped (`fill_parts`: `desc` int64
        [k, 7], column 4 each weight's first table row; bf16 results only). False where the xxhash library does
        not export XXH3_64bits: the caller then goes weight by weight with `rows`."""
        if self.lut.element_size() != 2:
            raise ValueError(f"BlockTable.parts writes 16-bit results, the table holds {self.lut.dtype}")
        return fill_parts(desc, self.at, hashes)

    def rows(self, x_ptr: int, out_ptr: int, n: int, block: tuple[int, int], first: int, r0: int, r1: int) -> None:
        """Rows [r0, r1) of one weight's out[M, n] from its fp8 bytes x[M, n], its blocks from table row `first`
        (`gather`)."""
        gather(x_ptr, self.at + first * self.row, out_ptr, n, block, r0, r1, self.lut.element_size())


def dequant_lut(x_u8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out: torch.Tensor,
                threads: int | None = None) -> torch.Tensor:
    """out[M, N] = lut of each block at x, rows split over up to `threads` threads (default: torch's
    thread count); arguments already checked by the caller."""
    global _pool
    m, n = x_u8.shape
    lut = block_luts(scale, out.dtype)
    fn = _lib.dequant_lut32 if out.element_size() == 4 else _lib.dequant_lut16
    threads = max(1, min(threads or torch.get_num_threads(), m // 64))
    args = (x_u8.data_ptr(), lut.data_ptr(), out.data_ptr(), n, block[0], block[1])
    if threads == 1:
        fn(*args, 0, m)
        return out
    if _pool is None:
        _pool = ThreadPoolExecutor(os.cpu_count() or 2, thread_name_prefix="expertd-dequant")
    step = -(-m // threads)
    futures = [_pool.submit(fn, *args, r0, min(m, r0 + step)) for r0 in range(0, m, step)]
    for fut in futures:  # ctypes drops the GIL during each call: the rows run in parallel
        fut.result()
    return out


# MXFP4 (kernels/mxfp4.c; the table and the checks are mxfp4.py's)


def mxfp4_simd(enable: bool | None = None) -> bool:
    """Whether the MXFP4 gather runs on SSSE3 / AVX2 (8 / 16 columns per step; the CPU is asked at run
    time). `enable` switches it (on only where the CPU has it; EXPERTD_NATIVE_SIMD=0 starts it off); the
    same bits either way."""
    if not available():
        return False
    return bool(_lib.mxfp4_simd(-1 if enable is None else int(enable)))


def mxfp4_stream_min(nbytes: int | None = None) -> int:
    """The result size (bytes per call of the compiled loop) from which the MXFP4 gather writes with
    non-temporal stores (AVX2 only; results nobody reads soon); `nbytes` sets it. The same bits either way."""
    if not available():
        return 0
    return int(_lib.mxfp4_stream_min(-1 if nbytes is None else nbytes))


def mxfp4_gather(x_ptr: int, s_ptr: int, table_ptr: int, out_ptr: int, experts: int, rows: int, groups: int,
                 g0: int, g1: int) -> None:
    """Groups [g0, g1) of `experts` consecutive experts (blocks uint8 [rows, groups, 16], scales uint8
    [rows, groups] each) into out bf16 [experts, (g1-g0)*32, rows], by address, the GIL dropped. The
    caller keeps the buffers (and the uint16 [256, 16] table) alive and correctly sized."""
    _lib.mxfp4_dequant16(x_ptr, s_ptr, table_ptr, out_ptr, experts, rows, groups, g0, g1)


def mxfp4_dequant(x: torch.Tensor, s: torch.Tensor, table: torch.Tensor, out: torch.Tensor, g0: int, g1: int,
                  threads: int | None = None) -> torch.Tensor:
    """out[E, (g1-g0)*32, R] from contiguous blocks x [E, R, G, 16] and scales s [E, R, G], split over up to
    `threads` threads (default: torch's): by experts when there are enough of them, else by groups."""
    global _pool
    e, r, g = s.shape
    threads = max(1, min(threads or torch.get_num_threads(), max(e, g1 - g0)))
    args = (x.data_ptr(), s.data_ptr(), table.data_ptr(), out.data_ptr())
    if threads == 1 or r == 0:
        mxfp4_gather(*args, e, r, g, g0, g1)
        return out
    if _pool is None:
        _pool = ThreadPoolExecutor(os.cpu_count() or 2, thread_name_prefix="expertd-dequant")
    xb, sb, ob = x.element_size() * r * g * 16, s.element_size() * r * g, out.element_size() * (g1 - g0) * 32 * r
    jobs = []
    if e >= threads:  # whole experts per thread
        step = -(-e // threads)
        for e0 in range(0, e, step):
            n = min(e, e0 + step) - e0
            jobs.append((args[0] + e0 * xb, args[1] + e0 * sb, args[2], args[3] + e0 * ob, n, r, g, g0, g1))
    else:  # each expert's groups split over the threads: disjoint row ranges of its result
        step = -(-(g1 - g0) // -(-threads // e))
        for i in range(e):
            for a in range(g0, g1, step):
                b = min(g1, a + step)
                jobs.append((args[0] + i * xb, args[1] + i * sb, args[2], args[3] + i * ob + (a - g0) * 32 * r * 2,
                             1, r, g, a, b))
    futures = [_pool.submit(mxfp4_gather, *job) for job in jobs]
    for fut in futures:  # ctypes drops the GIL during each call: the parts run in parallel
        fut.result()
    return out
