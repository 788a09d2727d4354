"""gpucluster: the library behind the Pulumi program. It declares no cloud resources: spec, catalog, cost, renderers
and the command line."""

# The one place: pyproject.toml reads it (tool.setuptools.dynamic); `gpucluster --version` says it.
__version__ = "0.1.0"
