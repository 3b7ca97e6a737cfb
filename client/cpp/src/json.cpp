// JSON text for values (tools and messages): maps in their order, bin as {"$bin": hex}, non-finite floats as null.
#include "expertd/value.h"

#include <cmath>
#include <cstdio>

#include "detail.h"

namespace expertd {

using detail::fmt;

namespace {

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

std::string to_json(const Value& value) {
  std::string out;
  json_value(out, value);
  return out;
}

}  // namespace expertd
