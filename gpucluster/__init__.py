"""gpucluster: the library behind the Pulumi program. It declares no cloud resources: spec, catalog, cost, renderers
and the command line."""
