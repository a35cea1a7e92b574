// The Python module jax_flash._cuda: `registrations()` maps each XLA FFI target name to a capsule
// holding its handler, which jax_flash/_ffi.py registers with jax.ffi.register_ffi_target;
// `built_archs` names the targets compiled (CMakeLists.txt), e.g. "80,90a", and `family_archs`
// those of each kernel family, e.g. "hopper=90a turing=75 mma_sync=80,90a mma_sync_off_hopper=80";
// `sm80_backward_smem_bytes(head_dim)` the shared memory of a block of the mma.sync backward
// (its compact tiles; `sm80_backward_usual_smem_bytes` its usual ones),
// `sm80_forward_smem_bytes(head_dim)` and `sm80_wide_forward_smem_bytes(head_dim)` those of the
// mma.sync forward up to 256 and above; `sm75_forward_smem_bytes` and `sm75_backward_smem_bytes`
// the Turing family's; `ffi_api_version` the XLA FFI API of the headers it was built against
// ("0.1" for jaxlib 0.6.2's: newer jaxlibs accept it, older ones refuse newer versions).
#include <nanobind/nanobind.h>

#include <string>

#include "xla/ffi/api/c_api.h"

#include "ffi/handlers.h"
#include "launch/dispatch.h"

namespace nb = nanobind;

NB_MODULE(_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    for (const auto& target : jax_flash::ffi_targets()) {
      targets[target.name] = nb::capsule(target.handler);
    }
    return targets;
  });
  m.attr("built_archs") = JAX_FLASH_BUILT_ARCHS;
  m.attr("family_archs") = JAX_FLASH_FAMILY_ARCHS;
  // nb::str, not std::string: without nanobind/stl/string.h a std::string attribute throws
  // std::bad_cast when the module is imported.
  m.attr("ffi_api_version") =
      nb::str((std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR)).c_str());
  m.def("sm80_backward_smem_bytes", &jax_flash::sm80_backward_smem_bytes);
  m.def("sm80_backward_usual_smem_bytes", &jax_flash::sm80_backward_usual_smem_bytes);
  m.def("sm80_forward_smem_bytes", &jax_flash::sm80_forward_smem_bytes);
  m.def("sm80_wide_forward_smem_bytes", &jax_flash::sm80_wide_forward_smem_bytes);
  m.def("sm75_forward_smem_bytes", &jax_flash::sm75_forward_smem_bytes);
  m.def("sm75_backward_smem_bytes", &jax_flash::sm75_backward_smem_bytes);
}
