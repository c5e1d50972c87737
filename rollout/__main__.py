"""`python -m rollout ...` is the `rollout` command."""

from rollout.tools.cli import main

main()
