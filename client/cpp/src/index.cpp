// The index segment (PROTOCOL.md §4): its descriptor, header and checksums checked, mapped and decoded.
#include "expertd/index.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "detail.h"
#include "trust.h"
#include "expertd/errors.h"

namespace expertd {

using detail::Fd;

IndexSegment parse_index_segment(const Value& desc) {
  if (!desc.is_map())
    throw ProtocolError(std::string("index segment descriptor must be a map, got ") + type_name(desc.type()));
  const Value *name = desc.get("segment"), *nbytes = desc.get("nbytes"), *digest = desc.get("checksum"),
              *generation = desc.get("generation");
  if (!name || !name->is_str() || name->as_str().empty() || name->as_str()[0] != '/' || !nbytes || !nbytes->is_int() ||
      nbytes->is_negative() || nbytes->as_uint() < INDEX_HEADER_BYTES || !digest || !digest->is_str() || !generation ||
      !generation->is_int())
    throw ProtocolError("malformed index segment descriptor " + to_json(desc));
  IndexSegment out;
  out.segment = name->as_str();
  out.nbytes = nbytes->as_uint();
  out.checksum = digest->as_str();
  out.generation = generation->as_int("index segment generation");
  if (const Value* shm_dir = desc.get("shm_dir")) {
    if (!shm_dir->is_str() || shm_dir->as_str().empty() || shm_dir->as_str()[0] != '/')
      throw ProtocolError("malformed index segment descriptor " + to_json(desc) + ": shm_dir must be an absolute path");
    out.shm_dir = shm_dir->as_str();
  }
  return out;
}

Value unpack_index_segment(const void* blob, std::size_t size, const IndexSegment& desc) {
  const std::string& name = desc.segment;
  if (size < desc.nbytes)
    throw CorruptIndex("index segment " + name + " is truncated: " + std::to_string(size) +
                       " bytes, the daemon announced " + std::to_string(desc.nbytes));
  const auto* bytes = static_cast<const unsigned char*>(blob);
  uint64_t stamped, length, checksum;  // little-endian on the wire, as on every host expertd runs on
  std::memcpy(&stamped, bytes + 8, 8);
  std::memcpy(&length, bytes + 16, 8);
  std::memcpy(&checksum, bytes + 24, 8);
  if (std::memcmp(bytes, INDEX_MAGIC, 8) != 0)
    throw CorruptIndex("index segment " + name + " does not start with an expertd index header");
  if (desc.generation < 0 || stamped != static_cast<uint64_t>(desc.generation))
    throw CorruptIndex("index segment " + name + " holds generation " + std::to_string(stamped) +
                       ", the daemon announced " + std::to_string(desc.generation));
  if (length > desc.nbytes - INDEX_HEADER_BYTES || INDEX_HEADER_BYTES + length != desc.nbytes)
    throw CorruptIndex("index segment " + name + " announces " + std::to_string(length) + " payload bytes, the daemon " +
                       std::to_string(desc.nbytes - INDEX_HEADER_BYTES));
  if (checksum_text(checksum) != desc.checksum)
    throw CorruptIndex("index segment " + name + ": header checksum " + checksum_text(checksum) +
                       ", the daemon announced " + desc.checksum);
  const unsigned char* payload = bytes + INDEX_HEADER_BYTES;
  if (xxh3_64(payload, length) != checksum)
    throw CorruptIndex("index segment " + name + " fails its checksum " + desc.checksum + ": its bytes were changed");
  try {
    return decode(payload, length, "the index", SIZE_MAX);
  } catch (const ProtocolError& exc) {
    throw CorruptIndex("index segment " + name + " is not a valid packed index: " + exc.what());
  }
}

Index read_index(const IndexSegment& desc) {
  std::string path = segment_path(desc.segment, desc.shm_dir);
  Fd fd{::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC)};
  if (fd.fd < 0) {
    int err = errno;
    if (err == ENOENT)
      throw ShmError("index segment " + desc.segment + " (" + path + ") does not exist (generation " +
                     std::to_string(desc.generation) + " retired, or the daemon gone?)");
    if (err == EACCES || err == EPERM)
      throw ShmError("no permission to open index segment " + desc.segment + " (" + path + ")");
    throw ShmError("cannot open index segment " + desc.segment + " (" + path + "): " + std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) throw ShmError("cannot stat index segment " + path + ": " + std::strerror(errno));
  detail::check_owner(path, st, "index segment");
  auto size = static_cast<std::size_t>(st.st_size);
  if (size < desc.nbytes)  // mapping past the end would SIGBUS on the first read
    throw CorruptIndex("index segment " + desc.segment + " is truncated: " + std::to_string(size) +
                       " bytes, the daemon announced " + std::to_string(desc.nbytes));
  // the whole file: on hugetlbfs an unmap must cover whole huge pages
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.fd, 0);
  if (p == MAP_FAILED)
    throw ShmError("cannot map index segment " + desc.segment + " (" + path + "): " + std::strerror(errno));
  Mapping mapping(p, size, desc.segment);
  Index index = index_from_value(unpack_index_segment(mapping.data(), mapping.size(), desc));
  if (index.generation != desc.generation)
    throw CorruptIndex("index segment " + desc.segment + " holds generation " + std::to_string(index.generation) +
                       ", the daemon announced " + std::to_string(desc.generation));
  return index;
}

}  // namespace expertd
