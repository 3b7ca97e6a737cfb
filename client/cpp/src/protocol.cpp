// The wire contract without torch: msgpack (msgpack-cxx), the control socket (libzmq), the index segment,
// checksums (xxHash, inlined). See include/expertd/protocol.hpp and PROTOCOL.md.
#include "expertd/protocol.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#define MSGPACK_NO_BOOST 1
#include <msgpack/object.hpp>
#include <msgpack/pack.hpp>
#include <msgpack/sbuffer.hpp>
#include <msgpack/unpack.hpp>

#define XXH_INLINE_ALL 1
#include <xxhash.h>

namespace expertd {

namespace {

std::string quote(std::string_view s) {  // as Python's repr of a str, near enough for messages
  std::string out = "'";
  out += s;
  out += "'";
  return out;
}

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

}  // namespace

// --- errors ----------------------------------------------------------------------------------------

void throw_daemon_error(const std::string& kind, const std::string& message) {
  if (kind == "NotReady") throw NotReady(message);
  if (kind == "LeaseExpired") throw LeaseExpired(message);
  if (kind == "Busy") throw Busy(message);
  if (kind == "GenerationGone") throw GenerationGone(message);
  if (kind == "GenerationLimit") throw GenerationLimit(message);
  if (kind == "UpdateRejected") throw UpdateRejected(message);
  if (kind == "PushDenied") throw PushDenied(message);
  if (kind == "AuthError") throw AuthError(message);
  if (kind == "DaemonNotRunning") throw DaemonNotRunning(message);
  throw DaemonError(message, kind);
}

// --- Value -----------------------------------------------------------------------------------------

Value::Type Value::type() const {
  switch (v_.index()) {
    case 0: return Type::Nil;
    case 1: return Type::Bool;
    case 2:
    case 3: return Type::Int;
    case 4: return Type::Float;
    case 5: return Type::Str;
    case 6: return Type::Bin;
    case 7: return Type::Array;
    default: return Type::Map;
  }
}

const char* type_name(Value::Type t) {
  switch (t) {
    case Value::Type::Nil: return "nil";
    case Value::Type::Bool: return "bool";
    case Value::Type::Int: return "int";
    case Value::Type::Float: return "float";
    case Value::Type::Str: return "str";
    case Value::Type::Bin: return "bin";
    case Value::Type::Array: return "array";
    case Value::Type::Map: return "map";
  }
  return "?";
}

namespace {
[[noreturn]] void wrong(std::string_view what, const char* want, const Value& v) {
  throw ProtocolError(std::string(what) + " must be " + want + ", got " + type_name(v.type()));
}
}  // namespace

bool Value::as_bool(std::string_view what) const {
  if (!is_bool()) wrong(what, "a bool", *this);
  return std::get<bool>(v_);
}

int64_t Value::as_int(std::string_view what) const {
  if (v_.index() == 2) return std::get<int64_t>(v_);
  if (v_.index() != 3) wrong(what, "an integer", *this);
  uint64_t u = std::get<uint64_t>(v_);
  if (u > static_cast<uint64_t>(INT64_MAX)) throw ProtocolError(std::string(what) + " is out of range");
  return static_cast<int64_t>(u);
}

uint64_t Value::as_uint(std::string_view what) const {
  if (v_.index() == 2) throw ProtocolError(std::string(what) + " must be a non-negative integer");
  if (v_.index() != 3) wrong(what, "a non-negative integer", *this);
  return std::get<uint64_t>(v_);
}

double Value::as_number(std::string_view what) const {
  if (v_.index() == 4) return std::get<double>(v_);
  if (v_.index() == 3) return static_cast<double>(std::get<uint64_t>(v_));
  if (v_.index() == 2) return static_cast<double>(std::get<int64_t>(v_));
  wrong(what, "a number", *this);
}

const std::string& Value::as_str(std::string_view what) const {
  if (!is_str()) wrong(what, "a string", *this);
  return std::get<std::string>(v_);
}

const Value::Bin& Value::as_bin(std::string_view what) const {
  if (v_.index() != 6) wrong(what, "bytes", *this);
  return std::get<Bin>(v_);
}

const Value::Array& Value::as_array(std::string_view what) const {
  if (!is_array()) wrong(what, "an array", *this);
  return std::get<Array>(v_);
}

const Value::Map& Value::as_map(std::string_view what) const {
  if (!is_map()) wrong(what, "a map", *this);
  return std::get<Map>(v_);
}

const Value* Value::get(std::string_view key) const {
  if (!is_map()) return nullptr;
  for (const auto& [k, v] : std::get<Map>(v_))
    if (k == key) return &v;
  return nullptr;
}

Value& Value::set(std::string key, Value value) {
  if (is_nil()) v_ = Map{};
  if (!is_map()) throw ProtocolError("set() on a value that is not a map");
  auto& m = std::get<Map>(v_);
  for (auto& [k, v] : m)
    if (k == key) return v = std::move(value);
  m.emplace_back(std::move(key), std::move(value));
  return m.back().second;
}

// --- msgpack ---------------------------------------------------------------------------------------

namespace {

Value from_object(const msgpack::object& o, std::size_t max_bin) {
  switch (o.type) {
    case msgpack::type::NIL: return Value();
    case msgpack::type::BOOLEAN: return Value(o.via.boolean);
    case msgpack::type::POSITIVE_INTEGER: return Value(static_cast<uint64_t>(o.via.u64));
    case msgpack::type::NEGATIVE_INTEGER: return Value(static_cast<int64_t>(o.via.i64));
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: return Value(o.via.f64);
    case msgpack::type::STR: return Value(std::string(o.via.str.ptr, o.via.str.size));
    case msgpack::type::BIN:
      if (o.via.bin.size > max_bin)
        throw ProtocolError("bytes of " + std::to_string(o.via.bin.size) + " exceed the limit of " + std::to_string(max_bin));
      return Value(Value::Bin{std::string(o.via.bin.ptr, o.via.bin.size)});
    case msgpack::type::ARRAY: {
      Value::Array a;
      a.reserve(o.via.array.size);
      for (uint32_t i = 0; i < o.via.array.size; ++i) a.push_back(from_object(o.via.array.ptr[i], max_bin));
      return Value(std::move(a));
    }
    case msgpack::type::MAP: {
      Value::Map m;
      m.reserve(o.via.map.size);
      for (uint32_t i = 0; i < o.via.map.size; ++i) {
        const auto& kv = o.via.map.ptr[i];
        if (kv.key.type != msgpack::type::STR) throw ProtocolError("map keys must be strings");
        m.emplace_back(std::string(kv.key.via.str.ptr, kv.key.via.str.size), from_object(kv.val, max_bin));
      }
      return Value(std::move(m));
    }
    default: throw ProtocolError("extension types are not part of the protocol");
  }
}

void pack_value(msgpack::packer<msgpack::sbuffer>& pk, msgpack::sbuffer& buf, const Value& v) {
  switch (v.type()) {
    case Value::Type::Nil: pk.pack_nil(); return;
    case Value::Type::Bool: v.as_bool() ? pk.pack_true() : pk.pack_false(); return;
    case Value::Type::Int:
      if (v.is_negative()) pk.pack_int64(v.as_int());
      else pk.pack_uint64(v.as_uint());
      return;
    case Value::Type::Float: {  // always float64, as Python packs a float (msgpack-cxx's pack_double would
      double d = v.as_number();  // write an integral double as an int: 3.0 would arrive as 3)
      uint64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      char out[9];
      out[0] = static_cast<char>(0xcb);
      for (int i = 0; i < 8; ++i) out[1 + i] = static_cast<char>((bits >> (56 - 8 * i)) & 0xff);
      buf.write(out, sizeof out);
      return;
    }
    case Value::Type::Str: {
      const auto& s = v.as_str();
      pk.pack_str(static_cast<uint32_t>(s.size()));
      pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
      return;
    }
    case Value::Type::Bin: {
      const auto& b = v.as_bin().bytes;
      pk.pack_bin(static_cast<uint32_t>(b.size()));
      pk.pack_bin_body(b.data(), static_cast<uint32_t>(b.size()));
      return;
    }
    case Value::Type::Array: {
      const auto& a = v.as_array();
      pk.pack_array(static_cast<uint32_t>(a.size()));
      for (const auto& x : a) pack_value(pk, buf, x);
      return;
    }
    case Value::Type::Map: {
      const auto& m = v.as_map();
      pk.pack_map(static_cast<uint32_t>(m.size()));
      for (const auto& [k, x] : m) {
        pk.pack_str(static_cast<uint32_t>(k.size()));
        pk.pack_str_body(k.data(), static_cast<uint32_t>(k.size()));
        pack_value(pk, buf, x);
      }
      return;
    }
  }
}

void json_string(std::string& out, std::string_view s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void json_value(std::string& out, const Value& v) {
  switch (v.type()) {
    case Value::Type::Nil: out += "null"; return;
    case Value::Type::Bool: out += v.as_bool() ? "true" : "false"; return;
    case Value::Type::Int: out += v.is_negative() ? std::to_string(v.as_int()) : std::to_string(v.as_uint()); return;
    case Value::Type::Float: {
      double d = v.as_number();
      if (!std::isfinite(d)) {
        out += "null";
        return;
      }
      std::string s = fmt("%.17g", d);
      if (s.find_first_of(".eE") == std::string::npos) s += ".0";
      out += s;
      return;
    }
    case Value::Type::Str: json_string(out, v.as_str()); return;
    case Value::Type::Bin: {
      static const char* hex = "0123456789abcdef";
      std::string h;
      for (unsigned char c : v.as_bin().bytes) {
        h += hex[c >> 4];
        h += hex[c & 15];
      }
      out += "{\"$bin\": ";
      json_string(out, h);
      out += "}";
      return;
    }
    case Value::Type::Array: {
      out += '[';
      bool first = true;
      for (const auto& x : v.as_array()) {
        if (!first) out += ", ";
        first = false;
        json_value(out, x);
      }
      out += ']';
      return;
    }
    case Value::Type::Map: {
      out += '{';
      bool first = true;
      for (const auto& [k, x] : v.as_map()) {
        if (!first) out += ", ";
        first = false;
        json_string(out, k);
        out += ": ";
        json_value(out, x);
      }
      out += '}';
      return;
    }
  }
}

}  // namespace

Value decode(const void* data, std::size_t size, std::string_view what, std::size_t max_bin) {
  std::size_t off = 0;
  try {
    msgpack::unpack_limit limit(0xffffffff, 0xffffffff, 0xffffffff, max_bin, 0, 0xffffffff);
    msgpack::object_handle oh = msgpack::unpack(static_cast<const char*>(data), size, off, nullptr, nullptr, limit);
    if (off != size) throw ProtocolError(std::to_string(size - off) + " bytes of extra data after the object");
    return from_object(oh.get(), max_bin);
  } catch (const ProtocolError& exc) {
    throw ProtocolError(std::string(what) + " is not valid msgpack: " + exc.what());
  } catch (const std::exception& exc) {  // msgpack-cxx throws several unrelated types on bad input
    throw ProtocolError(std::string(what) + " is not valid msgpack: " + exc.what());
  }
}

std::string encode(const Value& value) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pack_value(pk, buf, value);
  return std::string(buf.data(), buf.size());
}

std::string to_json(const Value& value) {
  std::string out;
  json_value(out, value);
  return out;
}

// --- requests and replies ----------------------------------------------------------------------------

Value request_message(const std::string& op, Value::Map fields, const std::optional<std::string>& token) {
  Value::Map m;
  m.reserve(fields.size() + 2);
  m.emplace_back("op", Value(op));
  for (auto& kv : fields) m.push_back(std::move(kv));
  if (token) m.emplace_back("token", Value(*token));
  return Value(std::move(m));
}

const Value::Map& check_reply(const Value& reply, const std::string& what) {
  const Value* ok = reply.get("ok");
  if (!reply.is_map() || ok == nullptr || !ok->is_bool())
    throw ProtocolError("the daemon's reply to " + what + " is malformed");
  if (!ok->as_bool()) {
    const Value* error = reply.get("error");
    const Value* message = reply.get("message");
    std::string kind = error && error->is_str() ? error->as_str() : (error ? to_json(*error) : "None");
    std::string text = message && message->is_str() ? message->as_str() : (message ? to_json(*message) : "None");
    throw_daemon_error(kind, "daemon refused " + what + ": " + kind + ": " + text);
  }
  return reply.as_map();
}

std::string op_words(const std::string& op) {
  static const std::map<std::string, std::string> words = {
      {"hello", "the handshake"}, {"lease", "attach"}, {"index", "the tensor index"}, {"heartbeat", "a heartbeat"},
      {"release", "detach"}, {"refresh", "refresh"}, {"status", "status"}, {"stop", "stop"}, {"reload", "reload"},
      {"update", "an update"}, {"stage", "an update's bytes"}, {"commit", "an update"},
      {"publish", "publishing an update"}, {"abort", "dropping an update"}, {"job", "build progress"}};
  auto it = words.find(op);
  return it == words.end() ? op : it->second;
}

// --- the tensor index --------------------------------------------------------------------------------

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

std::vector<std::string> decode_sources(const Value& value) {
  std::vector<std::string> out;
  if (value.is_array()) {
    for (const auto& s : value.as_array()) out.push_back(s.as_str("a tensor's source"));
    return out;
  }
  if (!value.is_map())
    throw ProtocolError(std::string("sources must be a list or a pattern, got ") + type_name(value.type()));
  const Value *prefix = value.get("prefix"), *experts = value.get("experts"), *parts = value.get("parts");
  bool ok = prefix && prefix->is_str() && parts && parts->is_array() && !parts->as_array().empty() && experts &&
            experts->is_array() && experts->as_array().size() == 2;
  if (ok)
    for (const auto& p : parts->as_array()) ok = ok && p.is_str();
  if (ok)
    for (const auto& n : experts->as_array()) ok = ok && n.is_int() && !n.is_negative();
  if (ok) ok = experts->as_array()[1].as_uint() >= 1;
  if (!ok) throw ProtocolError("malformed sources pattern " + to_json(value));
  uint64_t first = experts->as_array()[0].as_uint(), count = experts->as_array()[1].as_uint();
  out.reserve(count * parts->as_array().size());
  for (uint64_t e = first; e < first + count; ++e)
    for (const auto& p : parts->as_array()) out.push_back(prefix->as_str() + std::to_string(e) + p.as_str());
  return out;
}

namespace {

const std::vector<std::string> ENTRY_FIELDS = {"name", "segment", "offset", "nbytes", "shape", "dtype",
                                               "sources", "base", "checksum", "experts"};

std::optional<ExpertBlock> expert_block(const Value* v) {
  if (v == nullptr || v->is_nil()) return std::nullopt;
  ExpertBlock b;
  try {
    const Value* total = v->get("total");
    const Value* ranges = v->get("ranges");
    if (!total || !ranges) throw ProtocolError("needs total and ranges");
    b.total = total->as_int("total");
    for (const auto& r : ranges->as_array("ranges")) {
      const auto& pair = r.as_array("a range");
      if (pair.size() != 2) throw ProtocolError("a range is [first, count]");
      b.ranges.emplace_back(pair[0].as_int("first"), pair[1].as_int("count"));
    }
  } catch (const ProtocolError& exc) {
    throw ProtocolError("malformed expert block " + to_json(*v) + ": " + exc.what());
  }
  for (auto [a, n] : b.ranges)
    if (a < 0 || n < 1 || a + n > b.total)
      throw ProtocolError("malformed expert block " + to_json(*v) + ": ranges must lie within " +
                          std::to_string(b.total) + " experts");
  return b;
}

TensorEntry tensor_entry(const Value& t, bool decode_pattern) {
  const auto& m = t.as_map("a tensor entry");
  for (const auto& [k, _] : m) {
    bool known = false;
    for (const auto& f : ENTRY_FIELDS) known = known || f == k;
    if (!known) throw ProtocolError("tensor entry has an unexpected field " + quote(k));
  }
  auto need = [&](const char* key) -> const Value& {
    const Value* v = t.get(key);
    if (v == nullptr) throw ProtocolError(std::string("tensor entry lacks ") + quote(key));
    return *v;
  };
  TensorEntry e;
  e.name = need("name").as_str("a tensor's name");
  e.segment = need("segment").as_str("a tensor's segment");
  e.offset = need("offset").as_uint("a tensor's offset");
  e.nbytes = need("nbytes").as_uint("a tensor's nbytes");
  for (const auto& d : need("shape").as_array("a tensor's shape")) {
    if (!d.is_int() || d.is_negative()) throw ProtocolError("a tensor's shape must hold non-negative integers");
    e.shape.push_back(d.as_int());
  }
  e.dtype = need("dtype").as_str("a tensor's dtype");
  if (const Value* s = t.get("sources")) {
    if (decode_pattern || s->is_array()) e.sources = decode_sources(*s);
    else throw ProtocolError("a view's sources must be a list");
  }
  if (const Value* b = t.get("base"); b && !b->is_nil()) e.base = b->as_str("a tensor's base");
  if (const Value* c = t.get("checksum"); c && !c->is_nil()) e.checksum = c->as_str("a tensor's checksum");
  e.experts = expert_block(t.get("experts"));
  return e;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

Index index_from_value(const Value& data) {
  if (!data.is_map()) throw ProtocolError(std::string("tensor index must be a mapping, got ") + type_name(data.type()));
  const Value* schema = data.get("schema");
  if (!schema || !schema->is_int() || schema->is_negative() || (schema->as_uint() != 1 && schema->as_uint() != 2))
    throw ProtocolError("tensor index schema " + (schema ? to_json(*schema) : std::string("None")) +
                        " is not supported (this expertd reads 1, 2)");
  Index index;
  index.schema = static_cast<int>(schema->as_uint());
  try {
    auto need = [&](const char* key) -> const Value& {
      const Value* v = data.get(key);
      if (v == nullptr) throw ProtocolError(quote(key));
      return *v;
    };
    for (const auto& t : need("tensors").as_array("tensors")) index.tensors.push_back(tensor_entry(t, true));
    index.generation = need("generation").as_int("generation");
    index.namespace_ = need("namespace").as_str("namespace");
    index.model_type = need("model_type").as_str("model_type");
    index.layout = need("layout").as_str("layout");
    index.config = need("config");
    index.config.as_map("config");
    for (const auto& s : need("segments").as_array("segments")) {
      const auto& m = s.as_map("a segment");
      if (m.size() != 2 || !s.get("name") || !s.get("nbytes"))
        throw ProtocolError("a segment is exactly {name, nbytes}, got " + to_json(s));
      index.segments.push_back({s.get("name")->as_str("a segment's name"), s.get("nbytes")->as_uint("a segment's nbytes")});
    }
    if (const Value* views = data.get("views"); views && !views->is_nil()) {
      index.views.emplace();
      for (const auto& t : views->as_array("views")) index.views->push_back(tensor_entry(t, false));
    }
    if (const Value* shm_dir = data.get("shm_dir")) index.shm_dir = shm_dir->as_str("shm_dir");
    if (const Value* ep = data.get("expert_parallel"); ep && !ep->is_nil()) {
      ExpertParallel p;
      const auto& m = ep->as_map("expert_parallel");
      for (const auto& [k, _] : m)
        if (k != "size" && k != "ranks") throw ProtocolError("expert_parallel has an unexpected field " + quote(k));
      const Value* size = ep->get("size");
      if (!size || !size->is_int() || size->is_negative() || size->as_uint() < 1)
        throw ProtocolError("expert_parallel.size must be an integer >= 1");
      p.size = size->as_int();
      if (const Value* ranks = ep->get("ranks")) {
        for (const auto& r : ranks->as_array("expert_parallel.ranks")) p.ranks.push_back(r.as_int("an EP rank"));
        if (p.ranks.empty()) throw ProtocolError("expert_parallel.ranks must be a non-empty list");
      } else {
        for (int64_t r = 0; r < p.size; ++r) p.ranks.push_back(r);
      }
      for (auto r : p.ranks)
        if (r < 0 || r >= p.size) throw ProtocolError("expert_parallel.ranks out of range");
      std::sort(p.ranks.begin(), p.ranks.end());
      if (std::adjacent_find(p.ranks.begin(), p.ranks.end()) != p.ranks.end())
        throw ProtocolError("expert_parallel.ranks names a rank twice");
      index.expert_parallel = p;
    }
  } catch (const ProtocolError& exc) {
    throw ProtocolError(std::string("malformed tensor index: ") + exc.what());
  }
  if (index.shm_dir.empty() || index.shm_dir[0] != '/')
    throw ProtocolError("tensor index: shm_dir " + quote(index.shm_dir) + " must be an absolute path");
  return index;
}

std::vector<TensorEntry> derive_views(const std::vector<TensorEntry>& tensors) {
  std::vector<TensorEntry> views;
  for (const auto& t : tensors) {
    std::size_t n = t.sources.size();
    if (n == 0 || (n == 1 && t.sources[0] == t.name)) continue;  // computed, or served under its own name
    if (n == 1) {  // served under the model's name for a renamed checkpoint tensor: the whole of it
      TensorEntry v = t;
      v.name = t.sources[0];
      v.base = t.name;
      v.checksum.reset();
      v.experts.reset();
      views.push_back(std::move(v));
      continue;
    }
    if (t.nbytes % n || t.shape.size() < 2 || t.shape[0] <= 0 || n % static_cast<std::size_t>(t.shape[0]) ||
        t.shape[1] % static_cast<int64_t>(n / t.shape[0]))
      throw ProtocolError("fused tensor " + t.name + " " + shape_text(t.shape) + " cannot hold " + std::to_string(n) +
                          " equal sources");
    uint64_t chunk = t.nbytes / n;
    int64_t per_expert = static_cast<int64_t>(n) / t.shape[0];
    std::vector<int64_t> shape{t.shape[1] / per_expert};
    shape.insert(shape.end(), t.shape.begin() + 2, t.shape.end());
    for (std::size_t k = 0; k < n; ++k) {
      TensorEntry v;
      v.name = t.sources[k];
      v.segment = t.segment;
      v.offset = t.offset + k * chunk;
      v.nbytes = chunk;
      v.shape = shape;
      v.dtype = t.dtype;
      v.sources = {t.sources[k]};
      v.base = t.name;
      views.push_back(std::move(v));
    }
  }
  return views;
}

std::vector<TensorEntry> Index::all_views() const { return views ? *views : derive_views(tensors); }

std::map<std::string, TensorEntry> Index::checkpoint_entries() const {
  std::map<std::string, TensorEntry> out;
  for (const auto& t : tensors)
    if (t.sources.size() == 1 && t.sources[0] == t.name) out[t.name] = t;
  for (auto& v : all_views()) out[v.name] = std::move(v);
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

namespace {

struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

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

// --- credentials and the control connection ----------------------------------------------------------

namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

// ZeroMQ's certificate format (what `expertd keys` writes): `public-key = "..."`, `secret-key = "..."`.
std::pair<std::optional<std::string>, std::optional<std::string>> load_certificate(const std::string& path,
                                                                                    const std::string& where) {
  std::ifstream f(path);
  if (!f) throw ConfigError(where + " " + path + ": not a readable ZeroMQ key file; make one with `expertd keys`");
  std::optional<std::string> pub, sec;
  std::string line;
  while (std::getline(f, line)) {
    for (auto [key, slot] : {std::pair{"public-key", &pub}, std::pair{"secret-key", &sec}}) {
      auto at = line.find(key);
      if (at == std::string::npos) continue;
      auto q1 = line.find('"', at), q2 = q1 == std::string::npos ? q1 : line.find('"', q1 + 1);
      if (q2 == std::string::npos) continue;
      *slot = line.substr(q1 + 1, q2 - q1 - 1);
    }
  }
  if (!pub) throw ConfigError(where + " " + path + ": holds no public key");
  return {pub, sec};
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

Credentials Credentials::resolve(std::optional<std::string> token, std::optional<std::string> server_key,
                                 std::optional<std::string> client_key) {
  Credentials c;
  c.token = token ? token : env("EXPERTD_TOKEN");
  if (c.token && c.token->empty()) c.token.reset();
  if (!server_key) server_key = env("EXPERTD_SERVER_KEY");
  if (!client_key) client_key = env("EXPERTD_CLIENT_KEY");
  if (server_key) {
    std::string v = *server_key;
    while (!v.empty() && std::isspace(static_cast<unsigned char>(v.back()))) v.pop_back();
    while (!v.empty() && std::isspace(static_cast<unsigned char>(v.front()))) v.erase(v.begin());
    c.server_key = v.size() == 40 && !file_exists(v) ? v : *load_certificate(v, "server key").first;
  }
  if (client_key) {
    auto [pub, sec] = load_certificate(*client_key, "client key");
    if (!sec)
      throw ConfigError("client key " + *client_key + ": holds no secret key; use the NAME.key_secret file `expertd keys` wrote");
    c.client_public = pub;
    c.client_secret = sec;
  }
  return c;
}

std::optional<std::string> ipc_path(const std::string& endpoint) {
  static const std::string prefix = "ipc://";
  if (endpoint.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  return endpoint.substr(prefix.size());
}

void check_running(const std::string& endpoint) {
  auto path = ipc_path(endpoint);
  if (path && !file_exists(*path))
    throw DaemonNotRunning("no expertd daemon is running at " + endpoint + ": the socket file " + *path +
                           " does not exist; start one with `expertd start --config CONFIG` (or point to the right "
                           "one with --endpoint / $EXPERTD_ENDPOINT)");
}

class Context {
 public:
  Context() : ctx_(zmq_ctx_new()) {
    if (ctx_ == nullptr) throw Error(std::string("cannot create a ZeroMQ context: ") + zmq_strerror(zmq_errno()));
  }
  ~Context() { zmq_ctx_term(ctx_); }
  void* get() const { return ctx_; }

 private:
  void* ctx_;
};

std::shared_ptr<Context> make_context() { return std::make_shared<Context>(); }

Connection::Connection(std::shared_ptr<Context> ctx, std::string endpoint, int timeout_ms, Credentials credentials)
    : ctx_(std::move(ctx)), endpoint_(std::move(endpoint)), timeout_ms_(std::max(1, timeout_ms)),
      credentials_(std::move(credentials)) {}

Connection::~Connection() { close(); }

void* Connection::socket() {
  if (sock_ != nullptr) return sock_;
  void* s = zmq_socket(ctx_->get(), ZMQ_REQ);
  if (s == nullptr) throw Error(std::string("cannot create a ZeroMQ socket: ") + zmq_strerror(zmq_errno()));
  int linger = 0;
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(s, ZMQ_RCVTIMEO, &timeout_ms_, sizeof timeout_ms_);
  zmq_setsockopt(s, ZMQ_SNDTIMEO, &timeout_ms_, sizeof timeout_ms_);
  if (credentials_.server_key) {
    std::string pub, sec;
    if (credentials_.client_public && credentials_.client_secret) {
      pub = *credentials_.client_public;
      sec = *credentials_.client_secret;
    } else {
      char p[41], q[41];
      if (zmq_curve_keypair(p, q) != 0) {
        zmq_close(s);
        throw Error(std::string("cannot make a CURVE key pair (libzmq without CURVE?): ") + zmq_strerror(zmq_errno()));
      }
      pub = p;
      sec = q;
    }
    // z85 keys: 40 characters and the terminating NUL
    if (zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, credentials_.server_key->c_str(), 41) != 0 ||
        zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, pub.c_str(), 41) != 0 ||
        zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, sec.c_str(), 41) != 0) {
      std::string why = zmq_strerror(zmq_errno());
      zmq_close(s);
      throw ConfigError("cannot use the CURVE keys (40 z85 characters each): " + why);
    }
  }
  if (zmq_connect(s, endpoint_.c_str()) != 0) {
    std::string why = zmq_strerror(zmq_errno());
    zmq_close(s);
    throw Error("cannot connect to " + endpoint_ + ": " + why);
  }
  sock_ = s;
  return sock_;
}

void Connection::reset() {
  if (sock_ != nullptr) {
    zmq_close(sock_);
    sock_ = nullptr;
  }
}

void Connection::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  reset();
}

std::string Connection::silence() const {
  if (ipc_path(endpoint_)) return "its socket exists: is it stuck, or is the timeout too short?";
  if (credentials_.server_key)
    return "with CURVE a daemon never answers a client whose server key is not its public key, nor a client key it "
           "does not allow: check EXPERTD_SERVER_KEY and EXPERTD_CLIENT_KEY; or it is not running there, or the "
           "timeout is too short";
  return "is it running there? A daemon with CURVE never answers a client without its public key: give it with "
         "EXPERTD_SERVER_KEY";
}

Value Connection::request(const std::string& op, Value::Map fields) {
  std::string frame;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (sock_ == nullptr) check_running(endpoint_);
    void* s = socket();
    std::string message = encode(request_message(op, std::move(fields), credentials_.token));
    auto timeout = [&]() {
      reset();
      throw DaemonTimeout("the daemon at " + endpoint_ + " did not answer " + op_words(op) + " within " +
                          fmt("%.1f", timeout_ms_ / 1000.0) + "s (" + silence() + ")");
    };
    while (zmq_send(s, message.data(), message.size(), 0) < 0) {
      int err = zmq_errno();
      if (err == EINTR) continue;
      if (err == EAGAIN) timeout();
      reset();
      throw Error("cannot send to " + endpoint_ + ": " + zmq_strerror(err));
    }
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    while (zmq_msg_recv(&msg, s, 0) < 0) {
      int err = zmq_errno();
      if (err == EINTR) continue;  // a signal: wait on (pyzmq retries the same way)
      zmq_msg_close(&msg);
      if (err == EAGAIN) timeout();
      reset();
      throw Error("cannot receive from " + endpoint_ + ": " + zmq_strerror(err));
    }
    frame.assign(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
    bool more = zmq_msg_more(&msg);
    zmq_msg_close(&msg);
    if (more) {  // never sent by a daemon: drop the rest so the socket can send again
      reset();
      throw ProtocolError("the daemon's reply to " + quote(op) + " has more than one frame");
    }
  }
  Value reply = decode(frame.data(), frame.size(), "the daemon's reply to " + quote(op));
  check_reply(reply, quote(op));
  if (on_reply) on_reply(reply);
  return reply;
}

// --- /proc ---------------------------------------------------------------------------------------------

std::optional<uint64_t> pid_namespace() {
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) != 0) return std::nullopt;
  return static_cast<uint64_t>(st.st_ino);
}

std::optional<uint64_t> process_start_time(long pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return std::nullopt;
  std::stringstream ss;
  ss << f.rdbuf();
  std::string stat = ss.str();
  auto close = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return std::nullopt;
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  for (int i = 0; i <= 19; ++i)
    if (!(fields >> field)) return std::nullopt;
  try {
    return static_cast<uint64_t>(std::stoull(field));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace expertd
