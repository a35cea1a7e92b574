// Device queries used by the dispatcher.
#pragma once

namespace jax_flash {

// Compute capability of the current device as 10 * major + minor (80, 90, ...), 0 on error.
int current_sm_version();

}  // namespace jax_flash
