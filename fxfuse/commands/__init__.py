"""Sub-commands of the `fxfuse` CLI: one module each, exposing `register(subparsers)`.

`register` adds a sub-parser whose `func` default takes the parsed args and returns
the process exit code.
"""
