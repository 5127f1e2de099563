"""The ops, each a package built on the pipeline in :mod:`mkernel.ops.base`."""
