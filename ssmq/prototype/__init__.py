"""Kernels and execution paths that are the default for no configuration: kept with their tests against the
``ssmq.ops`` references, reached only by importing them (nothing in the product imports this package)."""
