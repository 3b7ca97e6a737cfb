// msgpack bytes for values: the bounded decoder and the canonical encoder (msgpack-cxx does the byte work).
#include "expertd/value.h"

#include <cstring>

#include "expertd/errors.h"

#define MSGPACK_NO_BOOST 1
#include <msgpack/object.hpp>
#include <msgpack/pack.hpp>
#include <msgpack/sbuffer.hpp>
#include <msgpack/unpack.hpp>

namespace expertd {

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

}  // namespace expertd
