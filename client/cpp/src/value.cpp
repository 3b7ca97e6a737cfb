// msgpack values: the type, its typed accessors and map entries (bytes in src/msgpack.cpp, JSON in src/json.cpp).
#include "expertd/value.h"

#include "expertd/errors.h"

namespace expertd {

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

}  // namespace expertd
