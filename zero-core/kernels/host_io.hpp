// zero: the input and output of the host check drivers (host_check.cpp
// here and examples/llama/cuda/host_check.cpp): the whole of stdin read
// into a bounds-checked reader, results written to stdout, and a failure
// that says what went wrong on stderr and exits 2. Host C++ only; no CUDA.

#ifndef ZERO_HOST_IO_HPP
#define ZERO_HOST_IO_HPP

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

[[noreturn]] inline void fail(const std::string& msg) {
  fprintf(stderr, "host_check: %s\n", msg.c_str());
  exit(2);
}

// Little-endian values taken in order from the input, with bounds checks.
struct Reader {
  std::vector<unsigned char> data;
  size_t pos = 0;
  bool done() const { return pos == data.size(); }
  void take(void* dst, size_t bytes) {
    if (data.size() - pos < bytes) fail("truncated input");
    if (bytes != 0) memcpy(dst, data.data() + pos, bytes);
    pos += bytes;
  }
  template <class T>
  T get() {
    T x;
    take(&x, sizeof x);
    return x;
  }
  template <class T>
  std::vector<T> vec(uint64_t n) {
    if (n > (data.size() - pos) / sizeof(T)) fail("truncated input");
    std::vector<T> v(n);
    take(v.data(), n * sizeof(T));
    return v;
  }
  void finish() const {
    if (!done()) fail("trailing input");
  }
};

inline Reader read_stdin() {
  Reader r;
  unsigned char buf[1 << 16];
  size_t got;
  while ((got = fread(buf, 1, sizeof buf, stdin)) > 0) {
    r.data.insert(r.data.end(), buf, buf + got);
  }
  if (ferror(stdin)) fail("cannot read stdin");
  return r;
}

inline void write_out(const void* p, size_t bytes) {
  if (bytes != 0 && fwrite(p, 1, bytes, stdout) != bytes) fail("cannot write stdout");
}

#endif  // ZERO_HOST_IO_HPP
