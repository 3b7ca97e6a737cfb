// The tensor index (PROTOCOL.md §5): its entries, the schema-2 dict parsed and checked, the per-expert
// views derived from the fused tensors and the checkpoint names they answer to.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>
#include "expertd/value.h"
#include "expertd/wire.h"

namespace expertd {

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
// A tensor of more ranges than MAX_EXTENTS, or an index of more than MAX_INDEX_EXTENTS in all, is refused before
// anything is mapped (each range is a mapping of the reader's, vm.max_map_count): a daemon writes a stack of more
// ranges whole again. Python's are expertd/extents.py's (which says why these numbers); tests/attacks checks both agree.
inline constexpr std::size_t MAX_EXTENTS = 64;
inline constexpr std::size_t MAX_INDEX_EXTENTS = 16384;

struct Extent {  // a byte range of a segment: a tensor of several segments is their concatenation, in order
  std::string segment;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  bool operator==(const Extent& o) const { return segment == o.segment && offset == o.offset && nbytes == o.nbytes; }
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
  std::vector<Extent> extents;  // schema 3: its bytes as ranges of several segments (segment/offset: the first's)
};
struct Index {
  int schema = 2;  // as read (1, 2, or 3 where a tensor has extents)
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

}  // namespace expertd
