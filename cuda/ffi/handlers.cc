// XLA FFI handlers: decode buffers and attributes, fill the kernel parameters, launch.
#include "ffi/handlers.h"

namespace jax_flash {

std::vector<FfiTarget> ffi_targets() { return {}; }

}  // namespace jax_flash
