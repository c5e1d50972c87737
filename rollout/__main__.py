"""`python -m rollout ...` is the `rollout` command."""

from rollout.cli import main

main()
