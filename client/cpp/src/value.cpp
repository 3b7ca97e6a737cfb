// msgpack values: typed access, the bounded decoder and the canonical encoder (msgpack-cxx), JSON text.
#include "expertd/value.h"

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "detail.h"
#include "expertd/errors.h"

#define MSGPACK_NO_BOOST 1
#include <msgpack/object.hpp>
#include <msgpack/pack.hpp>
#include <msgpack/sbuffer.hpp>
#include <msgpack/unpack.hpp>

namespace expertd {

using detail::quote;
using detail::fmt;
using detail::shape_text;
using detail::Fd;

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

// `items` between `open` and `close`, comma-separated, each written by `write`.
template <class Items, class Write>
void json_items(std::string& out, char open, char close, const Items& items, Write write) {
  out += open;
  bool first = true;
  for (const auto& x : items) {
    if (!first) out += ", ";
    first = false;
    write(x);
  }
  out += close;
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
    case Value::Type::Array:
      json_items(out, '[', ']', v.as_array(), [&](const Value& x) { json_value(out, x); });
      return;
    case Value::Type::Map:
      json_items(out, '{', '}', v.as_map(), [&](const auto& item) {
        json_string(out, item.first);
        out += ": ";
        json_value(out, item.second);
      });
      return;
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

}  // namespace expertd
