// The tensor index (PROTOCOL.md §4-8): the index segment and its descriptor, the schema-2 index with the
// per-expert views derived from it, xxh3 checksums, dtypes and read-only mappings of segment files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>
#include "expertd/value.h"
#include "expertd/wire.h"

namespace expertd {

// --- the tensor index --------------------------------------------------------------------------------

struct IndexSegment {  // the descriptor a lease (refresh, index with segment) reply names
  std::string segment;
  uint64_t nbytes = 0;
  std::string checksum;
  int64_t generation = 0;
  std::string shm_dir = DEFAULT_SHM_DIR;
};
IndexSegment parse_index_segment(const Value& desc);  // ProtocolError when malformed

struct SegmentEntry {
  std::string name;
  uint64_t nbytes = 0;
};
struct ExpertBlock {  // a partitioned daemon's fused expert tensor: which experts it holds
  int64_t total = 0;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // (first expert, count)
};
struct ExpertParallel {
  int64_t size = 0;
  std::vector<int64_t> ranks;
};
struct TensorEntry {
  std::string name;
  std::string segment;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  std::vector<int64_t> shape;
  std::string dtype;                 // "torch.bfloat16", ...
  std::vector<std::string> sources;  // expanded from a pattern
  std::optional<std::string> base;   // the served tensor a view lies inside
  std::optional<std::string> checksum;
  std::optional<ExpertBlock> experts;
};
struct Index {
  int schema = 2;  // as read (1 or 2)
  int64_t generation = 0;
  std::string namespace_;
  std::string model_type;
  std::string layout;
  Value config;  // the model's config.json, as a map
  std::vector<SegmentEntry> segments;
  std::vector<TensorEntry> tensors;
  std::optional<std::vector<TensorEntry>> views;  // only schema 1 writes them out
  std::string shm_dir = DEFAULT_SHM_DIR;
  std::optional<ExpertParallel> expert_parallel;

  std::vector<TensorEntry> all_views() const;  // the per-expert views (derived from the fused tensors)
  // Every checkpoint tensor name -> where its bytes are (a served tensor or a view): Python's rule.
  std::map<std::string, TensorEntry> checkpoint_entries() const;
};

Index index_from_value(const Value& data);  // TensorIndex.from_dict: ProtocolError when malformed
std::vector<TensorEntry> derive_views(const std::vector<TensorEntry>& tensors);
std::vector<std::string> decode_sources(const Value& value);

// The index dict in an index segment's bytes, checked against the descriptor (magic, generation,
// length, header and payload xxh3): CorruptIndex when anything disagrees.
Value unpack_index_segment(const void* blob, std::size_t size, const IndexSegment& desc);
// Map the index segment read-only, check and decode it (ShmError when it cannot be opened).
Index read_index(const IndexSegment& desc);

inline constexpr char INDEX_MAGIC[8] = {'E', 'X', 'P', 'D', 'I', 'D', 'X', '\x01'};
inline constexpr std::size_t INDEX_HEADER_BYTES = 32;

// --- checksums, dtypes, segment files ----------------------------------------------------------------

uint64_t xxh3_64(const void* data, std::size_t size);
std::string checksum_text(uint64_t value);  // "xxh3_64:%016x"
int checksum_parts(const std::string& recorded);  // n of "xxh3_64x<n>:", 1 for "xxh3_64:"
// A tensor's checksum as the index records it: of its bytes, or combined from `parts` equal parts.
std::string tensor_checksum(const void* data, std::size_t size, int parts = 1);
std::string combined_checksum(const std::vector<std::string>& part_checksums);

std::size_t dtype_itemsize(const std::string& dtype);  // ShmError for a dtype expertd does not serve
const std::vector<std::string>& dtype_names();

std::string segment_path(const std::string& name, const std::string& shm_dir = DEFAULT_SHM_DIR);

class Mapping {  // a read-only shared mapping of a segment file; unmapped when the last owner goes
 public:
  Mapping(void* data, std::size_t size, std::string name) : data_(data), size_(size), name_(std::move(name)) {}
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  const uint8_t* data() const { return static_cast<const uint8_t*>(data_); }
  std::size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  void* data_;
  std::size_t size_;
  std::string name_;
};
// Map `nbytes` of segment `name` read-only (ShmError if missing, unreadable or shorter).
std::shared_ptr<const Mapping> map_segment(const std::string& name, uint64_t nbytes,
                                           const std::string& shm_dir = DEFAULT_SHM_DIR);

}  // namespace expertd
