// msgpack values as the protocol uses them (maps with string keys in wire order), their canonical encoding,
// a bounded decoder and JSON text for tools: the type in src/value.cpp, the bytes (msgpack-cxx) in
// src/msgpack.cpp, the JSON in src/json.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>
#include "expertd/wire.h"

namespace expertd {

// --- msgpack values --------------------------------------------------------------------------------

class Value {
 public:
  enum class Type { Nil, Bool, Int, Float, Str, Bin, Array, Map };
  struct Bin {
    std::string bytes;
    bool operator==(const Bin& o) const { return bytes == o.bytes; }
  };
  using Array = std::vector<Value>;
  using Map = std::vector<std::pair<std::string, Value>>;  // in wire order; keys are strings

  Value() = default;
  Value(std::nullptr_t) {}
  Value(bool b) : v_(b) {}
  template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
  Value(T n) {
    if constexpr (std::is_signed_v<T>) {
      if (n < 0) {
        v_ = static_cast<int64_t>(n);
        return;
      }
    }
    v_ = static_cast<uint64_t>(n);
  }
  Value(double d) : v_(d) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(std::string_view s) : v_(std::string(s)) {}
  Value(Bin b) : v_(std::move(b)) {}
  Value(Array a) : v_(std::move(a)) {}
  Value(Map m) : v_(std::move(m)) {}

  Type type() const;
  bool is_nil() const { return v_.index() == 0; }
  bool is_bool() const { return v_.index() == 1; }
  bool is_int() const { return v_.index() == 2 || v_.index() == 3; }  // bool is not an int here
  bool is_float() const { return v_.index() == 4; }
  bool is_str() const { return v_.index() == 5; }
  bool is_array() const { return v_.index() == 7; }
  bool is_map() const { return v_.index() == 8; }
  bool is_negative() const { return v_.index() == 2; }

  // Typed accessors: a ProtocolError naming `what` when the value is not of that type (or out of range).
  bool as_bool(std::string_view what = "value") const;
  int64_t as_int(std::string_view what = "value") const;
  uint64_t as_uint(std::string_view what = "value") const;
  double as_number(std::string_view what = "value") const;  // an int or a float
  const std::string& as_str(std::string_view what = "value") const;
  const Bin& as_bin(std::string_view what = "value") const;
  const Array& as_array(std::string_view what = "value") const;
  const Map& as_map(std::string_view what = "value") const;

  const Value* get(std::string_view key) const;  // a map's entry, or nullptr (also for a non-map)
  Value& set(std::string key, Value value);      // add or replace a map entry (keeps the order)

  bool operator==(const Value& o) const { return v_ == o.v_; }
  bool operator!=(const Value& o) const { return !(v_ == o.v_); }

 private:
  std::variant<std::monostate, bool, int64_t, uint64_t, double, std::string, Bin, Array, Map> v_;
};

const char* type_name(Value::Type t);
// One msgpack object filling all of data[0, size) (trailing bytes are an error), else a ProtocolError
// naming `what`; bin objects over max_bin bytes are refused (as the Python side refuses them).
Value decode(const void* data, std::size_t size, std::string_view what = "message",
             std::size_t max_bin = MAX_MESSAGE_BYTES);
// Canonical msgpack: the smallest form of each integer and string, floats as float64, maps in their order.
std::string encode(const Value& value);
std::string to_json(const Value& value);  // JSON text (bin as {"$bin": hex})

}  // namespace expertd
