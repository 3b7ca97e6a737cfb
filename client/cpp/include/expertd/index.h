// The index segment (PROTOCOL.md §4): its descriptor, header and checks, and reading the tensor index from it.
// Also brings in the tensor index itself (tensor_index.h) and the segment files' helpers (shm.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include "expertd/shm.h"
#include "expertd/tensor_index.h"
#include "expertd/value.h"
#include "expertd/wire.h"

namespace expertd {

struct IndexSegment {  // the descriptor a lease (refresh, index with segment) reply names
  std::string segment;
  uint64_t nbytes = 0;
  std::string checksum;
  int64_t generation = 0;
  std::string shm_dir = DEFAULT_SHM_DIR;
};
IndexSegment parse_index_segment(const Value& desc);  // ProtocolError when malformed

// The index dict in an index segment's bytes, checked against the descriptor (magic, generation,
// length, header and payload xxh3): CorruptIndex when anything disagrees.
Value unpack_index_segment(const void* blob, std::size_t size, const IndexSegment& desc);
// Map the index segment read-only, check and decode it (ShmError when it cannot be opened).
Index read_index(const IndexSegment& desc);

inline constexpr char INDEX_MAGIC[8] = {'E', 'X', 'P', 'D', 'I', 'D', 'X', '\x01'};
inline constexpr std::size_t INDEX_HEADER_BYTES = 32;

}  // namespace expertd
