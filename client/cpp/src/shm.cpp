// xxh3 checksums (xxHash, inlined), dtypes, segment paths and read-only mappings of segment files.
#include "expertd/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "detail.h"
#include "trust.h"
#include "expertd/errors.h"

#define XXH_INLINE_ALL 1
#include <xxhash.h>

namespace expertd {

using detail::quote;
using detail::fmt;
using detail::shape_text;
using detail::Fd;

// --- checksums, dtypes, segment files ----------------------------------------------------------------

uint64_t xxh3_64(const void* data, std::size_t size) { return XXH3_64bits(data, size); }

std::string checksum_text(uint64_t value) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "xxh3_64:%016" PRIx64, value);
  return buf;
}

int checksum_parts(const std::string& recorded) {
  std::string kind = recorded.substr(0, recorded.find(':'));
  static const std::string prefix = "xxh3_64x";
  if (kind.compare(0, prefix.size(), prefix) != 0) return 1;
  std::string n = kind.substr(prefix.size());
  if (n.empty() || n.find_first_not_of("0123456789") != std::string::npos || n.size() > 9)
    throw ProtocolError("malformed checksum " + quote(recorded));
  return std::stoi(n);
}

std::string combined_checksum(const std::vector<std::string>& parts) {
  if (parts.size() == 1) return parts[0];
  std::string digests;
  for (const auto& c : parts) {
    std::string hex = c.substr(c.rfind(':') + 1);
    if (hex.size() % 2 || hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
      throw ProtocolError("malformed checksum " + quote(c));
    for (std::size_t i = 0; i < hex.size(); i += 2)
      digests += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));  // bytes.fromhex: big-endian
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, "xxh3_64x%zu:%016" PRIx64, parts.size(), xxh3_64(digests.data(), digests.size()));
  return buf;
}

std::string tensor_checksum(const void* data, std::size_t size, int parts) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (parts <= 1) return checksum_text(xxh3_64(bytes, size));
  std::size_t step = size / static_cast<std::size_t>(parts);  // as Python: a remainder is not hashed
  std::vector<std::string> sums;
  sums.reserve(parts);
  for (int k = 0; k < parts; ++k) sums.push_back(checksum_text(xxh3_64(bytes + k * step, step)));
  return combined_checksum(sums);
}

namespace {
const std::vector<std::pair<std::string, std::size_t>>& dtypes() {
  static const std::vector<std::pair<std::string, std::size_t>> d = {
      {"torch.float8_e4m3fn", 1}, {"torch.float8_e5m2", 1}, {"torch.bfloat16", 2}, {"torch.float16", 2},
      {"torch.float32", 4},       {"torch.float64", 8},     {"torch.int64", 8},    {"torch.int32", 4},
      {"torch.int16", 2},         {"torch.int8", 1},        {"torch.uint8", 1},    {"torch.bool", 1}};
  return d;
}
}  // namespace

std::size_t dtype_itemsize(const std::string& dtype) {
  for (const auto& [name, size] : dtypes())
    if (name == dtype) return size;
  throw ShmError("index names unknown dtype " + quote(dtype));
}

const std::vector<std::string>& dtype_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const auto& d : dtypes()) n.push_back(d.first);
    return n;
  }();
  return names;
}

std::string segment_path(const std::string& name, const std::string& shm_dir) {
  std::size_t start = name.find_first_not_of('/');
  std::string rest = start == std::string::npos ? "" : name.substr(start);
  if (rest.empty() || rest.find('/') != std::string::npos || rest == "." || rest == "..")
    throw ShmError("segment name " + quote(name) + " is not a file name in " + shm_dir +
                   " (an index that names it is corrupt)");
  if (!shm_dir.empty() && shm_dir.back() == '/') return shm_dir + rest;
  return shm_dir + "/" + rest;
}

Mapping::~Mapping() {
  if (data_ != nullptr && size_ != 0) ::munmap(data_, size_);
}

std::shared_ptr<const Mapping> map_segment(const std::string& name, uint64_t nbytes, const std::string& shm_dir) {
  std::string path = segment_path(name, shm_dir);
  Fd fd{::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC)};
  if (fd.fd < 0) {
    int err = errno;
    if (err == ENOENT)
      throw ShmError("shared-memory segment " + name + " (" + path + ") does not exist (daemon gone or restarted?)");
    if (err == EACCES || err == EPERM)
      throw ShmError("no permission to open shared-memory segment " + name + " (" + path +
                     "); run the worker as the daemon's user, or set group: in the daemon's config and add the "
                     "worker's user to it");
    throw ShmError("cannot open shared-memory segment " + name + " (" + path + "): " + std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) throw ShmError("cannot stat shared-memory segment " + path + ": " + std::strerror(errno));
  detail::check_owner(path, st, "segment");  // a segment of someone this process does not trust is never mapped
  if (static_cast<uint64_t>(st.st_size) < nbytes)
    throw ShmError("segment " + name + " (" + path + ") has " + std::to_string(st.st_size) + " bytes, index says " +
                   std::to_string(nbytes));
  if (nbytes == 0) return std::make_shared<const Mapping>(nullptr, 0, name);
  void* p = ::mmap(nullptr, nbytes, PROT_READ, MAP_SHARED, fd.fd, 0);
  if (p == MAP_FAILED)
    throw ShmError("cannot map shared-memory segment " + name + " (" + path + ", " + std::to_string(nbytes) +
                   " bytes): " + std::strerror(errno));
  return std::make_shared<const Mapping>(p, nbytes, name);
}

}  // namespace expertd
