"""`python -m jaxinfer.cli`: the `jaxinfer` command."""

from jaxinfer.cli import run

run()
