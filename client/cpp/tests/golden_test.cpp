// The golden protocol vectors (tests/golden/protocol, written by tests/test_protocol_golden.py from the Python
// client and daemon) through the C++ protocol code: every message decodes to its recorded map and re-encodes
// to the same bytes; requests built by request_message() are byte-identical; error replies raise the typed
// exceptions; the index segment decodes (and its corruptions are CorruptIndex); checksums agree.
//
//   expertd_golden_test GOLDEN_DIR    ($EXPERTD_GOLDEN_DIR, when set, wins: a cached build tests this checkout)
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "expertd/protocol.h"
#include "json_reader.h"

using expertd::Value;
using golden::Json;

namespace {

int failures = 0, checks = 0;

#define CHECK(cond, what)                                                                  \
  do {                                                                                     \
    ++checks;                                                                              \
    if (!(cond)) {                                                                         \
      ++failures;                                                                          \
      std::cerr << "FAIL " << __LINE__ << ": " << (what) << "  [" #cond "]" << std::endl; \
    }                                                                                      \
  } while (0)


std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
}

std::string unhex(const std::string& hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
    out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

template <class E>
bool is(const std::exception& e) {
  return dynamic_cast<const E*>(&e) != nullptr;
}

// The typed errors a reply's error name must arrive as, the first that matches.
struct Typed {
  const char* name;
  bool (*matches)(const std::exception&);
  bool kind_too;  // its kind() must be the name too, and a plain DaemonError may not carry the name
};
const Typed typed_errors[] = {
    {"AuthError", is<expertd::AuthError>, true},       {"VersionMismatch", is<expertd::VersionMismatch>, true},
    {"LeaseExpired", is<expertd::LeaseExpired>, true}, {"GenerationGone", is<expertd::GenerationGone>, true},
    {"NotReady", is<expertd::NotReady>, false},
};

// Which C++ type a reply's error name must arrive as.
bool thrown_as(const std::string& kind, const std::function<void()>& fn, std::string& got) {
  try {
    fn();
    got = "nothing";
    return false;
  } catch (const expertd::DaemonError& e) {
    bool plain_may_carry = true;
    for (const Typed& t : typed_errors) {
      if (t.matches(e)) {
        got = t.name;
        return kind == t.name && (!t.kind_too || e.kind() == kind);
      }
      if (t.kind_too && kind == t.name) plain_may_carry = false;
    }
    got = "DaemonError(" + e.kind() + ")";
    return e.kind() == kind && plain_may_carry;
  } catch (const std::exception& e) {
    got = e.what();
    return false;
  }
}

template <class E>
bool throws(const std::function<void()>& fn, std::string& what) {
  try {
    fn();
  } catch (const E& e) {
    what = e.what();
    return true;
  } catch (const std::exception& e) {
    what = std::string("another error: ") + e.what();
    return false;
  }
  what = "no error";
  return false;
}

void test_messages(const Value& golden) {
  const std::string token = golden.get("token")->as_str();
  for (const auto& [name, entry] : golden.get("messages")->as_map()) {
    const std::string op = entry.get("op")->as_str();
    for (const char* side : {"request", "reply"}) {
      const Value& v = *entry.get(side);
      std::string bytes = unhex(v.get("hex")->as_str());
      Value decoded = expertd::decode(bytes.data(), bytes.size());
      CHECK(decoded == *v.get("decoded"), name + " " + side + ": decodes to " + expertd::to_json(decoded).substr(0, 300));
      CHECK(expertd::encode(decoded) == bytes, name + " " + side + ": re-encodes to other bytes");
      CHECK(expertd::encode(*v.get("decoded")) == bytes, name + " " + side + ": the JSON map encodes to other bytes");
    }
    // the request as the C++ client builds it: op first, then the fields, the token last
    const Value& request = *entry.get("request")->get("decoded");
    Value::Map fields;
    std::optional<std::string> tok;
    for (const auto& [k, x] : request.as_map()) {
      if (k == "token") tok = x.as_str();
      else if (k != "op") fields.emplace_back(k, x);
    }
    std::string built = expertd::encode(expertd::request_message(op, fields, tok));
    CHECK(built == unhex(entry.get("request")->get("hex")->as_str()), name + ": request_message() builds other bytes");
    CHECK(name == "error.AuthError" || tok == token, name + ": carries the token");

    const Value& reply = *entry.get("reply")->get("decoded");
    CHECK(reply.get("latest") && reply.get("latest")->is_int(), name + ": reply carries an int latest");
    if (const Value* error = entry.get("error")) {
      std::string got;
      CHECK(thrown_as(error->as_str(), [&] { expertd::check_reply(reply, "'" + op + "'"); }, got),
            name + ": " + error->as_str() + " arrives as " + got);
    } else {
      std::string why;
      bool ok = true;
      try {
        expertd::check_reply(reply, "'" + op + "'");
        if (const Value* place = reply.get("index_segment"); place && place->is_map()) {  // status: a name
          auto desc = expertd::parse_index_segment(*place);
          ok = desc.segment == place->get("segment")->as_str() && desc.nbytes == place->get("nbytes")->as_uint() &&
               desc.generation == place->get("generation")->as_int() && desc.shm_dir == "/dev/shm";
        }
      } catch (const std::exception& e) {
        ok = false;
        why = e.what();
      }
      CHECK(ok, name + ": a successful reply is accepted " + why);
    }
  }
  // the typed fields the client reads
  const Value& lease = *golden.get("messages")->get("lease")->get("reply")->get("decoded");
  CHECK(lease.get("client")->as_str() == "c1", "lease reply: client");
  CHECK(lease.get("lease_timeout_s")->as_number() > 0, "lease reply: lease_timeout_s");
  CHECK(lease.get("generation")->as_int() == 1, "lease reply: generation");
  const Value& lreq = *golden.get("messages")->get("lease")->get("request")->get("decoded");
  const char* order[] = {"op", "pid", "protocol", "pid_ns", "start_time", "token"};
  std::size_t k = 0;
  for (const auto& [key, _] : lreq.as_map()) CHECK(k < 6 && key == order[k++], "lease request field order: " + key);
  CHECK(lreq.get("protocol")->as_int() == expertd::PROTOCOL_VERSION, "lease request: protocol version");
}

void test_checksums(const Value& golden) {
  std::string data;
  for (int r = 0; r < 4; ++r)
    for (int b = 0; b < 256; ++b) data += static_cast<char>(b);
  for (const auto& c : golden.get("checksums")->as_array()) {
    int parts = static_cast<int>(c.get("parts")->as_int());
    std::string got = expertd::tensor_checksum(data.data(), data.size(), parts);
    CHECK(got == c.get("checksum")->as_str(), "checksum of " + std::to_string(parts) + " part(s): " + got);
    CHECK(expertd::checksum_parts(c.get("checksum")->as_str()) == parts, "checksum_parts");
  }
  // the checksum an updater computed over 320 bf16 1.5 (bytes c0 3f)
  const Value& commit = *golden.get("messages")->get("commit")->get("request")->get("decoded");
  std::string ones;
  for (int i = 0; i < 320; ++i) ones += "\xc0\x3f";
  CHECK(expertd::tensor_checksum(ones.data(), ones.size()) == commit.get("checksums")->as_array()[0].as_str(),
        "the commit's checksum of 320 x bf16 1.5");
}

void test_index_segment(const Value& golden, const std::string& dir) {
  const Value& seg = *golden.get("index_segment");
  std::string blob = read_file(dir + "/" + seg.get("file")->as_str());
  expertd::IndexSegment desc = expertd::parse_index_segment(*seg.get("descriptor"));
  CHECK(desc.nbytes == blob.size(), "descriptor nbytes is the file's size");
  Value data = expertd::unpack_index_segment(blob.data(), blob.size(), desc);
  CHECK(data == *seg.get("index"), "the index segment decodes to the golden index");
  expertd::Index index = expertd::index_from_value(data);
  CHECK(index.generation == 1 && index.schema == 2 && index.namespace_ == "golden", "index header fields");
  CHECK(index.segments.size() == 47 && index.tensors.size() == 47, "47 segments and tensors");
  auto entries = index.checkpoint_entries();
  const auto& want = seg.get("checkpoint_entries")->as_map();
  CHECK(entries.size() == want.size(), "checkpoint entries: " + std::to_string(entries.size()));
  for (const auto& [name, w] : want) {
    auto it = entries.find(name);
    if (it == entries.end()) {
      CHECK(false, "checkpoint entry missing: " + name);
      continue;
    }
    const auto& e = it->second;
    const auto& a = w.as_array();
    std::vector<int64_t> shape;
    for (const auto& d : a[3].as_array()) shape.push_back(d.as_int());
    bool same = e.segment == a[0].as_str() && e.offset == a[1].as_uint() && e.nbytes == a[2].as_uint() &&
                e.shape == shape && e.dtype == a[4].as_str() &&
                (a[5].is_nil() ? !e.base.has_value() : e.base == a[5].as_str());
    CHECK(same, "checkpoint entry " + name);
  }

  // as a worker reads it: a file in an shm_dir, mapped read-only
  char tmpl[] = "/tmp/expertd-golden-XXXXXX";
  std::string shm_dir = mkdtemp(tmpl);
  std::string path = expertd::segment_path(desc.segment, shm_dir);
  desc.shm_dir = shm_dir;
  write_file(path, blob);
  std::string why;
  bool ok = true;
  try {
    ok = expertd::read_index(desc).tensors.size() == 47;
  } catch (const std::exception& e) {
    ok = false;
    why = e.what();
  }
  CHECK(ok, "read_index from a segment file " + why);

  auto corrupt = [&](const std::string& what, std::string bytes, expertd::IndexSegment d) {
    write_file(path, bytes);
    std::string msg;
    CHECK(throws<expertd::CorruptIndex>([&] { expertd::read_index(d); }, msg), what + ": " + msg);
  };
  std::string flipped = blob;
  flipped[blob.size() / 2] ^= 0x01;
  corrupt("a changed payload byte", flipped, desc);
  std::string magic = blob;
  magic[0] = 'X';
  corrupt("another magic", magic, desc);
  corrupt("a truncated segment", blob.substr(0, blob.size() - 1), desc);
  auto other = desc;
  other.generation = 2;
  corrupt("another generation", blob, other);
  other = desc;
  other.checksum = "xxh3_64:0000000000000000";
  corrupt("another checksum", blob, other);
  other = desc;
  other.nbytes = desc.nbytes - 1;
  corrupt("another length", blob, other);
  write_file(path, blob);

  std::string msg;
  Value bad = *seg.get("descriptor");
  bad.set("segment", "no-slash");
  CHECK(throws<expertd::ProtocolError>([&] { expertd::parse_index_segment(bad); }, msg), "a descriptor without '/': " + msg);
  bad = *seg.get("descriptor");
  bad.set("shm_dir", "relative/dir");
  CHECK(throws<expertd::ProtocolError>([&] { expertd::parse_index_segment(bad); }, msg), "a relative shm_dir: " + msg);
  for (const char* outside : {"/../etc/passwd", "/a/b", "/..", "///"})  // a name that would leave shm_dir
    CHECK(throws<expertd::ShmError>([&] { expertd::segment_path(outside, "/dev/shm"); }, msg) &&
              msg.find("is not a file name in /dev/shm") != std::string::npos,
          std::string("segment name ") + outside + ": " + msg);
  ::unlink(path.c_str());
  CHECK(throws<expertd::ShmError>([&] { expertd::read_index(desc); }, msg), "a missing segment file: " + msg);
  ::rmdir(shm_dir.c_str());

  // an index the Python side refuses is refused here too
  Value wrong = data;
  wrong.set("schema", 7);
  CHECK(throws<expertd::ProtocolError>([&] { expertd::index_from_value(wrong); }, msg), "schema 7: " + msg);
  wrong = data;
  wrong.set("shm_dir", "dev/shm");
  CHECK(throws<expertd::ProtocolError>([&] { expertd::index_from_value(wrong); }, msg), "relative shm_dir: " + msg);
  CHECK(throws<expertd::ShmError>([] { expertd::dtype_itemsize("torch.complex64"); }, msg), "unknown dtype: " + msg);
  for (const auto& t : index.tensors) CHECK(expertd::dtype_itemsize(t.dtype) > 0, "dtype of " + t.name);
}

}  // namespace

int main(int argc, char** argv) {
  const char* env = std::getenv("EXPERTD_GOLDEN_DIR");
  if (argc != 2 && !(env && *env)) {
    std::cerr << "usage: expertd_golden_test GOLDEN_DIR (tests/golden/protocol)" << std::endl;
    return 2;
  }
  std::string dir = env && *env ? env : argv[1];
  try {
    Value golden = Json(read_file(dir + "/messages.json")).parse();
    CHECK(golden.get("protocol")->as_int() == expertd::PROTOCOL_VERSION, "the vectors' protocol version");
    test_messages(golden);
    test_checksums(golden);
    test_index_segment(golden, dir);
  } catch (const std::exception& e) {
    std::cerr << "FAIL: " << e.what() << std::endl;
    return 1;
  }
  std::cout << checks - failures << "/" << checks << " golden checks passed" << std::endl;
  return failures ? 1 : 0;
}
