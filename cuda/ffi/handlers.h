// The XLA FFI handlers that jax_flash exports, as (target name, handler symbol) pairs.
#pragma once

#include <vector>

namespace jax_flash {

struct FfiTarget {
  const char* name;
  void* handler;  // an XLA_FFI_Handler*, as XLA_FFI_DEFINE_HANDLER_SYMBOL defines it
};

std::vector<FfiTarget> ffi_targets();

}  // namespace jax_flash
