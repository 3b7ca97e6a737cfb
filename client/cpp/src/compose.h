// One contiguous read-only view of a tensor whose bytes lie in several segments' ranges (its extents), as the
// Python client's expertd/compose.py makes it (not installed).
#pragma once

#include <map>
#include <memory>
#include <string>

#include "expertd/client.h"

namespace expertd::detail {

using Segments = std::map<std::string, std::shared_ptr<const Mapping>>;

// The view of `entry` (with extents): each range's pages mapped again into one reserved range, read-only like the
// segments (a write is SIGSEGV); where the last view composed of a tensor of that name is alive and has some ranges
// at the same places (a newer generation of the stack), their page tables move to the new view (MREMAP_DONTUNMAP:
// the old view stays valid). Ranges that are whole 2 MiB pages get a view starting on a 2 MiB boundary (a huge-page
// tmpfs's pages then map as huge pages). A private copy where the ranges are not whole pages.
at::Tensor compose(const Segments& segments, const TensorEntry& entry, const at::TensorOptions& options);

}  // namespace expertd::detail
