// Segment files (PROTOCOL.md §6-8): xxh3 checksums, dtypes, segment paths and read-only mappings.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>
#include "expertd/wire.h"

namespace expertd {

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
