# Sourced by .ci/run and scripts/build_h100_wheel.sh: path_without_nvcc prints $PATH with every nvcc
# on it hidden, as on a pip user's machine without a CUDA toolkit (a directory holding one is
# replaced by a temporary directory of links to all it holds but nvcc).
path_without_nvcc() {
  local dirs dir entry shadow out=""
  IFS=: read -ra dirs <<< "$PATH"
  for dir in "${dirs[@]}"; do
    if [[ -x $dir/nvcc ]]; then
      shadow=$(mktemp -d /tmp/jax_flash_ci_path.XXXXXX)
      for entry in "$dir"/*; do
        [[ $(basename "$entry") == nvcc ]] || ln -s "$entry" "$shadow/"
      done
      dir=$shadow
    fi
    out+=${out:+:}$dir
  done
  echo "$out"
}
