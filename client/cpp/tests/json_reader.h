// A small JSON reader for the golden test: JSON text into expertd::Value (objects keep their order; numbers
// with '.', 'e' or 'E' are floats, the others integers).
#pragma once

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "expertd/value.h"

namespace golden {

using expertd::Value;

class Json {
 public:
  explicit Json(const std::string& text) : s_(text) {}
  Value parse() {
    Value v = value();
    ws();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& why) {
    throw std::runtime_error("JSON: " + why + " at " + std::to_string(i_));
  }
  void ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool eat(const char* word) {
    std::size_t n = std::strlen(word);
    if (s_.compare(i_, n, word) != 0) return false;
    i_ += n;
    return true;
  }
  Value value() {
    ws();
    if (i_ >= s_.size()) fail("unexpected end");
    char c = s_[i_];
    if (c == '{') return object();
    if (c == '[') return array();
    if (c == '"') return Value(string());
    if (eat("true")) return Value(true);
    if (eat("false")) return Value(false);
    if (eat("null")) return Value();
    return number();
  }
  // The items of an object or array up to `close`, each read by `item`.
  template <class Item>
  void items(char close, const char* expected, Item item) {
    ++i_;
    ws();
    if (s_[i_] == close) {
      ++i_;
      return;
    }
    while (true) {
      item();
      ws();
      char c = s_[i_++];
      if (c == close) return;
      if (c != ',') fail(expected);
    }
  }
  Value object() {
    Value::Map m;
    items('}', "expected ',' or '}'", [&] {
      ws();
      std::string key = string();
      ws();
      if (s_[i_++] != ':') fail("expected ':'");
      m.emplace_back(std::move(key), value());
    });
    return Value(std::move(m));
  }
  Value array() {
    Value::Array a;
    items(']', "expected ',' or ']'", [&] { a.push_back(value()); });
    return Value(std::move(a));
  }
  void utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  uint32_t hex4() {
    uint32_t v = static_cast<uint32_t>(std::stoul(s_.substr(i_, 4), nullptr, 16));
    i_ += 4;
    return v;
  }
  std::string string() {
    if (s_[i_++] != '"') fail("expected a string");
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("unterminated string");
      char c = s_[i_++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      char e = s_[i_++];
      if (e == 'u') {
        uint32_t cp = hex4();
        if (cp >= 0xD800 && cp < 0xDC00 && s_.compare(i_, 2, "\\u") == 0) {
          i_ += 2;
          cp = 0x10000 + ((cp - 0xD800) << 10) + (hex4() - 0xDC00);
        }
        utf8(out, cp);
        continue;
      }
      static const char escapes[] = "\"\\/bfnrt", meanings[] = "\"\\/\b\f\n\r\t";  // by position
      const char* at = e ? std::strchr(escapes, e) : nullptr;
      if (!at) fail("bad escape");
      out += meanings[at - escapes];
    }
  }
  Value number() {
    std::size_t start = i_;
    while (i_ < s_.size() && std::strchr("+-0123456789.eE", s_[i_])) ++i_;
    std::string text = s_.substr(start, i_ - start);
    if (text.empty()) fail("unexpected character");
    if (text.find_first_of(".eE") != std::string::npos) return Value(std::strtod(text.c_str(), nullptr));
    if (text[0] == '-') return Value(static_cast<int64_t>(std::stoll(text)));
    return Value(static_cast<uint64_t>(std::stoull(text)));
  }

  const std::string& s_;
  std::size_t i_ = 0;
};

}  // namespace golden
