// bfloat16 <-> float32 on raw bits, in integer ops the compiler vectorizes (c10's conversions are not),
// shared by the elementwise kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace zenserve {

// bfloat16 is the top half of a float32.
inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// Round to nearest even, as c10::BFloat16 does for finite values.
inline uint16_t float_to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace zenserve
