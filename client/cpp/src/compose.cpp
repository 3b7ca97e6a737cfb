// A tensor of several segments' ranges as one view (see compose.h).
#include "compose.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "detail.h"

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4
#endif

namespace expertd::detail {

namespace {

struct Last {  // the last view composed of a tensor name: its ranges and its reservation, while it lives
  std::vector<Extent> extents;
  std::weak_ptr<const Mapping> whole;
};

std::mutex last_mutex;
std::map<std::string, Last> last_views;

struct Run {  // bytes [lo, hi) of the tensor, and whether the old view has the same bytes there
  uint64_t lo, hi;
  bool same;
};

// The extent at byte `at` of the tensor, split where `old` (the last view's ranges) has the same segment's same
// bytes at the same places and where it does not.
std::vector<Run> runs(uint64_t at, const Extent& e, const std::vector<Extent>& old) {
  std::vector<std::pair<uint64_t, uint64_t>> kept;
  uint64_t pos = 0;
  for (const Extent& o : old) {
    uint64_t lo = std::max(at, pos), hi = std::min(at + e.nbytes, pos + o.nbytes);
    if (lo < hi && o.segment == e.segment && o.offset + at == e.offset + pos) kept.emplace_back(lo, hi);
    pos += o.nbytes;
  }
  std::vector<Run> out;
  uint64_t lo = at;
  for (const auto& [a, b] : kept) {
    if (lo < a) out.push_back({lo, a, false});
    out.push_back({a, b, true});
    lo = b;
  }
  if (lo < at + e.nbytes) out.push_back({lo, at + e.nbytes, false});
  return out;
}

constexpr uint64_t kHugePage = 2ull << 20;

// Whether the ranges map into one contiguous range with pages of `unit` bytes: every one starts on a page of its
// segment and every one but the last is whole pages (Python's `expertd.extents.mappable`). At 2 MiB (a huge-page
// tmpfs's ranges) the view starts on a 2 MiB boundary too, so the pages map as huge pages.
bool mappable(const std::vector<Extent>& extents, uint64_t unit) {
  for (std::size_t k = 0; k < extents.size(); ++k)
    if (extents[k].offset % unit || (k + 1 < extents.size() && extents[k].nbytes % unit)) return false;
  return true;
}

// `length` bytes of address space (PROT_NONE) starting on a multiple of `align`; MAP_FAILED if there is none.
void* reserve(uint64_t length, uint64_t align, uint64_t page) {
  uint64_t extra = align > page ? align - page : 0;
  void* got = ::mmap(nullptr, length + extra, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (got == MAP_FAILED || extra == 0) return got;
  uintptr_t at = reinterpret_cast<uintptr_t>(got), start = (at + align - 1) / align * align;
  if (start > at) ::munmap(got, start - at);  // the larger range around the aligned one given back
  if (at + extra > start) ::munmap(reinterpret_cast<void*>(start + length), at + extra - start);
  return reinterpret_cast<void*>(start);
}

}  // namespace

at::Tensor compose(const Segments& segments, const TensorEntry& entry, const at::TensorOptions& options) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  bool pages = mappable(entry.extents, page);
  for (const Extent& e : entry.extents) {
    auto it = segments.find(e.segment);
    if (it == segments.end() || e.offset + e.nbytes > it->second->size() || e.offset + e.nbytes < e.offset)
      throw ShmError("index entry " + entry.name + ": its extent in " + e.segment + " lies outside the segment");
    pages = pages && e.offset + (e.nbytes + page - 1) / page * page <= it->second->size();  // its last page too
  }
  if (pages) {
    uint64_t reserved = (entry.nbytes + page - 1) / page * page;
    bool huge = reserved >= kHugePage && mappable(entry.extents, kHugePage);
    void* base = reserve(reserved, huge ? kHugePage : page, page);
    if (base == MAP_FAILED)
      throw ShmError("cannot reserve " + std::to_string(reserved) + " bytes for " + entry.name + ": " + std::strerror(errno));
    auto whole = std::make_shared<const Mapping>(base, reserved, entry.name);  // unmapped with the last tensor
    std::lock_guard<std::mutex> lock(last_mutex);
    Last& last = last_views[entry.name];
    std::shared_ptr<const Mapping> old = last.whole.lock();
    const std::vector<Extent> none;
    const std::vector<Extent>& before = old && old->size() == reserved ? last.extents : none;
    uint64_t at = 0;
    for (const Extent& e : entry.extents) {
      for (const Run& r : runs(at, e, before)) {
        uint64_t length = std::min(reserved - r.lo, (r.hi - r.lo + page - 1) / page * page);
        void* target = static_cast<uint8_t*>(base) + r.lo;
        void* moved = const_cast<uint8_t*>(old ? old->data() + r.lo : nullptr);
        if (r.same && ::mremap(moved, length, length, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, target) == target)
          continue;  // the unchanged range's page tables moved here; the old view refaults if read
        void* source = const_cast<uint8_t*>(segments.at(e.segment)->data() + e.offset + (r.lo - at));
        if (::mremap(source, 0, length, MREMAP_MAYMOVE | MREMAP_FIXED, target) != target)
          throw ShmError("cannot map an extent of " + entry.name + " in " + e.segment + ": " + std::strerror(errno));
      }
      at += e.nbytes;
    }
    last = Last{entry.extents, whole};
    return at::from_blob(base, entry.shape, [whole](void*) {}, options);
  }
  at::Tensor out = at::empty(entry.shape, options);
  uint64_t at = 0;
  for (const Extent& e : entry.extents) {
    std::memcpy(static_cast<uint8_t*>(out.data_ptr()) + at, segments.at(e.segment)->data() + e.offset, e.nbytes);
    at += e.nbytes;
  }
  return out;
}

}  // namespace expertd::detail
