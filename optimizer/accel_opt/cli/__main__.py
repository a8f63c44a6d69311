"""`python -m accel_opt.cli`: the same group as the `accel-opt` command."""

from accel_opt.cli import main

main()
