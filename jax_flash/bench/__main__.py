"""python -m jax_flash.bench"""

from jax_flash.bench.cli import main

main()
